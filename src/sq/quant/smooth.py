"""``--smooth ALPHA``: SmoothQuant's migration of activation outliers into the weights, before the algorithm.

A norm that feeds Linears (``input_layernorm -> q/k/v``, ``post_attention_layernorm -> gate/up`` or a
routed MoE's experts, DeepSeek's ``q_a_layernorm`` / ``kv_a_layernorm``) has its output channels divided by
``s`` and the Linears' input columns multiplied by it: the block computes the same function (up to the
weights' rounding to their dtype), and the Linears' inputs -- which a W8A8 / FP8 / NVFP4 / MXFP4 scheme
quantizes at serving time -- lose their outlier channels to the weights, which the algorithm quantizes
offline. As llm-compressor 0.14's ``SmoothQuantModifier``, per channel ``j``::

    act_j = max(x_j) - min(x_j)        over every calibration token of every rank (the norm's output)
    w_j   = 2 * max |W[:, j]|          over every row of every Linear the norm feeds
    s_j   = act_j^alpha / w_j^(1 - alpha)   (act_j where w_j = 0), at least 1e-5

When: at the start of each block, on the chain inputs the algorithm then calibrates on (the quantized
chain for GPTQ), before anything observes the block: its static activation scales, Hessians and served
roundings all see the smoothed inputs. One forward of the block per block; its statistics all-reduced
(MIN / MAX), so every rank computes the same ``s`` and folds it into its own shards
(``sq.quant.algorithms.awq.fold``). The norms are written with their block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from sq.errors import SqError
from sq.load.fill import local_box
from sq.quant.algorithms.awq import balance_param, fold
from sq.quant.awq import Mapping, block_mappings
from sq.quant.forward import block_forward

__all__ = ["MIN_SCALE", "smooth_block", "smooth_mappings", "smooth_problems", "smoothing_scales", "SmoothStats"]

MIN_SCALE = 1e-5  # llm-compressor's MINIMUM_SMOOTHING_SCALE


def smooth_mappings(block: nn.Module) -> tuple[list[Mapping], list[str]]:
    """The block's norm -> Linears mappings (AWQ's, those whose smoothed op is a norm), or refusals."""
    mappings, problems = block_mappings(block)
    if problems:
        return [], [p.replace("--algo awq", "--smooth") for p in problems]
    return [m for m in mappings if not m.per_expert and not isinstance(block.get_submodule(m.smooth), nn.Linear)], []


def smooth_problems(cfg, blocks: list[tuple[str, nn.Module]]) -> list[str]:
    """Refusals of ``--smooth`` for this job (identical on every rank; before anything is mutated)."""
    if cfg.smooth is None:
        return []
    a = cfg.smooth
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a <= 1:
        return [f"--smooth must be a migration strength in (0, 1], got {a!r}"]
    out = []
    if cfg.skip_nonfinite:
        out.append("--smooth with --skip-nonfinite: a Linear left raw for its NaN/Inf values would still be scaled")
    if cfg.algo.name == "awq":
        out.append("--smooth with --algo awq: AWQ searches its own scales for the same norms")
    if cfg.rotate:
        out.append("--smooth with --rotate: a rotation spreads the outlier channels that smoothing would scale "
                   "(use one or the other)")
    for prefix, block in blocks:  # every block: a hybrid model's blocks differ
        _, problems = smooth_mappings(block)
        if problems:
            return out + [f"{prefix}: {p}" for p in problems]
    return out


def smoothing_scales(act: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s`` per channel (float32) from the activations' range and the fed weights' column absmax."""
    act, w = act.float(), 2.0 * weight_max.float()
    s = act.pow(alpha) / w.pow(1 - alpha)
    s = torch.where(w > 0, s, act)
    return torch.clamp_min(s, MIN_SCALE)


class SmoothStats:
    """Per-channel min / max of each mapping's norm output over a block forward (``block_forward``'s
    counter: ``on`` is off for dummy batches); ``reduce`` all-reduces them (collective)."""

    def __init__(self, block: nn.Module, mappings: list[Mapping]):
        self.on = True
        self.lo: dict[str, torch.Tensor] = {}
        self.hi: dict[str, torch.Tensor] = {}
        self.handles = [block.get_submodule(m.smooth).register_forward_hook(self._hook(m.smooth)) for m in mappings]

    def _hook(self, name: str):
        def hook(module, args, out):
            if not self.on:
                return
            y = (out[0] if isinstance(out, tuple) else out).detach()
            y = y.reshape(-1, y.shape[-1])
            lo, hi = y.amin(dim=0).float(), y.amax(dim=0).float()
            if name in self.lo:
                torch.minimum(self.lo[name], lo, out=self.lo[name])
                torch.maximum(self.hi[name], hi, out=self.hi[name])
            else:
                self.lo[name], self.hi[name] = lo, hi
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def ranges(self, names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """``max - min`` per channel of each named output over every rank's tokens (two all-reduces)."""
        lo = torch.cat([self.lo[n] for n in names]).to(device)
        hi = torch.cat([self.hi[n] for n in names]).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        sizes = [self.lo[n].numel() for n in names]
        return dict(zip(names, (hi - lo).split(sizes)))


def column_absmax(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``max |W[..., j]|`` over every row of every parameter (this rank's shards, then all-reduced MAX)."""
    out = None
    for p in params:
        local, _ = local_box(p)
        m = local.detach().abs().reshape(-1, local.shape[-1]).amax(dim=0).float() if local.numel() else \
            torch.zeros(local.shape[-1], dtype=torch.float32, device=local.device)
        out = m if out is None else torch.maximum(out, m)
    out = out.to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def smooth_block(block: nn.Module, inputs, steps: int, dummy, alpha: float, device: torch.device,
                 autocast: torch.dtype | None = None) -> int:
    """Migrate the block's norm -> Linears mappings at strength ``alpha`` (collective): one forward of the
    block on ``inputs`` for the norms' output ranges, the fed weights' column absmax, ``s``, folded into
    this rank's shards. Returns the number of mappings smoothed."""
    mappings, problems = smooth_mappings(block)
    if problems:  # (smooth_problems refused these before anything was mutated)
        raise SqError(problems)
    stats = SmoothStats(block, mappings)
    try:
        block_forward(block, inputs, steps, dummy, counters=[stats], autocast=autocast, outputs=False)
    finally:
        stats.remove()
    ranges = stats.ranges([m.smooth for m in mappings], device)
    for m in mappings:
        w = column_absmax([balance_param(block, b) for b in m.balance], device)
        fold(block, m, smoothing_scales(ranges[m.smooth], w, alpha).to(w.device))
    return len(mappings)
