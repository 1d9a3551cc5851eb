"""GPTQ (Frantar et al., 2022) on any subset of a Linear's output rows.

One small class with three verbs, as IST-DASLab's ``gptq.py``: ``add_batch`` accumulates
``H = sum x^T x`` over calibration inputs, ``quantize`` runs the whole algorithm on the
rows this rank holds, ``free`` drops the Hessian.

Why rows can be split across ranks: GPTQ quantizes column by column and pushes each
column's error onto the later columns *of the same row* (``W[r, j:] -= err[r] *
Hinv[i, j:] / Hinv[i, i]``).  Rows never mix, so given the full ``in x in`` Hessian
(summed over every rank's tokens) a rank can solve its own rows alone.  Scales are
per row too (groups run along ``in``).

Numerics: the Hessian is accumulated in float64 -- per calibration sample ``x^T x`` in float32,
summed in float64 -- so a sum over ranks (which split by samples) does not depend on the rank
count beyond float64 rounding; it is factored in float64, and the column sweep runs
in float32.  Scales are computed by the scheme's own format maths
(:func:`sq.quant.primitives.choose_qparams` with the ``QuantSpec`` of ``formats.spec_for``) on the
weights rounded to their storage dtype, so a GPTQ scale is exactly the one compressed-tensors
would compute for those (error-updated) weights; the error that is propagated is the
difference to the value a loader will reconstruct, ``(q - zp) * scale`` in that dtype.

Formats: every scheme whose scales are per row -- per channel or per group along ``in`` --
int (W4A16 ... W8A8, W4A8), FP8 per channel, the fp4 formats (NVFP4: e2m1 groups of 16,
float8_e4m3fn group scales under one float32 global scale; MXFP4: groups of 32, e8m0
power-of-two scales) and MXFP8.  The quantizer inside the sweep is the format's: its element
rounding (fp4 e2m1, fp8), its scale type (fp8 / e8m0 rounding of each group scale) and
NVFP4's global scale, which is a statistic of the whole weight -- the all-reduced
``global_absmax`` (shared by fused partners) passed as ``stats``, fixed before the sweep --
while the group scales under it are like any group scale: fixed up front from the weights with
act-order / static groups (llm-compressor 0.14 takes every qparam, global scale included, from
its observer before the sweep), else computed per group mid-sweep from the error-updated
columns.  Per-tensor and 2-D block scales (FP8, FP8_BLOCK) are refused.

To combine Hessians across ranks: all-reduce (SUM) ``gptq.H`` and ``gptq.nsamples``
(or build the object with :meth:`GPTQ.from_hessian`) before calling ``quantize``.

Weights that share one accumulator (q/k/v read the same input; with calibrate-all every
expert's gate/up reads every token) share its prepared Hessian: the normalized, dead-column
fixed, act-order permuted matrix and its damped inverse Cholesky factor are computed by the
first ``quantize`` call and reused by the later ones with the same settings (on DeepSeek-V3 a
7168 x 7168 float64 factorization once per block instead of once per local expert).  Each call
would compute exactly that matrix from exactly the same inputs, so the bits do not change.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sq.errors import SqError
from sq.quant import primitives, rtn
from sq.quant.formats import spec_for
from sq.quant.settings import AlgoConfig, option
from sq.quant.schemes import QuantScheme, check_group_size

__all__ = ["GPTQ", "GPTQConfig", "GPTQResult"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPTQConfig(AlgoConfig):
    """Algorithm settings; ``GPTQ.quantize(w, scheme, **cfg.to_dict())``.

    ``actorder``: quantize columns by descending ``diag(H)`` ("static" act-order as in
    llm-compressor / vLLM: scales are fixed up front from the unpermuted weights, so the
    checkpoint stays plain group-wise, no ``g_idx``).  ``static_groups``: fixed up-front
    scales without reordering.  Otherwise a group's scales are computed when the sweep
    reaches its first column, from the error-updated weights (IST-DASLab default).
    ``max_retries``: failed Cholesky factorizations are retried with dampening
    ``percdamp * damp_growth**k``.
    """

    name = "gptq"

    blocksize: int = 128
    percdamp: float = 0.01
    actorder: bool = option(True, "column order: static act-order (descending Hessian diagonal, scales fixed "
                                  "up front, as llm-compressor) or off (natural order)",
                            choices={"static": True, "off": False})
    static_groups: bool = False
    max_retries: int = 4
    damp_growth: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.blocksize, bool) or not isinstance(self.blocksize, int) or self.blocksize <= 0:
            raise ValueError(f"blocksize must be a positive int, got {self.blocksize!r}")
        if not (isinstance(self.percdamp, (int, float)) and 0 < self.percdamp and math.isfinite(self.percdamp)):
            raise ValueError(f"percdamp must be a positive finite number, got {self.percdamp!r}")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if not (isinstance(self.damp_growth, (int, float)) and self.damp_growth > 1):
            raise ValueError(f"damp_growth must be > 1, got {self.damp_growth!r}")



@dataclass
class GPTQResult:
    """Quantized rows of one weight, as data (nothing is applied to a module)."""

    q: Tensor  # [rows, in] int8 (int schemes), float8_e4m3fn, or bf16 holding fp4 e2m1 values
    scale: Tensor  # [rows, n_groups] or [rows, 1]: weight dtype (float32 under a global scale)
    zero_point: Tensor | None  # like scale, int8; None when symmetric
    weight: Tensor  # [rows, in] dequantized, weight dtype: what a loader reconstructs
    loss: float  # GPTQ's own objective, sum_j (w - q)^2 / Hinv_jj^2 / 2 (reference)
    rel_err: float  # ||(W - Q) X^T|| / ||W X^T|| through the (undamped) Hessian
    damp: float  # absolute dampening added to diag(H) that succeeded
    percdamp: float  # the same, relative to mean(diag(H))
    retries: int  # failed factorizations before success (0 = first try)
    dead_columns: int  # input channels never active in calibration (zeroed)
    nsamples: int
    seconds: float
    # NVFP4's float32 global scale: [1] for one weight; [n] when ``stats`` was a list of n row
    # segments (stacked experts), one per segment; None for schemes without one
    global_scale: Tensor | None = None

    def stats(self) -> dict[str, Any]:
        """The scalar part, for the report."""
        return {
            k: getattr(self, k)
            for k in ("loss", "rel_err", "damp", "percdamp", "retries", "dead_columns", "nsamples", "seconds")
        }


class GPTQ:
    """Hessian accumulator and solver for one Linear of width ``in_features``."""

    def __init__(self, in_features: int, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64):
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = in_features
        self.H: Tensor | None = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.nsamples = 0  # tokens seen (rows of the flattened inputs)
        self._prepared: _Prepared | None = None

    @classmethod
    def from_hessian(cls, H: Tensor, nsamples: int) -> GPTQ:
        """Wrap an already-summed ``H = sum x^T x`` (e.g. all-reduced across ranks)."""
        if H.ndim != 2 or H.shape[0] != H.shape[1]:
            raise SqError(f"Hessian must be square, got shape {tuple(H.shape)}")
        g = cls.__new__(cls)
        g.in_features = H.shape[0]
        g.H = H
        g.nsamples = int(nsamples)
        g._prepared = None
        return g

    @torch.no_grad()
    def add_batch(self, x: Tensor) -> None:
        """Accumulate inputs: ``x [samples, tokens, in]`` (a calibration batch) or ``x [tokens, in]``."""
        if self.H is None:
            raise RuntimeError("GPTQ.add_batch after free()")
        if x.shape[-1] != self.in_features:
            raise SqError(f"GPTQ input width {x.shape[-1]} != in_features {self.in_features}")
        self._prepared = None
        if x.dim() >= 3:
            # [samples, tokens, in]: each sample's x^T x in float32 (2-5x faster than float64 on CPU),
            # summed in float64.  A sample's product does not depend on which rank or batch holds it,
            # so the sum over ranks is the single-process sum up to float64 rounding, as before.
            for sample in x.reshape(x.shape[0], -1, self.in_features):
                s32 = sample.to(device=self.H.device, dtype=torch.float32)
                self.H.add_(s32.T @ s32)
                self.nsamples += s32.shape[0]
            return
        x = x.reshape(-1, self.in_features).to(device=self.H.device, dtype=self.H.dtype)
        self.H.addmm_(x.T, x)  # H += x^T x, a token set (e.g. an expert's routed tokens): float64
        self.nsamples += x.shape[0]

    def hessian(self) -> Tensor:
        """The normalized Hessian ``2 / n * sum x^T x`` (float64, a new tensor)."""
        if self.H is None:
            raise RuntimeError("GPTQ.hessian after free()")
        if self.nsamples == 0:
            raise SqError("GPTQ: no calibration samples were accumulated")
        return self.H * (2.0 / self.nsamples)

    def free(self) -> None:
        self.H = None
        self._prepared = None

    def _check_solvable(self, w: Tensor, name: str) -> None:
        """Refuse a weight this accumulator cannot solve: freed, another width, not float, no tokens."""
        if self.H is None:
            raise RuntimeError(f"{name}: GPTQ.quantize after free()")
        if w.ndim != 2 or w.shape[1] != self.in_features:
            raise SqError(
                f"{name}: weight shape {tuple(w.shape)} does not match the Hessian width {self.in_features}"
            )
        if not w.is_floating_point():
            raise SqError(f"{name}: expected a floating-point weight, got {w.dtype}")
        if self.nsamples == 0:
            raise SqError(
                f"{name}: no calibration tokens reached this layer, so GPTQ has nothing to solve "
                f"against; calibrate all experts, use more samples, or quantize it with rtn"
            )

    def _prepare(self, cfg: GPTQConfig, dev: torch.device, name: str) -> _Prepared:
        """The solve's Hessian-only part, computed once per settings and device (see the module doc)."""
        key = (cfg.percdamp, cfg.actorder, cfg.max_retries, cfg.damp_growth, str(dev), self.nsamples)
        if self._prepared is not None and self._prepared.key == key:
            return self._prepared
        self._prepared = None
        H = self.hessian().to(device=dev, dtype=torch.float64)  # [cols, cols]
        if not torch.isfinite(H).all():
            raise SqError(f"{name}: the calibration Hessian has non-finite entries (inf/NaN inputs)")
        # Input channels never active carry no information: the reference zeroes them.
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        H_err = H.to(torch.float32)  # undamped, for the reported error
        perm = None
        if cfg.actorder:
            perm = torch.argsort(torch.diag(H), descending=True, stable=True)
            H = H[perm][:, perm]
        Hinv, damp, retries = _inverse_cholesky(H, cfg, name)
        self._prepared = _Prepared(key, dead, int(dead.sum()), H_err, perm, Hinv, damp, retries)
        return self._prepared

    @torch.no_grad()
    def quantize(
        self,
        w: Tensor,
        scheme: QuantScheme,
        *,
        blocksize: int = 128,
        percdamp: float = 0.01,
        actorder: bool = False,
        static_groups: bool = False,
        max_retries: int = 4,
        damp_growth: float = 10.0,
        name: str = "linear",
        stats: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor] | None] | None = None,
    ) -> GPTQResult:
        """Quantize ``w [rows, in]`` (any subset of the layer's rows) against ``H``.

        ``name`` is used in errors and logs.  ``w`` is not modified; its dtype is the
        storage dtype of the scales and of the dequantized weight.  See ``GPTQConfig``
        for the settings.  Group scales computed mid-sweep use the fully updated
        weights (the blocksize is rounded to a multiple of the group size so a group
        never straddles a lazy-update block; the IST-DASLab code reads stale columns
        there).  Solving rows ``[a, b)`` alone reproduces those rows of the full solve
        (bit for bit on CPU in the tests; elsewhere up to BLAS kernel choice).

        ``stats``: the weight's cross-row statistics, all-reduced over the ranks holding its rows
        and shared by fused partners (``rtn.local_stats``; NVFP4's ``global_absmax``), when ``w``
        is a shard; None: ``w`` is the whole weight.  A list of n of them: ``w`` stacks n weights
        of equal height (experts solved against one Hessian), each quantized under its own.
        """
        cfg = GPTQConfig(blocksize, percdamp, actorder, static_groups, max_retries, damp_growth)
        t0 = time.perf_counter()
        self._check_solvable(w, name)
        check_group_size(name, self.in_features, scheme)
        spec = spec_for(scheme)
        if not isinstance(spec.granularity, (primitives.PerChannel, primitives.PerGroup)):
            raise SqError(f"{name}: GPTQ solves per-channel and per-group scales; scheme {scheme.name} has "
                          f"{type(spec.granularity).__name__} scales (use rtn for it)")
        rows, cols = w.shape
        wdtype = w.dtype
        dev = w.device
        segs = _segments(w, spec, stats, name)  # [(row slice, stats)]: one per stacked weight
        gscales = [_global_scale(st, spec, wdtype) for _, st in segs]

        prep = self._prepare(cfg, dev, name)
        dead, n_dead, H_err, perm, Hinv, damp = prep.dead, prep.n_dead, prep.H_err, prep.perm, prep.Hinv, prep.damp
        W = w.to(torch.float32).clone()
        W[:, dead] = 0

        # Scales fixed up front come from the unpermuted, dead-zeroed weights in their
        # storage dtype: for a layer without dead columns they equal RTN's exactly.
        fixed = scheme.strategy == "channel" or cfg.actorder or cfg.static_groups
        if fixed:
            scale, zp = _qparams(W.to(wdtype), spec, segs)
        else:
            sdtype = torch.promote_types(wdtype, torch.float32) if spec.global_scale else wdtype
            scale = torch.empty(rows, scheme.num_groups(cols), dtype=sdtype, device=dev)
            zp = None if scheme.symmetric else torch.empty(scale.shape, dtype=torch.int8, device=dev)
        # a column's effective scale is scale / global scale (the library's quantize and
        # dequantize divide first, in float32): one global scale per row
        gs_rows = None
        if spec.global_scale:
            gs_rows = torch.cat([g.expand(sl.stop - sl.start) for (sl, _), g in zip(segs, gscales)]).to(dev)
        group_spec = dataclasses.replace(spec, granularity=primitives.PerChannel())  # one group, per row
        if perm is not None:
            W = W[:, perm]

        # column j (in sweep order) uses scale column group_of[j]
        if scheme.strategy == "channel":
            group_of = torch.zeros(cols, dtype=torch.long)
        else:
            group_of = torch.arange(cols) // scheme.group_size
            if perm is not None:
                group_of = group_of[perm.cpu()]
        group_of = group_of.tolist()

        # Groups must not straddle blocks when their scales are computed mid-sweep: the
        # columns of the next block have not yet received this block's lazy update.
        bs = cfg.blocksize
        if not fixed and bs % scheme.group_size:
            bs = max(scheme.group_size, bs - bs % scheme.group_size)

        # The sweep works on transposed copies so that a column of W is a contiguous row
        # in memory: Wt [cols, rows], Qt [cols, rows].
        Wt = W.T.contiguous()
        del W
        Qt = torch.empty(cols, rows, dtype=scheme.storage_dtype, device=dev)
        # per-group scale / zero point as contiguous float32 rows: [n_groups, rows]
        scale_t = scale.T.to(torch.float32).contiguous()
        if gs_rows is not None:
            scale_t = scale_t / gs_rows
        zp_t = None if zp is None else zp.T.to(torch.float32).contiguous()
        losses = torch.zeros(rows, dtype=torch.float32, device=dev)
        for i1 in range(0, cols, bs):
            i2 = min(i1 + bs, cols)
            count = i2 - i1
            W1 = Wt[i1:i2]  # view [count, rows], updated in place
            Err1 = torch.empty_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            diag1 = torch.diag(Hinv1).tolist()
            for i in range(count):
                j = i1 + i
                g = group_of[j]
                if not fixed and j % scheme.group_size == 0:
                    # compressed-tensors' scales of this group's current (error-updated)
                    # weights: [group, rows] -> [rows, 1]
                    s, z = _qparams(W1[i : i + scheme.group_size].to(wdtype).T.contiguous(), group_spec, segs)
                    scale[:, g : g + 1] = s
                    scale_t[g] = s[:, 0] if gs_rows is None else s[:, 0].to(torch.float32) / gs_rows
                    if zp is not None:
                        zp[:, g : g + 1] = z
                        zp_t[g] = z[:, 0]
                s32 = scale_t[g]
                z32 = None if zp_t is None else zp_t[g]
                w_col = W1[i]
                # float32 copies of the scale give the same bits as the stored dtype: the
                # library promotes it to float32 for this division anyway (NVFP4: scale /
                # global scale, which the library computes in float32 first, is s32)
                q = rtn.quantize_values(w_col, s32, z32, scheme)
                Qt[j] = q
                # (q - zp) * scale is exact in float32; one rounding to the weight dtype
                # then equals the loader's own dequantization in that dtype
                dq = rtn.dequantize_values(q, s32, z32)
                if wdtype != torch.float32:
                    dq = dq.to(wdtype).to(torch.float32)
                err = Err1[i]
                torch.sub(w_col, dq, out=err)
                err.div_(diag1[i])
                # push the error onto this block's later columns (rank-1, row by row)
                if i + 1 < count:
                    # (addmm_ with an inner dim of 1: BLAS; addr_ is far slower on CPU)
                    W1[i + 1 :].addmm_(Hinv1[i, i + 1 :, None], err[None, :], alpha=-1)
            losses += (Err1 * Err1).sum(dim=0) / 2
            # lazy batch update of every column after the block
            if i2 < cols:
                Wt[i2:].addmm_(Hinv[i1:i2, i2:].T, Err1, alpha=-1)
        del Wt
        Q = Qt.T.contiguous()
        del Qt

        if perm is not None:
            Q = Q[:, torch.argsort(perm)]
        return self._result(w, Q, scale, zp, scheme, segs, gscales, losses, dead, H_err, damp, cfg, prep, n_dead, t0)

    def _result(self, w, Q, scale, zp, scheme, segs, gscales, losses, dead, H_err, damp, cfg, prep, n_dead,
                t0) -> GPTQResult:
        """The solve's result: the dequantized weight (each stacked weight under its own global
        scale), the loss and relative error, and the solve's facts."""
        wdtype = w.dtype
        if len(segs) > 1:
            weight = torch.cat([rtn.dequantize(Q[sl], scale[sl], None if zp is None else zp[sl], scheme, global_scale=g)
                                for (sl, _), g in zip(segs, gscales)]).to(wdtype)
        else:
            weight = rtn.dequantize(Q, scale, zp, scheme, global_scale=gscales[0]).to(wdtype)
        loss = float(losses.sum())
        return GPTQResult(
            q=Q,
            scale=scale,
            zero_point=zp,
            weight=weight,
            loss=loss,
            rel_err=_relative_error(w, weight, dead, H_err, loss, damp),
            damp=damp,
            percdamp=cfg.percdamp * cfg.damp_growth**prep.retries,
            retries=prep.retries,
            dead_columns=n_dead,
            nsamples=self.nsamples,
            seconds=time.perf_counter() - t0,
            global_scale=torch.cat(gscales) if spec_for(scheme).global_scale else None,
        )


