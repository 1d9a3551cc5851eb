"""Perplexity of any checkpoint (full precision or compressed-tensors quantized).

    python -m sq.eval --model DIR_OR_demo:NAME [--dataset builtin:pydoc] [--seqlen 512] [--nwindows 40]

Scores the last ``nwindows`` windows of the tokenized corpus (see ``sq.calib.data``); each
window is scored alone (no context carried over), perplexity = exp(mean NLL over every
predicted token), logits in fp32.  transformers loads quantized checkpoints by itself when
``config.json`` carries a ``quantization_config``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

import torch
import torch.nn.functional as F

from sq.calib.data import BUILTIN_PYDOC, eval_windows, read_corpus, tokenize_corpus
from sq.errors import SqError
from sq.hub import resolve_model_dist
from sq.memory import bound_cpu_kernel_caches

logger = logging.getLogger(__name__)


@torch.no_grad()
def perplexity(
    model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 4, progress: bool = False
) -> float:
    """exp(mean next-token NLL) of ``windows[n, seqlen]``, each window scored independently.

    Every window predicts its tokens 1..seqlen-1, so ``n * (seqlen - 1)`` tokens count.  The
    NLL sum is accumulated in float64 so the result does not depend on ``batch_size``
    beyond fp32 logit rounding.
    """
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise SqError(f"perplexity needs windows [n, seqlen >= 2], got shape {tuple(windows.shape)}")
    if batch_size < 1:
        raise SqError(f"batch size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    batches = list(torch.split(windows, batch_size))
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="perplexity", unit="batch")
    nll = 0.0
    count = 0
    for batch in batches:
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()  # [b, seqlen, vocab]
        pred = logits[:, :-1].reshape(-1, logits.shape[-1])  # [b*(seqlen-1), vocab]
        target = batch[:, 1:].reshape(-1)  # [b*(seqlen-1)]
        nll += F.cross_entropy(pred, target, reduction="sum").double().item()
        count += target.numel()
    return math.exp(nll / count)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so bad flags read like every other sq error."""

    def error(self, message: str):
        raise SqError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m sq.eval", description="Perplexity of a checkpoint on a text corpus.")
    p.add_argument("--model", required=True, help="checkpoint directory, hub id, or demo:smollm2 / demo:tiny-moe")
    p.add_argument("--dataset", default=BUILTIN_PYDOC,
                   help="builtin:pydoc, a .txt/.jsonl/.parquet file, or a hub dataset org/name[:split]; docs/data.md")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--nwindows", type=int, default=40, help="score the last N windows of the corpus")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _load(spec: str, source, *, model: bool):
    """The tokenizer (or, with ``model``, the fp32 CPU model) of ``source``; a failure as one sq line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        if not model:
            return AutoTokenizer.from_pretrained(source)
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, device_map="cpu").eval()
    except (OSError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())  # one line per problem, as every sq error
        raise SqError(f"cannot load model {spec!r} ({source}): {reason}") from e


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sq").setLevel(logging.INFO)  # e.g. "building demo:smollm2 (once)" during a long wait
    bound_cpu_kernel_caches()  # before any matmul: a MoE forward on CPU is a new shape per expert
    try:
        args = _parse(argv)
        corpus = read_corpus(args.dataset)  # first: a bad dataset fails before the slow model load
        source = resolve_model_dist(args.model)  # a hub id: config, tokenizer, safetensors only
        tokenizer = _load(args.model, source, model=False)
        tokens = tokenize_corpus(tokenizer, corpus.text(tokenizer))  # chat records need the tokenizer
        windows = eval_windows(tokens, args.nwindows, args.seqlen)
        model = _load(args.model, source, model=True)
        ppl = perplexity(model, windows, batch_size=args.batch_size, progress=args.progress)
    except SqError as e:
        for problem in e.problems:
            print(f"sq: error: {problem}", file=sys.stderr)
        return 2
    print(f"perplexity: {ppl:.2f}")
    print(
        f"tokens: {windows.numel()} in {args.nwindows} windows of {args.seqlen} "
        f"({args.nwindows * (args.seqlen - 1)} predicted), corpus {tokens.numel()}"
    )
    return 0


if __name__ == "__main__":
    from sq.cli import exit_process

    exit_process(main())
