"""SignRound (AutoRound): tuned rounding and clipping per block, signed gradient descent, data parallel.

For every quantized weight ``W`` (a Linear's ``[out, in]``, or a fused expert tensor
``[E, out, in]``) SignRound learns, group by group,

=========  =======================  ======================  =====
parameter  shape                    range                   start
=========  =======================  ======================  =====
``v``      like ``W``               ``[-0.5, 0.5]``         0
``alpha``  ``[..., out, groups]``   ``[0, 1]`` (x min)      1
``beta``   ``[..., out, groups]``   ``[0, 1]`` (x max)      1
=========  =======================  ======================  =====

and quantizes ``q = clamp(round(W / s + v) + zp)`` with ``s`` (and ``zp``) from the clipped range
``(alpha * min, beta * max)`` by the same formulas as RTN (``sq.quant.rtn``), rounding through the
straight-through estimator.  With ``v = 0, alpha = beta = 1`` it is RTN.

fp4 formats (NVFP4: e2m1 groups of 16, float8_e4m3fn group scales under one float32 global
scale; MXFP4: groups of 32, e8m0 power-of-two scales) are tuned the same way, as auto-round tunes
them: ``v`` perturbs ``W / s`` in fp4 units before the e2m1 rounding, and the clipped range sets
the group scale, which the format's own maths computes (``primitives.choose_qparams``: the fp8 or
power-of-two rounding of the scale, the global scale of the all-reduced ``global_absmax`` -- the
same one RTN, GPTQ and every rank use, shared by fused partners).  The forward carries those exact
values; gradients pass the two roundings (scale and element) straight through, the scale's as
``absmax * global_scale / 6`` (NVFP4) or ``absmax / 4`` (MX).  Again ``v = 0, alpha = beta = 1`` is
RTN, bit for bit.  fp8 elements are not tuned (refused by the handler).  The loss is the MSE
between the block's output with the quantized weights on the quantized chain's inputs and the
full-precision block's output on the full-precision chain's inputs; the parameters take signed
gradient steps (``lr`` defaults to ``1 / iters``, decaying linearly to 0) and the parameters of
the best loss seen are kept.

Distribution.  Calibration sample ``j`` lives on rank ``j % world``.  Every step each rank draws
its share of the global batch (``batch_size / world`` samples) from its own samples, with a
generator seeded by the seed, the block and the rank, runs them and normalises by the global
batch, so the gradients summed over ranks are the gradient of the whole (stratified) batch and
every rank does the same work.  Each rank owns the tuned parameters of
the dim-0 shard FSDP2 gave it (its rows of a Linear, its experts of a fused expert tensor): it
quantizes only those, and all-gathers the quantized weight for the forward, whose backward sums
every rank's gradient for each owner's rows (``sq.parallel.collectives.all_gather_rows_autograd``).
Every rank takes the same steps in the same order, so a run is deterministic and a resumed block
is redone bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from sq.parallel.collectives import all_gather_rows_autograd
from sq.quant.settings import AlgoConfig, option
from sq.formats import primitives
from sq.quant import rtn
from sq.formats.specs import required_reductions, spec_for
from sq.quant.forward import autocast_to, block_kwargs, frozen
from sq.formats.schemes import QuantScheme

logger = logging.getLogger(__name__)

__all__ = ["SignRoundConfig", "TunedWeight", "tunable", "tune_block", "tuned_qdq", "tuned_quantize", "tuned_global_scale"]


@dataclass(frozen=True)
class SignRoundConfig(AlgoConfig):
    name = "signround"
    # 2: the tuning forward quantizes with the stored (weight-dtype) scale
    version = 2
    # auto-round's grid: on the standard benchmark 12.95 against the standard grid's 13.4-14.1 (docs/recipes.md)
    default_int_grid = "full"

    iters: int = option(200, "signed-gradient steps per block (0 = RTN)")
    lr: float | None = option(None, "step size (default: 1/iters, decaying linearly)")
    batch_size: int = option(8, "calibration samples per step, over all ranks")

    def problems(self) -> list[str]:
        out = []
        if self.iters < 0:
            out.append(f"--iters must be >= 0, got {self.iters}")
        if self.batch_size <= 0:
            out.append(f"--batch-size must be positive, got {self.batch_size}")
        if self.lr is not None and not self.lr > 0:
            out.append(f"--lr must be positive, got {self.lr}")
        return out

    @property
    def step_size(self) -> float:
        return self.lr if self.lr is not None else 1.0 / max(self.iters, 1)


# ---------------------------------------------------------------- the maths (row-independent)


def _round_ste(x: Tensor) -> Tensor:
    return x + (x.round() - x).detach()


def _grouped(w: Tensor, scheme: QuantScheme) -> Tensor:
    """``[..., out, in]`` -> ``[..., out, groups, group]`` (a channel is one group)."""
    gs = w.shape[-1] if scheme.strategy == "channel" else scheme.group_size
    return w.unflatten(-1, (w.shape[-1] // gs, gs))


def _range(wg: Tensor, alpha: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    wmin = wg.amin(-1).clamp(max=0) * alpha  # 0 stays representable, as RTN
    wmax = wg.amax(-1).clamp(min=0) * beta
    return wmin, wmax


def _scale(wmin: Tensor, wmax: Tensor, scheme: QuantScheme) -> Tensor:
    span = scheme.qmax - scheme.qmin
    if scheme.symmetric and scheme.int_grid == "full":  # primitives.choose_qparams' full range, differentiable
        return torch.where(-wmin > wmax, -wmin, -wmax) / -scheme.qmin
    if scheme.symmetric:
        return torch.maximum(wmin.abs(), wmax) / (span / 2)
    return (wmax - wmin) / span


def _stored_scale(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """An integer scheme's scale as the checkpoint holds it: in the weight's dtype, a zero (an all-zero
    group) replaced by that dtype's eps."""
    scale = scale.to(dtype)
    return torch.where(scale == 0, torch.tensor(torch.finfo(dtype).eps, dtype=dtype), scale)