@dataclass
class _Prepared:
    """What a solve needs from the Hessian alone (shared by every weight quantized against it)."""

    key: tuple
    dead: Tensor  # [cols] bool: input channels never active
    n_dead: int
    H_err: Tensor  # undamped, dead-fixed, unpermuted, float32: the reported error's metric
    perm: Tensor | None  # act-order permutation
    Hinv: Tensor  # upper factor of the damped inverse, in sweep order, float32
    damp: float
    retries: int


def _relative_error(w: Tensor, weight: Tensor, dead: Tensor, H_err: Tensor, loss: float, damp: float) -> float:
    """Output error through the Hessian, relative: ``||(W - Q) X^T|| / ||W X^T||``.

    With ``U^T U = (H + damp I)^-1`` the sweep's errors satisfy ``D = Err U``, so
    ``tr(D (H + damp I) D^T) = ||Err||^2 = 2 * loss``: only the denominator needs a matmul.
    (Checked against the direct trace to ~1e-7.)  Dead columns are zero in both W and Q as
    GPTQ saw them and have no weight in the true H.
    """
    Wd = w.to(torch.float32, copy=True)
    Wd[:, dead] = 0
    D = Wd - weight.to(torch.float32)
    num = max(2.0 * loss - damp * float((D * D).sum()), 0.0)
    den = float(((Wd @ H_err) * Wd).sum())
    return math.sqrt(num / den) if den > 0 else 0.0


