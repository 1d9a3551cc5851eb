"""Predictions a job makes before it writes anything: the disk it needs (``sq.ptq``'s preflight).

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

from sq.anatomy import EXPERT_PARAMS

__all__ = ["predict_output_bytes", "disk_need", "chain_bytes", "disk_problems", "written_bytes", "GiB", "main"]

GiB = 1 << 30
SLACK = 1.02  # index, config, report, picture and logs beside the checkpoint: under 1% on the demo (tests/test_plan.py)
ROWS = 256  # a multiple of every scheme's row block (FP8_BLOCK's 128)
HEADER_ENTRY = 64  # a header entry's bytes beside its name (dtype, shape, offsets, punctuation)
CHAINS_KEPT = 4  # sq.resume keeps the last three chains, and a fourth is written before the oldest goes


@functools.lru_cache(maxsize=256)
def _stored(scheme, out_features: int, in_features: int, dtype: torch.dtype) -> tuple[tuple[str, int], ...]:
    """Each tensor the scheme writes for the shape, and its bytes.  Wide weights are measured at
    ``ROWS`` and ``2 * ROWS`` rows and extended linearly (every stored tensor grows with the rows or
    not at all), so a DeepSeek-size model is planned in milliseconds, not by quantizing its shapes."""
    from sq.pipeline.search import stored_tensors

    if out_features <= 2 * ROWS:
        return tuple(stored_tensors(scheme, out_features, in_features, dtype).items())
    one, two = (stored_tensors(scheme, r, in_features, dtype) for r in (ROWS, 2 * ROWS))
    return tuple((k, one[k] + (two[k] - one[k]) * (out_features - ROWS) // ROWS) for k in one)


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _header(name: str) -> int:
    """A safetensors header entry: the name and ``{"dtype":"BF16","shape":[..],"data_offsets":[..,..]}``."""
    return len(name) + HEADER_ENTRY


def _quantized_bytes(prefix: str, scheme, out_features: int, in_features: int, dtype: torch.dtype) -> int:
    return sum(n + _header(f"{prefix}.{suffix}") for suffix, n in _stored(scheme, out_features, in_features, dtype))


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
                    n for _, n in _stored(lin.scheme, m.out_features, m.in_features, dtype))
    for es in targets.experts:
        for ex in es:
            for name in EXPERT_PARAMS:
                p = ex.module._parameters[name]
                quantized.add(id(p))
                n_experts, rows, cols = (int(d) for d in p.shape)
                total += n_experts * _quantized_bytes(f"{ex.prefix}.0.{name}", ex.scheme, rows, cols, dtype)
    seen: set[int] = set()
    for name, p in model.named_parameters():  # tied parameters once
        if id(p) in quantized or id(p) in seen:
            continue
        seen.add(id(p))
        total += _nbytes(p) + _header(name)
    return total


def disk_need(cfg, model: nn.Module, targets, weight_dtype: torch.dtype | None, src: Path | None, *,
              calibrated: bool, chain_dtype: torch.dtype, fp_chain: bool) -> dict:
    """The job's predicted disk: the checkpoint with its side files, and the resume state's peak."""
    output = predict_output_bytes(model, targets, weight_dtype, target_bits=cfg.target_bits)
    state = 0
    if calibrated and cfg.bookkeeping and targets.blocks:
        hidden = int(model.get_input_embeddings().weight.shape[-1])
        state = chain_bytes(cfg.nsamples * cfg.seqlen, hidden, chain_dtype, fp_chain)
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


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_problems(out: Path, need: int) -> tuple[list[str], dict]:
    """Refusal when the filesystem holding ``out`` cannot take ``need`` more bytes than the folder already
    has (a resumed or replaced run reuses its own files); the numbers for the report."""
    where = _existing(out)
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


# ---- python -m sq.plan: the same prediction before launching

DESCRIPTION = """\
Predict what a sq.ptq job needs before launching it. Takes sq.ptq's own arguments (prefix
the job's command line with python -m sq.plan), reads only config.json, the index and the
safetensors headers, and prints the disk the checkpoint and the resume state will take and the
free space where --output lives; exits 2 with the job's own refusal when it would not fit.
Memory and time are not predicted yet."""


def build_parser():
    from sq.ptq import build_parser as ptq_parser

    p = ptq_parser()
    p.prog = "python -m sq.plan"
    p.description = DESCRIPTION
    p.add_argument("--world", type=int, default=1, metavar="N",
                   help="ranks the job will run on (nproc-per-node x nnodes; default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON line (for schedulers)")
    return p


def plan_job(cfg, world: int) -> tuple[dict, list[str]]:
    """The prediction ``sq.ptq`` makes at start, without a process group or any weight read."""
    from sq.errors import SqError
    from sq.load.loader import plan_load
    from sq.load.meta import build_skeleton
    from sq.parallel.fsdp import main_dtype
    from sq.pipeline.targets import plan_targets
    from sq.pipeline.weights import CheckpointWeights
    from sq.quant.algorithms import make_algorithm
    from sq.resolve import resolve_model

    if world < 1:
        raise SqError(f"--world must be at least 1, got {world}")
    assigner = cfg.assigner()
    src = resolve_model(cfg.model)
    if not isinstance(src, Path):
        raise SqError(f"sq.plan reads a local checkpoint folder or demo:NAME; {cfg.model!r} is not one "
                      "(download it first: sq.ptq does, on rank 0)")
    model = build_skeleton(src, trust_remote_code=cfg.trust_remote_code)
    load = plan_load(model, src, trust_remote_code=cfg.trust_remote_code)
    targets = plan_targets(model, assigner, CheckpointWeights(model, load, src, torch.device("cpu")), world)
    weight_dtype = main_dtype(targets.blocks[0][1]) if targets.blocks else None
    algo = make_algorithm(cfg.algo)
    calibrated = cfg.needs_data(assigner)
    # the calibration dtype is measured at start (sq.probe): float32 is the larger chain
    chain_dtype = weight_dtype if cfg.calib_dtype == "model" and weight_dtype else torch.float32
    need = disk_need(cfg, model, targets, weight_dtype, src, calibrated=calibrated, chain_dtype=chain_dtype,
                     fp_chain=algo.fp_chain)
    problems, facts = disk_problems(Path(cfg.output), need["predicted_output_bytes"] + need["predicted_state_bytes"])
    quantized = sum(len(ls) for ls in targets.linears)
    plan = {"model": str(src), "world": world, "algo": cfg.algo.name, "quantized_linears": quantized,
            "experts_modules": sum(len(es) for es in targets.experts), "blocks": len(targets.blocks),
            "chain_dtype": str(chain_dtype).removeprefix("torch."), **need, **facts, "fits": not problems}
    return plan, problems


def _print(plan: dict) -> None:
    free = plan.get("free_bytes")
    lines = [
        f"sq.plan: {plan['model']} -- {plan['quantized_linears']} Linears and {plan['experts_modules']} experts modules "
        f"quantized over {plan['blocks']} blocks, --algo {plan['algo']}, {plan['world']} rank(s)",
        f"  checkpoint     {plan['predicted_output_bytes'] / GiB:9.3f} GiB",
        f"  resume state   {plan['predicted_state_bytes'] / GiB:9.3f} GiB  (chain files at their peak, "
        f"{plan['chain_dtype']})",
        f"  disk needed    {plan['need_bytes'] * SLACK / GiB:9.3f} GiB  (with {SLACK - 1:.0%} for the index, report "
        "and logs)",
        f"  free there     {free / GiB:9.3f} GiB" if free is not None else f"  free there     unknown ({plan['error']})",
        f"  verdict        {'fits' if plan['fits'] else 'does not fit'}",
        "  memory, time   not predicted yet",
    ]
    print("\n".join(lines))


def main(argv=None) -> int:
    from sq.cli import run_cli
    from sq.errors import SqError
    from sq.ptq import config_from

    def body():
        import json

        a = build_parser().parse_args(argv)
        plan, problems = plan_job(config_from(a), a.world)
        print(json.dumps(plan)) if a.json else _print(plan)
        if problems:
            raise SqError(problems)

    return run_cli(body)


if __name__ == "__main__":
    from sq.cli import exit_process

    exit_process(main())
