"""Perplexity of a compressed-tensors checkpoint, fp32 on CPU, for every preset (issue 17 table).

    .venv/bin/python bench/peers/eval_preset.py --model DIR [--weights-only] [--load-dtype auto|float32|bfloat16]

Same corpus, windows and scoring as ``python -m sq.eval`` (sq.calib.data + sq.eval.perplexity: the
last 40 windows of 512 builtin:pydoc tokens, each window scored alone, NLL in fp32/float64), and the
same loader (transformers 5.24 + compressed-tensors 0.20.1, default compressed route). What differs
from ``sq.eval`` is only the dtype handling, so every preset runs its forward in fp32:

1. The model is loaded (``--load-dtype auto``: float32, except formats the library decompresses only
   to bfloat16 -- nvfp4-pack-quantized, mxfp4-pack-quantized -- which load in bfloat16; mxfp8-quantized
   loads in float32 and still decompresses to bfloat16, which step 2's cast covers).
2. The weights are decompressed right away with the library's own ``decompress_model`` (what its
   first-forward hook would do), then ``model.float()``: the forward runs in fp32 on the library's
   dequantized weights (bf16 / fp16 parameters and buffers cast to fp32 in place: transformers refuses
   ``model.float()`` on a quantized model; fp8 / uint8 qparams stay as they are) (exact in fp32 for every format; for NVFP4 the library's bf16 dequantization
   rounds ``fp4 * fp8 scale / global scale`` to bf16 first -- the library's only path).
3. Activations: the library's fake quantization of input activations (``set_forward_quantized``:
   W8A8 int8 per token, FP8_DYNAMIC fp8 per token, W4A8 / W4AFP8 per token, NVFP4 / MXFP4 per group,
   FP8 / NVFP4 static scales) stays on, as transformers runs it; ``--weights-only`` switches it off
   (``quantization_enabled = False``; weight QDQ is already skipped after decompression).
   FP8_BLOCK's per-token-group activation quantization fails in the library when the input width is
   not a multiple of 128 (SmolLM2: 576); ``--weights-only`` is then the only way to score it.

Why not bf16: sq.eval is fp32 (the standard benchmark's numbers are), and on this CPU (avx512_bf16,
no AMX) a bf16 forward is 3-5x slower than fp32 (bench/_work/ref/results.jsonl: 335-560 s vs ~100 s).
Prints ``perplexity: X`` plus one JSON line with the settings and times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BF16_ONLY = {"nvfp4-pack-quantized", "mxfp4-pack-quantized"}


def formats(model_dir: Path) -> set[str]:
    cfg = json.loads((model_dir / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    out = {g.get("format") or qc.get("format") for g in (qc.get("config_groups") or {}).values()}
    if not out and qc.get("format"):
        out = {qc["format"]}
    return {f for f in out if f}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--weights-only", action="store_true", help="switch the library's activation fake quantization off")
    p.add_argument("--load-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--nwindows", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sq.calib.data import BUILTIN_PYDOC, eval_windows, read_corpus, tokenize_corpus
    from sq.eval import perplexity
    from sq.memory import bound_cpu_kernel_caches

    bound_cpu_kernel_caches()
    t0 = time.perf_counter()
    fmts = formats(args.model)
    load_dtype = args.load_dtype if args.load_dtype != "auto" else ("bfloat16" if fmts & BF16_ONLY else "float32")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens = tokenize_corpus(tokenizer, read_corpus(BUILTIN_PYDOC).text(tokenizer))
    windows = eval_windows(tokens, args.nwindows, args.seqlen)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, load_dtype), device_map="cpu",
                                                 use_safetensors=True).eval()
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(model, "ct_decompress_hook"):
        quantizer.compressor.decompress_model(model)
    weight_dtypes = sorted({str(m.weight.dtype) for m in model.modules()
                            if isinstance(m, torch.nn.Linear) and getattr(m, "quantization_scheme", None)})
    for t in list(model.parameters()) + list(model.buffers()):  # model.float() is refused for quantized models
        if t.dtype in (torch.bfloat16, torch.float16):
            t.data = t.data.float()
    act_quant = False
    for m in model.modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        if args.weights_only:
            m.quantization_enabled = False
        elif scheme.input_activations is not None:
            act_quant = True
    t_load = time.perf_counter() - t0
    t = time.perf_counter()
    ppl = perplexity(model, windows, batch_size=args.batch_size)
    t_score = time.perf_counter() - t
    print(f"perplexity: {ppl:.2f}")
    print(json.dumps({"ppl": round(ppl, 4), "formats": sorted(fmts), "load_dtype": load_dtype,
                      "decompressed_weight_dtypes": weight_dtypes, "forward_dtype": "float32",
                      "activation_fake_quant": act_quant, "weights_only": args.weights_only,
                      "load_s": round(t_load, 1), "score_s": round(t_score, 1), "threads": torch.get_num_threads(),
                      "tokens": windows.numel()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
