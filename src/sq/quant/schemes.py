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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sq.dictconfig import DictConfig
from sq.errors import SqError
from sq.quant import formats
from sq.quant.primitives import scale_shape

__all__ = [
    "QuantScheme",
    "SCHEME_NAMES",
    "get_scheme",
    "check_group_size",
    "to_compressed_tensors",
    "format_name",
]

_TYPES = ("int", "float")
_STRATEGIES = ("group", "channel", "tensor")
_ACTIVATIONS = tuple(formats.ACTIVATIONS)


@dataclass(frozen=True)
class QuantScheme(DictConfig):
    """How one Linear weight ``[out, in]`` is quantized.

    The fields say what the user asked for; which schemes sq can write, with which maths and
    tensors, is decided by the format registry (``sq.quant.formats``): a scheme no registered
    format accepts is refused here.  Whether ranks can quantize their own rows with it is the
    format's declaration too (``formats.check_row_shardable``).
    """

    name: str
    num_bits: int
    type: str = "int"  # "int" | "float"
    symmetric: bool = True
    strategy: str = "group"  # "group" | "channel" | "tensor"
    group_size: int | None = 128  # None unless "group"
    activations: str = "none"  # "none" | "fp8_dynamic_token"

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
        if self.strategy == "group":
            if (
                isinstance(self.group_size, bool)
                or not isinstance(self.group_size, int)
                or self.group_size <= 0
            ):
                raise ValueError(
                    f"scheme {self.name}: strategy 'group' needs a positive int group_size, "
                    f"got {self.group_size!r}"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"scheme {self.name}: strategy {self.strategy!r} takes group_size=None, got {self.group_size!r}"
            )
        formats.format_for(self)  # ValueError naming each format's reason when none writes it

    # -- derived facts -------------------------------------------------------------------

    @property
    def qmin(self) -> float:
        """Smallest quantized value (as compressed-tensors' ``calculate_range``)."""
        return formats.spec_for(self).qtype.qmin

    @property
    def qmax(self) -> float:
        return formats.spec_for(self).qtype.qmax

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the quantized values before packing (int8 for any int width)."""
        return formats.spec_for(self).qtype.storage_dtype

    @property
    def format(self) -> str:
        return format_name(self)

    def num_groups(self, in_features: int) -> int:
        """Scale columns for a weight with ``in_features`` columns."""
        return scale_shape(formats.spec_for(self).granularity, (1, in_features))[-1]

    # -- serialization -------------------------------------------------------------------



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


SCHEME_NAMES: tuple[str, ...] = tuple(_presets(128))


def get_scheme(name: str, group_size: int = 128) -> QuantScheme:
    """The preset ``name`` (case-insensitive); ``group_size`` is ignored by per-channel FP8."""
    key = str(name).upper()
    if key not in SCHEME_NAMES:
        raise SqError(f"unknown scheme {name!r}; choose one of {', '.join(SCHEME_NAMES)}")
    if key != "FP8_DYNAMIC" and (
        isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0
    ):
        raise SqError(f"scheme {key}: group size must be a positive integer, got {group_size!r}")
    return _presets(group_size)[key]


def check_group_size(layer_name: str, in_features: int, scheme: QuantScheme) -> None:
    """Refuse a layer whose input width the scheme's groups do not tile exactly.

    compressed-tensors (and vLLM's kernels) need ``in_features % group_size == 0``;
    a ragged last group would be silently mis-shaped on load.
    """
    if scheme.strategy == "group" and in_features % scheme.group_size != 0:
        raise SqError(
            f"{layer_name}: group size {scheme.group_size} does not divide in_features "
            f"{in_features} (scheme {scheme.name}); pick a group size that divides "
            f"{in_features}, or add the layer to --ignore"
        )


def format_name(scheme: QuantScheme) -> str:
    """compressed-tensors format the export writes (the registered format that accepts it)."""
    return formats.format_for(scheme).name


def to_compressed_tensors(scheme: QuantScheme, targets: list[str]):
    """The library's ``QuantizationScheme`` for ``targets`` (with ``format`` filled in)."""
    return formats.format_for(scheme).ct_scheme(scheme, targets)
