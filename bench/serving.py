"""sq's outputs served by vLLM, beside transformers and beside llm-compressor's outputs (issue 33's table).

    .venv/bin/python bench/serving.py run   [--matrix "W4A16:rtn,gptq;W8A8:rtn"] [--nwindows 20] [--no-peer]
    .venv/bin/python bench/serving.py table
    python3 bench/serving.py gpu --model DIR [--engine-python PY]   # on a lent GPU (bench/gpu_check.sh)

For every (preset, algorithm) of ``--matrix`` on ``demo:smollm2``, group 64, calibration = the first
``--nsamples x --seqlen`` tokens of ``builtin:pydoc`` (default 16 x 256: AWQ's grid search at the
standard 128 x 512 takes tens of minutes per output on 2 cores, and the subject here is how the output
is served, not its quality):

1. sq writes the output (``sq.ptq``; GPTQ at 2 ranks, the others in one process; SignRound ``--iters 10
   --batch-size 8``) under ``bench/_work/serving/sq-<algo>-<PRESET>``;
2. llm-compressor 0.14 writes its own (``--llmc-worker``, run inside ``bench/_work/venv-llmc``:
   ``oneshot`` with ``QuantizationModifier`` (rtn), ``GPTQModifier`` (gptq) or ``AWQModifier(n_grid=20,
   duo_scaling=True)`` + ``QuantizationModifier`` (awq), the preset with group 64, ignore ``lm_head``,
   the same token windows, no shuffling) under ``.../llmc-<algo>-<PRESET>``; SignRound has no
   llm-compressor side here (its AutoRoundModifier runs auto-round, not in that venv);
3. ``sq.engines.compare.compare_all`` scores every output on the last ``--nwindows`` windows of 512
   (default 20) and 32 greedy tokens of the fixed prompt: transformers (fp32;
   W4A16_ASYM, which transformers cannot load, through sq's own dequantization) and vLLM's CPU build
   (``.venv-vllm``), all checkpoints in one vLLM process.  vLLM's dtype: bfloat16 for the int4
   weight-only presets (vLLM's CPU WNA16 GEMM has no fp32 kernel), float32 otherwise.

``gpu``: what vLLM's CPU build cannot run, on the GPU: sq's RTN outputs (16 x 256 calibration where
the preset calibrates) of NVFP4A16, NVFP4, MXFP4A16, MXFP8, W8A16, FP8 (static) and FP8 with an fp8 KV
cache on ``--model`` (the demo model, or gpu_check.sh's random-weight SmolLM2), FP8_BLOCK on a random
Llama with widths that are multiples of 128, W4A16 and FP8_DYNAMIC on a random Qwen3-MoE; each
compared in the GPU's vLLM (``--engine-python``, default as ``sq.engines.vllm_client.engine_python``: this
python when it imports vLLM, as on the device image) with ``dtype auto``.  Records go
to ``$OUT/serving_gpu.jsonl`` (or ``bench/_work/serving``).

Records go to ``bench/_work/serving/results.jsonl`` (one line per output, with the failures the serving
check would report); ``table`` prints the markdown table docs/benchmarks.md holds.
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
WORK = ROOT / "bench" / "_work" / "serving"
RESULTS = WORK / "results.jsonl"
LLMC_PY = ROOT / "bench" / "_work" / "venv-llmc" / "bin" / "python"
GROUP = 64
INT4_WEIGHT_ONLY = {"W4A16", "W4A16_ASYM"}


def llmc_worker(args) -> int:
    """Inside venv-llmc (no sq): one preset x algorithm on the given windows, saved compressed."""
    import torch
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():  # the sequential pipeline pins batches; torch refuses without a GPU
        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    data = json.loads(Path(args.windows).read_text())
    windows = data["windows"]
    scheme = preset_name_to_scheme(args.preset, ["Linear"])
    if scheme.weights.group_size is not None and scheme.weights.type == "int":
        scheme.weights = scheme.weights.model_copy(update={"group_size": GROUP})
    groups = {"group_0": scheme}
    if args.algo == "gptq":
        recipe = [GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    elif args.algo == "awq":
        recipe = [AWQModifier(duo_scaling=True, n_grid=20),
                  QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    else:
        recipe = [QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", device_map="cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe, num_calibration_samples=len(windows),
            max_seq_length=len(windows[0]), shuffle_calibration_samples=False)
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    return 0


def _log(cmd: list[str], log: Path, env=None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3600).returncode


def sq_output(model: Path, algo: str, preset: str, args) -> tuple[Path, str]:
    out = WORK / f"sq-{algo}-{preset}"
    if (out / "config.json").is_file():
        return out, "kept"
    args_ = ["--model", str(model), "--output", str(out), "--scheme", preset, "--algo", algo,
             "--group-size", str(GROUP), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen)]
    if algo == "signround":
        args_ += ["--iters", "10", "--batch-size", "8"]
    env = dict(os.environ)
    launcher = [sys.executable, "-m", "sq.ptq"]
    if algo == "gptq":  # the distributed path: 2 ranks, one thread each
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "sq.ptq"]
        env["OMP_NUM_THREADS"] = "1"
    code = _log(launcher + args_, WORK / "logs" / f"sq-{algo}-{preset}.log", env)
    return out, "ok" if code == 0 else f"sq exited {code}"


def llmc_output(model: Path, algo: str, preset: str, windows_file: Path) -> tuple[Path | None, str]:
    out = WORK / f"llmc-{algo}-{preset}"
    if algo == "signround":
        return None, "no llm-compressor side"
    if (out / "config.json").is_file():
        return out, "kept"
    if not LLMC_PY.is_file():
        return None, "venv-llmc missing (bench/peers/setup_llmc.sh)"
    code = _log([str(LLMC_PY), __file__, "--llmc-worker", "--model", str(model), "--out", str(out), "--preset", preset,
                 "--algo", algo, "--windows", str(windows_file)], WORK / "logs" / f"llmc-{algo}-{preset}.log")
    return (out, "ok") if code == 0 else (None, f"llm-compressor exited {code}")


def cmd_run(args) -> int:
    from sq.calib.data import BUILTIN_PYDOC, calibration_windows, eval_windows, load_tokenizer, read_corpus, tokenize_corpus
    from sq.resolve import resolve_model
    from sq.engines.compare import PROMPT, Case, compare_all

    WORK.mkdir(parents=True, exist_ok=True)
    model = resolve_model("demo:smollm2")
    tokenizer = load_tokenizer(model)
    tokens = tokenize_corpus(tokenizer, read_corpus(BUILTIN_PYDOC).text(tokenizer))
    calib = calibration_windows(tokens, args.nsamples, args.seqlen)
    windows_file = WORK / f"windows-{args.nsamples}x{args.seqlen}.json"
    windows_file.write_text(json.dumps({"windows": calib.tolist()}))
    windows = eval_windows(tokens, args.nwindows, 512)
    prompt = tokenizer(PROMPT)["input_ids"]

    rows = []  # (tool, algo, preset, dir, status, seconds)
    for item in args.matrix.split(";"):
        preset, _, algos = item.partition(":")
        for algo in algos.split(","):
            t = time.perf_counter()
            out, status = sq_output(model, algo, preset, args)
            rows.append(("sq", algo, preset, out if status in ("ok", "kept") else None, status, time.perf_counter() - t))
            if args.peer:
                t = time.perf_counter()
                out, status = llmc_output(model, algo, preset, windows_file)
                rows.append(("llmc", algo, preset, out, status, time.perf_counter() - t))
            print(rows[-2:] if args.peer else rows[-1:], flush=True)
    cases = []
    for tool, algo, preset, out, status, _ in rows:
        if out is None:
            continue
        reference = None
        if preset == "W4A16_ASYM":
            reference = dequantized_copy(out, preset)
        cases.append(Case(out, "bfloat16" if preset in INT4_WEIGHT_ONLY else "float32", reference))
    results = iter(compare_all(cases, windows, prompt, python=args.engine_python, timeout=7200))
    with open(RESULTS, "a") as f:
        for tool, algo, preset, out, status, seconds in rows:
            rec = {"tool": tool, "algo": algo, "preset": preset, "status": status, "write_s": round(seconds, 1),
                   "nwindows": args.nwindows, "calibration": f"{args.nsamples}x{args.seqlen}"}
            if out is not None:
                result = next(results)
                if isinstance(result, Exception):
                    rec["status"] = f"vLLM refused: {result}"
                else:
                    rec.update(result.record())
            f.write(json.dumps(rec) + "\n")
            print(json.dumps({k: rec.get(k) for k in ("tool", "algo", "preset", "status", "transformers_ppl",
                                                       "vllm_ppl", "gap", "greedy_agree", "failures")}), flush=True)
    return cmd_table(args)


def dequantized_copy(out: Path, preset: str) -> Path:
    """A dense checkpoint of what ``out`` means, by sq's own dequantization."""
    from sq.engines.compare import dequantized_copy

    dst = out.parent / f"dense-{out.name}"
    if not (dst / "config.json").is_file():
        dequantized_copy(out, dst, preset, GROUP)
    return dst


