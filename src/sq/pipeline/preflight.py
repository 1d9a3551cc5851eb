"""The preflights a job runs on every rank before it touches the output folder or reads a weight: the memory
its ranks need (``sq.pipeline.footprint``) and the disk it writes (``sq.pipeline.disk``), each against what this
machine has, and the time it takes (``sq.pipeline.timing``: a prediction, never a refusal).  Any rank's refusal
stops all of them (``sq.run.Run.claim`` agrees on the problems); the numbers go to the report's ``memory``,
``disk`` and ``time`` sections.  ``--no-preflight`` skips them all."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from sq.memory import rss_bytes, trim_heap
from sq.pipeline.disk import disk_need, disk_problems
from sq.pipeline.footprint import carried_bytes, fit_memory, fitting_layout, memory_problems, predict_ranks, with_layout

logger = logging.getLogger(__name__)

__all__ = ["memory_preflight", "disk_preflight", "time_preflight", "job_times", "machine_rates"]


def memory_preflight(p) -> tuple[list[str], dict]:
    """Each rank's predicted peak against what its node (or GPU) has left, the node holding its ranks, each counted
    at the largest rank's prediction.  ``p``: the pipeline (``sq.pipeline.blocks._Pipeline``).  Returns the
    problems and this rank's prediction with the node's numbers."""
    cfg = p.cfg
    kw = dict(base=rss_bytes(), world=p.world, ep=cfg.ep or 1, nsamples=cfg.nsamples, seqlen=cfg.seqlen,
              calibrated=p.calibrated, compute_dtype=p.compute_dtype or p.weight_dtype, weight_dtype=p.weight_dtype,
              calibrate_all_experts=cfg.calibrate_all_experts, device=p.device.type, resident=p.weights.in_memory,
              bookkeeping=cfg.bookkeeping, carried=carried_bytes(getattr(p.weights, "plan", None), p.weight_dtype, largest=True),
              hand_chunks=(p.choice.attn_chunk,) if p.choice is not None and p.choice.attn_backward == "sq"
              and p.choice.attn_chunk else ())
    ranks = range(p.world) if p.algo.rank_dependent_memory else [p.rank]

    def predict(**more):
        every = predict_ranks(p.model, p.targets, p.algo, ranks=ranks, **kw, **more)
        return {**max(every.values(), key=lambda m: m["predicted_peak_rank0_bytes"]), "mine": every[p.rank]}

    worst = predict()
    problems, facts = memory_problems(worst)
    problems, worst, fit = fit_memory(problems, worst, predict, lambda pred: memory_problems(pred)[0], cfg.fit_memory)
    mine = worst.pop("mine")
    if fit is not None:  # --fit-memory's choice, taken: the files of each block before the next one
        problems, facts = memory_problems(worst)
        facts["fit"] = fit
        p.run.files.overlap = False
        logger.info("--fit-memory: %s", fit["why"])
    if problems and not p.weights.in_memory:  # name the layout that fits: more nodes like this one
        from sq.pipeline.targets import auto_ep, plan_targets

        def at(w):
            e = auto_ep(p.model, w, p.algo)
            pred = predict_ranks(p.model, plan_targets(p.model, p.assigner, p.weights, w), p.algo,
                                 ranks=range(w) if p.algo.rank_dependent_memory else [0], **{**kw, "world": w, "ep": e})
            return max(pred.values(), key=lambda m: m["predicted_peak_rank0_bytes"]), e

        fits = fitting_layout(at, world=p.world, local_world=facts["local_ranks"],
                              check=lambda pred: memory_problems(pred, available=facts["available_bytes"],
                                                                 where=facts["where"])[0])
        problems = [with_layout(problems[0], fits), *problems[1:]]
    return problems, {**mine, **facts}


def disk_preflight(p) -> tuple[list[str], dict]:
    """The disk the job needs against the free space where ``--output`` lives (every rank measures)."""
    need = disk_need(p.cfg, p.model, p.targets, p.weight_dtype, getattr(p.weights, "src", None),
                     calibrated=p.calibrated, fp_chain=p.algo.fp_chain,
                     chain_dtype=p.compute_dtype or p.weight_dtype or torch.float32)
    problems, facts = disk_problems(p.out, need["predicted_output_bytes"] + need["predicted_state_bytes"])
    return problems, need | facts


def job_times(model, targets, algo, *, rates, world: int, ep: int, plan, nsamples: int, seqlen: int,
              calibrated: bool, compute_dtype, weight_dtype, calibrate_all_experts: bool, started: float) -> dict:
    """The job's predicted seconds: the blocks' phases (``sq.pipeline.timing``; each as long as its slowest rank),
    the root's fill before them and its write at the end, after ``started`` seconds already spent (the process's
    start: measured), and the checkpoint bytes each rank reads.  ``plan``: the load plan (None: the weights are
    in memory, nothing read)."""
    from sq.pipeline.footprint import carried_bytes
    from sq.pipeline.timing import (FP8_DEQUANT_BYTES, OPS_FINAL, OPS_PER_FILL, OPS_PER_PIECE_READ, OPS_START, Cost,
                                    predict_times, read_bytes)

    ranks = range(world)
    reads = read_bytes(model, plan, world=world, ep=ep, ranks=ranks) if plan is not None else None
    t = predict_times(model, targets, algo, ranks=ranks, rates=rates, world=world, ep=ep, nsamples=nsamples,
                      seqlen=seqlen, calibrated=calibrated, compute_dtype=compute_dtype, weight_dtype=weight_dtype,
                      reads=reads, calibrate_all_experts=calibrate_all_experts)
    root = max((reads[r]["root"] for r in ranks), default=0) if reads is not None else 0
    pieces = max((reads[r]["root_pieces"] for r in ranks), default=0) if reads is not None else 0
    t["start_seconds"] = round(started + rates.seconds(Cost(read=root, ops=OPS_START + OPS_PER_FILL
                                                            + OPS_PER_PIECE_READ * pieces)), 3)
    # rank 0 at the end: the root gathered and written, the carried tensors read (FP8 ones dequantized) and written
    carried = carried_bytes(plan, weight_dtype)
    t["final_seconds"] = round(rates.seconds(Cost(write=root * world + carried, link=root * world, files=4,
                                                  read=carried, ops=OPS_FINAL,
                                                  mem=FP8_DEQUANT_BYTES * carried / 2 if plan is not None and plan.fp8 else 0)), 3)
    t["predicted_seconds"] = round(t["start_seconds"] + t["blocks_seconds"] + t["final_seconds"], 3)
    if reads is not None:
        t["predicted_read_bytes"] = [reads[r]["root"] + sum(reads[r]["blocks"]) for r in ranks]
    t["rates"] = rates.to_dict()
    return t


def machine_rates(model, targets, algo, *, calibrated: bool, nsamples: int, seqlen: int, world: int, ep: int, dtype,
                  weight_dtype, device, src, out_dir, local_world: int):
    """This machine's rates for a job (``sq.pipeline.timing.probe_rates``) on its first block's Linear shapes, its
    scheme and weights where GPTQ sweeps, its attention heads and ``seqlen``, its experts at the rows a forward
    call routes to each."""
    import math

    from sq.anatomy import expert_params, experts_modules
    from sq.pipeline.timing import probe_rates, top_k_of
    from sq.quant.forward import CALIB_BATCH

    shapes = sorted(targets.linear_shapes())
    scheme = next((l.scheme for ls in targets.linears for l in ls), None) if algo.sweeps and calibrated else None
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    experts = None
    moe = [ex for _, blk in targets.blocks for _, ex in experts_modules(blk)][:1]
    if moe:  # a call's tokens (over the --ep group, which gathers them) at top-k of the experts
        gu, down = (moe[0]._parameters[n] for n in expert_params(moe[0]))
        tokens = min(math.ceil(nsamples / world), CALIB_BATCH) * seqlen * (ep if ep > 1 else 1)
        experts = (max(8, tokens * top_k_of(config) // int(down.shape[0])), int(gu.shape[-1]), int(down.shape[-1]))
    return probe_rates(shapes=shapes, heads=heads if isinstance(heads, int) and heads > 0 else 8, seqlen=seqlen,
                       compute_dtype=dtype, device=device, scheme=scheme, weight_dtype=weight_dtype or torch.float32,
                       hessian_width=min((s[0] for s in shapes), default=0), experts=experts, src=src, out_dir=out_dir,
                       local_world=local_world)


def time_preflight(p) -> dict:
    """The job's predicted seconds (no refusal: a slow job is still a job), priced by this machine's rates,
    measured by every rank at once (or from the cache); {} where it could not be predicted (a prediction never
    stops one rank: the others would wait for it)."""
    try:
        return _time_preflight(p)
    except Exception as e:  # noqa: BLE001
        logger.warning("time not predicted: %s: %s", type(e).__name__, e)
        return {}
    finally:  # the probes' buffers (under the mmap threshold: from the C heap) go back now, not at block 0's peak
        trim_heap()


def _time_preflight(p) -> dict:
    cfg = p.cfg
    dtype = p.compute_dtype or p.weight_dtype or torch.float32
    rates = machine_rates(p.model, p.targets, p.algo, calibrated=p.calibrated, nsamples=cfg.nsamples,
                          seqlen=cfg.seqlen, world=p.world, ep=cfg.ep or 1,
                          dtype=p.autocast or dtype,  # (mixed: the matmuls run in the half dtype)
                          weight_dtype=p.weight_dtype, device=p.device, src=getattr(p.weights, "src", None), out_dir=p.out.parent,
                          local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    chunk = p.choice.attn_chunk if p.choice is not None else None
    probed = p.choice.attn.get("seconds", {}) if chunk else {}
    if str(chunk) in probed:  # attention in query chunks (sq.quant.attention): faster by the probe's ratio
        rates = dataclasses.replace(rates, attention=rates.attention * probed["none"] / probed[str(chunk)])
    return job_times(p.model, p.targets, p.algo, rates=rates, world=p.world, ep=cfg.ep or 1,
                     plan=getattr(p.weights, "plan", None), nsamples=cfg.nsamples, seqlen=cfg.seqlen,
                     calibrated=p.calibrated, compute_dtype=dtype, weight_dtype=p.weight_dtype,
                     calibrate_all_experts=cfg.calibrate_all_experts, started=time.perf_counter() - p.t_start)