def _segments(w: Tensor, spec: primitives.QuantSpec, stats, name: str) -> list[tuple[slice, dict | None]]:
    """``w``'s row segments and the cross-row statistics each is quantized under: one segment
    (the whole ``w``) for a mapping or None, n equal ones for a list of n.  Without statistics a
    scheme with a global scale reads it from its segment (which is then its whole weight)."""
    rows = w.shape[0]
    parts = list(stats) if isinstance(stats, (list, tuple)) else [stats]
    if not parts or rows % len(parts):
        raise SqError(f"{name}: {rows} rows do not split into {len(parts)} stacked weights")
    h = rows // len(parts)
    need = primitives.cross_row_stats(spec)
    out = []
    for i, st in enumerate(parts):
        sl = slice(i * h, (i + 1) * h)
        if need:
            if st is None:
                st = {k: primitives.local_stat(w[sl], spec, k) for k in need}
            elif set(need) - set(st):
                raise SqError(f"{name}: statistics {sorted(set(need) - set(st))} missing for scheme {spec}")
            st = {k: st[k] for k in need}
        else:
            st = None
        out.append((sl, st))
    return out


def _global_scale(stats: Mapping[str, Tensor] | None, spec: primitives.QuantSpec, wdtype: torch.dtype) -> Tensor | None:
    """NVFP4's global scale from the (all-reduced) ``global_absmax``, as ``choose_qparams``
    computes it for a weight of ``wdtype`` (float32 ``[1]``); None without one."""
    if not spec.global_scale:
        return None
    absmax = stats["global_absmax"].to(wdtype)
    return primitives.global_scale(absmax, spec.qtype, spec.scale_dtype or torch.float8_e4m3fn)


