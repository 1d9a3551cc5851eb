"""Weight quantization schemes and their compressed-tensors form.

A ``QuantScheme`` is a small frozen (hashable) value: it keys the export's config groups,
goes into the resume signature and the report through ``to_dict`` / ``from_dict``, and is
translated to compressed-tensors' own ``QuantizationScheme`` only at the export boundary.

The presets match compressed-tensors' presets of the same name (``preset_name_to_scheme``):

=============  =====================================================  ================
name           weights                                                format
=============  =====================================================  ================
W4A16          int4 symmetric, group-wise (default group 128)         pack-quantized
W4A16_ASYM     int4 asymmetric (int8-stored zero points), group-wise  pack-quantized
W3A16, W2A16   int3 / int2 symmetric, group-wise (low-bit; for         pack-quantized
               SignRound or GPTQ)
W8A16          int8 symmetric, group-wise (the library preset is      pack-quantized
               group 128, not per-channel)
FP8_DYNAMIC    float8 e4m3 per output channel; activations float8     float-quantized
               per token, dynamic
=============  =====================================================  ================

and the serving presets (``SERVING_SCHEME_NAMES``; docs/output.md has their tensors and engines):

=============  =====================================================  ====================
name           weights; activations                                   format
=============  =====================================================  ====================
FP8_BLOCK      fp8 e4m3, one scale per 128 x 128 block (partial edge  float-quantized
               blocks); fp8 per-token groups of 128, dynamic
FP8            fp8 e4m3, one scale per tensor; fp8 per tensor,        float-quantized
               STATIC (``input_scale``: calibrated)
NVFP4A16       fp4 e2m1 groups of 16, fp8 scales, float32 global      nvfp4-pack-quantized
               scale per tensor; none
NVFP4          NVFP4A16's weights; fp4 groups of 16 at run time under nvfp4-pack-quantized
               a STATIC global scale (``input_global_scale``)
MXFP4A16       fp4 e2m1 groups of 32, e8m0 (power-of-two) scales      mxfp4-pack-quantized
MXFP4          MXFP4A16's weights; mxfp4 activations, dynamic         mxfp4-pack-quantized
MXFP8A16       fp8 e4m3 groups of 32, e8m0 scales                     mxfp8-quantized
MXFP8          MXFP8A16's weights; mxfp8 activations, dynamic         mxfp8-quantized
W8A8           int8 per output channel; int8 per token, dynamic       int-quantized
W4A8           int4 group-wise (128); int8 per token, dynamic         int-quantized
W4AFP8         int4 group-wise (128); fp8 per token, dynamic          int-quantized
=============  =====================================================  ====================

``--group-size`` sets the group of the int group-wise presets (W4A16 ... W8A16, W4A8, W4AFP8);
the others have their format's fixed blocks (NVFP4: 16, MX: 32, FP8_BLOCK: 128 x 128) and
ignore it.  Which of them need statistics reduced across ranks, or calibrated activation
scales, is their format's declaration (``specs.required_reductions`` /
``specs.activation_observers``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sq.dictconfig import DictConfig
from sq.errors import SqError
from sq.formats import specs
from sq.formats.primitives import scale_shape

__all__ = [
    "QuantScheme",
    "SCHEME_NAMES",
    "SERVING_SCHEME_NAMES",
    "PRESET_NAMES",
    "get_scheme",
    "check_group_size",
    "to_compressed_tensors",
    "format_name",
    "with_int_grid",
    "INT_GRIDS",
]

_TYPES = ("int", "float")
_STRATEGIES = ("group", "channel", "tensor", "block", "tensor_group")
_GROUPED = ("group", "tensor_group")
_SCALE_DTYPES = tuple(k for k in specs.SCALE_DTYPES if k is not None)
# optional fields: left out of ``to_dict`` while None, so a scheme that does not use them keeps the
# resume signature it has without them
_OPTIONAL = ("block_structure", "scale_dtype", "int_grid")
INT_GRIDS = ("standard", "full")
_ACTIVATIONS = tuple(specs.ACTIVATIONS)


@dataclass(frozen=True)
class QuantScheme(DictConfig):
    """How one Linear weight ``[out, in]`` is quantized.

    The fields say what the user asked for; which schemes sq can write, with which maths and
    tensors, is decided by the format registry (``sq.formats.specs``): a scheme no registered
    format accepts is refused here.  Whether ranks can quantize their own rows with it is the
    format's declaration too (``specs.check_row_shardable``).
    """

    name: str
    num_bits: int
    type: str = "int"  # "int" | "float"
    symmetric: bool = True
    strategy: str = "group"  # "group" | "channel" | "tensor"
    group_size: int | None = 128  # None unless "group" / "tensor_group"
    activations: str = "none"  # a key of specs.ACTIVATIONS
    block_structure: tuple[int, int] | None = None  # (rows, cols), "block" only
    scale_dtype: str | None = None  # None (the weight's dtype) | "float8_e4m3fn" | "e8m0"
    # symmetric int only: None, compressed-tensors' grid (scale = absmax / 7.5 for int4, codes -7.5..7.5
    # rounded into -8..7); "full", auto-round's (the larger-magnitude extreme of each group lands on -8:
    # scale = that extreme / -qmin, negative when it is the positive one), sq.formats.primitives
    int_grid: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"scheme name must be a non-empty string, got {self.name!r}")
        if self.type not in _TYPES:
            raise ValueError(f"scheme {self.name}: type must be one of {_TYPES}, got {self.type!r}")
        if self.strategy not in _STRATEGIES:
            raise ValueError(
                f"scheme {self.name}: strategy must be one of {_STRATEGIES}, got {self.strategy!r}"
            )
        if self.activations not in _ACTIVATIONS:
            raise ValueError(
                f"scheme {self.name}: activations must be one of {_ACTIVATIONS}, "
                f"got {self.activations!r}"
            )
        if isinstance(self.num_bits, bool) or not isinstance(self.num_bits, int):
            raise ValueError(f"scheme {self.name}: num_bits must be an int, got {self.num_bits!r}")
        self._check_block_and_scale()
        if self.int_grid == "standard":  # the default spelled out: stored as None (signatures unchanged)
            object.__setattr__(self, "int_grid", None)
        if self.int_grid is not None:
            if self.int_grid not in INT_GRIDS:
                raise ValueError(f"scheme {self.name}: int_grid must be one of {INT_GRIDS}, got {self.int_grid!r}")
            if self.type != "int" or not self.symmetric:
                raise ValueError(f"scheme {self.name}: int_grid 'full' is a symmetric integer grid; this scheme is "
                                 f"{'symmetric' if self.symmetric else 'asymmetric'} {self.type}")
        if self.strategy in _GROUPED:
            if (
                isinstance(self.group_size, bool)
                or not isinstance(self.group_size, int)
                or self.group_size <= 0
            ):
                raise ValueError(
                    f"scheme {self.name}: strategy {self.strategy!r} needs a positive int group_size, "
                    f"got {self.group_size!r}"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"scheme {self.name}: strategy {self.strategy!r} takes group_size=None, got {self.group_size!r}"
            )
        specs.format_for(self)  # ValueError naming each format's reason when none writes it

    def _check_block_and_scale(self) -> None:
        b = self.block_structure
        if b is not None:
            if (not isinstance(b, (tuple, list)) or len(b) != 2
                    or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in b)):
                raise ValueError(f"scheme {self.name}: block_structure must be two positive ints, got {b!r}")
            object.__setattr__(self, "block_structure", tuple(b))  # from JSON: a list
        if (self.strategy == "block") != (b is not None):
            raise ValueError(f"scheme {self.name}: strategy 'block' and block_structure go together "
                             f"(strategy {self.strategy!r}, block_structure {b!r})")
        if self.scale_dtype is not None and self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scheme {self.name}: scale_dtype must be None or one of {_SCALE_DTYPES}, "
                             f"got {self.scale_dtype!r}")

    # -- derived facts -------------------------------------------------------------------

    @property
    def qmin(self) -> float:
        """Smallest quantized value (as compressed-tensors' ``calculate_range``)."""
        return specs.spec_for(self).qtype.qmin

    @property
    def qmax(self) -> float:
        return specs.spec_for(self).qtype.qmax

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the quantized values before packing (int8 for any int width)."""
        return specs.spec_for(self).qtype.storage_dtype

    @property
    def format(self) -> str:
        return format_name(self)

    @property
    def row_local(self) -> bool:
        """Each row's scales come from that row alone, up to one global scale shared across rows
        (NVFP4): what an algorithm that changes a weight row by row and column by column (GPTQ's
        sweep, AWQ's search) can quantize.  False for per-tensor and 2-D block scales."""
        return all(r.stat == "global_absmax" for r in specs.required_reductions(self))

    def num_groups(self, in_features: int) -> int:
        """Scale columns for a weight with ``in_features`` columns."""
        return scale_shape(specs.spec_for(self).granularity, (1, in_features))[-1]

    # -- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The fields; ``block_structure`` / ``scale_dtype`` only when set (a list for JSON)."""
        d = super().to_dict()
        for k in _OPTIONAL:
            if d[k] is None:
                del d[k]
        if "block_structure" in d:
            d["block_structure"] = list(d["block_structure"])
        return d


def _presets(group_size: int) -> dict[str, QuantScheme]:
    return {
        "W4A16": QuantScheme("W4A16", 4, "int", True, "group", group_size),
        "W4A16_ASYM": QuantScheme("W4A16_ASYM", 4, "int", False, "group", group_size),
        "W3A16": QuantScheme("W3A16", 3, "int", True, "group", group_size),
        "W2A16": QuantScheme("W2A16", 2, "int", True, "group", group_size),
        "W8A16": QuantScheme("W8A16", 8, "int", True, "group", group_size),
        "FP8_DYNAMIC": QuantScheme(
            "FP8_DYNAMIC", 8, "float", True, "channel", None, activations="fp8_dynamic_token"
        ),
    }


def _serving_presets(group_size: int) -> dict[str, QuantScheme]:
    nvfp4 = dict(strategy="tensor_group", group_size=16, scale_dtype="float8_e4m3fn")
    mx = dict(strategy="group", group_size=32, scale_dtype="e8m0")
    return {
        "FP8_BLOCK": QuantScheme("FP8_BLOCK", 8, "float", True, "block", None, "fp8_dynamic_group128",
                                 block_structure=(128, 128)),
        "FP8": QuantScheme("FP8", 8, "float", True, "tensor", None, "fp8_static_tensor"),
        "NVFP4A16": QuantScheme("NVFP4A16", 4, "float", **nvfp4),
        "NVFP4": QuantScheme("NVFP4", 4, "float", activations="nvfp4_static_global", **nvfp4),
        "MXFP4A16": QuantScheme("MXFP4A16", 4, "float", **mx),
        "MXFP4": QuantScheme("MXFP4", 4, "float", activations="mxfp4_dynamic", **mx),
        "MXFP8A16": QuantScheme("MXFP8A16", 8, "float", **mx),
        "MXFP8": QuantScheme("MXFP8", 8, "float", activations="mxfp8_dynamic", **mx),
        "W8A8": QuantScheme("W8A8", 8, "int", True, "channel", None, "int8_dynamic_token"),
        "W4A8": QuantScheme("W4A8", 4, "int", True, "group", group_size, "int8_dynamic_token"),
        "W4AFP8": QuantScheme("W4AFP8", 4, "int", True, "group", group_size, "fp8_dynamic_token"),
    }


SCHEME_NAMES: tuple[str, ...] = tuple(_presets(128))
"""The base presets: weight-only int and FP8_DYNAMIC, row-independent, for every algorithm."""
SERVING_SCHEME_NAMES: tuple[str, ...] = tuple(_serving_presets(128))
"""compressed-tensors' serving presets beyond the base ones (FP8 block / static, NVFP4, MX, W8A8, W4A8)."""
PRESET_NAMES: tuple[str, ...] = SCHEME_NAMES + SERVING_SCHEME_NAMES
"""Every preset ``get_scheme`` (``--scheme``, recipes, ``sq.quantize``) accepts."""
_GROUP_PRESETS = ("W4A16", "W4A16_ASYM", "W3A16", "W2A16", "W8A16", "W4A8", "W4AFP8")


def get_scheme(name: str, group_size: int = 128) -> QuantScheme:
    """The preset ``name`` (case-insensitive); ``group_size`` sets the int group-wise presets'
    group and is ignored by the others (fixed blocks, or per-channel / per-tensor scales)."""
    key = str(name).upper()
    if key not in PRESET_NAMES:
        raise SqError(f"unknown scheme {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    if key in _GROUP_PRESETS and (
        isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0
    ):
        raise SqError(f"scheme {key}: group size must be a positive integer, got {group_size!r}")
    if key in SCHEME_NAMES:
        return _presets(group_size)[key]
    return _serving_presets(group_size if key in _GROUP_PRESETS else 128)[key]


def with_int_grid(scheme: QuantScheme | None, int_grid: str) -> QuantScheme | None:
    """``scheme`` on ``int_grid`` (``--int-grid``) where it is a symmetric integer scheme that names no grid
    of its own; every other scheme (and None) as it is."""
    if (scheme is None or int_grid == "standard" or scheme.type != "int" or not scheme.symmetric
            or scheme.int_grid is not None):
        return scheme
    return dataclasses.replace(scheme, int_grid=int_grid)


def check_group_size(layer_name: str, in_features: int, scheme: QuantScheme) -> None:
    """Refuse a layer whose input width the scheme's groups do not tile exactly.

    compressed-tensors (and vLLM's kernels) need ``in_features % group_size == 0``;
    a ragged last group would be silently mis-shaped on load.
    """
    if scheme.strategy in _GROUPED and in_features % scheme.group_size != 0:
        # NVFP4's 16 and MX's 32 are fixed by their formats (scales in fp8 / e8m0)
        fix = (f"pick a group size that divides {in_features}, or add the layer to --ignore"
               if scheme.scale_dtype is None else "its format fixes the group size: add the layer to --ignore")
        raise SqError(
            f"{layer_name}: group size {scheme.group_size} does not divide in_features "
            f"{in_features} (scheme {scheme.name}); {fix}"
        )


def format_name(scheme: QuantScheme) -> str:
    """compressed-tensors format the export writes (the registered format that accepts it)."""
    return specs.format_for(scheme).name


def to_compressed_tensors(scheme: QuantScheme, targets: list[str]):
    """The library's ``QuantizationScheme`` for ``targets`` (with ``format`` filled in)."""
    return specs.format_for(scheme).ct_scheme(scheme, targets)
