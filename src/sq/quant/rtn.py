"""Round-to-nearest for a ``QuantScheme``: the scheme's format gives the maths, a
``QuantSpec`` (``sq.formats.specs.spec_for``), and ``sq.formats.primitives`` computes it.

The numbers are compressed-tensors' own, bit for bit, on every device (see
``sq.formats.primitives``).  Per-channel and per-group scales depend only on the rows being
quantized, so quantizing rows ``[a, b)`` alone gives exactly those rows of the whole.  A scheme
whose scales read statistics across rows (``FP8``'s per-tensor scale, ``FP8_BLOCK``'s 128-row
blocks, ``NVFP4``'s global scale) takes them, all-reduced, as ``stats``; one rank's part::

    reductions = formats.required_reductions(scheme)              # [] for row-independent schemes
    parts = local_stats(w_rows, scheme, row_offset=a, rows=R)     # {stat: tensor}
    for r in reductions: dist.all_reduce(parts[r.stat], op=r.reduce_op)   # over the weight's ranks
    qp = qparams(w_rows, scheme, stats=parts or None)             # QParams(scale, zero_point, global_scale)
    q = quantize(w_rows, qp.scale, qp.zero_point, scheme, global_scale=qp.global_scale, row_offset=a)

Then ``qp.scale`` has this rank's rows (``scales_follow_rows``) or is the whole scale,
identical on every rank (per-tensor, block); ``qp.global_scale`` is the whole weight's.

Shapes: ``w [rows, in]``; ``scale`` / ``zero_point`` ``[rows, n_groups]`` (group) or
``[rows, 1]`` (channel), ``[1]`` (tensor), the block grid (block); ``zero_point`` is ``None``
for symmetric schemes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from sq.anatomy import partner_groups
from sq.load.fill import local_box
from sq.errors import SqError
from sq.formats import primitives
from sq.formats.specs import required_reductions, spec_for
from sq.formats.schemes import QuantScheme
from sq.quant.work import BlockWork, Solved, err_terms


def local_stats(w: Tensor, scheme: QuantScheme, *, row_offset: int = 0, rows: int | None = None) -> dict[str, Tensor]:
    """This rank's contribution to each statistic the scheme's format declares as a reduction:
    ``w`` holds rows ``[row_offset, row_offset + len(w))`` of a weight with ``rows`` rows
    (default: ``w`` is the whole weight).  Empty for row-independent schemes.  All-reduce each
    with its ``Reduction.reduce_op`` before :func:`qparams`; partners vLLM fuses (q/k/v,
    gate/up) reduce ``global_absmax`` over one another too, so they share one global scale."""
    return {r.stat: r.local(w, row_offset=row_offset, rows=rows) for r in required_reductions(scheme)}


def combine_stats(parts: list[Mapping[str, Tensor]], scheme: QuantScheme) -> dict[str, Tensor]:
    """What the all-reduce of :func:`local_stats` computes, in one process (tests, one rank, or
    fused partners' statistics combined)."""
    return {r.stat: r.combine([p[r.stat] for p in parts]) for r in required_reductions(scheme)}


def scales_follow_rows(scheme: QuantScheme) -> bool:
    """True if a shard's scales are its rows of the whole (gather them with the rows); False if
    every rank computes the whole scale (per-tensor, 2-D blocks): the writer takes its own."""
    return primitives.scales_follow_rows(spec_for(scheme))

__all__ = [
    "rtn_rows",
    "report_terms",
    "err_dtype",
    "rtn_codes",
    "share_global_absmax",
    "reduce_linear_stats",
    "local_stats",
    "combine_stats",
    "scales_follow_rows",
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
    """``(scale, zero_point)`` of ``w [rows, in]`` in ``w.dtype`` (zero point int8, or None).

    Refused for a scheme with a global scale (NVFP4), which this pair would drop: use
    :func:`qparams`."""
    qp = qparams(w, scheme, stats=stats)
    if qp.global_scale is not None:
        raise SqError(f"scheme {scheme.name} has a global scale: use rtn.qparams, which returns it")
    return qp.scale, qp.zero_point


def quantize_values(x: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme, *,
                    global_scale: Tensor | None = None) -> Tensor:
    """Quantize with already-broadcastable ``scale`` / ``zero_point`` (no group reshaping).

    ``int8`` values in ``[qmin, qmax]`` for int schemes, ``float8_e4m3fn`` for fp8.
    The division runs in the promoted dtype of ``x`` and ``scale`` (the library's rule).
    """
    return primitives.quantize_values(x, scale, zero_point, spec_for(scheme).qtype, global_scale=global_scale)


def dequantize_values(q: Tensor, scale: Tensor, zero_point: Tensor | None, *,
                      global_scale: Tensor | None = None) -> Tensor:
    """``(q - zp) * (scale / global_scale)`` in the scale's dtype (the library's decompression)."""
    return primitives.dequantize_values(q, scale, zero_point, global_scale=global_scale)


def quantize(w: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme, *,
             global_scale: Tensor | None = None, row_offset: int = 0) -> Tensor:
    """Quantized values of ``w [rows, in]`` (``scheme.storage_dtype``, same shape).

    ``global_scale``: NVFP4's (``QParams.global_scale``); ``row_offset``: the first row of ``w``
    in the whole weight when ``scale`` is a whole block grid (``FP8_BLOCK``)."""
    qp = primitives.QParams(scale, zero_point, global_scale)
    return primitives.quantize(w, qp, spec_for(scheme), row_offset=row_offset)


def dequantize(
    q: Tensor,
    scale: Tensor,
    zero_point: Tensor | None,
    scheme: QuantScheme,
    dtype: torch.dtype | None = None,
    *,
    global_scale: Tensor | None = None,
    row_offset: int = 0,
) -> Tensor:
    """The float weight ``[rows, in]`` a loader reconstructs, in ``scale.dtype`` by default
    (float32 under a float32 global scale)."""
    qp = primitives.QParams(scale, zero_point, global_scale)
    return primitives.dequantize(q, qp, spec_for(scheme), row_offset=row_offset, dtype=dtype)


def fake_quantize(w: Tensor, scheme: QuantScheme, *, stats: Mapping[str, Tensor] | None = None,
                  row_offset: int = 0) -> Tensor:
    """RTN quantize-dequantize of ``w``, in ``w.dtype``."""
    return primitives.fake_quantize(w, spec_for(scheme), stats=stats, row_offset=row_offset)


def all_finite(w: torch.Tensor) -> bool:
    """Whether ``w`` holds no NaN or Inf: ``aminmax`` propagates NaN and shows an infinity, in one
    vectorized pass (``isfinite(w).all()`` on a bf16 CPU tensor costs ~50x more, a third of a
    model-free rank's time)."""
    if w.numel() == 0:
        return True
    if w.element_size() == 1:  # float8 kinds: aminmax has no CPU kernel for them
        return bool(torch.isfinite(w.float()).all())
    lo, hi = torch.aminmax(w)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def share_global_absmax(stats: dict[str, dict[str, Tensor]]) -> None:
    """One global scale per fused weight (q/k/v, gate/up, which an engine loads as one weight; vLLM
    requires it, llm-compressor does it): partners' ``global_absmax`` replaced by their max."""
    for group in partner_groups([n for n, st in stats.items() if "global_absmax" in st]):
        if len(group) > 1:
            shared = torch.stack([stats[n]["global_absmax"] for n in group]).amax(0)
            for n in group:
                stats[n]["global_absmax"] = shared.clone()


def reduce_linear_stats(work: BlockWork) -> None:
    """The reduce stage for a block's dense Linears: each one's
    cross-row statistics (``sq.formats.specs`` reductions) from this rank's rows, all-reduced over the
    ranks holding its rows, fused partners sharing one global scale -> ``work.linear_stats``; this rank's
    first row of each -> ``work.row_offset``.  Collective: every rank calls it for the same Linears."""
    for lin in work.linears:
        local, off = local_box(lin.module.weight)
        work.row_offset[lin.name] = off[0]
        reds = required_reductions(lin.scheme)
        if reds:
            stats = local_stats(local, lin.scheme, row_offset=off[0], rows=lin.module.out_features)
            for r in reds:
                dist.all_reduce(stats[r.stat], op=r.reduce_op)
            work.linear_stats[lin.name] = stats
    share_global_absmax(work.linear_stats)


def rtn_codes(w: torch.Tensor, scheme, stats=None, row_offset: int = 0):
    """Round-to-nearest codes of the rows ``w``: ``(qparams, q)``, without the dequantized copy
    (what the model-free path writes; ``rtn_rows`` adds the copy the model path writes back)."""
    qp = qparams(w, scheme, stats=stats)
    return qp, quantize(w, qp.scale, qp.zero_point, scheme, global_scale=qp.global_scale, row_offset=row_offset)


def rtn_rows(w: torch.Tensor, scheme, stats=None, row_offset: int = 0) -> Solved:
    """Round-to-nearest of the rows ``w [rows, in]`` (what every algorithm is compared with).

    ``stats``: the weight's cross-row statistics, all-reduced (None for row-independent schemes);
    ``row_offset``: the first row of ``w`` in the weight (block scales are indexed by it)."""
    qp, q = rtn_codes(w, scheme, stats, row_offset)
    deq = dequantize(q, qp.scale, qp.zero_point, scheme, global_scale=qp.global_scale, row_offset=row_offset)
    return Solved(q, qp.scale, qp.zero_point, deq.to(w.dtype), global_scale=qp.global_scale)


def report_terms(w: torch.Tensor, deq: torch.Tensor, H: torch.Tensor | None, scheme, stats, row_offset: int,
                 compare: bool, h_cast: dict, dtype: torch.dtype) -> list[float]:
    """The report's error terms of ``deq`` (and, ``compare``, of RTN on the same rows) for the rows ``w``
    through ``H`` (``err_terms``)."""
    deqs = [deq]
    if compare:  # RTN on the same rows (and the same H), for comparison in the report
        deqs.append(rtn_rows(w, scheme, stats, row_offset).deq)
    return err_terms(w, deqs, H, h_cast, dtype)


def err_dtype(inputs) -> torch.dtype:
    """The report's products through H: in bfloat16 where the forwards compute in it (by default on GPU and on
    a CPU with AMX: ~1e-3 relative on a reported error), else float32."""
    return torch.bfloat16 if inputs and inputs[0][0].dtype == torch.bfloat16 else torch.float32
