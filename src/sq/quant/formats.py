"""The format registry: what each compressed-tensors format writes, and what it needs first.

A :class:`Format` is keyed by compressed-tensors' format name (``config.json``'s ``format``:
``pack-quantized``, ``float-quantized``, ...) and declares, for each ``QuantScheme`` it
:meth:`~Format.accepts`:

- :meth:`~Format.spec`: the maths, a :class:`~sq.quant.primitives.QuantSpec` (block shape,
  target type, scale type) that :mod:`sq.quant.primitives` computes with;
- :meth:`~Format.tensors`: the checkpoint tensors of one Linear (names, dtypes, shapes);
- :meth:`~Format.compress` / :meth:`~Format.decompress`: packing and unpacking, always with the
  compressed-tensors library's own helpers, never by hand, so the bits match the library's;
- :meth:`~Format.ct_scheme`: the library's ``QuantizationScheme`` for the config;
- :meth:`~Format.reductions`: the statistics every rank's rows contribute to, all-reduced
  before any rank quantizes (none for per-channel / per-group scales; the absmax over all rows
  for a per-tensor scale or NVFP4's global scale);
- :meth:`~Format.row_alignment`: rows a shard boundary must be a multiple of for a shard's
  *packed* tensors to be rows of the whole ones.

The row-independence contract.  sq quantizes a weight on the ranks that hold its rows, each
rank its own rows, before any gather.  That is exact only if every scale depends on the rows
being quantized alone, or on statistics that were reduced over every rank's rows first.  The
primitives know which statistics a spec's scales read across rows
(:func:`~sq.quant.primitives.cross_row_stats`); a format declares which it reduces; and
:func:`check_row_shardable` -- which the driver calls before quantizing with a scheme -- refuses
a scheme whose format leaves one undeclared.  :func:`required_reductions` is then the list the
driver all-reduces (empty for every scheme registered today).

A scheme is resolved to exactly one format (:func:`format_for`): ``QuantScheme`` refuses, at
construction, a scheme that no registered format accepts.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from sq.errors import SqError
from sq.quant import primitives as P

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
]


class SchemeFields(Protocol):
    """What a format reads of a ``sq.quant.schemes.QuantScheme``."""

    name: str
    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    activations: str


# compressed-tensors' input activation args per ``QuantScheme.activations``
ACTIVATIONS: dict[str, dict | None] = {
    "none": None,
    "fp8_dynamic_token": dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
}


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


def granularity_of(scheme: SchemeFields) -> P.Granularity:
    """The block shape a scheme's ``strategy`` names."""
    if scheme.strategy == "group":
        return P.PerGroup(scheme.group_size)
    if scheme.strategy == "channel":
        return P.PerChannel()
    if scheme.strategy == "tensor":
        return P.PerTensor()
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

        return QuantizationArgs(
            num_bits=scheme.num_bits,
            type=scheme.type,
            symmetric=scheme.symmetric,
            strategy=scheme.strategy,
            group_size=scheme.group_size,
            dynamic=False,
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
    return _resolve(scheme).spec(scheme)


def _registry_changed() -> None:
    _resolve.cache_clear()
    spec_for.cache_clear()


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
            return "writes weight-only int schemes (dynamic fp8 activations need fp8 weights)"
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
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        out = {
            "weight_packed": pack_to_int32(q.contiguous(), scheme.num_bits),
            "weight_scale": qp.scale.contiguous(),
            "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
        }
        if qp.zero_point is not None:
            out["weight_zero_point"] = pack_to_int32(
                qp.zero_point.contiguous(), scheme.num_bits, packed_dim=0
            ).contiguous()
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


@register_format
class FloatQuantized(Format):
    """float8 e4m3 values as they are (``weight``), scales in the weight dtype (``weight_scale``
    ``[out, 1]`` per channel, ``[out, in / group]`` per group)."""

    name = "float-quantized"

    def accepts(self, scheme):
        if scheme.type != "float":
            return f"writes float weights, not {scheme.type}"
        if scheme.num_bits != 8:
            return f"writes float8 e4m3 weights only, not {scheme.num_bits} bits"
        if not scheme.symmetric:
            return "writes symmetric float weights only"
        if scheme.strategy not in ("group", "channel"):
            return f"writes per-group or per-channel scales, not {scheme.strategy}"
        return None

    def spec(self, scheme):
        return P.QuantSpec(granularity_of(scheme), P.FP8_E4M3)

    def tensors(self, scheme, shape, dtype):
        return (
            TensorSpec("weight", torch.float8_e4m3fn, tuple(shape)),
            TensorSpec("weight_scale", dtype, P.scale_shape(granularity_of(scheme), shape)),
        )

    def compress(self, q, qp, scheme):
        return {"weight": q.contiguous(), "weight_scale": qp.scale.contiguous()}

    def decompress(self, tensors, scheme):
        return P.dequantize(tensors["weight"], P.QParams(tensors["weight_scale"]), self.spec(scheme))
