"""``python -m sq.plan``: what a ``sq.ptq`` job will need, predicted before launching it.

Takes sq.ptq's own arguments, reads config.json, the index and the safetensors headers (the model is
built on the meta device, as every rank of the job builds it), and prints the job's disk preflight
(``sq.pipeline.disk``): the checkpoint, the resume state, the free space where ``--output`` lives, a
verdict.  No process group, no weight read.  Memory and time are not predicted yet.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sq.pipeline.disk import SLACK, GiB, disk_need, disk_problems

__all__ = ["build_parser", "plan_job", "main"]

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
    p.add_argument("--json", action="store_true", help="print the plan as one JSON line (for schedulers)")
    return p


def plan_job(cfg) -> tuple[dict, list[str]]:
    """The prediction ``sq.ptq`` makes at start, without a process group or any weight read.  The disk a
    job needs does not depend on its ranks (each writes its share into the one output folder)."""
    from sq.errors import SqError
    from sq.load.loader import plan_load
    from sq.load.meta import build_skeleton
    from sq.parallel.fsdp import main_dtype
    from sq.pipeline.targets import plan_targets
    from sq.pipeline.weights import CheckpointWeights
    from sq.quant.algorithms import make_algorithm
    from sq.resolve import resolve_model

    assigner = cfg.assigner()
    src = resolve_model(cfg.model)
    if not isinstance(src, Path):
        raise SqError(f"sq.plan reads a local checkpoint folder or demo:NAME; {cfg.model!r} is not one "
                      "(download it first: sq.ptq does, on rank 0)")
    model = build_skeleton(src, trust_remote_code=cfg.trust_remote_code)
    load = plan_load(model, src, trust_remote_code=cfg.trust_remote_code)
    targets = plan_targets(model, assigner, CheckpointWeights(model, load, src, torch.device("cpu")), 1)
    weight_dtype = main_dtype(targets.blocks[0][1]) if targets.blocks else None
    algo = make_algorithm(cfg.algo)
    calibrated = cfg.needs_data(assigner)
    # the calibration dtype is measured at start (sq.probe): float32 is the larger chain
    chain_dtype = weight_dtype if cfg.calib_dtype == "model" and weight_dtype else torch.float32
    need = disk_need(cfg, model, targets, weight_dtype, src, calibrated=calibrated, chain_dtype=chain_dtype,
                     fp_chain=algo.fp_chain)
    problems, facts = disk_problems(Path(cfg.output), need["predicted_output_bytes"] + need["predicted_state_bytes"])
    quantized = sum(len(ls) for ls in targets.linears)
    plan = {"model": str(src), "algo": cfg.algo.name, "quantized_linears": quantized,
            "experts_modules": sum(len(es) for es in targets.experts), "blocks": len(targets.blocks),
            "chain_dtype": str(chain_dtype).removeprefix("torch."), **need, **facts, "fits": not problems}
    return plan, problems


def _print(plan: dict) -> None:
    free = plan.get("free_bytes")
    lines = [
        f"sq.plan: {plan['model']} -- {plan['quantized_linears']} Linears and {plan['experts_modules']} experts modules "
        f"quantized over {plan['blocks']} blocks, --algo {plan['algo']}",
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
        plan, problems = plan_job(config_from(a))
        print(json.dumps(plan)) if a.json else _print(plan)
        if problems:
            raise SqError(problems)

    return run_cli(body)


if __name__ == "__main__":
    from sq.cli import exit_process

    exit_process(main())