def tunable(scheme: QuantScheme) -> bool:
    """Schemes SignRound tunes: integer weights, and fp4 (NVFP4, MXFP4) group-wise weights."""
    if scheme.type == "int":
        return True
    spec = spec_for(scheme)
    return spec.qtype == primitives.FP4_E2M1 and isinstance(spec.granularity, primitives.PerGroup)


def _fp4(scheme: QuantScheme) -> bool:
    return scheme.type == "float"


def _fp4_scales(wmin: Tensor, wmax: Tensor, scheme: QuantScheme, stats, dtype: torch.dtype):
    """The format's exact group scales for clipped ranges ``(wmin, wmax)`` ``[..., out, groups]`` of a
    weight of ``dtype``: ``(scale [..., out, groups], global scale)``.  ``choose_qparams`` itself, fed
    each group's range as a group of two values ``(min, max)`` (its range, 0 included, is that pair);
    ``stats``: the weight's all-reduced statistics (a list, one per expert, for ``[E, out, groups]``).
    The global scale is ``[1]`` (``[E, 1, 1]`` for experts) or None."""
    spec = dataclasses.replace(spec_for(scheme), granularity=primitives.PerGroup(2))
    pairs = torch.stack([wmin, wmax], -1).flatten(-2).to(dtype)  # [..., out, 2 * groups]
    if pairs.ndim == 2:
        qp = primitives.choose_qparams(pairs, spec, stats=stats)
        return qp.scale, qp.global_scale
    qps = [primitives.choose_qparams(pairs[i], spec, stats=stats[i] if stats is not None else None)
           for i in range(pairs.shape[0])]
    gs = torch.stack([q.global_scale for q in qps]).view(-1, 1, 1) if spec.global_scale else None
    return torch.stack([q.scale for q in qps]), gs


def _fp4_proxy(wmin: Tensor, wmax: Tensor, scheme: QuantScheme, gs: Tensor | None) -> Tensor:
    """A differentiable stand-in for the group scale (the value without its rounding)."""
    amax = torch.maximum(-wmin, wmax)
    qmax = scheme.qmax
    if gs is not None:  # NVFP4: scale = global * absmax / 6, rounded to fp8
        return gs * amax / qmax
    return amax / 2.0 ** math.floor(math.log2(qmax))  # MX: a power of two near absmax / 4


def _local_stats(w: Tensor, scheme: QuantScheme):
    """Statistics of ``w`` as the whole weight (no all-reduced ones given): ``[..., out, in]``."""
    if not required_reductions(scheme):
        return None
    if w.ndim == 2:
        return rtn.local_stats(w, scheme)
    return [rtn.local_stats(w[i], scheme) for i in range(w.shape[0])]