def cmd_table(args) -> int:
    latest = {}
    for line in RESULTS.read_text().splitlines() if RESULTS.is_file() else []:
        rec = json.loads(line)
        latest[(rec["preset"], rec["algo"], rec["tool"])] = rec
    print("| preset | algorithm | sq: transformers | sq: vLLM | gap | greedy (of 32) | llm-compressor: vLLM | "
          "llm-compressor: transformers | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (preset, algo, tool), rec in latest.items():
        if tool != "sq" or (args.matrix_only and preset not in args.matrix):
            continue
        peer = latest.get((preset, algo, "llmc"), {})

        def ppl(r, key):
            return f"{r[key]:.2f}" if r.get(key) is not None else (r.get("status", "-")[:60] or "-")

        check = "ok" if rec.get("vllm_ppl") and not rec.get("failures") else "; ".join(rec.get("failures") or [rec["status"]])[:80]
        greedy = f"{rec['greedy_agree']}" if rec.get("vllm_ppl") else "-"
        gap = f"{rec['gap']:+.2%}" if rec.get("vllm_ppl") else "-"
        print(f"| {preset} | {algo} | {ppl(rec, 'transformers_ppl')} | {ppl(rec, 'vllm_ppl')} | {gap} | {greedy} | "
              f"{ppl(peer, 'vllm_ppl') if peer else '-'} | {ppl(peer, 'transformers_ppl') if peer else '-'} | {check} |")
    return 0


GPU_CASES = [  # (preset, model, extra sq.ptq flags)
    ("NVFP4A16", "model", []), ("NVFP4", "model", []), ("MXFP4A16", "model", []), ("MXFP8", "model", []),
    ("W8A16", "model", []), ("FP8", "model", []), ("FP8", "model", ["--kv-cache", "fp8"]),
    ("FP8_BLOCK", "llama128", []), ("W4A16", "moe", []), ("FP8_DYNAMIC", "moe", []),
    # online rotation (transform_config), which vLLM's CPU build cannot apply
    ("W4A16", "model", ["--rotate", "r1,r2,r4", "--rotate-block", "64"]),
    # SmoothQuant's norms and columns (offline: an ordinary NVFP4 checkpoint with other weights)
    ("NVFP4", "model", ["--smooth", "0.8"]),
]


def cmd_gpu(args) -> int:
    """The presets the CPU engine cannot run, compared in the GPU's vLLM; one JSON line per case."""
    import torch

    from sq.calib.data import BUILTIN_PYDOC, eval_windows, load_tokenizer, read_corpus, tokenize_corpus
    from sq.engines.compare import PROMPT, Case, compare_all
    from sq.testing.checkpoints import build_llama, build_qwen3_moe

    out_root = Path(os.environ.get("OUT", WORK))
    work = out_root / "serving-gpu"
    work.mkdir(parents=True, exist_ok=True)
    models = {"model": Path(args.model),
              "llama128": build_llama(work / "llama128", dtype=torch.bfloat16, hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2),
              "moe": build_qwen3_moe(work / "moe", dtype=torch.bfloat16, hidden_size=256, moe_intermediate_size=128,
                                     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=64, num_hidden_layers=2)}
    groups: dict[str, list[tuple[str, Case]]] = {}
    for preset, model, extra in GPU_CASES:
        name = (f"{model}-{preset}{'-kv' if '--kv-cache' in extra else ''}{'-r4' if '--rotate' in extra else ''}"
                f"{'-smooth' if '--smooth' in extra else ''}")
        out = work / name
        if not (out / "config.json").is_file():
            group = ["--group-size", "64"] if preset in ("W8A16", "W4A16") else []
            code = _log([sys.executable, "-m", "sq.ptq", "--model", str(models[model]), "--output", str(out),
                         "--scheme", preset, "--algo", "rtn", "--nsamples", "16", "--seqlen", "256", *group, *extra],
                        work / f"{name}.log")
            if code:
                print(json.dumps({"case": name, "status": f"sq exited {code}"}), flush=True)
                continue
        groups.setdefault(model, []).append((name, Case(out, "auto")))
    with open(out_root / "serving_gpu.jsonl", "a") as f:
        for model, named in groups.items():  # one engine process per model: each scores its own tokenizer's ids
            tokenizer = load_tokenizer(models[model])
            tokens = tokenize_corpus(tokenizer, read_corpus(BUILTIN_PYDOC).text(tokenizer))
            windows = eval_windows(tokens, args.nwindows, 256)
            prompt = tokenizer(PROMPT)["input_ids"]
            results = compare_all([c for _, c in named], windows, prompt, python=args.engine_python, timeout=1200)
            for (name, _), result in zip(named, results):
                rec = {"case": name, "status": f"vLLM refused: {result}"} if isinstance(result, Exception) \
                    else {"case": name, "status": "compared", **result.record()}
                f.write(json.dumps(rec) + "\n")
                print(json.dumps({k: rec.get(k) for k in ("case", "status", "transformers_ppl", "vllm_ppl", "gap",
                                                           "greedy_agree", "schemes", "failures")}), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cmd", nargs="?", choices=["run", "table", "gpu"], default="run")
    p.add_argument("--matrix", default="W4A16:rtn,gptq,awq,signround;W4A16_ASYM:rtn,gptq,awq;W8A8:rtn,gptq;"
                                        "FP8_DYNAMIC:rtn,gptq")
    p.add_argument("--nsamples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--nwindows", type=int, default=20)
    p.add_argument("--no-peer", dest="peer", action="store_false")
    p.add_argument("--matrix-only", action="store_true", help="table: only the presets of --matrix")
    p.add_argument("--engine-python", default=None)
    p.add_argument("--llmc-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model"), p.add_argument("--out"), p.add_argument("--preset"), p.add_argument("--algo")
    p.add_argument("--windows")
    args = p.parse_args()
    if args.llmc_worker:
        return llmc_worker(args)
    return {"run": cmd_run, "table": cmd_table, "gpu": cmd_gpu}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
