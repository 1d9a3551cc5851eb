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
from pathlib import Path

import torch
import torch.nn.functional as F

from sq.calib.data import BUILTIN_PYDOC, eval_windows, read_corpus, tokenize_corpus
from sq.demo import resolve_model_dist
from sq.errors import SqError
from sq.memory import bound_cpu_kernel_caches

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Perplexity of a checkpoint (full precision, or quantized by sq: compressed-tensors) on
the last windows of a text corpus, each window scored alone, fp32 on CPU.
One process: python -m sq.eval."""


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
    from sq.cli import HelpFormatter

    p = _Parser(prog="python -m sq.eval", description=DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("--model", required=True,
                   help="checkpoint folder, Hugging Face hub id org/name (config, tokenizer and safetensors only), "
                        "or demo:smollm2 / demo:tiny-moe")
    p.add_argument("--dataset", default=BUILTIN_PYDOC, metavar="SPEC",
                   help="builtin:pydoc, a .txt/.jsonl/.parquet file, or a hub dataset org/name[:split]; docs/data.md")
    p.add_argument("--seqlen", type=int, default=512, metavar="N", help="tokens per window")
    p.add_argument("--nwindows", type=int, default=40, metavar="N", help="score the last N windows of the corpus")
    p.add_argument("--batch-size", type=int, default=4, metavar="N", help="windows per forward pass")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _load(spec: str, source, *, model: bool):
    """The tokenizer (or, with ``model``, the fp32 CPU model) of ``source``; a failure as one sq line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        if not model:
            return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, device_map="cpu",
                                                    trust_remote_code=False, use_safetensors=True).eval()
    except (OSError, ValueError, KeyError) as e:
        reason = " ".join(str(e).split())  # one line per problem, as every sq error
        raise SqError(f"cannot load model {spec!r} ({source}): {reason}") from e


def _refuse_unsafe(source) -> None:
    """Before transformers opens anything: the refusals sq.ptq makes at scan time for the files it reads.

    A link that leaves the checkpoint folder (other than the hub cache's own blob links) and a
    tokenizer with custom code (``auto_map`` in tokenizer_config.json) are refused, never run.
    """
    from sq.load.meta import tokenizer_problems
    from sq.load.source import checkpoint_link_problems

    problems = list(checkpoint_link_problems(source).values())
    problems += tokenizer_problems(source, trust_remote_code=False)
    if problems:
        raise SqError(problems)


def _refuse_pickle(source) -> None:
    """sq reads safetensors only: a folder without them (pickle weights only, or none) is refused up front.

    transformers would otherwise unpickle ``pytorch_model.bin`` (weights-only, yet still a
    pickle) or fail with a raw error; the model is also loaded with ``use_safetensors=True``.
    """
    from sq.load.source import PICKLE_SUFFIXES

    root = Path(source)
    if not root.is_dir() or any(p.name.endswith(".safetensors") for p in root.iterdir()):
        return
    pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise SqError(f"{root} holds only pickle checkpoints ({', '.join(pickles[:3])}); sq reads safetensors only "
                      "because unpickling can run arbitrary code. Convert them to safetensors first")
    raise SqError(f"{root} has no *.safetensors files")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sq").setLevel(logging.INFO)  # e.g. "building demo:smollm2 (once)" during a long wait
    bound_cpu_kernel_caches()  # before any matmul: a MoE forward on CPU is a new shape per expert
    try:
        args = _parse(argv)
        corpus = read_corpus(args.dataset)  # first: a bad dataset fails before the slow model load
        source = resolve_model_dist(args.model)  # a hub id: config, tokenizer, safetensors only
        _refuse_unsafe(source)
        _refuse_pickle(source)
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
