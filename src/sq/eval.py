"""Perplexity of any checkpoint (full precision or compressed-tensors quantized), in transformers or vLLM.

    python -m sq.eval --model DIR_OR_demo:NAME [--dataset builtin:pydoc] [--seqlen 512] [--nwindows 40]
    python -m sq.eval --model DIR --engine vllm      # the same windows scored by vLLM (its own venv)
    python -m sq.eval --model DIR --engine both      # both, plus greedy tokens; exit 1 when they disagree

Scores the last ``nwindows`` windows of the tokenized corpus (see ``sq.calib.data``); each
window is scored alone (no context carried over), perplexity = exp(mean NLL over every
predicted token), logits in fp32.  transformers loads quantized checkpoints by itself when
``config.json`` carries a ``quantization_config``.  vLLM gets the same token ids and scores them
from its prompt logprobs (``sq.engines``; docs/serving.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from sq.calib.data import BUILTIN_PYDOC, eval_windows, read_corpus, tokenize_corpus
from sq.resolve import resolve_model_dist
from sq.engines.reference import load as load_model
from sq.engines.reference import perplexity
from sq.errors import SqError
from sq.memory import bound_cpu_kernel_caches

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Perplexity of a checkpoint (full precision, or quantized by sq: compressed-tensors) on
the last windows of a text corpus, each window scored alone: in transformers (fp32 on CPU),
in vLLM (the way it will be served; vLLM runs in its own venv), or both side by side.
One process: python -m sq.eval."""


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
    p.add_argument("--engine", choices=["transformers", "vllm", "both"], default="transformers",
                   help="who scores the windows: transformers (fp32; bf16 for NVFP4 / MX formats), vLLM (its offline LLM API in its own venv), or "
                        "both (also greedy tokens of --prompt; exit 1 when they disagree, docs/serving.md)")
    p.add_argument("--engine-python", metavar="PATH",
                   help="python of a venv with vLLM (default: $SQ_VLLM_PYTHON, else .venv-vllm beside this venv, "
                        "else this python if it imports vllm)")
    p.add_argument("--engine-dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto",
                   help="vLLM's compute dtype; auto: the checkpoint's dtype, as vLLM serves it")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="prompt for the greedy tokens of --engine both (default: a fixed Python snippet)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="N", help="greedy tokens compared by --engine both")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


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


def _refuse_unfinished(source) -> None:
    """An sq output folder whose run has not finished (``.sq-run/`` there, no config.json or index yet) is
    named as that, not as a checkpoint missing its tokenizer."""
    from sq.files import INDEX_NAME, RUN_DIR

    root = Path(source)
    if (root / RUN_DIR).is_dir() and not ((root / "config.json").is_file() and (root / INDEX_NAME).is_file()):
        raise SqError(f"{root} is an unfinished sq.ptq run ({RUN_DIR}/ holds its state; the checkpoint's config.json "
                      "and index are written last): rerun the sq.ptq command that made it (it resumes where it "
                      "stopped), then evaluate the folder")


def _refuse_torn(source) -> None:
    """Every safetensors file's header against its size (``sq.load.source.read_safetensors_header``): a
    truncated or corrupt shard is named, not left to safetensors' raw error mid-load."""
    from sq.load.source import read_safetensors_header

    root = Path(source)
    problems = []
    for path in sorted(root.glob("*.safetensors")) if root.is_dir() else ():
        try:
            read_safetensors_header(path)
        except (ValueError, OSError) as e:
            problems.append(f"{path}: {e}; copy or download the file again (or rerun the sq.ptq that wrote it "
                            "with --resume never)")
    if problems:
        raise SqError(problems)


def _refuse_long_windows(source, seqlen: int) -> None:
    """``--seqlen`` beyond the model's context (``max_position_embeddings``): refused, since such windows score
    the model's extrapolation past what it was built for, not the model (and the quantization's effect on it)."""
    import json

    try:
        cfg = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the load names a missing or broken config
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    limit = text.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < seqlen:
        raise SqError(f"--seqlen {seqlen} is beyond the model's context ({limit} tokens: max_position_embeddings in "
                      f"{Path(source) / 'config.json'}); give --seqlen {limit} or less")


