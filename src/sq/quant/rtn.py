"""Round-to-nearest quantization: pure tensor maths, bit-identical to compressed-tensors.

Every function here reproduces compressed-tensors' CPU (torch) path op for op and in the
same dtypes (``calculate_qparams`` fed by a min-max observer, ``quantize``,
``dequantize``), so an sq checkpoint holds exactly the bits the library would write for
the same weights.  In particular, the arithmetic runs in the *weight's* dtype: for bf16
weights the scale ``absmax / 7.5`` is a bf16 division, and ``w / scale`` is rounded to
bf16 before ``round``.  (compressed-tensors' CUDA Triton kernel divides in fp32 instead,
so the library itself is not bit-stable across devices; sq follows the torch path on
every device.)

Everything is row-independent: scales are reductions along ``in`` only and the rest is
elementwise, so quantizing rows ``[a, b)`` alone gives the same bits as those rows of
the full matrix.

Shapes: ``w [rows, in]``; ``scale`` / ``zero_point`` ``[rows, n_groups]`` (group) or
``[rows, 1]`` (channel); ``zero_point`` is ``None`` for symmetric schemes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sq.errors import SqError
from sq.quant.schemes import QuantScheme

__all__ = [
    "compute_qparams",
    "quantize",
    "dequantize",
    "fake_quantize",
    "quantize_values",
    "dequantize_values",
]


def _grouped(x: Tensor, scheme: QuantScheme) -> Tensor:
    # x [rows, in] -> [rows, n_groups, group_size] (group) or unchanged (channel)
    if scheme.strategy == "channel":
        return x
    if x.shape[-1] % scheme.group_size:
        raise SqError(
            f"group size {scheme.group_size} does not divide the weight width {x.shape[-1]}"
        )
    return x.unflatten(-1, (x.shape[-1] // scheme.group_size, scheme.group_size))


def _ungrouped(x: Tensor, scheme: QuantScheme) -> Tensor:
    return x if scheme.strategy == "channel" else x.flatten(-2)


def _as_param(p: Tensor, scheme: QuantScheme) -> Tensor:
    # scale [rows, n_groups] -> [rows, n_groups, 1] to broadcast over a group
    return p if scheme.strategy == "channel" else p.unsqueeze(-1)


def _eps(dtype: torch.dtype) -> float:
    # compressed-tensors' _get_dtype_eps for the scale dtypes sq meets
    return torch.finfo(dtype).eps


def compute_qparams(w: Tensor, scheme: QuantScheme) -> tuple[Tensor, Tensor | None]:
    """Min-max scales (and int8 zero points when asymmetric) of ``w [rows, in]``.

    Same maths as compressed-tensors ``calculate_qparams`` on a min-max observation:
    the range is widened to include 0; symmetric ``scale = absmax / ((qmax - qmin) / 2)``
    (``/ 7.5`` for int4, ``/ 448`` for fp8); asymmetric ``scale = (max - min) /
    (qmax - qmin)``, ``zp = clamp(round(qmin - min / scale))``; a zero scale becomes the
    dtype's eps.  Computed in ``w.dtype``; the scale keeps that dtype.

    One deliberate definition: an all-zero group under an asymmetric scheme makes the
    library compute ``0 / 0``, whose NaN it casts to int8 (0 on x86); sq sets that zero
    point to 0 explicitly (same bits, but defined on every platform).
    """
    if w.ndim != 2:
        raise SqError(f"expected a 2-D weight [rows, in], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise SqError(f"expected a floating-point weight, got {w.dtype}")
    g = _grouped(w, scheme)
    if scheme.strategy == "channel":
        min_vals = torch.amin(g, dim=-1, keepdim=True)  # [rows, 1]
        max_vals = torch.amax(g, dim=-1, keepdim=True)
    else:
        min_vals = torch.amin(g, dim=-1)  # [rows, n_groups]
        max_vals = torch.amax(g, dim=-1)
    # 0.0 must be representable exactly
    min_vals = torch.min(min_vals, torch.zeros_like(min_vals))
    max_vals = torch.max(max_vals, torch.zeros_like(max_vals))

    # the library's range is float32 0-d tensors cast to the observed dtype
    bit_min = torch.tensor(scheme.qmin, device=w.device)
    bit_range = torch.tensor(scheme.qmax, device=w.device) - bit_min

    if scheme.symmetric:
        max_val_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
        scales = max_val_pos / (bit_range.to(max_val_pos.dtype) / 2)
        zero_points = None
    else:
        scales = (max_vals - min_vals) / bit_range.to(max_vals.dtype)
        zero_points = bit_min - (min_vals / scales)
        zero_points = torch.clamp(zero_points, bit_min, bit_min + bit_range)
        zero_points = torch.where(scales == 0, torch.zeros_like(zero_points), zero_points)

    scales = torch.where(
        scales == 0, torch.tensor(_eps(scales.dtype), dtype=scales.dtype, device=w.device), scales
    )
    if zero_points is not None:
        zero_points = torch.round(torch.clamp(zero_points, -128, 127)).to(torch.int8)
    return scales, zero_points


def quantize_values(x: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme) -> Tensor:
    """Quantize with already-broadcastable ``scale`` / ``zero_point`` (no group reshaping).

    ``int8`` values in ``[qmin, qmax]`` for int schemes, ``float8_e4m3fn`` for fp8.
    The division runs in the promoted dtype of ``x`` and ``scale`` (the library's rule).
    """
    scaled = x / scale
    if zero_point is not None:
        scaled = scaled + zero_point.to(x.dtype)
    # qmin / qmax (integers, or +-448) are exact in every float dtype, so python scalars
    # clamp exactly like the library's 0-d float32 tensors
    scaled = torch.clamp(scaled, scheme.qmin, scheme.qmax)
    if scheme.type == "float":
        return scaled.to(torch.float8_e4m3fn)
    return torch.round(scaled).to(torch.int8)


def dequantize_values(q: Tensor, scale: Tensor, zero_point: Tensor | None) -> Tensor:
    """``(q - zp) * scale`` in ``scale.dtype`` (what the library's decompression computes)."""
    x = q.to(scale.dtype)
    if zero_point is not None:
        x = x - zero_point.to(scale.dtype)
    return x * scale


def quantize(w: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme) -> Tensor:
    """Quantized values of ``w [rows, in]`` (int8 or float8_e4m3fn, same shape)."""
    q = quantize_values(
        _grouped(w, scheme),
        _as_param(scale, scheme),
        None if zero_point is None else _as_param(zero_point, scheme),
        scheme,
    )
    return _ungrouped(q, scheme)


def dequantize(
    q: Tensor,
    scale: Tensor,
    zero_point: Tensor | None,
    scheme: QuantScheme,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The float weight ``[rows, in]`` a loader reconstructs, in ``scale.dtype`` by default."""
    x = dequantize_values(
        _grouped(q, scheme),
        _as_param(scale, scheme),
        None if zero_point is None else _as_param(zero_point, scheme),
    )
    x = _ungrouped(x, scheme)
    return x if dtype is None else x.to(dtype)


def fake_quantize(w: Tensor, scheme: QuantScheme) -> Tensor:
    """RTN quantize-dequantize of ``w``, in ``w.dtype``."""
    scale, zp = compute_qparams(w, scheme)
    return dequantize(quantize(w, scale, zp, scheme), scale, zp, scheme)
