"""Issue 17 driver: llm-compressor references per preset, sq vs reference, perplexity of the references.

Runs in sq's venv (it only starts subprocesses; llm-compressor runs in bench/_work/venv-llmc):

    .venv/bin/python bench/peers/presets.py ref  [--models smollm2,llama] [--presets W4A16,NVFP4,...] [--nsamples 128]
    .venv/bin/python bench/peers/presets.py sq   [--models ...] [--presets ...] [--sq-src DIR]
    .venv/bin/python bench/peers/presets.py eval [--models smollm2] [--presets ...] [--sq-src DIR]
    .venv/bin/python bench/peers/presets.py table

- Models: ``smollm2`` = demo:smollm2 (bf16 SmolLM2-135M, resolved by sq.resolve.resolve_model),
  ``llama`` = the tiny Llama fixture of sq.testing.checkpoints (fp32), built under bench/_work/fixtures.
- ``ref``: bench/peers/llmc_rtn.py in venv-llmc -> bench/_work/ref/<model>-<PRESET> (kept; an existing
  complete output is skipped unless --force). Int group presets use --group-size 64 (576 % 128 != 0).
- ``sq``: ``python -m sq.ptq --scheme P --algo rtn --group-size 64`` (one process) ->
  bench/_work/sq/<model>-<PRESET> (with the reference's ``--nsamples/--seqlen`` when it calibrated),
  then bench/peers/compare.py sq-vs-reference. Static activation scales (``input_scale``,
  ``input_global_scale``: maxima over each tool's own calibration forward) pass within ``--rtol``
  (relative; every other tensor must be bit-equal) and the record says how many were bit-equal. A preset sq's
  --scheme refuses (unknown, or "not observed yet") is recorded as "refused by sq". ``--sq-src DIR`` puts DIR first on PYTHONPATH (e.g. a
  ``git archive HEAD src`` snapshot while the working tree is mid-edit); default: sq as installed.
- ``eval``: ``python -m sq.eval --model REF_DIR`` (fp32, last 40 windows of 512 of pydoc) on each
  reference; the load error's last line where transformers cannot load it. ``--dtype bfloat16``:
  bench/peers/eval_dtype.py instead (same windows and scoring, model loaded in bf16; NVFP4 / MXFP*
  outputs load only so). Preset ``FP``: the unquantized source model.
- ``gptq``: ``OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m sq.ptq --scheme P --algo gptq --group-size 64
  --nsamples 128 --seqlen 512`` (the standard benchmark's calibration) -> bench/_work/sq-gptq/<model>-<PRESET>;
  a preset sq's GPTQ refuses (exit 2) is recorded as "refused".
- ``ppl``: bench/peers/eval_preset.py (sq.eval's windows and scoring, forward in fp32 for every preset,
  the library's activation fake quantization on; FP8_BLOCK weights only, see there) on sq RTN
  (bench/_work/sq), sq GPTQ (bench/_work/sq-gptq), llm-compressor RTN (bench/_work/ref) and, preset
  ``FP``, the source model. ``ppltable`` prints the per-preset perplexity table.
- Every step appends one JSON line to bench/_work/ref/results.jsonl; ``table`` prints the latest
  record per (step, model, preset) as markdown.
Runs are sequential (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
WORK = BENCH / "_work"
REF = WORK / "ref"
SQOUT = WORK / "sq"
SQGPTQ = WORK / "sq-gptq"
LOGS = REF / "logs"
RESULTS = REF / "results.jsonl"
LLMC_PY = WORK / "venv-llmc" / "bin" / "python"
SQ_PY = Path(sys.executable)
GROUP_SIZE = 64

PRESETS = ["W4A16", "W4A16_ASYM", "W3A16", "W2A16", "W8A16", "FP8_DYNAMIC", "FP8_BLOCK", "FP8", "NVFP4A16",
           "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8", "W8A8", "W4AFP8", "W4A8"]
MODELS = ["smollm2", "llama"]


def model_dir(name: str) -> Path:
    code = {
        "smollm2": "from sq.resolve import resolve_model; print(resolve_model('demo:smollm2'))",
        "llama": f"from sq.testing.checkpoints import CheckpointFactory; from pathlib import Path; "
                 f"print(CheckpointFactory(Path({str(WORK / 'fixtures')!r}))['llama'])",
    }[name]
    out = subprocess.run([str(SQ_PY), "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    return Path(out.stdout.strip().splitlines()[-1]).resolve()


def record(rec: dict) -> None:
    REF.mkdir(parents=True, exist_ok=True)
    rec["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with RESULTS.open("a") as f:
        f.write(json.dumps(rec) + "\n")


LAST: dict = {}  # run_logged's CPU seconds (user + sys of the finished child processes) of the last command


def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, float, str]:
    """(exit code, wall seconds, last meaningful stderr/stdout line)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    wall = time.perf_counter() - t
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST["cpu_s"] = round((ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime), 1)
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    last = ""
    if rc != 0:  # the exception line: the last line that looks like "SomeError: ..." or "sq: error: ..."
        errs = [ln for ln in lines if re.match(r"^(\[rank\d+\]:\s*)?([\w.]+(Error|Exception)\b|sq: error:)", ln)]
        last = (errs or lines or [""])[-1]
    return rc, wall, last[:500]


