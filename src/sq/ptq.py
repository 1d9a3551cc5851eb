"""``python -m sq.ptq`` / ``torchrun -m sq.ptq``: quantize a checkpoint (thin: parse -> quantize_model)."""

from __future__ import annotations

import argparse
import os

from sq.cli import ArgParser, run_cli
from sq.quant.schemes import SCHEME_NAMES


def build_parser() -> ArgParser:
    from sq.quant.blockwise import ALGOS

    p = ArgParser(prog="torchrun -m sq.ptq", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder, hub id org/name, or demo:NAME")
    p.add_argument("--output", required=True, help="new or empty output folder")
    p.add_argument("--scheme", default="W4A16", type=str.upper, choices=SCHEME_NAMES)
    p.add_argument("--algo", default="gptq", choices=ALGOS)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default="builtin:pydoc")
    p.add_argument("--ignore", nargs="*", default=[], metavar="REGEX",
                   help="Linear module names (re.search) left unquantized")
    p.add_argument("--recipe", default=None, metavar="FILE",
                   help="mixed precision: YAML/JSON of ordered regex -> scheme rules and a default "
                        "(docs/recipes.md)")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout in seconds")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides the world size)")
    p.add_argument("--no-calibrate-all-experts", dest="calibrate_all", action="store_false",
                   help="feed each expert's Hessian only the tokens routed to it (default: every token)")
    p.add_argument("--resume", default="auto", choices=("auto", "never", "require"),
                   help="auto: continue a matching unfinished run in --output; never: start over; "
                        "require: fail if there is nothing to resume")
    p.add_argument("--actorder", default="static", choices=("static", "off"),
                   help="GPTQ column order: static act-order (descending Hessian diagonal, scales fixed up "
                        "front, as llm-compressor) or off (natural order)")
    p.add_argument("--iters", type=int, default=200, help="SignRound: signed-gradient steps per block")
    p.add_argument("--lr", type=float, default=None, help="SignRound: step size (default 1/iters, decaying linearly)")
    p.add_argument("--batch-size", type=int, default=8, help="SignRound: calibration samples per step, over all ranks")
    p.add_argument("--no-bookkeeping", dest="bookkeeping", action="store_false", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    from sq.quant.blockwise import PTQConfig

    a = build_parser().parse_args(argv)
    return PTQConfig(model=a.model, output=a.output, scheme=a.scheme, algo=a.algo, group_size=a.group_size,
                     nsamples=a.nsamples, seqlen=a.seqlen, seed=a.seed, dataset=a.dataset,
                     ignore=tuple(a.ignore), recipe=a.recipe, timeout_s=a.timeout, ep=a.ep,
                     calibrate_all_experts=a.calibrate_all, resume=a.resume, actorder=a.actorder == "static",
                     iters=a.iters, lr=a.lr, batch_size=a.batch_size, bookkeeping=a.bookkeeping,
                     fault=os.environ.get("SQ_FAULT"))


def main(argv=None) -> int:
    def body():
        from sq.dist import init_distributed, setup_logging
        from sq.quant.blockwise import quantize_model

        from sq.memory import prefer_mmap_for_large_allocations

        cfg = parse_args(argv)
        prefer_mmap_for_large_allocations()
        env = init_distributed(timeout_s=cfg.timeout_s)
        setup_logging(env.rank)
        report = quantize_model(cfg)
        if report.get("complete") and env.rank == 0:
            print(f"sq: {cfg.output} is already complete; nothing to do")

    return run_cli(body)


if __name__ == "__main__":
    from sq.cli import exit_process

    exit_process(main())
