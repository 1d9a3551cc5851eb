"""Round-to-nearest for a ``QuantScheme``: the scheme's format gives the maths, a
``QuantSpec`` (``sq.quant.formats.spec_for``), and ``sq.quant.primitives`` computes it.

The numbers are compressed-tensors' own, bit for bit, on every device (see
``sq.quant.primitives``).  For every scheme registered today the scales depend only on the
rows being quantized, so quantizing rows ``[a, b)`` alone gives exactly those rows of the
whole; a scheme whose scales read statistics across rows takes them, all-reduced, as
``stats`` (``sq.quant.formats.required_reductions``).

Shapes: ``w [rows, in]``; ``scale`` / ``zero_point`` ``[rows, n_groups]`` (group) or
``[rows, 1]`` (channel); ``zero_point`` is ``None`` for symmetric schemes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from sq.quant import primitives
from sq.quant.formats import spec_for
from sq.quant.schemes import QuantScheme

__all__ = [
    "qparams",
    "compute_qparams",
    "quantize",
    "dequantize",
    "fake_quantize",
    "quantize_values",
    "dequantize_values",
]


def qparams(w: Tensor, scheme: QuantScheme, *, stats: Mapping[str, Tensor] | None = None) -> primitives.QParams:
    """Min-max qparams of ``w [rows, in]`` (``primitives.choose_qparams`` with the scheme's spec);
    ``stats``: the all-reduced cross-row statistics when ``w`` is a shard of rows."""
    return primitives.choose_qparams(w, spec_for(scheme), stats=stats)


def compute_qparams(
    w: Tensor, scheme: QuantScheme, *, stats: Mapping[str, Tensor] | None = None
) -> tuple[Tensor, Tensor | None]:
    """``(scale, zero_point)`` of ``w [rows, in]`` in ``w.dtype`` (zero point int8, or None)."""
    qp = qparams(w, scheme, stats=stats)
    return qp.scale, qp.zero_point


def quantize_values(x: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme) -> Tensor:
    """Quantize with already-broadcastable ``scale`` / ``zero_point`` (no group reshaping).

    ``int8`` values in ``[qmin, qmax]`` for int schemes, ``float8_e4m3fn`` for fp8.
    The division runs in the promoted dtype of ``x`` and ``scale`` (the library's rule).
    """
    return primitives.quantize_values(x, scale, zero_point, spec_for(scheme).qtype)


def dequantize_values(q: Tensor, scale: Tensor, zero_point: Tensor | None) -> Tensor:
    """``(q - zp) * scale`` in ``scale.dtype`` (what the library's decompression computes)."""
    return primitives.dequantize_values(q, scale, zero_point)


def quantize(w: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme) -> Tensor:
    """Quantized values of ``w [rows, in]`` (``scheme.storage_dtype``, same shape)."""
    return primitives.quantize(w, primitives.QParams(scale, zero_point), spec_for(scheme))


def dequantize(
    q: Tensor,
    scale: Tensor,
    zero_point: Tensor | None,
    scheme: QuantScheme,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The float weight ``[rows, in]`` a loader reconstructs, in ``scale.dtype`` by default."""
    return primitives.dequantize(q, primitives.QParams(scale, zero_point), spec_for(scheme), dtype=dtype)


def fake_quantize(w: Tensor, scheme: QuantScheme, *, stats: Mapping[str, Tensor] | None = None) -> Tensor:
    """RTN quantize-dequantize of ``w``, in ``w.dtype``."""
    return primitives.fake_quantize(w, spec_for(scheme), stats=stats)
