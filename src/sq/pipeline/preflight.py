"""The preflights a job runs on every rank before it touches the output folder or reads a weight: the memory
its ranks need (``sq.pipeline.footprint``) and the disk it writes (``sq.pipeline.disk``), each against what this
machine has.  Any rank's refusal stops all of them (``sq.run.Run.claim`` agrees on the problems); the numbers go
to the report's ``memory`` and ``disk`` sections.  ``--no-preflight`` skips both."""

from __future__ import annotations

import torch

from sq.memory import rss_bytes
from sq.pipeline.disk import disk_need, disk_problems
from sq.pipeline.footprint import memory_problems, predict_ranks

__all__ = ["memory_preflight", "disk_preflight"]


def memory_preflight(p) -> tuple[list[str], dict]:
    """Each rank's predicted peak against what its node (or GPU) has left, the node holding its ranks, each counted
    at the largest rank's prediction.  ``p``: the pipeline (``sq.pipeline.blocks._Pipeline``).  Returns the
    problems and this rank's prediction with the node's numbers."""
    cfg = p.cfg
    kw = dict(base=rss_bytes(), world=p.world, ep=cfg.ep or 1, nsamples=cfg.nsamples, seqlen=cfg.seqlen,
              calibrated=p.calibrated, compute_dtype=p.compute_dtype or p.weight_dtype, weight_dtype=p.weight_dtype,
              calibrate_all_experts=cfg.calibrate_all_experts, device=p.device.type, resident=p.weights.in_memory,
              bookkeeping=cfg.bookkeeping)
    every = predict_ranks(p.model, p.targets, p.algo, ranks=range(p.world) if p.algo.rank_dependent_memory else [p.rank],
                          **kw)
    mine, worst = every[p.rank], max(every.values(), key=lambda m: m["predicted_peak_rank0_bytes"])
    problems, facts = memory_problems(worst)
    return problems, {**mine, **facts}


def disk_preflight(p) -> tuple[list[str], dict]:
    """The disk the job needs against the free space where ``--output`` lives (every rank measures)."""
    need = disk_need(p.cfg, p.model, p.targets, p.weight_dtype, getattr(p.weights, "src", None),
                     calibrated=p.calibrated, fp_chain=p.algo.fp_chain,
                     chain_dtype=p.compute_dtype or p.weight_dtype or torch.float32)
    problems, facts = disk_problems(p.out, need["predicted_output_bytes"] + need["predicted_state_bytes"])
    return problems, need | facts
