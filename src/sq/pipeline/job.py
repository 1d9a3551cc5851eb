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
from sq.calib.data import (
    calibration_windows,
    load_tokenizer,
    read_corpus_dist,
    tokenize_corpus,
)
from sq.config import PTQConfig
from sq.dist import ParallelDims, rank_device
from sq.errors import SqError
from sq.files import sha256_bytes
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton
from sq.parallel.fsdp import apply_parallel
from sq.pipeline.blocks import run_pipeline
from sq.pipeline.weights import CheckpointWeights
from sq.pipeline.targets import auto_ep
from sq.quant.algorithms import make_algorithm
from sq.resolve import resolve_model_dist
from sq.run import raise_all

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
    raise_all(cfg.problems(), "argument checks")
    assigner, problems = None, []
    try:
        assigner = cfg.assigner()
    except SqError as e:
        problems += e.problems
    raise_all(problems, "recipe checks")

    src = resolve_model_dist(cfg.model)  # a hub id: rank 0 downloads, the others wait
    model = build_skeleton(src, trust_remote_code=cfg.trust_remote_code)
    plan = plan_load(model, src, trust_remote_code=cfg.trust_remote_code)
    if cfg.ep is None:
        cfg = dataclasses.replace(cfg, ep=auto_ep(model, world, make_algorithm(cfg.algo)))
    weights = CheckpointWeights(model, plan, src, device, verify_source=cfg.verify_source)
    text = tokenizer = None
    if cfg.needs_data(assigner):  # rank 0 reads the dataset (a hub dataset downloads once); chat records need the tokenizer
        tokenizer = load_tokenizer(src, model, purpose=f"{cfg.data_reason(assigner)} calibrates on data tokenized with it",
                                   trust_remote_code=cfg.trust_remote_code)  # auto_map: refused by plan_load unless allowed
        text = read_corpus_dist(cfg.dataset).text(tokenizer)

    # the windows are cut before the output folder is touched: a corpus too short for
    # --nsamples x --seqlen is refused like every other argument (every rank, same tokens)
    # (only the text those windows take is tokenized: sq.calib.data.tokenize_corpus)
    calib = (calibration_windows(tokenize_corpus(tokenizer, text, need=cfg.nsamples * cfg.seqlen), cfg.nsamples,
                                 cfg.seqlen) if text is not None else None)
    data = {"spec": cfg.dataset, "sha256": sha256_bytes(text.encode()) if text is not None else None}
    return run_pipeline(cfg, model, weights, assigner, data, lambda: calib,
                        parallelize=lambda compute_dtype: apply_parallel(
                            model, ParallelDims(world, cfg.ep).build_mesh(device.type), compute_dtype=compute_dtype),
                        t_start=t_start)

