"""Quantization primitives: pure tensor maths, parameterized by block shape and target type.

torchao's ``quant_primitives`` shape (``choose_qparams_affine(block_size, target_dtype)``,
``quantize_affine``, ``dequantize_affine``) with compressed-tensors' numbers: every function
reproduces compressed-tensors 0.20's torch (CPU) path op for op and in the same dtypes
(``calculate_qparams`` fed by a min-max observation, ``generate_gparam``,
``generate_mx_scales``, ``cast_to_fp4``, the forward ``quantize`` / ``dequantize``), so an sq
checkpoint holds exactly the bits the library would write for the same weights.  In particular
the arithmetic runs in the *weight's* dtype: for bf16 weights ``absmax / 7.5`` is a bf16
division.  (The library's CUDA Triton kernels divide in fp32 instead, so the library itself is
not bit-stable across devices; sq follows the torch path on every device.)

A :class:`QuantSpec` names the three choices:

- **granularity** -- the block one scale covers, for a weight ``[rows, in]``:
  :class:`PerTensor` (the whole weight), :class:`PerChannel` (one row), :class:`PerGroup`
  (``1 x size`` along ``in``), :class:`PerBlock` (``rows x cols``; edge blocks are partial,
  as the library pads them with zeros);
- **target type** -- :class:`QType`: int N-bit (symmetric or asymmetric), fp8 e4m3, fp4 e2m1;
- **scale type** -- ``scale_dtype``: ``None`` (the weight's own dtype, the library's default),
  a float dtype the scale values are rounded through (``torch.float8_e4m3fn``, ``torch.bfloat16``,
  ...), or :data:`E8M0` (a power of two, MX formats); and ``global_scale`` (NVFP4's two-level
  scales: per-group fp8 scales under one per-tensor float32 scale).

Rows and shards.  A scale whose block spans one row (per-channel, per-group) depends only on
that row: quantizing rows ``[a, b)`` alone gives exactly those rows of the whole result.  Any
other scale reads *cross-row statistics* (:func:`cross_row_stats`): the per-tensor or per-block
range, the global scale's absmax.  Each is a max (or min) whose identity is 0, so every rank
computes its rows' contribution (:func:`local_stat`, 0 where it holds no rows), an all-reduce
combines them, and :func:`choose_qparams` given the combined ``stats`` returns what it would
for the whole weight.  Scales whose block spans rows then come back whole (the full per-tensor
scale or block grid, identical on every rank; :func:`scales_follow_rows` is False), and
:func:`quantize` / :func:`dequantize` take the shard's ``row_offset`` to pick its rows' blocks.

Shapes: ``x [rows, in]``; scales :func:`scale_shape`: ``[1]`` (tensor), ``[rows, 1]``
(channel), ``[rows, in / size]`` (group), ``[ceil(rows / r), ceil(in / c)]`` (block); zero
points the same (int8), ``None`` for symmetric types.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sq.errors import SqError

__all__ = [
    "PerTensor",
    "PerChannel",
    "PerGroup",
    "PerBlock",
    "Granularity",
    "QType",
    "int_type",
    "FP8_E4M3",
    "FP4_E2M1",
    "E8M0",
    "QuantSpec",
    "QParams",
    "block_size",
    "scale_shape",
    "scales_follow_rows",
    "cross_row_stats",
    "local_stat",
    "choose_qparams",
    "quantize",
    "dequantize",
    "fake_quantize",
    "quantize_values",
    "dequantize_values",
    "round_to_e2m1",
    "round_to_power_of_two",
    "e8m0_scale",
    "global_scale",
]


# ------------------------------------------------------------------ granularity (block shape)


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole weight."""


@dataclass(frozen=True)
class PerChannel:
    """One scale per output row."""


@dataclass(frozen=True)
class PerGroup:
    """One scale per ``size`` consecutive inputs of a row (``size`` must divide ``in``)."""

    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
            raise ValueError(f"PerGroup size must be a positive int, got {self.size!r}")