def _fp4_qdq(w: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, scheme: QuantScheme, stats,
             dtype: torch.dtype) -> Tensor:
    wg = _grouped(w, scheme)
    wmin, wmax = _range(wg, alpha, beta)
    sc, gs = _fp4_scales(wmin.detach(), wmax.detach(), scheme, stats, dtype)
    p = _fp4_proxy(wmin, wmax, scheme, gs)
    scale = sc.to(torch.float32) + (p - p.detach())  # the exact value, the proxy's gradient
    eff = (scale if gs is None else scale / gs).unsqueeze(-1)  # the library divides by scale / global
    x = torch.clamp(wg / eff + _grouped(v, scheme), scheme.qmin, scheme.qmax)
    q = primitives.round_to_e2m1(x.detach()) + (x - x.detach())
    return (q * eff).flatten(-2)


def tuned_qdq(w: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, scheme: QuantScheme, *, stats=None,
              dtype: torch.dtype | None = None) -> Tensor:
    """Differentiable quantize-dequantize of ``w`` (float32) with the tuned parameters.

    ``dtype`` is the weight's own (default ``w.dtype``): the scales are the ones :func:`tuned_quantize`
    computes in it (fp4 schemes: the format computes its scales in it; ``stats`` are the weight's
    all-reduced statistics, NVFP4's ``global_absmax``; default: ``w`` is the whole weight)."""
    if _fp4(scheme):
        if stats is None:
            stats = _local_stats(w, scheme)
        return _fp4_qdq(w, v, alpha, beta, scheme, stats, dtype or w.dtype)
    wg = _grouped(w, scheme)
    wmin, wmax = _range(wg, alpha, beta)
    # the scale the checkpoint will hold (tuned_quantize's: in the weight's dtype, 0 -> its eps), with the
    # exact scale's gradient: the steps tune the roundings a loader reconstructs, not float32 ones
    exact = _scale(wmin, wmax, scheme)
    scale = (exact + (_stored_scale(exact.detach(), dtype or w.dtype).float() - exact).detach()).unsqueeze(-1)
    x = wg / scale + _grouped(v, scheme)
    if scheme.symmetric:
        q = torch.clamp(_round_ste(x), scheme.qmin, scheme.qmax)
        return (q * scale).flatten(-2)
    zp = torch.clamp(_round_ste(scheme.qmin - wmin.unsqueeze(-1) / scale), scheme.qmin, scheme.qmax)
    q = torch.clamp(_round_ste(x) + zp, scheme.qmin, scheme.qmax)
    return ((q - zp) * scale).flatten(-2)


@torch.no_grad()
def tuned_quantize(w: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, scheme: QuantScheme, *, stats=None):
    """The checkpoint form of the tuned quantization of ``w [rows, in]``: ``(q, scale, zp, dequantized)``.

    ``scale`` is in ``w.dtype`` (as RTN's; float32 under NVFP4's global scale) and the dequantized
    weight is exactly what a loader reconstructs from ``(q, scale, zp)`` (``rtn.dequantize``).
    ``stats``: fp4 schemes' all-reduced statistics (default: ``w`` is the whole weight); the global
    scale they give is :func:`tuned_global_scale`.
    """
    if _fp4(scheme):
        return _fp4_quantize(w, v, alpha, beta, scheme, stats if stats is not None else _local_stats(w, scheme))[:4]
    wg = _grouped(w.float(), scheme)
    wmin, wmax = _range(wg, alpha, beta)
    scale = _stored_scale(_scale(wmin, wmax, scheme), w.dtype)
    s32 = scale.float().unsqueeze(-1)
    x = torch.round(wg / s32 + _grouped(v, scheme))
    zp = None
    if not scheme.symmetric:
        zp = torch.clamp(torch.round(scheme.qmin - wmin.unsqueeze(-1) / s32), scheme.qmin, scheme.qmax)
        x = x + zp
        zp = zp.squeeze(-1).to(torch.int8)
    q = torch.clamp(x, scheme.qmin, scheme.qmax).flatten(-2).to(torch.int8)
    return q, scale, zp, rtn.dequantize(q, scale, zp, scheme).to(w.dtype)


