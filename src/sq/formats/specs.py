"""The format registry: what each compressed-tensors format writes, and what it needs first.

A :class:`Format` is keyed by compressed-tensors' format name (``config.json``'s ``format``:
``pack-quantized``, ``float-quantized``, ...) and declares, for each ``QuantScheme`` it
:meth:`~Format.accepts`:

- :meth:`~Format.spec`: the maths, a :class:`~sq.formats.primitives.QuantSpec` (block shape,
  target type, scale type) that :mod:`sq.formats.primitives` computes with;
- :meth:`~Format.tensors`: the checkpoint tensors of one Linear (names, dtypes, shapes);
- :meth:`~Format.compress` / :meth:`~Format.decompress`: packing and unpacking, always with the
  compressed-tensors library's own helpers, never by hand, so the bits match the library's;
- :meth:`~Format.ct_scheme`: the library's ``QuantizationScheme`` for the config;
- :meth:`~Format.reductions`: the statistics every rank's rows contribute to, all-reduced
  before any rank quantizes (none for per-channel / per-group scales; the absmax over all rows
  for a per-tensor scale or NVFP4's global scale);
- :meth:`~Format.row_alignment`: rows a shard boundary must be a multiple of for a shard's
  *packed* tensors to be rows of the whole ones;
- :func:`activation_observers`: the static activation scales the scheme writes (FP8's
  ``input_scale``, NVFP4's ``input_global_scale``), which need calibration: every rank's
  tokens observed, the statistic all-reduced, the tensor computed as the library does.

The row-independence contract.  sq quantizes a weight on the ranks that hold its rows, each
rank its own rows, before any gather.  That is exact only if every scale depends on the rows
being quantized alone, or on statistics that were reduced over every rank's rows first.  The
primitives know which statistics a spec's scales read across rows
(:func:`~sq.formats.primitives.cross_row_stats`); a format declares which it reduces; and
:func:`check_row_shardable` -- which the driver calls before quantizing with a scheme -- refuses
a scheme whose format leaves one undeclared.  :func:`required_reductions` is then the list the
driver all-reduces: none for per-channel / per-group schemes; the per-tensor absmax (``FP8``),
the 128 x 128 block grid's absmax (``FP8_BLOCK``) or the global absmax (``NVFP4*``) otherwise.

A scheme is resolved to exactly one format (:func:`format_for`): ``QuantScheme`` refuses, at
construction, a scheme that no registered format accepts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from sq.errors import SqError
from sq.formats import primitives as P

__all__ = [
    "Format",
    "Reduction",
    "TensorSpec",
    "ACTIVATIONS",
    "register_format",
    "unregister_format",
    "get_format",
    "format_names",
    "format_for",
    "spec_for",
    "granularity_of",
    "check_row_shardable",
    "required_reductions",
    "row_independent",
    "ActivationObserver",
    "activation_observers",
    "SCALE_DTYPES",
]


class SchemeFields(Protocol):
    """What a format reads of a ``sq.formats.schemes.QuantScheme``."""

    name: str
    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    activations: str
    block_structure: tuple[int, int] | None
    scale_dtype: str | None


# compressed-tensors' input activation args per ``QuantScheme.activations`` (exactly the fields
# the library's presets set, so the serialized config equals theirs; tests/test_presets.py)
_FP8 = dict(num_bits=8, type="float", symmetric=True)
_MX = dict(type="float", symmetric=True, strategy="group", group_size=32, dynamic=True,
           scale_dtype=torch.uint8, zp_dtype=torch.uint8)
ACTIVATIONS: dict[str, dict | None] = {
    "none": None,
    # FP8_DYNAMIC, W4AFP8
    "fp8_dynamic_token": dict(_FP8, strategy="token", dynamic=True),
    # FP8_BLOCK: per-token groups of 128, scaled at run time
    "fp8_dynamic_group128": dict(_FP8, strategy="group", group_size=128, dynamic=True),
    # FP8: one static input scale per Linear (calibrated: ``input_scale``)
    "fp8_static_tensor": dict(_FP8, strategy="tensor", dynamic=False, observer="static_minmax"),
    # W8A8, W4A8
    "int8_dynamic_token": dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
    # NVFP4: fp4 groups of 16 scaled at run time under a static global scale (calibrated:
    # ``input_global_scale``)
    "nvfp4_static_global": dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                                dynamic="local", observer="static_minmax", scale_dtype=torch.float8_e4m3fn,
                                zp_dtype=torch.float8_e4m3fn),
    # MXFP4 / MXFP8: e8m0-scaled groups of 32, at run time
    "mxfp4_dynamic": dict(_MX, num_bits=4),
    "mxfp8_dynamic": dict(_MX, num_bits=8),
}

SCALE_DTYPES: dict[str | None, torch.dtype | str | None] = {
    None: None,  # the weight's own dtype
    "float8_e4m3fn": torch.float8_e4m3fn,  # NVFP4's per-group scales
    "e8m0": P.E8M0,  # MX: powers of two, stored as uint8 biased exponents
}
# the library's QuantizationArgs.scale_dtype (and zp_dtype) for each
_CT_SCALE_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "e8m0": torch.uint8}


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor of a quantized Linear, relative to the module (``weight_scale``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Reduction:
    """A statistic every rank holding rows of a weight contributes to, all-reduced (``op``)
    over those ranks before any of them quantizes.  ``stat`` names it in ``choose_qparams``'s
    ``stats``; the op comes from the maths (a max or min, identity 0)."""

    stat: str
    spec: P.QuantSpec

    def __post_init__(self) -> None:
        if self.stat not in P.cross_row_stats(self.spec):
            raise ValueError(f"{self.stat!r} is not a cross-row statistic of {self.spec}")

    @property
    def op(self) -> str:
        return P.cross_row_stats(self.spec)[self.stat]

    @property
    def reduce_op(self) -> dist.ReduceOp:
        return dist.ReduceOp.MAX if self.op == "max" else dist.ReduceOp.MIN

    def local(self, w_rows: Tensor, *, row_offset: int = 0, rows: int | None = None) -> Tensor:
        """This rank's contribution from its rows ``[row_offset, row_offset + len(w_rows))`` of a
        weight with ``rows`` rows (zeros for a rank holding none)."""
        return P.local_stat(w_rows, self.spec, self.stat, row_offset=row_offset, rows=rows)

    def combine(self, parts: Sequence[Tensor]) -> Tensor:
        """What the all-reduce computes, in one process (tests; single-rank runs)."""
        stacked = torch.stack(list(parts))
        return stacked.amax(0) if self.op == "max" else stacked.amin(0)


def _declare_all(spec: P.QuantSpec) -> tuple[Reduction, ...]:
    """A reduction for every statistic ``spec``'s scales read across rows."""
    return tuple(Reduction(stat, spec) for stat in P.cross_row_stats(spec))


