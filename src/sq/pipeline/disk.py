"""The disk a job needs, predicted before it writes anything (``sq.ptq``'s preflight, ``python -m sq.plan``).

The output's size is counted from the model on the meta device and the job's targets: every quantized
Linear (and experts module) at the bytes its scheme stores on that shape (``sq.pipeline.search.stored_tensors``:
codes, scales, zero points, global scales, the shape record, as compressed-tensors writes them), every
other parameter at its own size; plus the resume state's peak (each rank keeps its last chain files,
``sq.resume``) and the side files copied from the source.  ``sq.ptq`` refuses, on every rank before the
output folder is touched, a job whose prediction does not fit the free space where ``--output`` lives
(``--no-preflight`` skips it); the report's ``disk`` section holds the prediction beside what was written.
"""

from __future__ import annotations

import functools
import math
import shutil
from pathlib import Path

import torch
from torch import nn

from sq.anatomy import expert_params
from sq.files import nearest_existing
from sq.pipeline.search import search_score, stored_tensors

__all__ = ["predict_output_bytes", "block_output_bytes", "disk_need", "chain_bytes", "disk_problems", "written_bytes", "size", "stored_bytes", "header_bytes", "GiB", "SLACK"]

GiB = 1 << 30
SLACK = 1.02  # index, config, report, picture and logs beside the checkpoint: under 1% on the demo (tests/test_plan.py)
ROWS = 256  # a multiple of every scheme's row block (FP8_BLOCK's 128)
HEADER_ENTRY = 64  # a header entry's bytes beside its name (dtype, shape, offsets, punctuation)
CHAINS_KEPT = 4  # sq.resume keeps the last three chains, and a fourth is written before the oldest goes


