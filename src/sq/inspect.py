"""Load a checkpoint sharded over the ranks and report what each rank read and holds.

    torchrun --nproc-per-node 2 -m sq.inspect --model demo:smollm2 --ppl

Every rank plans (mapping + refusals), shards and fills its part; rank 0 prints the plan
summary (with the tensors of an FP8 or MXFP4 source dequantized while read) and a per-rank table
(shard bytes, checkpoint bytes its boxes asked for, disk bytes read, memory rise, time).  ``--ppl``
scores the sharded model data-parallel on the last windows of the corpus.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sq.calib.data import BUILTIN_PYDOC, eval_windows, read_corpus_dist, tokenize_corpus
from sq.cli import ArgParser, positive_seconds, run_cli
from sq.dist import init_distributed, setup_logging
from sq.memory import io_read_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes

DESCRIPTION = """\
Load a checkpoint sharded over the ranks (as sq.ptq does) and report, per rank, the
shard bytes it holds, the disk bytes it read, its memory rise and load time; with
--ppl, also the sharded model's perplexity. Run it under torchrun."""


def build_parser() -> ArgParser:
    p = ArgParser(prog="torchrun -m sq.inspect", description=DESCRIPTION)
    p.add_argument("--model", required=True,
                   help="checkpoint folder, Hugging Face hub id org/name, or demo:smollm2 / demo:tiny-moe")
    p.add_argument("--ep", type=int, default=1, metavar="N", help="expert-parallel degree (divides the world size)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                   help="dtype the model is built and filled in")
    p.add_argument("--ppl", action="store_true", help="also score the sharded model's perplexity, data-parallel")
    p.add_argument("--dataset", default=BUILTIN_PYDOC, metavar="SPEC",
                   help="corpus for --ppl: builtin:pydoc, a .txt/.jsonl/.parquet file, or a hub dataset "
                        "org/name[:split] (docs/data.md)")
    p.add_argument("--seqlen", type=int, default=512, metavar="N", help="window length for --ppl")
    p.add_argument("--nwindows", type=int, default=8, metavar="N",
                   help="score the last N windows of the corpus (--ppl)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the checkpoint's own modeling code (only if you trust its author)")
    p.add_argument("--timeout", type=positive_seconds, default=600.0, metavar="SECONDS",
                   help="collective timeout: a dead or hung rank ends the job instead of hanging it")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@torch.no_grad()
def sharded_perplexity(model, windows: torch.Tensor, rank: int, world: int) -> float:
    """Each rank scores windows rank, rank+world, ...; every rank runs the same number of forwards
    (FSDP2 gathers per forward), the extra ones on a dummy window that is not counted."""
    mine = windows[rank::world]
    steps = math.ceil(windows.shape[0] / world)
    nll = torch.zeros(2, dtype=torch.float64)
    for i in range(steps):
        batch = mine[i:i + 1] if i < mine.shape[0] else windows[:1]
        logits = model(input_ids=batch, use_cache=False).logits.float()
        if i < mine.shape[0]:
            nll[0] += F.cross_entropy(logits[0, :-1], batch[0, 1:], reduction="sum").double()
            nll[1] += batch.shape[1] - 1
    dist.all_reduce(nll)
    return math.exp((nll[0] / nll[1]).item())


def run(args: argparse.Namespace) -> dict:
    from sq.resolve import resolve_model_dist
    from sq.load.loader import load_sharded

    env = init_distributed(timeout_s=args.timeout)
    setup_logging(env.rank)
    path = resolve_model_dist(args.model)  # a hub id: rank 0 downloads, the others wait
    dtype = getattr(torch, args.dtype)
    reset_peak_rss()
    rss0, io0, t0 = rss_bytes(), io_read_bytes(), time.perf_counter()
    model = load_sharded(path, ep=args.ep, dtype=dtype, trust_remote_code=args.trust_remote_code)
    load_s = time.perf_counter() - t0
    plan = model.sq_plan
    mine = dict(
        rank=env.rank, load_s=round(load_s, 2), read_bytes=io_read_bytes() - io0,
        asked_bytes=plan.reader().bytes_read,
        rss_rise=peak_rss_bytes() - rss0,
        shard_bytes=sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
    )
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, mine)
    report = dict(
        model=str(path), architecture=type(model).__name__.removeprefix("FSDP"), world_size=env.world_size, ep=args.ep,
        checkpoint_bytes=plan.source.total_bytes, tensors=len(plan.source.tensors),
        blocks=len(plan.block_names), rules=dict(Counter(plan.keymap.rules().values())),
        carried_over=len(plan.carried), ranks=per_rank, dequantized=_dequantized(plan),
    )
    if args.ppl:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        tokens = tokenize_corpus(tokenizer, read_corpus_dist(args.dataset).text(tokenizer))
        windows = eval_windows(tokens, args.nwindows, args.seqlen)
        report["perplexity"] = round(sharded_perplexity(model, windows, env.rank, env.world_size), 3)
        report["ppl_tokens"] = windows.numel()
    return report if env.rank == 0 else {}


def _dequantized(plan) -> dict | None:
    """What the reader dequantizes while reading: ``{"format", "tensors"}``, or None (a plain source)."""
    if plan.mxfp4 is not None:
        return {"format": "mxfp4", "tensors": len(plan.mxfp4.pairs)}
    if plan.fp8 is not None:
        return {"format": f"fp8 block {list(plan.fp8.block)}", "tensors": len(plan.fp8.scales)}
    return None


def _print(report: dict, as_json: bool) -> None:
    if not report:
        return
    if as_json:
        print(json.dumps(report))
        return
    mb = 1 / 2**20
    print(f"{report['architecture']} from {report['model']}: {report['tensors']} tensors, "
          f"{report['checkpoint_bytes'] * mb:.1f} MiB, {report['blocks']} blocks; rules {report['rules']}, "
          f"{report['carried_over']} carried over")
    deq = report.get("dequantized")
    if deq:
        print(f"source {deq['format']}: {deq['tensors']} tensors dequantized while read, each rank its own boxes")
    print(f"world {report['world_size']}, ep {report['ep']}")
    print("rank  shard MiB  asked MiB  read MiB  RSS rise MiB  load s")
    for r in report["ranks"]:
        print(f"{r['rank']:>4}  {r['shard_bytes'] * mb:>9.1f}  {r['asked_bytes'] * mb:>9.2f}  "
              f"{r['read_bytes'] * mb:>8.1f}  {r['rss_rise'] * mb:>12.1f}  {r['load_s']:>6.2f}")
    if "perplexity" in report:
        print(f"perplexity (sharded model, {report['ppl_tokens']} tokens): {report['perplexity']:.3f}")


def main(argv=None) -> int:
    def body():
        args = parse_args(argv)
        _print(run(args), args.json)

    return run_cli(body)


if __name__ == "__main__":
    from sq.cli import exit_process

    exit_process(main())