def _qtype(scheme: SchemeFields) -> P.QType:
    if scheme.type == "int":
        return P.int_type(scheme.num_bits, scheme.symmetric)
    return P.FP8_E4M3 if scheme.num_bits == 8 else P.FP4_E2M1


def _spec(scheme: SchemeFields) -> P.QuantSpec:
    """The maths a scheme's fields name: block shape, element type, scale type, global scale."""
    return P.QuantSpec(granularity_of(scheme), _qtype(scheme), SCALE_DTYPES[scheme.scale_dtype],
                       global_scale=scheme.strategy == "tensor_group")


def granularity_of(scheme: SchemeFields) -> P.Granularity:
    """The block shape a scheme's ``strategy`` names."""
    if scheme.strategy == "group":
        return P.PerGroup(scheme.group_size)
    if scheme.strategy == "channel":
        return P.PerChannel()
    if scheme.strategy == "tensor":
        return P.PerTensor()
    if scheme.strategy == "tensor_group":  # per-group scales under one global scale
        return P.PerGroup(scheme.group_size)
    if scheme.strategy == "block":
        return P.PerBlock(*scheme.block_structure)
    raise ValueError(f"scheme {scheme.name}: no block shape for strategy {scheme.strategy!r}")


class Format:
    """One compressed-tensors format.  A registration subclasses this and sets ``name``."""

    name: ClassVar[str] = ""

    def accepts(self, scheme: SchemeFields) -> str | None:
        """None if this format writes ``scheme``; otherwise why not (one line)."""
        raise NotImplementedError

    def spec(self, scheme: SchemeFields) -> P.QuantSpec:
        raise NotImplementedError

    def reductions(self, scheme: SchemeFields) -> tuple[Reduction, ...]:
        """Cross-rank reductions needed before quantizing rows (none: row-independent)."""
        return ()

    def tensors(self, scheme: SchemeFields, shape: tuple[int, int], dtype: torch.dtype) -> tuple[TensorSpec, ...]:
        """Checkpoint tensors for a weight of ``shape`` whose scales are in ``dtype``."""
        raise NotImplementedError

    def names(self, scheme: SchemeFields) -> tuple[str, ...]:
        """The tensor names (they do not depend on the shape: read off one scale block's)."""
        unit = P.block_size(self.spec(scheme).granularity, (1, 1))
        return tuple(t.name for t in self.tensors(scheme, unit, torch.float32))

    def row_alignment(self, scheme: SchemeFields) -> int:
        return 1

    def compress(self, q: Tensor, qp: P.QParams, scheme: SchemeFields) -> dict[str, Tensor]:
        """The checkpoint tensors from quantized values ``q [out, in]`` and their qparams."""
        raise NotImplementedError

    def decompress(self, tensors: Mapping[str, Tensor], scheme: SchemeFields) -> Tensor:
        """The dense weight a loader reconstructs from :meth:`compress`'s tensors."""
        raise NotImplementedError

    def weight_args(self, scheme: SchemeFields):
        """The library's ``QuantizationArgs`` for the weights (only the fields it sets, so the
        serialized config equals the library's own)."""
        from compressed_tensors.quantization import QuantizationArgs

        extra = {}
        if scheme.block_structure is not None:
            extra["block_structure"] = list(scheme.block_structure)
        if scheme.scale_dtype is not None:
            extra["scale_dtype"] = extra["zp_dtype"] = _CT_SCALE_DTYPES[scheme.scale_dtype]
        return QuantizationArgs(
            num_bits=scheme.num_bits,
            type=scheme.type,
            symmetric=scheme.symmetric,
            strategy=scheme.strategy,
            group_size=scheme.group_size,
            dynamic=False,
            **extra,
        )

    def ct_scheme(self, scheme: SchemeFields, targets: Sequence[str]):
        """The library's ``QuantizationScheme`` for ``targets`` (with ``format`` filled in)."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        act = ACTIVATIONS[scheme.activations]
        return QuantizationScheme(
            targets=list(targets),
            weights=self.weight_args(scheme),
            input_activations=None if act is None else QuantizationArgs(**act),
            format=self.name,
        )


# ------------------------------------------------------------------ the registry

_FORMATS: dict[str, Format] = {}


def register_format(fmt: type[Format] | Format):
    """Register a format (class decorator, or an instance); a name registers once."""
    inst = fmt() if isinstance(fmt, type) else fmt
    if not inst.name:
        raise ValueError(f"{type(inst).__name__} has no format name")
    if inst.name in _FORMATS:
        raise ValueError(f"format {inst.name!r} is already registered")
    _FORMATS[inst.name] = inst
    _registry_changed()
    return fmt


def unregister_format(name: str) -> None:
    _FORMATS.pop(name)
    _registry_changed()


def get_format(name: str) -> Format:
    if name not in _FORMATS:
        raise SqError(f"unknown format {name!r}; registered: {', '.join(_FORMATS)}")
    return _FORMATS[name]


def format_names() -> tuple[str, ...]:
    return tuple(_FORMATS)


@functools.lru_cache(maxsize=256)
def _resolve(scheme: SchemeFields) -> Format:
    reasons, found = [], []
    for fmt in _FORMATS.values():
        why = fmt.accepts(scheme)
        (reasons.append(f"{fmt.name}: {why}") if why else found.append(fmt))
    if not found:
        raise ValueError(f"scheme {scheme.name}: no registered format writes it ({'; '.join(reasons)})")
    if len(found) > 1:
        raise ValueError(f"scheme {scheme.name}: formats {[f.name for f in found]} all accept it")
    return found[0]


def format_for(scheme: SchemeFields) -> Format:
    """The one registered format that writes ``scheme`` (ValueError if none or several)."""
    return _resolve(scheme)


@functools.lru_cache(maxsize=256)
def spec_for(scheme: SchemeFields) -> P.QuantSpec:
    """The maths of ``scheme`` (cached: GPTQ asks once per column)."""
    spec = _resolve(scheme).spec(scheme)
    if getattr(scheme, "int_grid", None) == "full":
        spec = dataclasses.replace(spec, full_range=True)
    return spec


def _registry_changed() -> None:
    _resolve.cache_clear()
    spec_for.cache_clear()


# ------------------------------------------------------------------ calibrated activations


@dataclass(frozen=True)
class ActivationObserver:
    """A static activation tensor a scheme writes for each Linear, from calibration.

    ``name``: the checkpoint tensor (``input_scale``: FP8's per-tensor fp8 scale, in the
    activation dtype; ``input_global_scale``: NVFP4's float32 global scale).  Its one statistic
    is the absmax of every input the Linear sees (0 included, so 0 is the identity): each forward
    contributes :meth:`local`, a rank keeps the running max, the ranks all-reduce with
    ``reduce_op`` (MAX) -- routed experts each their own --, and :meth:`finalize` turns the result
    into the tensor exactly as the library does from its ``static_minmax`` observer's running
    min / max (``calculate_qparams`` / ``generate_gparam``).  An absmax of 0 (an expert no token
    reached) still gives a finite, valid tensor: the fp8 scale becomes the dtype's eps, the
    global scale 1 (the library's own fallbacks).
    """

    name: str
    kind: str  # "scale" (fp8 per-tensor) | "global_scale" (NVFP4)
    stat: ClassVar[str] = "absmax"
    op: ClassVar[str] = "max"

    @property
    def reduce_op(self) -> dist.ReduceOp:
        return dist.ReduceOp.MAX

    @staticmethod
    def local(x: Tensor) -> Tensor:
        """One batch's contribution: ``max(|x|)`` (0 for an empty batch), float32 ``[1]`` (exact for
        bf16 / fp16 inputs; float64 inputs stay float64)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        zero = torch.zeros(1, dtype=dtype, device=x.device)
        if x.numel() == 0:
            return zero
        return torch.maximum(torch.maximum(x.amax(), -x.amin()).to(dtype).reshape(1), zero)

    def finalize(self, absmax: Tensor, dtype: torch.dtype) -> Tensor:
        """The checkpoint tensor from the all-reduced ``absmax``; ``dtype``: the observed
        activations' dtype (the library computes in it; the model's dtype)."""
        a = absmax.reshape(1).to(dtype)
        if self.kind == "global_scale":
            return P.global_scale(a, P.FP4_E2M1, torch.float8_e4m3fn)
        spec = P.QuantSpec(P.PerTensor(), P.FP8_E4M3)
        return P.choose_qparams(torch.zeros(0, 1, dtype=dtype, device=a.device), spec, stats={"absmax": a}).scale

    def tensor(self, dtype: torch.dtype) -> TensorSpec:
        """The checkpoint tensor's declaration for a model in ``dtype``."""
        return TensorSpec(self.name, torch.float32 if self.kind == "global_scale" else dtype, (1,))


_OBSERVERS: dict[str, tuple[ActivationObserver, ...]] = {
    "fp8_static_tensor": (ActivationObserver("input_scale", "scale"),),
    "nvfp4_static_global": (ActivationObserver("input_global_scale", "global_scale"),),
}


def activation_observers(scheme: SchemeFields) -> tuple[ActivationObserver, ...]:
    """The calibrated activation tensors ``scheme`` writes per Linear (empty: nothing to
    observe; dynamic activation schemes are scaled at run time by the serving engine)."""
    return _OBSERVERS.get(scheme.activations, ())


# ------------------------------------------------------------------ row independence


def check_row_shardable(scheme: SchemeFields) -> None:
    """Refuse ``scheme`` unless every statistic its scales read across rows is reduced.

    The driver calls this before any rank quantizes its rows with ``scheme``: without the
    reductions each rank would compute its own per-tensor (or per-block, or global) scale from
    its rows and write scales that disagree with one another.
    """
    fmt = format_for(scheme)
    spec = fmt.spec(scheme)
    needed = P.cross_row_stats(spec)
    declared = {r.stat for r in fmt.reductions(scheme)}
    missing = sorted(set(needed) - declared)
    if missing:
        raise SqError(
            f"scheme {scheme.name} ({fmt.name}, {spec.granularity}, {spec.qtype.name}): its scales read "
            f"{', '.join(missing)} over all rows of a weight, but the format declares no reduction for "
            f"{'it' if len(missing) == 1 else 'them'}; ranks quantizing their own rows would write "
            f"disagreeing scales. Declare the reductions in the format's registration."
        )


def required_reductions(scheme: SchemeFields) -> list[Reduction]:
    """The reductions the driver all-reduces before quantizing rows with ``scheme`` (checked)."""
    check_row_shardable(scheme)
    return list(format_for(scheme).reductions(scheme))


def row_independent(scheme: SchemeFields) -> bool:
    """True if ``scheme``'s scales depend only on the rows being quantized, given its format's
    declared reductions (:func:`check_row_shardable` would pass)."""
    fmt = format_for(scheme)
    return set(P.cross_row_stats(fmt.spec(scheme))) <= {r.stat for r in fmt.reductions(scheme)}


# ------------------------------------------------------------------ registrations


@register_format
class PackQuantized(Format):
    """Ints of 2..8 bits packed densely into int32 along ``in`` (the library's ``pack_to_int32``).

    ==================  =======================================  ============
    weight_packed       [out, ceil(in * bits / 32)]              int32
    weight_scale        [out, in / group] (group) / [out, 1]     weight dtype
    weight_shape        [2] = (out, in)                          int64
    weight_zero_point   [ceil(out * bits / 32), in / group]      int32 (asymmetric only;
                                                                 packed along *out*)
    ==================  =======================================  ============
    """

    name = "pack-quantized"

    def accepts(self, scheme):
        if scheme.type != "int":
            return f"packs int weights, not {scheme.type}"
        if not 2 <= scheme.num_bits <= 8:
            return f"packs 2..8-bit ints, not {scheme.num_bits}"
        if scheme.strategy not in ("group", "channel"):
            return f"writes per-group or per-channel scales, not {scheme.strategy}"
        if scheme.activations != "none":
            return "writes weight-only int schemes (int weights with quantized activations: int-quantized)"
        if scheme.scale_dtype is not None:
            return f"writes scales in the weight's dtype, not {scheme.scale_dtype}"
        return None

    def spec(self, scheme):
        return P.QuantSpec(granularity_of(scheme), P.int_type(scheme.num_bits, scheme.symmetric))

    def tensors(self, scheme, shape, dtype):
        out_f, in_f = shape
        bits = scheme.num_bits
        s_shape = P.scale_shape(granularity_of(scheme), shape)
        specs = (
            TensorSpec("weight_packed", torch.int32, (out_f, -(-in_f * bits // 32))),
            TensorSpec("weight_scale", dtype, s_shape),
            TensorSpec("weight_shape", torch.int64, (2,)),
        )
        if not scheme.symmetric:
            specs += (TensorSpec("weight_zero_point", torch.int32, (-(-out_f * bits // 32), s_shape[1])),)
        return specs

    def row_alignment(self, scheme):
        # only asymmetric zero points mix rows: 32 / bits rows per int32 along out
        if not scheme.symmetric:
            return 32 // scheme.num_bits if 32 % scheme.num_bits == 0 else 32
        return 1

    def compress(self, q, qp, scheme):
        out = {
            "weight_packed": pack_int32(q.contiguous(), scheme.num_bits),
            "weight_scale": qp.scale.contiguous(),
            "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
        }
        if qp.zero_point is not None:
            out["weight_zero_point"] = pack_int32(qp.zero_point.contiguous(), scheme.num_bits, packed_dim=0).contiguous()
        return out

    def decompress(self, tensors, scheme):
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        scale = tensors["weight_scale"]
        shape = torch.Size(int(v) for v in tensors["weight_shape"])
        q = unpack_from_int32(tensors["weight_packed"], scheme.num_bits, shape)
        zp = None
        if not scheme.symmetric:
            zp = unpack_from_int32(
                tensors["weight_zero_point"], scheme.num_bits, torch.Size((shape[0], scale.shape[-1])), packed_dim=0
            )
        return P.dequantize(q, P.QParams(scale, zp), self.spec(scheme))


_FP8_ACTIVATIONS = ("none", "fp8_dynamic_token", "fp8_dynamic_group128", "fp8_static_tensor")


def _observed(scheme: SchemeFields, dtype: torch.dtype) -> tuple[TensorSpec, ...]:
    return tuple(o.tensor(dtype) for o in activation_observers(scheme))


@register_format
class FloatQuantized(Format):
    """float8 e4m3 values as they are (``weight``), scales in the weight dtype.

    ==================  ===============================================================
    weight              [out, in] float8_e4m3fn
    weight_scale        [out, 1] (channel), [out, in / group] (group), [1] (tensor: FP8),
                        [ceil(out / 128), ceil(in / 128)] (block: FP8_BLOCK; edge blocks
                        partial, as the library pads them with zeros)
    input_scale         [1] (FP8 only: static activations, calibrated)
    ==================  ===============================================================

    A per-tensor scale reads the absmax of every row, a 128 x 128 block's scale that of 128
    rows: both declared as reductions (all-reduced before any rank quantizes).
    """

    name = "float-quantized"

    def accepts(self, scheme):
        if scheme.type != "float":
            return f"writes float weights, not {scheme.type}"
        if scheme.num_bits != 8:
            return f"writes float8 e4m3 weights only, not {scheme.num_bits} bits"
        if not scheme.symmetric:
            return "writes symmetric float weights only"
        if scheme.strategy not in ("group", "channel", "tensor", "block"):
            return f"writes per-group, per-channel, per-tensor or block scales, not {scheme.strategy}"
        if scheme.scale_dtype is not None:
            return f"writes scales in the weight's dtype, not {scheme.scale_dtype} (e8m0: mxfp8-quantized)"
        if scheme.activations not in _FP8_ACTIVATIONS:
            return f"writes fp8 weights with fp8 activations (or none), not {scheme.activations}"
        return None

    def spec(self, scheme):
        return _spec(scheme)

    def reductions(self, scheme):
        return _declare_all(self.spec(scheme))

    def tensors(self, scheme, shape, dtype):
        return (
            TensorSpec("weight", torch.float8_e4m3fn, tuple(shape)),
            TensorSpec("weight_scale", dtype, P.scale_shape(granularity_of(scheme), shape)),
        ) + _observed(scheme, dtype)

    def compress(self, q, qp, scheme):
        return {"weight": q.contiguous(), "weight_scale": qp.scale.contiguous()}

    def decompress(self, tensors, scheme):
        return P.dequantize(tensors["weight"], P.QParams(tensors["weight_scale"]), self.spec(scheme))


def _library_decompress(fmt: Format, tensors: Mapping[str, Tensor], scheme: SchemeFields) -> Tensor:
    """The library compressor's own ``decompress`` of one Linear's tensors (its dense weight)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(fmt.name)
    return compressor.decompress(dict(tensors), fmt.ct_scheme(scheme, ["Linear"]))["weight"]


@register_format
class IntQuantized(Format):
    """Int weights with quantized activations (``W8A8``, ``W4A8``, ``W4AFP8``): the values
    unpacked, one int8 each -- the library's ``int-quantized`` compressor, which it picks for any
    int weights with input activations, 4-bit ones included.

    ==================  =======================================  ============
    weight              [out, in]                                int8
    weight_scale        [out, 1] (channel) / [out, in / group]   weight dtype
    ==================  =======================================  ============
    """

    name = "int-quantized"

    def accepts(self, scheme):
        if scheme.type != "int":
            return f"writes int weights, not {scheme.type}"
        if not 2 <= scheme.num_bits <= 8:
            return f"writes 2..8-bit ints, not {scheme.num_bits}"
        if not scheme.symmetric:
            return "writes symmetric int weights only"
        if scheme.strategy not in ("group", "channel"):
            return f"writes per-group or per-channel scales, not {scheme.strategy}"
        if scheme.activations not in ("int8_dynamic_token", "fp8_dynamic_token"):
            return "writes int weights with dynamic per-token int8 or fp8 activations (weight-only: pack-quantized)"
        if scheme.scale_dtype is not None:
            return f"writes scales in the weight's dtype, not {scheme.scale_dtype}"
        return None

    def spec(self, scheme):
        return _spec(scheme)

    def tensors(self, scheme, shape, dtype):
        return (
            TensorSpec("weight", torch.int8, tuple(shape)),
            TensorSpec("weight_scale", dtype, P.scale_shape(granularity_of(scheme), shape)),
        )

    def compress(self, q, qp, scheme):
        return {"weight": q.contiguous(), "weight_scale": qp.scale.contiguous()}

    def decompress(self, tensors, scheme):
        return P.dequantize(tensors["weight"], P.QParams(tensors["weight_scale"]), self.spec(scheme))


class _FP4Packed(Format):
    """fp4 e2m1 values two to a byte (the library's ``pack_fp4_to_uint8``)."""

    group_size: ClassVar[int] = 0
    strategy: ClassVar[str] = ""
    scale_dtype: ClassVar[str] = ""
    activations: ClassVar[tuple[str, ...]] = ()

    def accepts(self, scheme):
        if (scheme.type, scheme.num_bits) != ("float", 4):
            return f"packs fp4 e2m1 weights, not {scheme.type}{scheme.num_bits}"
        if not scheme.symmetric:
            return "packs symmetric fp4 weights only"
        if (scheme.strategy, scheme.group_size, scheme.scale_dtype) != (self.strategy, self.group_size,
                                                                        self.scale_dtype):
            return (f"writes strategy {self.strategy!r} groups of {self.group_size} with {self.scale_dtype} "
                    "scales")
        if scheme.activations not in self.activations:
            return f"writes activations {' or '.join(self.activations)}, not {scheme.activations}"
        return None

    def spec(self, scheme):
        return _spec(scheme)

    def reductions(self, scheme):
        return _declare_all(self.spec(scheme))

    def _packed(self, q):
        from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

        if q.device.type == "cpu" and q.ndim == 2 and q.shape[1] % 2 == 0:
            return pack_fp4_cpu(q.contiguous())
        return pack_fp4_to_uint8(q.contiguous())

    def decompress(self, tensors, scheme):
        return _library_decompress(self, tensors, scheme)


_FP4_CODE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)  # code of |2x|


def pack_fp4_cpu(q: Tensor) -> Tensor:
    """The library's ``pack_fp4_to_uint8`` on CPU, bit for bit on any input, by a table lookup (its CPU
    fallback makes seven masked assignments over the tensor: 55% of the time to quantize and compress
    an NVFP4 expert on this CPU).  The magnitude code of ``|2x|`` as int8 (values 0..12; anything at or above 12 is code 7, other values
    code 0, as there), the sign bit from ``signbit`` (so -0.0 keeps it), two codes a byte, low first.
    ``q [m, n]``, ``n`` even.  Tested against the library's own function (``tests/test_formats.py``)."""
    m, n = q.shape
    mag = (q * 2).to(torch.int8).abs_().clamp_(0, 12)  # int8 -128 stays negative under abs: code 0 there too
    codes = _FP4_CODE[mag.to(torch.int32)] | (torch.signbit(q).to(torch.uint8) << 3)
    pairs = codes.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).view(m, n // 2)


def pack_int32(q: Tensor, bits: int, packed_dim: int = 1) -> Tensor:
    """The library's ``pack_to_int32`` (int8 codes of ``bits`` bits, offset to unsigned, packed densely into int32
    along ``packed_dim``), bit for bit.  Where ``bits`` divides 32 (2, 4, 8) on a 2-D CPU tensor, by OR-ing each
    word's ``32 / bits`` shifted codes: the library's scatter builds int32 and int64 copies of every element, ~16
    bytes an element churned through the C heap per weight -- 1.4 ms and ~1.3 MiB of heap left fragmented per
    call for a 384 x 1024 expert projection on one core here, against 0.4 ms and none this way (a block of 64
    experts compresses 192 of them).  Tested against the library's own function (``tests/test_formats.py``)."""
    if q.device.type != "cpu" or q.ndim != 2 or 32 % bits or q.dtype != torch.int8:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        return pack_to_int32(q, bits, packed_dim=packed_dim)
    if packed_dim == 0:
        return pack_int32(q.t().contiguous(), bits).t().contiguous()
    per = 32 // bits
    rows, cols = q.shape
    codes = (q + (1 << (bits - 1))).view(torch.uint8)  # two's complement wraps -2^(b-1) .. 2^(b-1)-1 to 0 .. 2^b-1
    if cols % per:
        codes = torch.nn.functional.pad(codes, (0, per - cols % per))
    codes = codes.view(rows, -1, per)
    out = codes[:, :, 0].to(torch.int32)
    for k in range(1, per):
        out |= codes[:, :, k].to(torch.int32) << (k * bits)
    return out


@register_format
class NVFP4PackQuantized(_FP4Packed):
    """NVFP4 (``NVFP4A16``, ``NVFP4``): fp4 groups of 16 with fp8 scales under one float32
    global scale per weight.

    ====================  ====================  =============
    weight_packed         [out, in / 2]         uint8
    weight_scale          [out, in / 16]        float8_e4m3fn
    weight_global_scale   [1]                   float32
    input_global_scale    [1]                   float32 (``NVFP4`` only: calibrated)
    ====================  ====================  =============

    The global scale reads the absmax of every row (declared: ``global_absmax``); vLLM fuses
    q/k/v and gate/up and needs them to share it (reduce it over the partners too).
    """

    name = "nvfp4-pack-quantized"
    group_size, strategy, scale_dtype = 16, "tensor_group", "float8_e4m3fn"
    activations = ("none", "nvfp4_static_global")

    def tensors(self, scheme, shape, dtype):
        out_f, in_f = shape
        return (
            TensorSpec("weight_packed", torch.uint8, (out_f, in_f // 2)),
            TensorSpec("weight_scale", torch.float8_e4m3fn, P.scale_shape(granularity_of(scheme), shape)),
            TensorSpec("weight_global_scale", torch.float32, (1,)),
        ) + _observed(scheme, dtype)

    def compress(self, q, qp, scheme):
        return {
            "weight_packed": self._packed(q),
            "weight_scale": qp.scale.to(torch.float8_e4m3fn).contiguous(),  # the library's _compress_scale
            "weight_global_scale": qp.global_scale.reshape(1).to(torch.float32),
        }


@register_format
class MXFP4PackQuantized(_FP4Packed):
    """MXFP4 (``MXFP4A16``, ``MXFP4``): fp4 groups of 32 with power-of-two scales.

    ==============  ==============  =====
    weight_packed   [out, in / 2]   uint8
    weight_scale    [out, in / 32]  uint8 (e8m0: biased exponent, ``2 ** (e - 127)``)
    ==============  ==============  =====
    """

    name = "mxfp4-pack-quantized"
    group_size, strategy, scale_dtype = 32, "group", "e8m0"
    activations = ("none", "mxfp4_dynamic")

    def tensors(self, scheme, shape, dtype):
        out_f, in_f = shape
        return (
            TensorSpec("weight_packed", torch.uint8, (out_f, in_f // 2)),
            TensorSpec("weight_scale", torch.uint8, P.scale_shape(granularity_of(scheme), shape)),
        )

    def compress(self, q, qp, scheme):
        from compressed_tensors.compressors.mx_utils import compress_mx_scale

        return {"weight_packed": self._packed(q), "weight_scale": compress_mx_scale(qp.scale, torch.uint8)}


@register_format
class MXFP8Quantized(Format):
    """MXFP8 (``MXFP8A16``, ``MXFP8``): fp8 e4m3 values in groups of 32 with power-of-two scales.

    ============  ==============  =============
    weight        [out, in]       float8_e4m3fn
    weight_scale  [out, in / 32]  uint8 (e8m0)
    ============  ==============  =============
    """

    name = "mxfp8-quantized"

    def accepts(self, scheme):
        if (scheme.type, scheme.num_bits) != ("float", 8):
            return f"writes fp8 weights, not {scheme.type}{scheme.num_bits}"
        if not scheme.symmetric:
            return "writes symmetric fp8 weights only"
        if (scheme.strategy, scheme.group_size, scheme.scale_dtype) != ("group", 32, "e8m0"):
            return "writes groups of 32 with e8m0 scales"
        if scheme.activations not in ("none", "mxfp8_dynamic"):
            return f"writes activations none or mxfp8_dynamic, not {scheme.activations}"
        return None

    def spec(self, scheme):
        return _spec(scheme)

    def tensors(self, scheme, shape, dtype):
        return (
            TensorSpec("weight", torch.float8_e4m3fn, tuple(shape)),
            TensorSpec("weight_scale", torch.uint8, P.scale_shape(granularity_of(scheme), shape)),
        )

    def compress(self, q, qp, scheme):
        from compressed_tensors.compressors.mx_utils import compress_mx_scale

        return {"weight": q.contiguous(), "weight_scale": compress_mx_scale(qp.scale, torch.uint8)}

    def decompress(self, tensors, scheme):
        return _library_decompress(self, tensors, scheme)