def _fp4_quantize(w: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, scheme: QuantScheme, stats):
    """``(q, scale, None, dequantized, global scale)`` of ``w [rows, in]`` (fp4 schemes)."""
    wg = _grouped(w.float(), scheme)
    wmin, wmax = _range(wg, alpha, beta)
    scale, gs = _fp4_scales(wmin, wmax, scheme, stats, w.dtype)
    eff = scale.to(torch.float32)
    if gs is not None:
        eff = eff / gs
    vg = _grouped(v, scheme)
    x = wg / eff.unsqueeze(-1)
    x = torch.where(vg != 0, x + vg, x)  # (x + 0 would turn a -0.0 into +0.0: RTN keeps the sign)
    q = primitives.round_to_e2m1(torch.clamp(x, scheme.qmin, scheme.qmax)).flatten(-2).to(scheme.storage_dtype)
    deq = rtn.dequantize(q, scale, None, scheme, global_scale=gs).to(w.dtype)
    return q, scale, None, deq, gs


def tuned_global_scale(w: Tensor, scheme: QuantScheme, stats=None) -> Tensor | None:
    """The global scale :func:`tuned_quantize` quantizes ``w [rows, in]`` under (None without one)."""
    if not spec_for(scheme).global_scale:
        return None
    return rtn.qparams(w, scheme, stats=stats if stats is not None else _local_stats(w, scheme)).global_scale


# ---------------------------------------------------------------- distribution


@dataclass
class TunedWeight:
    """One tuned weight: this rank's dim-0 shard of ``module.<pname>`` and its parameters."""

    name: str
    module: nn.Module
    pname: str
    scheme: QuantScheme
    local: Tensor  # this rank's shard (a view of FSDP2's sharded storage)
    counts: list[int]  # dim-0 shard sizes of every rank
    # the weight's all-reduced cross-row statistics (NVFP4's global_absmax), one dict per local
    # expert for a fused expert tensor; None: none needed (or the shard is the whole weight)
    stats: Any = None
    global_scale: Any = field(init=False, default=None)  # [1] (a list per local expert) or None

    def __post_init__(self):
        w = self.local.float()
        if _fp4(self.scheme) and self.stats is None:
            self.stats = _local_stats(self.local, self.scheme)
        if spec_for(self.scheme).global_scale:
            if self.local.ndim == 2:
                self.global_scale = tuned_global_scale(self.local, self.scheme, self.stats)
            else:
                self.global_scale = [tuned_global_scale(self.local[i], self.scheme, self.stats[i])
                                     for i in range(self.local.shape[0])]
        groups = _grouped(w, self.scheme).shape[:-1]
        self.v = torch.zeros_like(w, requires_grad=True)
        self.alpha = torch.ones(groups, dtype=torch.float32, device=w.device, requires_grad=True)
        self.beta = torch.ones(groups, dtype=torch.float32, device=w.device, requires_grad=True)
        self.w32 = w
        self.best = None

    @property
    def params(self) -> list[Tensor]:
        return [self.v, self.alpha, self.beta]

    def full_qdq(self) -> Tensor:
        local = tuned_qdq(self.w32, self.v, self.alpha, self.beta, self.scheme, stats=self.stats,
                          dtype=self.local.dtype).to(self.local.dtype)
        return all_gather_rows_autograd(local, self.counts)  # [sum(counts), ...] on every rank

    def keep_best(self) -> None:
        self.best = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for p, (lo, hi) in zip(self.params, ((-0.5, 0.5), (0.0, 1.0), (0.0, 1.0))):
            if p.grad is not None:
                p.add_(torch.sign(p.grad), alpha=-lr).clamp_(lo, hi)
                p.grad = None

    def result(self):
        """(q, scale, zp, dequantized) of the local shard with the best parameters, 2-D or per expert."""
        v, a, b = self.best if self.best is not None else [p.detach() for p in self.params]
        w = self.local
        if w.ndim == 2:
            return tuned_quantize(w, v, a, b, self.scheme, stats=self.stats)
        parts = [tuned_quantize(w[i], v[i], a[i], b[i], self.scheme, stats=self.stats[i] if self.stats else None)
                 for i in range(w.shape[0])]
        return tuple(torch.stack(t) if t[0] is not None else None for t in zip(*parts)) if parts else None


# ---------------------------------------------------------------- the loop


class _Swapped:
    """``module.<name>`` reads a given tensor instead of its parameter while inside."""

    def __init__(self, pairs: list[tuple[nn.Module, str, Tensor]]):
        self.pairs = pairs

    def __enter__(self):
        self.saved = []
        for m, name, t in self.pairs:
            self.saved.append(m._parameters.pop(name))
            m.__dict__[name] = t

    def __exit__(self, *exc):
        for (m, name, _), p in zip(self.pairs, self.saved):
            del m.__dict__[name]
            m._parameters[name] = p


