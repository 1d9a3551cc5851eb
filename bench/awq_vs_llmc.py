"""AWQ side by side: sq (``--algo awq``, 2 ranks) vs llm-compressor 0.14's ``AWQModifier`` (issue 18).

    .venv/bin/python bench/awq_vs_llmc.py [--model demo:smollm2] [--group-size 64] [--nsamples 128]
        [--seqlen 512] [--work bench/_work/awq] [--gptq] [--skip-llmc | --skip-sq] [--peer-dtype float32]

Standard benchmark (docs/benchmarks.md): W4A16 group 64, calibration = the first
``nsamples x seqlen`` tokens of ``builtin:pydoc`` as consecutive windows (the same tokens on both
sides), perplexity on the last 40 windows of 512 tokens by ``bench/peers/eval_preset.py`` (fp32
forward on the library's dequantized weights) for the source, sq and llm-compressor.

- sq: ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m sq.ptq --algo awq``
  (``OMP_NUM_THREADS=1`` per rank), wall time of the launch;
- llm-compressor: this file re-run inside ``bench/_work/venv-llmc`` (``--llmc-worker``):
  ``oneshot`` with ``[AWQModifier(duo_scaling=True, n_grid=20), QuantizationModifier(W4A16, group
  --group-size, ignore lm_head)]`` (``--gptq``: ``GPTQModifier`` instead of the
  ``QuantizationModifier``, and sq's ``--awq-gptq on``), wall time of ``oneshot``.  Without an
  accelerator its cache's ``pin_memory`` (which torch then refuses) is made a no-op.

Writes ``WORK/results.json`` and prints one line per checkpoint.  Heavy on CPU (the full
standard benchmark is several minutes per side): run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLMC_PY = ROOT / "bench" / "_work" / "venv-llmc" / "bin" / "python"


def llmc_worker(args) -> int:
    """Inside the llm-compressor venv: AWQ then RTN (or GPTQ), saved compressed."""
    import torch
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from pydoc_data.topics import topics
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # AWQ pins its cached batches for faster onloading, which torch refuses without an accelerator;
    # on a CPU-only machine the pinning is skipped (it changes no value)
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights = scheme.weights.model_copy(update={"group_size": args.group_size})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.peer_dtype, device_map="cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    text = "\n\n".join(topics[k] for k in sorted(topics))  # sq's builtin:pydoc
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"][: args.nsamples * args.seqlen]
    windows = torch.tensor(ids).reshape(args.nsamples, args.seqlen).tolist()
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * args.seqlen for _ in windows]})
    quant = (GPTQModifier if args.gptq else QuantizationModifier)(config_groups={"group_0": scheme}, ignore=["lm_head"])
    t = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=[AWQModifier(duo_scaling=True, n_grid=20), quant],
            num_calibration_samples=args.nsamples, max_seq_length=args.seqlen, shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    (Path(args.out) / "llmc_run.json").write_text(json.dumps({"oneshot_s": round(seconds, 2)}) + "\n")
    return 0


def run(cmd: list[str], env=None) -> tuple[float, str]:
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"awq_vs_llmc: {' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return time.perf_counter() - t, res.stdout


def perplexity(model: Path) -> float:
    _, out = run([sys.executable, "bench/peers/eval_preset.py", "--model", str(model)])
    return json.loads(out.strip().splitlines()[-1])["ppl"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo:smollm2")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--nsamples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--work", type=Path, default=ROOT / "bench" / "_work" / "awq")
    p.add_argument("--gptq", action="store_true", help="AWQ followed by GPTQ on both sides")
    p.add_argument("--skip-llmc", action="store_true")
    p.add_argument("--skip-sq", action="store_true", help="llm-compressor's side only (sq's kept from an earlier run)")
    p.add_argument("--peer-dtype", choices=["auto", "float32"], default="auto",
                   help="llm-compressor's model dtype: auto = the checkpoint's bf16 (its default); float32 = the "
                        "dtype sq calibrates in on CPU (bf16 matmuls are slow on a CPU without native bf16)")
    p.add_argument("--llmc-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.llmc_worker:
        return llmc_worker(args)

    from sq.resolve import resolve_model

    src = Path(resolve_model(args.model))
    tag = "awq-gptq" if args.gptq else "awq"
    work = args.work / f"{src.name}-g{args.group_size}-n{args.nsamples}x{args.seqlen}"
    work.mkdir(parents=True, exist_ok=True)
    results = {"model": args.model, "group_size": args.group_size, "nsamples": args.nsamples, "seqlen": args.seqlen}
    sq_out = work / f"sq-{tag}"
    sq_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "sq.ptq",
              "--model", str(src), "--output", str(sq_out), "--algo", "awq", "--scheme", "W4A16", "--group-size",
              str(args.group_size), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen),
              "--resume", "never"] + (["--awq-gptq", "on"] if args.gptq else [])
    res_file = work / f"results-{tag}.json"
    if res_file.is_file():  # keep the other side's numbers when one side is rerun
        results.update({k: v for k, v in json.loads(res_file.read_text()).items() if k not in results})
    if not args.skip_sq:
        results["sq_wall_s"] = round(run(sq_cmd, env={"OMP_NUM_THREADS": "1"})[0], 1)
        results["sq_ppl"] = perplexity(sq_out)
        print(f"sq {tag}: ppl {results['sq_ppl']} in {results['sq_wall_s']} s (2 ranks)", flush=True)
    if not args.skip_llmc:
        results["llmc_dtype"] = args.peer_dtype
        llmc_out = work / f"llmc-{tag}"
        subprocess.run(["rm", "-rf", str(llmc_out)], check=True)
        cmd = [str(LLMC_PY), __file__, "--llmc-worker", "--model", str(src), "--out", str(llmc_out),
               "--group-size", str(args.group_size), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen),
               "--peer-dtype", args.peer_dtype]
        results["llmc_wall_s"] = round(run(cmd + (["--gptq"] if args.gptq else []))[0], 1)
        results["llmc_oneshot_s"] = json.loads((llmc_out / "llmc_run.json").read_text())["oneshot_s"]
        results["llmc_ppl"] = perplexity(llmc_out)
        print(f"llm-compressor {tag}: ppl {results['llmc_ppl']} in {results['llmc_oneshot_s']} s (oneshot)", flush=True)
    if "source_ppl" not in results:
        results["source_ppl"] = perplexity(src)
    print(f"source: ppl {results['source_ppl']}")
    res_file.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
