"""Python API: quantize a model that is already in memory and FSDP2-sharded, and export it.

For training frameworks (torchtitan, accelerate, a plain FSDP2 loop): at the end of training,
every rank calls ``sq.quantize(model, "out/")`` with the same arguments.  No checkpoint is read;
the schemes, algorithms and output format are those of ``sq.ptq``.  See docs/python-api.md.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from sq.errors import SqError


def quantize(model: nn.Module, output: str | Path, *, scheme: str = "W4A16", algo: str = "gptq",
             group_size: int = 128, calibration: torch.Tensor | None = None, tokenizer=None,
             dataset: str = "builtin:pydoc", nsamples: int = 128, seqlen: int = 512, seed: int = 0,
             ignore: tuple[str, ...] = (), recipe: str | Path | None = None, resume: str = "never",
             allow_unmatched: bool = False, **settings) -> dict:
    """Quantize ``model`` in place (its weights become the dequantized values) and write a
    compressed-tensors checkpoint to ``output`` that transformers and vLLM load.

    Args:
        model: a transformers causal LM whose decoder layers are each ``fully_shard``-ed over the
            whole world (FSDP2, dim-0 shards), identical on every rank; world size 1 needs no sharding.
            MoE experts (fused ``gate_up_proj`` / ``down_proj``) sharded with their layer, or DTensors
            on an expert-parallel mesh of the caller's (``Shard(0)`` over one mesh dimension,
            optionally ``Shard(1)`` over one other), as ``sq.load_sharded(..., ep=N)`` returns;
            the mesh is read off the DTensors (docs/python-api.md, "MoE models").
        output: a new or empty folder.
        calibration: token ids ``[nsamples, seqlen]`` (the same on every rank; each rank uses rows
            ``rank::world``); default: ``nsamples`` windows of ``dataset`` cut with ``tokenizer``.
        tokenizer: saved beside the weights; needed when ``calibration`` is not given for GPTQ / SignRound.
        settings: the algorithm's own settings, named as its config's fields (the same as the
            command line's flags): ``actorder`` for GPTQ; ``iters``, ``lr``, ``batch_size`` for
            SignRound (docs/signround.md).  Their defaults are the config's; a setting the
            algorithm does not have is refused.  Job settings of the command line go here too:
            ``int_grid="full"`` (``--int-grid``), ``calib_dtype``, ``kv_cache``, ``target_bits``,
            ``candidates`` and ``search_score`` (``--target-bits``: a recipe searched under a bit budget,
            docs/recipes.md).
        resume: ``never`` by default -- an in-memory model cannot prove its weights are those of a
            previous attempt; ``auto`` resumes a folder whose run signature matches (same
            architecture, shapes, arguments and calibration data).
        allow_unmatched: accept ``ignore`` patterns and recipe rules that match no module (logged as
            warnings); by default they are refused, as a typo would be.

    Returns the report (``sq_report.json``) on rank 0 and ``{}`` elsewhere.  Problems raise
    ``SqError`` on every rank before anything is written; among them, a model that is already
    quantized (by an earlier ``sq.quantize``, or loaded from a quantized checkpoint): quantizing
    quantized weights again would only add a second rounding error.
    """
    with _resharded(model):
        return _quantize(model, output, scheme=scheme, algo=algo, group_size=group_size, calibration=calibration,
                         tokenizer=tokenizer, dataset=dataset, nsamples=nsamples, seqlen=seqlen, seed=seed,
                         ignore=ignore, recipe=recipe, resume=resume, allow_unmatched=allow_unmatched, **settings)


# set on a model whose blocks sq.quantize began to quantize in place: the output folder
QUANTIZED_MARK = "_sq_quantized_into"
# compressed-tensors' (and sq's) tensors of a quantized Linear: present only on a quantized module
_QUANTIZED_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape")


def calibration_problems(windows, model: nn.Module) -> list[str]:
    """``calibration=`` refused before anything is written: not a tensor, not integer ids ``[nsamples, seqlen]``,
    rows without tokens (a window needs 2: a token and the next), ids outside the model's vocabulary (its input
    embedding's rows), which an embedding lookup would fail on mid-job."""
    if not isinstance(windows, torch.Tensor):
        return [f"calibration: expected a torch.Tensor of integer token ids [nsamples, seqlen], got a "
                f"{type(windows).__name__} (torch.tensor(ids, dtype=torch.long) makes one)"]
    if windows.dim() != 2 or windows.dtype not in (torch.int64, torch.int32):
        return [f"calibration: expected integer token ids [nsamples, seqlen], got {windows.dtype} "
                f"{tuple(windows.shape)}"]
    if windows.shape[0] == 0 or windows.shape[1] < 2:
        what = "no rows" if windows.shape[0] == 0 else f"rows of {windows.shape[1]} token(s)"
        return [f"calibration: shape {tuple(windows.shape)} has {what}; every row needs at least 2 tokens"]
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    lo, hi = int(windows.min()), int(windows.max())
    if lo < 0 or (isinstance(rows, int) and hi >= rows):
        bad = lo if lo < 0 else hi
        where = torch.nonzero(windows == bad)[0].tolist()
        return [f"calibration: token id {bad} at row {where[0]}, column {where[1]} is outside the model's vocabulary "
                f"(ids 0..{rows - 1 if isinstance(rows, int) else 'N'}: its input embedding's rows); tokenize with the "
                "model's own tokenizer"]
    return []


def already_quantized_problems(model: nn.Module) -> list[str]:
    """Why ``model`` must not be quantized (again): it holds sq's dequantized weights from an earlier
    ``sq.quantize``, carries a ``quantization_config`` (loaded from a quantized checkpoint), or has
    modules holding quantized tensors.  Identical on every rank for identical models."""
    name = type(model).__name__
    problems = []
    out = model.__dict__.get(QUANTIZED_MARK)
    if out is not None:
        problems.append(f"sq.quantize: this {name} was already quantized in place by sq.quantize (into {out}): its "
                        "weights are now the dequantized values of that checkpoint, and quantizing them again would "
                        "round twice; call sq.quantize on the full-precision model (reload it, or keep a copy before "
                        f"the first call), or use the checkpoint in {out}")
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is None and getattr(model, "hf_quantizer", None) is not None:
        qc = getattr(model.hf_quantizer, "quantization_config", "?")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        method = getattr(method, "value", method)
        problems.append(f"sq.quantize: {name}.config carries a quantization_config (quant_method {method!r}): the "
                        "model was loaded from a quantized checkpoint, and quantizing it again would round twice; "
                        "quantize the full-precision model instead (if these weights are full precision on purpose, "
                        "e.g. dequantized, delete model.config.quantization_config first)")
    held = []
    for n, m in model.named_modules():
        tensors = [t for t in _QUANTIZED_TENSORS if t in m._parameters or t in m._buffers]
        if getattr(m, "quantization_scheme", None) is not None or tensors:
            held.append(f"{n or '<root>'} ({', '.join(tensors) or 'a compressed-tensors quantization_scheme'})")
        elif isinstance(m, nn.Linear) and isinstance(m.weight, torch.Tensor) and (
                not m.weight.dtype.is_floating_point or m.weight.dtype.itemsize == 1):  # int8, packed, float8
            held.append(f"{n} ({str(m.weight.dtype).removeprefix('torch.')} weight)")
    if held:
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        problems.append(f"sq.quantize: {len(held)} modules of this {name} are already quantized: "
                        f"{'; '.join(held[:3])}{more}; quantize the full-precision model instead")
    return problems


class _resharded:
    """Every FSDP2 unit of ``model`` sharded, and resharding after each forward, for the job (the
    pipeline reads and writes each rank's shard; a training loop may keep units unsharded between
    forwards: ``reshard_after_forward=False``); the caller's settings come back after."""

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def __enter__(self):
        from sq.parallel.fsdp import unsharded

        self.saved = [unsharded._settings(m) for m in self.units]
        for m in self.units:
            m.set_reshard_after_forward(True, recurse=False)
            m.reshard()
        return self

    def __exit__(self, *exc):
        for m, (fwd, bwd) in zip(self.units, self.saved):
            m.set_reshard_after_forward(fwd, recurse=False)
            m.set_reshard_after_backward(bwd, recurse=False)


def _quantize(model: nn.Module, output, *, scheme, algo, group_size, calibration, tokenizer, dataset, nsamples,
              seqlen, seed, ignore, recipe, resume, allow_unmatched, **settings) -> dict:
    from sq.agree import agree, argument_facts
    from sq.anatomy import annotate_experts
    from sq.calib.data import calibration_windows, read_corpus_dist, tokenize_corpus
    from sq.dist import all_ok, init_distributed, teardown_at_exit
    from sq.files import sha256_bytes
    from sq.config import PTQConfig
    from sq.pipeline.blocks import run_pipeline
    from sq.pipeline.weights import ModelWeights

    t_start = time.perf_counter()
    if not dist.is_initialized():
        init_distributed()
    teardown_at_exit()
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:  # the same string on every rank: all refuse
        raise SqError(f"sq.quantize: the process group runs {backend} alone, and sq's collectives also carry "
                      "small CPU tensors (statistics, flags, report terms); create it with gloo beside NCCL: "
                      "dist.init_process_group(\"cpu:gloo,cuda:nccl\")")
    cfg, problems = None, []
    try:
        cfg = PTQConfig.build(model=f"<in-memory {type(model).__name__}>", output=str(output), scheme=scheme,
                              algo=algo, group_size=group_size, nsamples=nsamples, seqlen=seqlen, seed=seed,
                              dataset=dataset, ignore=tuple(ignore), recipe=None if recipe is None else str(recipe),
                              resume=resume, allow_unmatched=bool(allow_unmatched), **settings)
    except (SqError, TypeError, ValueError) as e:
        problems += e.problems if isinstance(e, SqError) else [str(e)]
    problems += already_quantized_problems(model)
    all_ok(not problems, "API argument checks")
    if problems:
        raise SqError(problems)
    agree(argument_facts(cfg, skip=("fault",)), "arguments")  # before any collective the arguments decide
    annotate_experts(model)  # which fused experts sq quantizes, under which per-expert names
    problems = cfg.problems()
    assigner = weights = None
    if not problems:
        try:
            assigner = cfg.assigner()
            weights = ModelWeights(model, tokenizer)
            cfg = dataclasses.replace(cfg, ep=weights.ep)  # read off the experts' DTensors
        except SqError as e:
            problems += e.problems
    windows, data = None, {"spec": None, "sha256": None}
    if not problems and cfg.needs_data(assigner):
        if calibration is not None:
            windows = calibration
            found = calibration_problems(windows, model)
            if not found and windows.shape[0] < dist.get_world_size():
                found.append(f"calibration: {windows.shape[0]} samples for {dist.get_world_size()} ranks; "
                             "every rank needs at least one")
            problems += found
            if not found:
                cfg = dataclasses.replace(cfg, nsamples=int(windows.shape[0]), seqlen=int(windows.shape[1]),
                                          dataset="tensor")
                data = {"spec": "tensor", "sha256": sha256_bytes(windows.contiguous().cpu().numpy().tobytes())}
        elif tokenizer is None:
            problems.append(f"{cfg.data_reason(assigner)} needs calibration data: pass calibration=token ids, or tokenizer= (and dataset=)")
        else:
            try:
                text = read_corpus_dist(dataset).text(tokenizer)
                windows = calibration_windows(tokenize_corpus(tokenizer, text, need=nsamples * seqlen), nsamples, seqlen)
                data = {"spec": dataset, "sha256": sha256_bytes(text.encode())}
            except SqError as e:
                problems += e.problems
    all_ok(not problems, "API argument checks")
    if problems:
        raise SqError(problems)
    was_training = model.training
    model.eval()
    try:
        weights.prepare()  # expert-parallel experts seen on sq's (dp, ep) mesh for the job (collective)
        return run_pipeline(cfg, model, weights, assigner, data, lambda: windows.long(), parallelize=None,
                            t_start=t_start)
    finally:
        if weights.touched:  # its blocks hold dequantized values now (all, or those done before a failure)
            setattr(model, QUANTIZED_MARK, str(output))
        weights.restore()
        model.train(was_training)