def sq_env(sq_src: str | None) -> dict:
    env = dict(os.environ)
    if sq_src:
        env["PYTHONPATH"] = str(Path(sq_src).resolve()) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def cmd_ref(args) -> int:
    if not LLMC_PY.exists():
        sys.exit(f"presets: {LLMC_PY} missing; run bench/peers/setup_llmc.sh first")
    bad = 0
    for m in args.models:
        src = model_dir(m)
        for p in args.presets:
            out = REF / f"{m}-{p}"
            if (out / "llmc_run.json").exists() and not args.force:
                print(f"ref {m} {p}: exists, skipped")
                continue
            if out.exists():
                subprocess.run(["rm", "-rf", str(out)], check=True)
            cmd = [str(LLMC_PY), str(BENCH / "peers" / "llmc_rtn.py"), str(src), str(out), p,
                   "--group-size", str(GROUP_SIZE), "--nsamples", str(args.nsamples)]
            rc, wall, err = run_logged(cmd, LOGS / f"ref-{m}-{p}.log")
            rec = {"step": "ref", "model": m, "preset": p, "rc": rc, "wall_s": round(wall, 1), "out": str(out)}
            if rc == 0:
                run = json.loads((out / "llmc_run.json").read_text())
                rec.update({k: run[k] for k in run if k.endswith("_s")})
                rec["calibration"] = run["calibration"]
                rec["size_bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            else:
                rec["error"] = err
                bad += 1
            record(rec)
            print(f"ref {m} {p}: rc={rc} wall={wall:.1f}s {rec.get('oneshot_s', '')} {err}")
    return 1 if bad else 0


CALIBRATED_KINDS = {"input_scale", "input_global_scale", "input_zero_point", "output_scale", "k_scale", "v_scale"}


def calibrated_rel_diffs(a_dir: Path, b_dir: Path, names: list[str]) -> dict[str, float]:
    """max |a - b| / |b| per tensor (float64) for the named tensors of two checkpoints."""
    from safetensors import safe_open

    def load(d: Path) -> dict:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    if k in wanted:
                        out[k] = h.get_tensor(k).double()
        return out

    wanted = set(names)
    ta, tb = load(a_dir), load(b_dir)
    return {n: float(((ta[n] - tb[n]).abs() / tb[n].abs().clamp_min(1e-30)).max()) for n in names if n in ta and n in tb}


def cmd_sq(args) -> int:
    bad = 0
    env = sq_env(args.sq_src)
    for m in args.models:
        src = model_dir(m)
        for p in args.presets:
            ref = REF / f"{m}-{p}"
            out = SQOUT / f"{m}-{p}"
            if out.exists():
                subprocess.run(["rm", "-rf", str(out)], check=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [str(SQ_PY), "-m", "sq.ptq", "--model", str(src), "--output", str(out), "--scheme", p,
                   "--algo", "rtn", "--group-size", str(GROUP_SIZE)]
            calib = (json.loads((ref / "llmc_run.json").read_text())["calibration"]
                     if (ref / "llmc_run.json").exists() else None)
            if calib:  # static activation scales: the same calibration windows as the reference
                cmd += ["--nsamples", str(calib["nsamples"]), "--seqlen", str(calib["seqlen"])]
            rc, wall, err = run_logged(cmd, LOGS / f"sq-{m}-{p}.log", env)
            rec = {"step": "sq", "model": m, "preset": p, "rc": rc, "wall_s": round(wall, 1), "sq_src": args.sq_src}
            if rc != 0:
                refused = rc == 2 and (("invalid choice" in err and "--scheme" in err) or f"scheme {p} " in err)
                rec["result"] = "refused by sq" if refused else "sq failed"
                rec["error"] = err
                if rec["result"] == "sq failed":
                    bad += 1
            elif not (ref / "llmc_run.json").exists():
                rec["result"] = "no reference"
                bad += 1
            else:
                cj = LOGS / f"compare-{m}-{p}.json"
                c = subprocess.run([str(SQ_PY), str(BENCH / "peers" / "compare.py"), str(out), str(ref),
                                    "--json", str(cj)], capture_output=True, text=True, cwd=ROOT)
                (LOGS / f"compare-{m}-{p}.txt").write_text(c.stdout + c.stderr)
                res = json.loads(cj.read_text())
                rows = res["tensors"]
                diff = [r for r in rows if "problem" in r]
                # Static activation scales come from data pushed through each tool's own quantized chain:
                # compared with a relative tolerance (--rtol), every other tensor bit for bit.
                cal = [r for r in rows if r["kind"] in CALIBRATED_KINDS]
                if cal:
                    rels = calibrated_rel_diffs(out, ref, [r["name"] for r in cal])
                    worst = max(rels.items(), key=lambda kv: kv[1])
                    within = [n for n, v in rels.items() if v <= args.rtol]
                    rec.update(calibrated_tensors=len(cal), calibrated_max_rel=worst[1], calibrated_worst=worst[0],
                               calibrated_within_rtol=len(within), rtol=args.rtol,
                               calibrated_bit_equal=sum(1 for r in cal if "problem" not in r))
                    diff = [r for r in diff if not (r["kind"] in CALIBRATED_KINDS and r["name"] in within)]
                material = [d for d in res["config_diff"] if not d["default"]]
                rec.update(compare_status=c.returncode, tensors=len(rows), tensors_differing=len(diff),
                           config_keys_differing=len(res["config_diff"]),
                           config_material=[f"{d['key']}: {d['a']!r} vs {d['b']!r}" for d in material],
                           differing=[f"{r['name']} ({r['problem']})" for r in diff[:10]])
                rec["result"] = "identical tensors" if not diff else f"{len(diff)}/{len(rows)} tensors differ"
                if cal and not diff:
                    rec["result"] = (f"weights identical; {rec['calibrated_bit_equal']}/{len(cal)} activation scales "
                                     f"bit-equal, all within rtol {args.rtol:g} (max rel {rec['calibrated_max_rel']:.2e})")
                if diff:
                    bad += 1
            record(rec)
            print(f"sq {m} {p}: {rec['result']} (sq {wall:.1f}s){' ' + err if err else ''}")
    return 1 if bad else 0


def cmd_eval(args) -> int:
    env = sq_env(args.sq_src)
    step = "eval" if args.dtype == "float32" else f"eval_{args.dtype}"
    for m in args.models:
        for p in args.presets:
            ref = model_dir(m) if p == "FP" else REF / f"{m}-{p}"  # FP: the unquantized source
            if p != "FP" and not (ref / "llmc_run.json").exists():
                print(f"eval {m} {p}: no reference output, skipped")
                continue
            if args.dtype == "float32":
                cmd = [str(SQ_PY), "-m", "sq.eval", "--model", str(ref)]
            else:
                cmd = [str(SQ_PY), str(BENCH / "peers" / "eval_dtype.py"), "--model", str(ref), "--dtype", args.dtype]
            log = LOGS / f"{step}-{m}-{p}.log"
            rc, wall, err = run_logged(cmd, log, env)
            text = log.read_text(errors="replace")
            mm = re.search(r"^perplexity: ([\d.]+)", text, re.M)
            rec = {"step": step, "model": m, "preset": p, "rc": rc, "wall_s": round(wall, 1),
                   "ppl": float(mm.group(1)) if mm else None, "sq_src": args.sq_src}
            if rc != 0 or not mm:
                rec["error"] = err
            record(rec)
            print(f"eval {m} {p}: {rec['ppl'] if mm else 'ERROR ' + err} ({wall:.1f}s)")
    return 0


def cmd_gptq(args) -> int:
    env = sq_env(args.sq_src)
    env["OMP_NUM_THREADS"] = "1"
    bad = 0
    for m in args.models:
        src = model_dir(m)
        for p in args.presets:
            out = SQGPTQ / f"{m}-{p}"
            if out.exists():
                subprocess.run(["rm", "-rf", str(out)], check=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            launch = ([str(SQ_PY), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
                      if args.nproc > 1 else [str(SQ_PY)])
            cmd = launch + ["-m", "sq.ptq", "--model", str(src), "--output", str(out), "--scheme", p, "--algo", "gptq",
                            "--group-size", str(GROUP_SIZE), "--nsamples", str(args.nsamples), "--seqlen", "512"]
            rc, wall, err = run_logged(cmd, LOGS / f"gptq-{m}-{p}.log", env)
            rec = {"step": "gptq", "model": m, "preset": p, "rc": rc, "wall_s": round(wall, 1), "sq_src": args.sq_src,
                   "nproc": args.nproc, "nsamples": args.nsamples, "cmd": " ".join(cmd), "cpu_s": LAST.get("cpu_s")}
            if rc != 0:
                rec["result"] = "refused" if rc == 2 else "failed"
                rec["error"] = err
                bad += rc != 2
            else:
                rec["result"] = "ok"
            record(rec)
            print(f"gptq {m} {p}: {rec['result']} ({wall:.1f}s){' ' + err if err else ''}")
    return 1 if bad else 0


def cmd_ppl(args) -> int:
    env = sq_env(args.sq_src)
    for m in args.models:
        for p in args.presets:
            for which in (["fp"] if p == "FP" else args.which):
                d = {"fp": model_dir(m) if p == "FP" else None, "rtn": SQOUT / f"{m}-{p}",
                     "gptq": SQGPTQ / f"{m}-{p}", "llmc": REF / f"{m}-{p}"}[which]
                if not (d / "config.json").exists():
                    print(f"ppl {m} {p} {which}: no output at {d}, skipped")
                    continue
                cmd = [str(SQ_PY), str(BENCH / "peers" / "eval_preset.py"), "--model", str(d)]
                if p == "FP8_BLOCK":  # the library's per-token-group activation QDQ needs in % 128 == 0 (576)
                    cmd.append("--weights-only")
                log = LOGS / f"ppl-{which}-{m}-{p}.log"
                rc, wall, err = run_logged(cmd, log, env)
                text = log.read_text(errors="replace")
                mm = re.search(r"^perplexity: ([\d.]+)", text, re.M)
                info = [ln for ln in text.splitlines() if ln.startswith("{")]
                rec = {"step": f"ppl_{which}", "model": m, "preset": p, "rc": rc, "wall_s": round(wall, 1),
                       "ppl": float(mm.group(1)) if mm else None, "sq_src": args.sq_src, "cmd": " ".join(cmd),
                       "cpu_s": LAST.get("cpu_s"),
                       **({"info": json.loads(info[-1])} if info else {})}
                if rc != 0 or not mm:
                    rec["error"] = err
                record(rec)
                print(f"ppl {m} {p} {which}: {rec['ppl'] if mm else 'ERROR ' + err} ({wall:.1f}s)")
    return 0


def cmd_ppltable(args) -> int:
    recs = latest()
    for m in args.models:
        print(f"\n### {m}\n")
        print("| preset | sq RTN | sq GPTQ | llm-compressor RTN | activations in the eval |")
        print("|---|---:|---:|---:|---|")
        for p in ["FP"] + args.presets:
            cells = []
            for which in (("fp", "fp", "fp") if p == "FP" else ("rtn", "gptq", "llmc")):
                r = recs.get((f"ppl_{which}", m, p))
                g = recs.get(("gptq", m, p)) if which == "gptq" else None
                if g and g.get("result") == "refused":
                    cells.append("refused")
                elif r and r.get("ppl"):
                    cells.append(f"{r['ppl']:.2f}")
                elif r:
                    cells.append("eval error")
                else:
                    cells.append("-")
            info = next((recs[(f"ppl_{w}", m, p)].get("info") for w in ("rtn", "llmc", "gptq", "fp")
                         if recs.get((f"ppl_{w}", m, p), {}).get("info")), None)
            act = "-" if not info else ("weights only" if info["weights_only"] else
                                        ("fake-quantized" if info["activation_fake_quant"] else "none (A16)"))
            print(f"| {p} | {' | '.join(cells[:1] if p == 'FP' else cells)} | {act} |" if p != "FP"
                  else f"| FP (bf16 source) | {cells[0]} | - | - | - |")
    return 0


def latest() -> dict:
    out = {}
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            r = json.loads(line)
            out[(r["step"], r["model"], r["preset"])] = r
    return out


def cmd_table(args) -> int:
    recs = latest()
    for m in args.models:
        print(f"\n### {m}\n")
        print("| preset | llmc wall (s) | oneshot (s) | size (MB) | ppl (sq.eval, fp32) | ppl (bf16 load) | sq vs llmc (RTN, g64) |")
        print("|---|---:|---:|---:|---|---:|---|")
        for p in args.presets:
            ref, ev, sq, eb = (recs.get((s, m, p)) for s in ("ref", "eval", "sq", "eval_bfloat16"))
            if not (ref or ev or sq or eb):
                continue
            wall = f"{ref['wall_s']:.0f}" if ref and ref["rc"] == 0 else ("failed: " + ref.get("error", "") if ref else "-")
            one = f"{ref['oneshot_s']:.1f}" if ref and ref["rc"] == 0 else "-"
            size = f"{ref['size_bytes'] / 1e6:.1f}" if ref and ref.get("size_bytes") else "-"
            ppl = (f"{ev['ppl']:.2f}" if ev and ev.get("ppl") else (f"load error: {ev.get('error', '')}" if ev else "-"))
            bf = f"{eb['ppl']:.2f}" if eb and eb.get("ppl") else (f"error: {eb.get('error', '')}" if eb else "-")
            if sq is None:
                cmp = "-"
            elif sq["result"] in ("identical tensors",) or "differ" in sq["result"]:
                cmp = sq["result"] + (f"; config: {'; '.join(sq['config_material'])}" if sq.get("config_material") else "")
            else:
                cmp = sq["result"]
            print(f"| {p} | {wall} | {one} | {size} | {ppl} | {bf} | {cmp} |")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["ref", "sq", "eval", "table", "gptq", "ppl", "ppltable"])
    p.add_argument("--models", default=",".join(MODELS), type=lambda s: s.split(","))
    p.add_argument("--presets", default=",".join(PRESETS), type=lambda s: [x.upper() for x in s.split(",")])
    p.add_argument("--nsamples", type=int, default=128, help="(ref) calibration windows of 512 for FP8 / NVFP4")
    p.add_argument("--force", action="store_true", help="(ref) redo existing reference outputs")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="(eval) float32: python -m sq.eval; bfloat16: bench/peers/eval_dtype.py (model loaded in bf16)")
    p.add_argument("--which", default="rtn,gptq,llmc", type=lambda s: s.split(","),
                   help="(ppl) outputs to score: rtn (sq), gptq (sq), llmc (llm-compressor RTN)")
    p.add_argument("--rtol", type=float, default=0.01,
                   help="(sq) relative tolerance for calibrated activation scales (input_scale, input_global_scale)")
    p.add_argument("--nproc", type=int, default=2, help="(gptq) ranks, one torch thread each")
    p.add_argument("--sq-src", default=None, help="(sq, eval) directory put first on PYTHONPATH for sq")
    args = p.parse_args()
    return {"ref": cmd_ref, "sq": cmd_sq, "eval": cmd_eval, "table": cmd_table, "gptq": cmd_gptq, "ppl": cmd_ppl,
            "ppltable": cmd_ppltable}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