@functools.lru_cache(maxsize=256)
def stored_bytes(scheme, out_features: int, in_features: int, dtype: torch.dtype) -> tuple[tuple[str, int], ...]:
    """Each tensor the scheme writes for the shape, and its bytes.  Wide weights are measured at
    ``ROWS`` and ``2 * ROWS`` rows and extended linearly (every stored tensor grows with the rows or
    not at all), so a DeepSeek-size model is planned in milliseconds, not by quantizing its shapes."""
    if out_features <= 2 * ROWS:
        return tuple(stored_tensors(scheme, out_features, in_features, dtype).items())
    one, two = (stored_tensors(scheme, r, in_features, dtype) for r in (ROWS, 2 * ROWS))
    return tuple((k, one[k] + (two[k] - one[k]) * (out_features - ROWS) // ROWS) for k in one)


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def header_bytes(name: str) -> int:
    """A safetensors header entry: the name and ``{"dtype":"BF16","shape":[..],"data_offsets":[..,..]}``."""
    return len(name) + HEADER_ENTRY


def _quantized_bytes(prefix: str, scheme, out_features: int, in_features: int, dtype: torch.dtype) -> int:
    return sum(n + header_bytes(f"{prefix}.{suffix}") for suffix, n in stored_bytes(scheme, out_features, in_features, dtype))


def block_output_bytes(targets, b: int, weight_dtype: torch.dtype | None) -> int:
    """Block ``b``'s safetensors bytes (its quantized Linears and experts as their schemes store them, the rest
    as they are): what the ranks write for it, together."""
    dtype = weight_dtype or torch.bfloat16
    _, block = targets.blocks[b]
    total, quantized = 0, set()
    for lin in targets.linears[b]:
        quantized.add(id(lin.module.weight))
        total += sum(n for _, n in stored_bytes(lin.scheme, lin.module.out_features, lin.module.in_features, dtype))
    for ex in targets.experts[b]:
        for name in expert_params(ex.module):
            p = ex.module._parameters[name]
            quantized.add(id(p))
            n_experts, rows, cols = (int(d) for d in p.shape)
            total += n_experts * sum(n for _, n in stored_bytes(ex.scheme, rows, cols, dtype))
    return total + sum(_nbytes(p) for p in block.parameters() if id(p) not in quantized)


def predict_output_bytes(model: nn.Module, targets, weight_dtype: torch.dtype | None,
                         target_bits: float | None = None) -> int:
    """The checkpoint's safetensors bytes, headers included: quantized weights as their scheme stores them,
    the rest as is (``target_bits``: a search's dense Linears at its budget, which it never exceeds)."""
    dtype = weight_dtype or torch.bfloat16
    quantized: set[int] = set()
    total = 0
    for ls in targets.linears:
        for lin in ls:
            quantized.add(id(lin.module.weight))
            m = lin.module
            total += _quantized_bytes(lin.name, lin.scheme, m.out_features, m.in_features, dtype)
            if target_bits is not None:  # the budget, over the bits the recipe's default would store
                total += math.ceil(target_bits * m.out_features * m.in_features / 8) - sum(
                    n for _, n in stored_bytes(lin.scheme, m.out_features, m.in_features, dtype))
    for es in targets.experts:
        for ex in es:
            for name in expert_params(ex.module):
                p = ex.module._parameters[name]
                quantized.add(id(p))
                n_experts, rows, cols = (int(d) for d in p.shape)
                total += n_experts * _quantized_bytes(f"{ex.prefix}.0.{name}", ex.scheme, rows, cols, dtype)
    seen: set[int] = set()
    for name, p in model.named_parameters():  # tied parameters once
        if id(p) in quantized or id(p) in seen:
            continue
        seen.add(id(p))
        total += _nbytes(p) + header_bytes(name)
    return total


def disk_need(cfg, model: nn.Module, targets, weight_dtype: torch.dtype | None, src: Path | None, *,
              calibrated: bool, chain_dtype: torch.dtype, fp_chain: bool) -> dict:
    """The job's predicted disk: the checkpoint with its side files, and the resume state's peak."""
    output = predict_output_bytes(model, targets, weight_dtype, target_bits=cfg.target_bits)
    state = 0
    if calibrated and targets.blocks:
        hidden = int(model.get_input_embeddings().weight.shape[-1])
        tokens, width = cfg.nsamples * cfg.seqlen, torch.empty((), dtype=chain_dtype).element_size()
        if cfg.bookkeeping:
            state = chain_bytes(tokens, hidden, chain_dtype, fp_chain)
        if cfg.target_bits is not None and search_score(cfg, targets) == "fisher":
            # the search's every block's inputs, all gone before the first chain file is written
            state = max(state, len(targets.blocks) * tokens * hidden * width)
    return {"predicted_output_bytes": output + side_bytes(src), "predicted_state_bytes": state}


def chain_bytes(tokens: int, hidden: int, dtype: torch.dtype, both_chains: bool) -> int:
    """All ranks' resume chain files at their peak: each block's inputs of every calibration token."""
    return CHAINS_KEPT * tokens * hidden * torch.empty((), dtype=dtype).element_size() * (2 if both_chains else 1)


def side_bytes(src: Path | None) -> int:
    """The source files copied beside the output (tokenizer, generation config, templates)."""
    if src is None or not Path(src).is_dir():
        return 0
    return sum(f.stat().st_size for f in Path(src).iterdir()
               if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"))


def written_bytes(out: Path, *, state: bool = False) -> int:
    """Bytes of the files under ``out`` (the resume state ``.sq-run`` only with ``state``)."""
    out = Path(out)
    if not out.is_dir():
        return 0
    return sum(f.stat().st_size for f in out.rglob("*")
               if f.is_file() and not f.is_symlink() and (state or ".sq-run" not in f.relative_to(out).parts))


def size(n: float) -> str:
    """Bytes for people: GiB from 1 GiB up, else MiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def disk_problems(out: Path, need: int) -> tuple[list[str], dict]:
    """Refusal when the filesystem holding ``out`` cannot take ``need`` more bytes than the folder already
    has (a resumed or replaced run reuses its own files); the numbers for the report."""
    where = nearest_existing(Path(out).absolute())
    try:
        free = shutil.disk_usage(where).free
    except OSError as e:  # no statvfs there: nothing to predict against (the write itself still reports ENOSPC)
        return [], {"need_bytes": need, "free_bytes": None, "error": f"{where}: {e.strerror or e}"}
    have = written_bytes(out, state=True)
    facts = {"need_bytes": need, "free_bytes": free, "in_output_bytes": have}
    if need * SLACK > free + have:
        return [f"--output {out}: the job needs about {size(need * SLACK)} on disk (checkpoint and resume "
                f"state, predicted from the model and the recipe), and {where} has {size(free)} free"
                + (f" beside {size(have)} already in the folder" if have else "")
                + "; free space, choose another --output, or pass --no-preflight to try anyway"], facts
    return [], facts
