"""A quantization job on a checkpoint: the glue from a folder to the block pipeline.

    PTQConfig (the job) -> resolve the model -> skeleton on meta -> load plan (every refusal)
    -> calibration windows (calibrated algorithms) -> sq.pipeline.blocks.run_pipeline

The per-block work is ``sq.pipeline.blocks``; the algorithms are ``sq.quant.algorithms``.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from sq.agree import agree, argument_facts
from sq.config import PTQConfig
from sq.dist import ParallelDims, rank_device
from sq.files import sha256_bytes
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton
from sq.parallel.fsdp import apply_parallel
from sq.pipeline.blocks import run_pipeline
from sq.pipeline.checks import argument_checks, calibration_data
from sq.pipeline.weights import CheckpointWeights
from sq.pipeline.targets import auto_ep
from sq.quant.algorithms import make_algorithm
from sq.resolve import resolve_model_dist

__all__ = ["quantize_model", "auto_ep"]

logger = logging.getLogger(__name__)

@torch.no_grad()
def quantize_model(cfg: PTQConfig) -> dict:
    """``sq.ptq``: a checkpoint folder in, a compressed-tensors checkpoint out.

    Runs inside an initialized process group; returns the report on rank 0, ``{}`` elsewhere.
    """
    t_start = time.perf_counter()
    world = dist.get_world_size()
    device = rank_device()
    agree(argument_facts(cfg), "arguments")  # before any collective the arguments decide
    assigner = argument_checks(cfg)

    src = resolve_model_dist(cfg.model)  # a hub id: rank 0 downloads, the others wait
    model = build_skeleton(src, trust_remote_code=cfg.trust_remote_code)
    plan = plan_load(model, src, trust_remote_code=cfg.trust_remote_code)
    if cfg.ep is None:
        cfg = dataclasses.replace(cfg, ep=auto_ep(model, world, make_algorithm(cfg.algo)))
    weights = CheckpointWeights(model, plan, src, device, verify_source=cfg.verify_source)
    # rank 0 reads the dataset (a hub dataset downloads once); the windows are cut before the output folder is
    # touched: a corpus too short for --nsamples x --seqlen is refused like every other argument (sq.pipeline.checks)
    text, calib = calibration_data(cfg, src, model, assigner)
    data = {"spec": cfg.dataset, "sha256": sha256_bytes(text.encode()) if text is not None else None}
    return run_pipeline(cfg, model, weights, assigner, data, lambda: calib,
                        parallelize=lambda compute_dtype: apply_parallel(
                            model, ParallelDims(world, cfg.ep).build_mesh(device.type), compute_dtype=compute_dtype),
                        t_start=t_start)