def _refuse_counts(args) -> None:
    problems = [f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}"
                for name, low in (("seqlen", 2), ("nwindows", 1), ("batch_size", 1), ("new_tokens", 1))
                if getattr(args, name) < low]
    if problems:
        raise SqError(problems)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sq").setLevel(logging.INFO)  # e.g. "building demo:smollm2 (once)" during a long wait
    bound_cpu_kernel_caches()  # before any matmul: a MoE forward on CPU is a new shape per expert
    try:
        args = _parse(argv)
        _refuse_counts(args)
        corpus = read_corpus(args.dataset)  # first: a bad dataset fails before the slow model load
        source = resolve_model_dist(args.model)  # a hub id: config, tokenizer, safetensors only
        _refuse_unfinished(source)
        _refuse_unsafe(source)
        _refuse_pickle(source)
        _refuse_torn(source)
        _refuse_long_windows(source, args.seqlen)
        tokenizer = load_model(args.model, source, model=False)
        tokens = tokenize_corpus(tokenizer, corpus.text(tokenizer))  # chat records need the tokenizer
        windows = eval_windows(tokens, args.nwindows, args.seqlen)
        if args.engine == "both":
            return _both(args, source, tokenizer, windows)
        if args.engine == "vllm":
            from sq.engines.vllm_client import engine_version, run_vllm

            served = run_vllm(source, windows=windows, dtype=args.engine_dtype, python=args.engine_python)
            ppl = served.perplexity
            for problem in served.problems:
                print(f"vLLM warned: {problem}", file=sys.stderr)
        else:
            model = load_model(args.model, source, model=True)
            ppl = perplexity(model, windows, batch_size=args.batch_size, progress=args.progress)
    except SqError as e:
        for problem in e.problems:
            print(f"sq: error: {problem}", file=sys.stderr)
        return 2
    print(f"perplexity: {ppl:.2f}")
    if args.engine == "vllm":
        print(f"engine: vLLM {engine_version(served.versions)}, dtype {args.engine_dtype}, "
              f"schemes {served.schemes or 'none (unquantized)'}")
    print(
        f"tokens: {windows.numel()} in {args.nwindows} windows of {args.seqlen} "
        f"({args.nwindows * (args.seqlen - 1)} predicted), corpus {tokens.numel()}"
    )
    return 0


def _both(args, source, tokenizer, windows) -> int:
    """--engine both: perplexity and greedy tokens in transformers and vLLM; 1 when they disagree."""
    from sq.engines.compare import PROMPT, compare
    from sq.engines.vllm_client import engine_version

    prompt = tokenizer(args.prompt if args.prompt is not None else PROMPT)["input_ids"]
    result = compare(source, windows, prompt, new_tokens=args.new_tokens, dtype=args.engine_dtype,
                     python=args.engine_python)
    record = result.record()
    print(f"perplexity: transformers {record['transformers_ppl']:.2f}, vLLM {record['vllm_ppl']:.2f} "
          f"({record['gap']:+.2%}; vLLM {engine_version(record['versions'])}, dtype {args.engine_dtype})")
    d = record["divergence"]
    print(f"greedy: {record['greedy_agree']} of {record['greedy_len']} tokens agree"
          + ("" if d is None else f"; first divergence at step {d['position']}: transformers {d['transformers']} "
             f"(margin {d['transformers_margin']:.3f}), vLLM {d['vllm']} (margin {d['vllm_margin']:.3f})"))
    print(f"vLLM schemes: {record['schemes'] or 'none (unquantized)'}")
    for failure in record["failures"]:
        print(f"sq: engines disagree: {failure}", file=sys.stderr)
    print("engines agree" if not record["failures"] else "engines disagree")
    return 1 if record["failures"] else 0


if __name__ == "__main__":
    from sq.cli import exit_process

    exit_process(main())
