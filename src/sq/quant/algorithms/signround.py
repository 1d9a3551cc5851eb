"""SignRound in the pipeline: the block's full-precision outputs are the targets; each rank tunes
the rounding and clipping of the rows / experts it holds (the maths: ``sq.quant.signround``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from sq.load.fill import local_box
from sq.anatomy import decoder_blocks, expert_params, experts_modules
from sq.quant.algorithms.base import RTN_PASSES, Algorithm, register, rtn_cost
from sq.quant.work import BlockWork, Cost, Solved
from sq.quant.recipe import scheme_tag
from sq.parallel.collectives import dim0_counts
from sq.parallel.fsdp import unsharded
from sq.quant.experts import whole_rows_stats
from sq.quant.attention import hand_backward_bytes
from sq.quant.forward import ACT_HIDDEN, ACT_WIDE
from sq.quant.signround import SignRoundConfig, TunedWeight, tunable, tune_block


SIGNROUND_PASS_FORWARDS = 5  # a tuning step's forward, backward and the loop around them, in forwards (fitted)
SIGNROUND_OPS = 60  # small ops per tuned weight and step (quantize-dequantize, the sign step)
OPS_PER_STEP = 200  # the step's own (the batch's kwargs, the loss, its all-reduce)


@register
class SignRoundAlgorithm(Algorithm):
    config_type = SignRoundConfig
    calibrated = True
    fp_chain = True
    expert_parallel = False
    # its signed gradients flow through the block's forward: bf16 residual streams cost perplexity
    # (docs/benchmarks.md, "SignRound and the calibration dtype"); autocast matmuls do not
    half_forwards = "mixed"
    memory_knob = ("SignRound holds both chains again and the tuned block: fewer --nsamples, more ranks, or a "
                   "smaller --batch-size")

    def refusals(self, model, assigner, world: int, ep: int) -> list[str]:
        problems = self.ep_refusals(ep)
        for prefix, block in decoder_blocks(model):
            names = [f"{prefix}.{n}" for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
            names += [f"{prefix}.{n}" for n, _ in experts_modules(block)]
            floats = {f"{s.name} ({scheme_tag(s)})" for s in map(assigner.assign, names)
                      if s is not None and not tunable(s)}
            if floats:
                problems.append(f"--algo signround tunes integer and fp4 (NVFP4, MXFP4) weights; {prefix} is assigned "
                                f"{', '.join(sorted(floats))} (quantize float8 layers in another run, or with rtn/gptq)")
                break
        return problems

    def observe(self, work: BlockWork) -> None:
        slots = {}
        for lin in work.linears:
            local, _ = local_box(lin.module.weight)
            slots[lin.name] = TunedWeight(lin.name, lin.module, "weight", lin.scheme, local,
                                   dim0_counts(lin.module.out_features, work.world), work.linear_stats.get(lin.name))
        for eprefix, ex, scheme in work.experts:
            for pname in expert_params(ex):
                p = ex._parameters[pname]
                local, _ = local_box(p)
                segs = work.expert_stats.get((eprefix, pname))
                stats = [whole_rows_stats(st, f"{eprefix}.{pname}") for st in segs] if segs else None
                slots[f"{eprefix}.{pname}"] = TunedWeight(f"{eprefix}.{pname}", ex, pname, scheme, local,
                                                   dim0_counts(p.shape[0], work.world), stats)
        work.state["slots"] = slots
        if slots and self.config.iters:
            with unsharded(work.block):
                work.state["tuning"] = tune_block(work.block, list(slots.values()), work.inputs, work.fp_out,
                                                  work.nsamples, self.config, work.seed, work.index, work.autocast)

    def memory(self, facts) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Its tuning loop (in place of a forward's activations): both chains again, each concatenated; the
        tuned rounding of this rank's rows with its gradient and the best one kept (float32); the quantized
        weights gathered whole for each step's forward; what one step's backward keeps of its forward
        (float32 under autocast); sq's attention backward's scores where it may run (``hand_backward_bytes``)."""
        b, cb = facts.block, facts.compute_bytes
        share = min(math.ceil(self.config.batch_size / facts.world), facts.samples)
        saved = 2 * share * facts.seqlen * 4
        scores = max((hand_backward_bytes(share, facts.heads, facts.seqlen, c) for c in facts.hand_chunks), default=0)
        tuned = [(math.ceil(o / facts.world) * i * 4, 3) for i, o in b.linears]
        tuned += [(math.ceil(n * 3 * h * i / facts.world) * 4, 3) for n, h, i in b.experts_modules]
        gathered = [(i * o * cb, 1) for i, o in b.linears] + [(n * 3 * h * i * cb, 1) for n, h, i in b.experts_modules]
        return [], [(facts.tokens * facts.hidden * cb, 2), *tuned, *gathered,
                    (saved * facts.hidden, ACT_HIDDEN), (saved * b.widest, ACT_WIDE), (scores, 1)]

    def cost(self, facts) -> dict[str, Cost]:
        """Calibrate: the full-precision outputs (a forward), then per step the tuned weights quantized and
        dequantized (every rank: whole weights for the gathered forward), a forward of this rank's share of the
        batch and its backward (about three times a forward: ``backward_s`` in the block reports), the loss
        all-reduced, the sign step on its rows.  Solve: the tuned rows quantized once more."""
        b, f = facts.block, facts.fwd
        if f is None or not self.config.iters:
            return {"solve": rtn_cost(facts)}
        share = min(math.ceil(self.config.batch_size / facts.world), facts.samples)
        whole = sum(i * o for i, o in b.linears) + sum(n * 3 * h * i for n, h, i in b.experts_modules)
        weights = len(b.linears) + 2 * len(b.experts_modules)
        step = (f.samples(share, facts.samples) * SIGNROUND_PASS_FORWARDS
                + Cost(mem=4 * RTN_PASSES * whole, ops=SIGNROUND_OPS * weights + OPS_PER_STEP))
        return {"calibrate": f.routed + step * self.config.iters, "solve": rtn_cost(facts)}

    def solve(self, work: BlockWork, linear, w: torch.Tensor) -> Solved:
        slot = work.state["slots"][linear.name]
        return Solved(*slot.result(), global_scale=slot.global_scale)

    def solve_experts(self, work, eprefix, ex, pname, local, first, scheme) -> Iterable[Solved]:
        slot = work.state["slots"][f"{eprefix}.{pname}"]
        res = slot.result()  # tuned per local expert already
        if res is None:
            return []
        q, scale, zp, deq = res
        gs = slot.global_scale or [None] * q.shape[0]
        return [Solved(q[i], scale[i], zp[i] if zp is not None else None, deq[i], global_scale=gs[i])
                for i in range(q.shape[0])]

    def block_report(self, work: BlockWork) -> dict | None:
        return work.state.get("tuning")
