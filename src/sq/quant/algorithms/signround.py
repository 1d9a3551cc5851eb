"""SignRound in the pipeline: the block's full-precision outputs are the targets; each rank tunes
the rounding and clipping of the rows / experts it holds (the maths: ``sq.quant.signround``)."""

from __future__ import annotations

import torch

from sq.load.fill import local_box
from sq.anatomy import EXPERT_PARAMS, decoder_blocks, experts_modules
from sq.quant.algorithms.base import Algorithm, BlockWork, Solved, register
from sq.quant.recipe import scheme_tag
from sq.parallel.collectives import dim0_counts
from sq.parallel.fsdp import unsharded
from sq.quant.signround import SignRoundConfig, Slot, tune_block


@register
class SignRoundAlgorithm(Algorithm):
    config_type = SignRoundConfig
    calibrated = True
    fp_chain = True

    def refusals(self, model, assigner, world: int, ep: int) -> list[str]:
        problems = []
        if ep > 1:
            problems.append("--algo signround runs with --ep 1 (experts tuned by the rank holding them under "
                            "FSDP2); expert-parallel tuning is not supported yet")
        for prefix, block in decoder_blocks(model):
            names = [f"{prefix}.{n}" for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
            names += [f"{prefix}.{n}" for n, _ in experts_modules(block)]
            floats = {scheme_tag(s) for s in map(assigner.assign, names) if s is not None and s.type != "int"}
            if floats:
                problems.append(f"--algo signround tunes integer weights; {prefix} is assigned "
                                f"{', '.join(sorted(floats))} (quantize float8 layers in another run, or with rtn/gptq)")
                break
        return problems

    def observe(self, work: BlockWork) -> None:
        slots = {}
        for lin in work.linears:
            local, _ = local_box(lin.module.weight)
            slots[lin.name] = Slot(lin.name, lin.module, "weight", lin.scheme, local,
                                   dim0_counts(lin.module.out_features, work.world))
        for eprefix, ex, scheme in work.experts:
            for pname in EXPERT_PARAMS:
                p = ex._parameters[pname]
                local, _ = local_box(p)
                slots[f"{eprefix}.{pname}"] = Slot(f"{eprefix}.{pname}", ex, pname, scheme, local,
                                                   dim0_counts(p.shape[0], work.world))
        work.state["slots"] = slots
        if slots and self.config.iters:
            with unsharded(work.block):
                work.state["tuning"] = tune_block(work.block, list(slots.values()), work.inputs, work.fp_out,
                                                  work.nsamples, self.config, work.seed, work.index)

    def solve(self, work: BlockWork, linear, w: torch.Tensor) -> Solved:
        return Solved(*work.state["slots"][linear.name].result())

    def solve_experts(self, work, eprefix, ex, pname, local, first, scheme) -> list[Solved]:
        res = work.state["slots"][f"{eprefix}.{pname}"].result()  # tuned per local expert already
        if res is None:
            return []
        q, scale, zp, deq = res
        return [Solved(q[i], scale[i], zp[i] if zp is not None else None, deq[i]) for i in range(q.shape[0])]

    def block_report(self, work: BlockWork) -> dict | None:
        return work.state.get("tuning")