def _batch_kwargs(kw: dict, micro: int, n: int) -> dict:
    """A local batch's forward kwargs for ``n`` samples: tensors batched like its ``micro`` samples take
    their first row (the windows share positions; only shapes differ)."""

    def batch(v):
        if isinstance(v, Tensor) and v.ndim and v.shape[0] == micro and micro > 1:
            return v[:1].expand(n, *v.shape[1:])
        if isinstance(v, tuple):
            return tuple(batch(x) for x in v)
        return v

    return {k: batch(v) for k, v in kw.items()}


def _out(y) -> Tensor:
    return y[0] if isinstance(y, tuple) else y


def tune_block(block: nn.Module, slots: list[TunedWeight], q_inputs, fp_outputs: list[Tensor], nsamples: int,
               cfg: SignRoundConfig, seed: int, block_index: int, autocast: torch.dtype | None = None) -> dict:
    """Tune every slot of ``block`` in place (``slot.best``); returns ``{"loss_first", "loss_best"}``.

    ``q_inputs`` are this rank's quantized-chain inputs ``[(hidden, kwargs), ...]`` (its samples
    ``rank::world`` in order) and ``fp_outputs`` the full-precision block's outputs for the
    same samples.  Collective: every rank calls it with the same slots in the same order.  The
    block's FSDP2 units must be unsharded (the caller's job: ``sq.parallel.fsdp.unsharded``).
    ``autocast``: the half dtype the block's forward (and so its backward) runs its matmuls in
    (``--calib-dtype mixed``); the loss, the tuned parameters and their steps stay float32.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    fp_rows = torch.cat(fp_outputs)
    q_rows = torch.cat([h for h, _ in q_inputs])  # the same samples, in the same order
    kw0, micro = block_kwargs(q_inputs[0][1], block), q_inputs[0][0].shape[0]
    bs = min(cfg.batch_size, nsamples)
    # this rank's share of each step's batch, drawn from its own samples: every rank does the same work
    n_local = fp_rows.shape[0]
    share = min(bs // world + (rank < bs % world), n_local)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + block_index) * 4099 + rank)
    numel_per_sample = fp_rows[0].numel()
    clock = _Clock()
    with frozen(block):  # the block's own weights are constants here
        first, best = _loop(block, slots, q_rows, fp_rows, kw0, micro, bs, share, n_local, gen, cfg,
                            numel_per_sample, clock, autocast)
    return {"loss_first": first, "loss_best": best if first is not None else None,
            **{f"{k}_s": round(v, 3) for k, v in clock.seconds.items()}}


def _loop(block, slots, q_rows, fp_rows, kw0, micro, bs, share, n_local, gen, cfg, numel_per_sample, clock, autocast):
    lr0 = cfg.step_size
    best, first = float("inf"), None
    for it in range(cfg.iters):
        mine = torch.randperm(n_local, generator=gen)[:share].sort().values.tolist()
        real = bool(mine)
        rows = mine if real else [0]
        with torch.enable_grad():
            # the tuned weights as the checkpoint would hold them, seen in the forward's dtype
            weights = [(s.module, s.pname, s.full_qdq().to(q_rows.dtype)) for s in slots]
            clock.lap("qdq")
            with _Swapped(weights), autocast_to(autocast, q_rows.device):
                y = _out(block.forward(q_rows[rows], **_batch_kwargs(kw0, micro, len(rows))))
            diff = (y.float() - fp_rows[rows].float())
            loss = diff.pow(2).sum() / (bs * numel_per_sample)
            if not real:
                loss = loss * 0.0
            clock.lap("forward")
            total = loss.detach().clone()
            dist.all_reduce(total)
            total = float(total)
            clock.lap("loss_sync")
            if first is None:
                first = total
            if total < best:
                best = total
                for s in slots:
                    s.keep_best()
            if it == cfg.iters - 1:
                break  # the last step's update would never be evaluated
            loss.backward()
            clock.lap("backward")
        lr = lr0 * (1.0 - it / cfg.iters)
        for s in slots:
            s.step(lr)
        clock.lap("step")
    return first, best


class _Clock:
    """Seconds spent per phase of the tuning loop (the block report's ``qdq_s``, ``forward_s``, ...)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.t
        self.t = now