def _qparams(x: Tensor, spec: primitives.QuantSpec, segs) -> tuple[Tensor, Tensor | None]:
    """``(scale, zero_point)`` of ``x [rows, k]`` (rows as ``w``'s) under ``spec``, each row
    segment under its own statistics: the format's ``choose_qparams``, exactly."""
    qps = [primitives.choose_qparams(x[sl], spec, stats=st) for sl, st in segs]
    if len(qps) == 1:
        return qps[0].scale, qps[0].zero_point
    zp = None if qps[0].zero_point is None else torch.cat([q.zero_point for q in qps])
    return torch.cat([q.scale for q in qps]), zp


def _inverse_cholesky(H: Tensor, cfg: GPTQConfig, name: str) -> tuple[Tensor, float, int]:
    """Upper Cholesky factor ``U`` of ``(H + damp I)^-1`` (``U^T U = (H + damp I)^-1``).

    Computed without forming the inverse: with ``J`` the index reversal and
    ``J H J = L L^T``, ``U = J L^-1 J`` (one Cholesky and one triangular inverse, in
    float64, instead of the reference's Cholesky, ``cholesky_inverse``, Cholesky).
    Dampening grows by ``damp_growth`` on each failure; the retries are returned for the
    report.  Never falls back to RTN silently: after ``max_retries`` failures it raises
    ``SqError`` naming the layer.
    """
    n = H.shape[0]
    Hf = H.flip(0, 1)
    mean_diag = float(torch.mean(torch.diag(H)))
    idx = torch.arange(n, device=H.device)
    eye = torch.eye(n, dtype=H.dtype, device=H.device)
    why = ""
    for attempt in range(cfg.max_retries + 1):
        rel = cfg.percdamp * cfg.damp_growth**attempt
        damp = rel * mean_diag
        Hd = Hf.clone()
        Hd[idx, idx] += damp
        L, info = torch.linalg.cholesky_ex(Hd)
        del Hd
        if int(info) != 0:
            why = f"leading minor of order {int(info)} is not positive"
            continue
        # A positive semi-definite H plus damp has every pivot^2 >= damp; a pivot that
        # only survives by rounding (a singular H + damp) counts as a failure too.
        if float(torch.diag(L).min()) ** 2 < 1e-10 * (mean_diag + damp):
            why = "numerically singular"
            continue
        U = torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1)
        if not bool(torch.isfinite(U).all()):
            why = "the inverse factor is not finite"
            continue
        if attempt:
            logger.warning(
                "%s: Hessian not positive definite at dampening %.3g of mean(diag(H)); "
                "succeeded at %.3g after %d retries", name, cfg.percdamp, rel, attempt,
            )
        return U.to(torch.float32), damp, attempt
    raise SqError(
        f"{name}: Cholesky factorization of the Hessian failed at every dampening from "
        f"{cfg.percdamp:g} to {cfg.percdamp * cfg.damp_growth**cfg.max_retries:g} of mean(diag(H)) "
        f"({why}); the calibration data for this layer is degenerate"
    )
