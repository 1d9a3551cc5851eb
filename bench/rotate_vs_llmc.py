"""llm-compressor 0.14's own rotations (or SmoothQuant) + GPTQ on the standard benchmark, beside ``sq.ptq --rotate``
(``--smooth``).

    .venv/bin/python bench/rotate_vs_llmc.py [--schemes W4A16,MXFP4] [--block N] [--nsamples 128 --seqlen 512]
    .venv/bin/python bench/rotate_vs_llmc.py --schemes NVFP4 --smooth 0.8   # SmoothQuantModifier instead

For each preset: ``oneshot([SpinQuantModifier(rotations=["R1", "R2"], transform_type="hadamard"
[, transform_block_size=N]), GPTQModifier(preset, group 64 for int presets, ignore lm_head)])`` on the demo model
(SmolLM2-135M) with the calibration windows sq.ptq builds (``bench/peers.py``'s windows file: 128 x 512 pydoc),
run in ``bench/_work/venv-llmc`` (``--llmc-worker``), saved compressed, then ``sq.eval`` (fp32 transformers, last
40 windows). R1/R2 are fused into the weights, so transformers reads the output as it reads any other.
Prints one line per preset; sq's side is ``sq.ptq --rotate r1,r2 [--rotate-block N]`` (docs/benchmarks.md,
"Rotations").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "_work" / "rotate"
LLMC_PY = ROOT / "bench" / "_work" / "venv-llmc" / "bin" / "python"
GROUP = 64


def llmc_worker(args) -> int:
    """Inside venv-llmc: SpinQuant R1/R2 then GPTQ, saved compressed."""
    import torch
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier, SpinQuantModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():  # the sequential pipeline pins cached batches; not without an accelerator
        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    d = json.loads(Path(args.windows).read_text())
    windows, n, seqlen = d["windows"], d["nsamples"], d["seqlen"]
    scheme = preset_name_to_scheme(args.scheme, ["Linear"])
    if args.scheme.startswith("W"):
        scheme.weights = scheme.weights.model_copy(update={"group_size": GROUP})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", device_map="cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seqlen for _ in windows]})
    spin = dict(rotations=["R1", "R2"], transform_type=args.type)
    if args.block:
        spin["transform_block_size"] = args.block
    first = SmoothQuantModifier(smoothing_strength=args.smooth) if args.smooth else SpinQuantModifier(**spin)
    t = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds,
            recipe=[first, GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])],
            num_calibration_samples=n, max_seq_length=seqlen, shuffle_calibration_samples=False)
    core = time.perf_counter() - t
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    (Path(args.out) / "peer_run.json").write_text(json.dumps({"core_s": round(core, 2)}) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--schemes", default="W4A16,MXFP4")
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--type", default="random-hadamard",
                   help="SpinQuantModifier's transform_type (its 'hadamard' is built only for powers of two: not 576)")
    p.add_argument("--smooth", type=float, default=None, help="SmoothQuantModifier at this strength, not SpinQuant")
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--llmc-worker", action="store_true")
    p.add_argument("--model"), p.add_argument("--out"), p.add_argument("--windows"), p.add_argument("--scheme")
    args = p.parse_args()
    if args.llmc_worker:
        return llmc_worker(args)
    sys.path.insert(0, str(ROOT / "bench"))
    from peers import windows_file
    from sq.demo import demo_path

    src = demo_path("demo:smollm2")
    wfile, digest = windows_file(src, args.nsamples, args.seqlen)
    for scheme in args.schemes.split(","):
        out = WORK / (f"llmc-{scheme}-smooth{args.smooth}" if args.smooth else f"llmc-{scheme}-{args.type}-b{args.block or 0}")
        t = time.perf_counter()
        r = subprocess.run([str(LLMC_PY), __file__, "--llmc-worker", "--model", str(src), "--out", str(out),
                            "--windows", str(wfile), "--scheme", scheme, "--type", args.type]
                           + (["--block", str(args.block)] if args.block else [])
                           + (["--smooth", str(args.smooth)] if args.smooth else []),
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
        if r.returncode:
            print(f"{scheme}: llm-compressor failed: {r.stderr[-2000:]}")
            continue
        e = subprocess.run([sys.executable, "-m", "sq.eval", "--model", str(out)], capture_output=True, text=True)
        ppl = next((ln for ln in e.stdout.splitlines() if ln.startswith("perplexity")), e.stderr[-500:])
        what = f"SmoothQuant {args.smooth}" if args.smooth else f"block {args.block or 'whole'} {args.type}: SpinQuant R1R2"
        print(f"{scheme} {what}: llm-compressor + GPTQ {ppl} "
              f"(wall {wall:.0f} s, windows {digest})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
