"""sq.eval's perplexity with the model loaded in another dtype (bench only; sq.eval itself loads fp32).

    .venv/bin/python bench/peers/eval_dtype.py --model DIR [--dtype bfloat16]

Same corpus, windows and scoring as ``python -m sq.eval`` (sq.calib.data + sq.eval.perplexity: the
last 40 windows of 512 pydoc tokens, each alone, logits cast to fp32 for the NLL), but
``from_pretrained(dtype=...)``: transformers 5.24 loads NVFP4A16 compressed-tensors outputs only in
bf16 (DESIGN.md, Gotchas). The forward runs in that dtype, so the number is not the fp32 one.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--nwindows", type=int, default=40)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sq.calib.data import BUILTIN_PYDOC, eval_windows, read_corpus, tokenize_corpus
    from sq.eval import perplexity

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens = tokenize_corpus(tokenizer, read_corpus(BUILTIN_PYDOC).text(tokenizer))
    windows = eval_windows(tokens, args.nwindows, args.seqlen)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device_map="cpu",
                                                 use_safetensors=True).eval()
    ppl = perplexity(model, windows)
    print(f"perplexity: {ppl:.2f}")
    print(f"dtype: {args.dtype}; tokens: {windows.numel()} in {args.nwindows} windows of {args.seqlen}, "
          f"corpus {tokens.numel()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