@dataclass(frozen=True)
class PerBlock:
    """One scale per ``rows x cols`` tile (partial tiles at the edges)."""

    rows: int
    cols: int

    def __post_init__(self) -> None:
        for v in (self.rows, self.cols):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"PerBlock needs positive int rows and cols, got {(self.rows, self.cols)}")


Granularity = PerTensor | PerChannel | PerGroup | PerBlock


def block_size(g: Granularity, shape: tuple[int, int]) -> tuple[int, int]:
    """torchao's ``block_size``: the ``(rows, cols)`` one scale covers in a weight of ``shape``."""
    rows, cols = shape
    if isinstance(g, PerTensor):
        return (rows, cols)
    if isinstance(g, PerChannel):
        return (1, cols)
    if isinstance(g, PerGroup):
        return (1, g.size)
    return (g.rows, g.cols)


def scale_shape(g: Granularity, shape: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scale (and zero point) for a weight of ``shape``."""
    rows, cols = shape
    if isinstance(g, PerTensor):
        return (1,)
    if isinstance(g, PerChannel):
        return (rows, 1)
    if isinstance(g, PerGroup):
        if cols % g.size:
            raise SqError(f"group size {g.size} does not divide the weight width {cols}")
        return (rows, cols // g.size)
    return (math.ceil(rows / g.rows), math.ceil(cols / g.cols))


def _spans_rows(g: Granularity) -> bool:
    return isinstance(g, PerTensor) or (isinstance(g, PerBlock) and g.rows > 1)


# ------------------------------------------------------------------ target and scale types


@dataclass(frozen=True)
class QType:
    """The quantized values: ``int`` of ``bits`` bits (2..8), or ``float`` e4m3 (8) / e2m1 (4)."""

    kind: str
    bits: int
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.kind == "int":
            if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
                raise ValueError(f"int values need 2..8 bits, got {self.bits!r}")
        elif self.kind == "float":
            if self.bits not in (4, 8):
                raise ValueError(f"float values are fp8 e4m3 or fp4 e2m1, got {self.bits!r} bits")
            if not self.symmetric:
                raise ValueError("float values are symmetric only")
        else:
            raise ValueError(f"QType kind must be 'int' or 'float', got {self.kind!r}")

    @property
    def name(self) -> str:
        if self.kind == "int":
            return f"int{self.bits}" + ("" if self.symmetric else "_asym")
        return "fp8_e4m3" if self.bits == 8 else "fp4_e2m1"

    @property
    def qmax(self) -> float:
        """Largest value (as compressed-tensors' ``calculate_range``)."""
        if self.kind == "int":
            return float((1 << (self.bits - 1)) - 1)
        return float(torch.finfo(torch.float8_e4m3fn).max) if self.bits == 8 else 6.0

    @property
    def qmin(self) -> float:
        return float(-(1 << (self.bits - 1))) if self.kind == "int" else -self.qmax

    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of quantized values before packing: int8 for any int width, float8_e4m3fn,
        and bfloat16 holding e2m1 values exactly (what the library's fp4 packer reads)."""
        if self.kind == "int":
            return torch.int8
        return torch.float8_e4m3fn if self.bits == 8 else torch.bfloat16


def int_type(bits: int, symmetric: bool = True) -> QType:
    return QType("int", bits, symmetric)


FP8_E4M3 = QType("float", 8)
FP4_E2M1 = QType("float", 4)

E8M0 = "e8m0"
"""Scale type: a power of two (stored as a biased exponent by the MX compressors)."""

# mantissa bits of the element types, for the MX power-of-two rounding (compressed-tensors
# uses e2m1's mantissa for both fp4 and fp8 elements)
_E2M1_MANTISSA = 1


@dataclass(frozen=True)
class QuantSpec:
    """Everything the maths needs: block shape, target type, scale type."""

    granularity: Granularity
    qtype: QType
    scale_dtype: torch.dtype | str | None = None  # None | a float dtype | E8M0
    global_scale: bool = False
    # symmetric int: each group's larger-magnitude extreme lands on qmin (auto-round's "full range";
    # the scale carries that extreme's sign) instead of absmax / ((qmax - qmin) / 2)
    full_range: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.granularity, (PerTensor, PerChannel, PerGroup, PerBlock)):
            raise ValueError(f"unknown granularity {self.granularity!r}")
        if self.scale_dtype == E8M0:
            if self.qtype.kind != "float" or self.global_scale:
                raise ValueError("e8m0 scales are for float values without a global scale")
        elif self.scale_dtype is not None and not (
            isinstance(self.scale_dtype, torch.dtype) and self.scale_dtype.is_floating_point
        ):
            raise ValueError(f"scale_dtype must be None, a float dtype or {E8M0!r}, got {self.scale_dtype!r}")
        if self.global_scale and (_spans_rows(self.granularity) or not self.qtype.symmetric):
            raise ValueError("a global scale sits over symmetric per-channel or per-group scales")
        if self.full_range and (self.qtype.kind != "int" or not self.qtype.symmetric or self.global_scale
                                or self.scale_dtype is not None):
            raise ValueError("the full-range grid is for symmetric int values under plain scales")


@dataclass
class QParams:
    """``choose_qparams``'s result: ``scale`` (a float tensor, values representable in the scale
    type), ``zero_point`` (int8, None when symmetric), ``global_scale`` (float32 ``[1]`` or None)."""

    scale: Tensor
    zero_point: Tensor | None = None
    global_scale: Tensor | None = None


def scales_follow_rows(spec: QuantSpec) -> bool:
    """True if ``scale`` / ``zero_point`` have one row per weight row (a shard's scales are its
    rows of the whole); False if they come back whole and identical on every rank."""
    return not _spans_rows(spec.granularity)


# ------------------------------------------------------------------ cross-row statistics


def cross_row_stats(spec: QuantSpec) -> dict[str, str]:
    """``{statistic: reduce op}`` that ``spec``'s scales read beyond the rows being quantized.

    Empty for per-channel and per-group scales: those are row-independent.
    """
    out = {}
    if _spans_rows(spec.granularity):
        out.update({"absmax": "max"} if spec.qtype.symmetric else {"min": "min", "max": "max"})
    if spec.global_scale:
        out["global_absmax"] = "max"
    return out


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 (or wider) holds every value of the weight's dtype exactly
    return torch.promote_types(dtype, torch.float32)


def local_stat(x: Tensor, spec: QuantSpec, stat: str, *, row_offset: int = 0, rows: int | None = None) -> Tensor:
    """This shard's contribution to ``stat``: ``x`` holds rows ``[row_offset, row_offset + len(x))``
    of a weight with ``rows`` rows (default: ``x`` is the whole weight).

    ``min`` / ``max`` / ``absmax`` already include 0 (the range must hold 0), so 0 is every
    statistic's identity and a rank holding no rows contributes zeros.  Shape ``[1]``, or the
    block grid for :class:`PerBlock`; dtype float32 (wider for float64 weights).
    """
    if stat not in cross_row_stats(spec):
        raise SqError(f"{stat!r} is not a cross-row statistic of {spec}")
    rows = x.shape[0] if rows is None else rows
    dtype = _stat_dtype(x.dtype)
    if stat == "global_absmax" or isinstance(spec.granularity, PerTensor):
        zero = torch.zeros(1, dtype=dtype, device=x.device)
        if x.numel() == 0:
            return zero
        v = _reduce(x.reshape(1, -1), stat).to(dtype)
        return torch.minimum(v, zero) if stat == "min" else torch.maximum(v, zero)
    # PerBlock: [rows_local, in] -> per-row block-column values [rows_local, n_bc] -> grid rows
    g = spec.granularity
    nbr, nbc = scale_shape(g, (rows, x.shape[1]))
    grid = torch.zeros(nbr, nbc, dtype=dtype, device=x.device)
    if x.shape[0] == 0:
        return grid
    if stat == "absmax":
        return _block_absmax(x, g, row_offset, grid)
    vals = _reduce(_grouped(x, g.cols), stat).to(dtype)
    idx = (torch.arange(x.shape[0], device=x.device) + row_offset) // g.rows
    how = "amin" if stat == "min" else "amax"
    return grid.scatter_reduce_(0, idx[:, None].expand_as(vals), vals, how, include_self=True)


def _block_absmax(x: Tensor, g: PerBlock, row_offset: int, grid: Tensor) -> Tensor:
    """``grid`` (zeros, the block grid) raised to the absmax of each tile's rows in ``x`` (rows
    ``row_offset...`` of the weight): first down the rows of each block row (a reduction across rows
    runs along contiguous columns: ~4x faster on CPU than one over each row's column groups, the
    old way), then across each tile's columns.  Exact, like any max."""
    a = x.abs()
    lo = 0
    while lo < a.shape[0]:
        br, off = divmod(row_offset + lo, g.rows)
        full = (a.shape[0] - lo) // g.rows if off == 0 else 0
        if full > 1:  # whole block rows at once
            hi = lo + full * g.rows
            m = a[lo:hi].unflatten(0, (full, g.rows)).amax(dim=1)
        else:  # one block row, or the part of it this shard holds (it starts or ends mid-tile)
            hi = min(a.shape[0], lo + g.rows - off)
            m = a[lo:hi].amax(dim=0, keepdim=True)
        blocks = _grouped(m, g.cols).amax(-1).to(grid.dtype)  # [block rows, n_bc]
        grid[br : br + blocks.shape[0]] = torch.maximum(grid[br : br + blocks.shape[0]], blocks)
        lo = hi
    return grid


def _reduce(t: Tensor, stat: str) -> Tensor:
    # along the last dim, in t's dtype (exact: min and max round nothing)
    if stat == "min":
        return t.amin(-1)
    if stat == "max":
        return t.amax(-1)
    mn, mx = torch.aminmax(t, dim=-1)  # one pass (twice as fast as amin + amax on bf16 CPU)
    return torch.maximum(mx, -mn)  # absmax without an |x| copy


def _missing(stats: Mapping[str, Tensor], spec: QuantSpec) -> list[str]:
    return sorted(set(cross_row_stats(spec)) - set(stats))


# ------------------------------------------------------------------ element types


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def round_to_e2m1(x: Tensor) -> Tensor:
    """Nearest fp4 e2m1 value (``+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}``), ties to the even code, in ``x.dtype``.

    The library's ``cast_to_fp4`` (same thresholds: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4; beyond 6 -> 6), and the same ``sign(x) * |value|`` so a negative
    value rounding to zero keeps the library's sign bit.
    """
    a = x.abs().to(_stat_dtype(x.dtype))  # exact
    # e2m1 is uniform within each binade -- steps of 0.5 below 2, 1 below 4, 2 up to 6 -- and in each
    # range the even multiple of the step is the even code, so round-half-to-even of |x| / step is
    # the library's rounding, ties included (checked against counting midpoints on every bf16 and
    # fp16 value; 20x cheaper on CPU than counting, which would be most of NVFP4's model-free time)
    values = torch.where(a < 2, torch.round(a * 2) * 0.5,
                         torch.where(a < 4, torch.round(a), torch.round(a * 0.5).mul_(2).clamp_(max=6)))
    values = values.nan_to_num_(0.0).to(x.dtype)  # NaN: code 0, as counting gave
    return torch.sign(x) * values


def round_to_power_of_two(x: Tensor, elem_mantissa: int = _E2M1_MANTISSA) -> Tensor:
    """The library's ``round_to_power_2``: keep sign and exponent of ``x`` after adding half an
    element-mantissa ulp, i.e. round to a power of two, upward only past ``1.5 * 2^e`` for e2m1."""
    bits = {
        torch.bfloat16: (torch.uint16, 7, 8),
        torch.float16: (torch.uint16, 10, 5),
        torch.float32: (torch.uint32, 23, 8),
        torch.float64: (torch.uint64, 52, 11),
    }
    if x.dtype not in bits:
        raise SqError(f"round_to_power_of_two: unsupported dtype {x.dtype}")
    int_dtype, mantissa, exponent = bits[x.dtype]
    v = x.view(int_dtype).to(torch.int64 if int_dtype == torch.uint64 else torch.int32)
    add = 1 << (mantissa - elem_mantissa - 1)
    sign_exponent = ((1 << (exponent + 1)) - 1) << mantissa
    r = torch.bitwise_and(v + add, sign_exponent)
    return (r.to(int_dtype) if int_dtype == torch.uint16 else r).view(x.dtype)


def e8m0_scale(absmax: Tensor, qtype: QType) -> Tensor:
    """MX scale of blocks with largest magnitude ``absmax``: a power of two in ``absmax.dtype``.

    The library's ``generate_mx_scales`` (the biased exponent ``127 + floor(log2(round_pow2(absmax)))
    - floor(log2(qmax))``), its rounding to a uint8 exponent (clamped to 0..255: an all-zero
    block gets ``2**-127``), and ``maybe_convert_from_mx_exp`` back to ``2 ** (e - 127)``.
    """
    offset = int(math.floor(math.log2(qtype.qmax)))
    exp = 127 + torch.floor(torch.log2(round_to_power_of_two(absmax, _E2M1_MANTISSA))) - offset
    exp = torch.round(torch.clamp(exp, 0, 255)).to(torch.uint8).to(absmax.dtype)
    return (2.00 ** ((exp.to(torch.int32) - 127).to(torch.float))).to(absmax.dtype)


def global_scale(absmax: Tensor, qtype: QType, scale_dtype: torch.dtype) -> Tensor:
    """NVFP4's per-tensor scale (the library's ``generate_gparam``), float32 ``[1]``: maps the
    tensor's absmax onto ``scale_max * qmax`` so the per-group scales use the scale type's range;
    1 where that is not finite (an all-zero or NaN weight)."""
    m = torch.clamp(absmax, min=torch.finfo(absmax.dtype).tiny)
    g = torch.finfo(scale_dtype).max * qtype.qmax / m
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape([1])


def _scale_eps(spec: QuantSpec, dtype: torch.dtype) -> float:
    # the library's _get_dtype_eps of scale_dtype (or of the scale's own dtype)
    d = spec.scale_dtype if spec.scale_dtype is not None else dtype
    if d == E8M0:
        return 1.0
    if d == torch.float8_e4m3fn:
        return 0.125
    return torch.finfo(d).eps


# ------------------------------------------------------------------ choose / quantize / dequantize


def _range(x: Tensor, spec: QuantSpec, stats: Mapping[str, Tensor] | None) -> tuple[Tensor, Tensor]:
    """Per-block ``(min, max)`` of ``x`` in ``x.dtype``, widened to include 0."""
    g = spec.granularity
    if _spans_rows(g):
        if stats is None:  # x is the whole weight
            stats = {s: local_stat(x, spec, s) for s in cross_row_stats(spec) if s != "global_absmax"}
        if spec.qtype.symmetric:
            amax = stats["absmax"].to(x.dtype)
            return -amax, amax
        return stats["min"].to(x.dtype), stats["max"].to(x.dtype)
    if isinstance(g, PerChannel):
        mn, mx = torch.aminmax(x, dim=-1, keepdim=True)
    else:
        xg = _grouped(x, g.size if isinstance(g, PerGroup) else g.cols)
        mn, mx = torch.aminmax(xg, dim=-1)
    # 0.0 must be representable exactly
    return torch.min(mn, torch.zeros_like(mn)), torch.max(mx, torch.zeros_like(mx))


def _grouped(x: Tensor, size: int) -> Tensor:
    # x [rows, in] -> [rows, ceil(in / size), size]; a partial last group (blocks only) is
    # zero-padded, as the library pads blocks
    pad = -x.shape[-1] % size
    if pad:
        x = F.pad(x, (0, pad))
    return x.unflatten(-1, (x.shape[-1] // size, size))


def choose_qparams(x: Tensor, spec: QuantSpec, *, stats: Mapping[str, Tensor] | None = None) -> QParams:
    """Min-max scales (and int8 zero points when asymmetric) of ``x [rows, in]``.

    The library's ``calculate_qparams`` step by step: the range includes 0; symmetric
    ``scale = absmax / ((qmax - qmin) / 2)`` (``/ 7.5`` for int4, ``/ 448`` for fp8, ``/ 6`` for
    fp4) or the e8m0 power of two (``full_range``: the group's larger-magnitude extreme over ``qmin``,
    signed, not the library's); asymmetric ``scale = (max - min) / (qmax - qmin)``,
    ``zp = clamp(round(qmin - min / scale))``; times the global scale; rounded through the scale
    type; a zero scale becomes the scale type's eps.  Computed in ``x.dtype``.

    ``stats``: the all-reduced :func:`cross_row_stats` when ``x`` is a shard of rows; without
    them ``x`` is taken as the whole weight.  Refused when some but not all are given.

    One deliberate definition: an all-zero group under an asymmetric scheme makes the library
    compute ``0 / 0``, whose NaN it casts to int8 (0 on x86); sq sets that zero point to 0
    explicitly (same bits, but defined on every platform).
    """
    if x.ndim != 2:
        raise SqError(f"expected a 2-D weight [rows, in], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise SqError(f"expected a floating-point weight, got {x.dtype}")
    if stats is not None and _missing(stats, spec):
        raise SqError(f"choose_qparams: statistics {_missing(stats, spec)} missing for {spec}")
    scale_shape(spec.granularity, tuple(x.shape))  # refuses a group size that does not divide
    qt = spec.qtype
    min_vals, max_vals = _range(x, spec, stats)

    # the library's range is float32 0-d tensors cast to the observed dtype
    bit_min = torch.tensor(qt.qmin, device=x.device)
    bit_range = torch.tensor(qt.qmax, device=x.device) - bit_min

    if qt.symmetric and spec.full_range:
        # the larger-magnitude extreme lands on qmin (-8 for int4: the grid's one extra code): the
        # scale is that extreme / qmin, so negative when it is the positive one (a tie: negative, as
        # auto-round); min <= 0 <= max, so an all-zero group gives -0.0 and takes the eps below
        neg, pos = -min_vals, max_vals
        scales = torch.where(neg > pos, neg, -pos) / (-bit_min).to(pos.dtype)
        zero_points = None
    elif qt.symmetric:
        max_val_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
        if spec.scale_dtype == E8M0:
            scales = e8m0_scale(max_val_pos, qt)
        else:
            scales = max_val_pos / (bit_range.to(max_val_pos.dtype) / 2)
        zero_points = None
    else:
        scales = (max_vals - min_vals) / bit_range.to(max_vals.dtype)
        zero_points = bit_min - (min_vals / scales)
        zero_points = torch.clamp(zero_points, bit_min, bit_min + bit_range)
        zero_points = torch.where(scales == 0, torch.zeros_like(zero_points), zero_points)

    gscale = None
    if spec.global_scale:
        if stats is not None:
            absmax = stats["global_absmax"].to(x.dtype)
        else:
            absmax = local_stat(x, spec, "global_absmax").to(x.dtype)
        gscale = global_scale(absmax, qt, spec.scale_dtype or torch.float8_e4m3fn)
        scales = gscale * scales
    if spec.scale_dtype is not None and spec.scale_dtype != E8M0:
        info = torch.finfo(spec.scale_dtype)
        scales = torch.clamp(scales, info.min, info.max).to(spec.scale_dtype).to(scales.dtype)

    scales = torch.where(
        scales == 0, torch.tensor(_scale_eps(spec, scales.dtype), dtype=scales.dtype, device=x.device), scales
    )
    if zero_points is not None:
        zero_points = torch.round(torch.clamp(zero_points, -128, 127)).to(torch.int8)
    return QParams(scales, zero_points, gscale)


def _broadcast(x: Tensor, p: Tensor | None, g: Granularity, row_offset: int) -> tuple[Tensor, Tensor | None, int]:
    """``x`` reshaped (grouped) and ``p`` laid out to broadcast elementwise against it; also the
    padded width to cut back to (0: nothing to undo)."""
    if p is None:
        return x, None, 0
    if isinstance(g, (PerTensor, PerChannel)):
        return x, p, 0
    if isinstance(g, PerGroup):
        # scale [rows, n_groups] -> [rows, n_groups, 1] to broadcast over a group
        return _grouped(x, g.size), p.unsqueeze(-1), 0
    if g.rows > 1:
        # the whole block grid [n_br, n_bc] -> this shard's rows [rows, n_bc]
        idx = (torch.arange(x.shape[0], device=p.device) + row_offset) // g.rows
        p = p.index_select(0, idx)
    return _grouped(x, g.cols), p.unsqueeze(-1), -x.shape[-1] % g.cols


def _ungrouped(y: Tensor, g: Granularity, pad: int) -> Tensor:
    if isinstance(g, (PerTensor, PerChannel)):
        return y
    y = y.flatten(-2)
    return y[..., : y.shape[-1] - pad] if pad else y


def quantize_values(x: Tensor, scale: Tensor, zero_point: Tensor | None, qtype: QType, *,
                    global_scale: Tensor | None = None) -> Tensor:
    """Quantize with already-broadcastable ``scale`` / ``zero_point`` (no reshaping).

    The library's ``_quantize``: ``x / (scale / global_scale) + zp`` in the promoted dtype of
    ``x`` and ``scale``, clamped to the type's range, rounded (ints), cast (fp8) or rounded to
    e2m1 (fp4); returned in ``qtype.storage_dtype``.
    """
    if global_scale is not None:
        scale = scale / global_scale
    scaled = x / scale
    if zero_point is not None:
        scaled = scaled + zero_point.to(x.dtype)
    # qmin / qmax (integers, +-448, +-6) are exact in every float dtype, so python scalars
    # clamp exactly like the library's 0-d float32 tensors
    scaled = torch.clamp(scaled, qtype.qmin, qtype.qmax)
    if qtype.kind == "int":
        return torch.round(scaled).to(torch.int8)
    if qtype.bits == 8:
        return scaled.to(torch.float8_e4m3fn)
    return round_to_e2m1(scaled).to(qtype.storage_dtype)


def dequantize_values(q: Tensor, scale: Tensor, zero_point: Tensor | None, *,
                      global_scale: Tensor | None = None) -> Tensor:
    """``(q - zp) * (scale / global_scale)`` in the scale's dtype (the library's ``_dequantize``)."""
    if global_scale is not None:
        scale = scale / global_scale
    x = q.to(scale.dtype)
    if zero_point is not None:
        x = x - zero_point.to(scale.dtype)
    return x * scale


def quantize(x: Tensor, qp: QParams, spec: QuantSpec, *, row_offset: int = 0) -> Tensor:
    """Quantized values of ``x [rows, in]`` (``spec.qtype.storage_dtype``, same shape).

    ``row_offset``: the first row of ``x`` in the whole weight (block scales only).
    """
    g = spec.granularity
    xs, s, pad = _broadcast(x, qp.scale, g, row_offset)
    _, z, _ = _broadcast(x, qp.zero_point, g, row_offset)
    q = quantize_values(xs, s, z, spec.qtype, global_scale=qp.global_scale)
    return _ungrouped(q, g, pad)


def dequantize(q: Tensor, qp: QParams, spec: QuantSpec, *, row_offset: int = 0,
               dtype: torch.dtype | None = None) -> Tensor:
    """The float weight ``[rows, in]`` a loader reconstructs, in the scale's dtype by default."""
    g = spec.granularity
    qs, s, pad = _broadcast(q, qp.scale, g, row_offset)
    _, z, _ = _broadcast(q, qp.zero_point, g, row_offset)
    y = _ungrouped(dequantize_values(qs, s, z, global_scale=qp.global_scale), g, pad)
    return y if dtype is None else y.to(dtype)


def fake_quantize(x: Tensor, spec: QuantSpec, *, stats: Mapping[str, Tensor] | None = None,
                  row_offset: int = 0) -> Tensor:
    """Quantize-dequantize of ``x``, in ``x.dtype``."""
    qp = choose_qparams(x, spec, stats=stats)
    return dequantize(quantize(x, qp, spec, row_offset=row_offset), qp, spec, row_offset=row_offset, dtype=x.dtype)
