"""Quantization benchmark (issue 4): quality and speed of sq.ptq on the standard benchmark.

    /work/venv/bin/python bench/ptq.py                       # every run, then the table
    /work/venv/bin/python bench/ptq.py --runs rtn_w2,eval_rtn_w2
    /work/venv/bin/python bench/ptq.py --table               # only print the table from results.jsonl

The standard benchmark (docs/benchmarks.md, DESIGN.md "Data and models available offline"):
model demo:smollm2 (SmolLM2-135M, bf16 checkpoint converted from the packaged GGUF), W4A16
symmetric, group 64; calibration = sq.ptq's defaults, ``--dataset builtin:pydoc --nsamples 128
--seqlen 512`` = tokens [0, 65536) as 128 windows of 512; evaluation = sq.eval's defaults
``--nwindows 40 --seqlen 512`` = the last 40 windows, tokens [92628, 113108), fp32 on CPU.

Runs (``--runs``, in this order by default; the quantizations first so their wall times are
measured before anything else shares the CPU):
  rtn_w2      torchrun 2 ranks, OMP_NUM_THREADS=1, --algo rtn
  gptq_w2     torchrun 2 ranks, OMP_NUM_THREADS=1, --algo gptq (static act-order, the default)
  gptq_w1     python -m sq.ptq (world 1), OMP_NUM_THREADS=1, --algo gptq  (speed-up reference)
  eval_fp     python -m sq.eval --model demo:smollm2
  eval_rtn_w2, eval_gptq_w2, eval_gptq_w1   python -m sq.eval --model OUTPUT
Opt-in: gptqoff_w2, eval_gptqoff_w2   the same with --actorder off (natural column order);
SignRound / GPTAQ rows (SIGNROUND, GPTAQ below).

Each run appends one JSON line to ``bench/_work/ptq/results.jsonl``: command, wall seconds
(subprocess start to exit), the report's own seconds, per-rank peak RSS, rank 0's per-block
seconds parsed from its log, perplexity, and the 1-minute load average before and after
(other jobs share this machine's 2 cores: compare ratios from the same session).
``--w1-limit S`` kills the 1-rank run after S seconds; the speed-up is then computed from the
per-block seconds of the blocks it finished (same blocks of the 2-rank run), and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / "_work" / "ptq"
PY = sys.executable
MODEL = "demo:smollm2"
QUANT = ["--scheme", "W4A16", "--group-size", "64", "--nsamples", "128", "--seqlen", "512"]
EVAL = ["--nwindows", "40", "--seqlen", "512"]
RUNS = ("rtn_w2", "gptq_w2", "gptq_w1", "eval_fp", "eval_rtn_w2", "eval_gptq_w2", "eval_gptq_w1")
# opt-in: GPTQ in natural column order (--actorder off; the driver's default before c1c0d7c);
# SignRound at 4 and 3 bits with RTN / GPTQ at 3 bits beside it (same calibration and evaluation)
SIGNROUND = ("sr4_w2", "rtn3_w2", "gptq3_w2", "sr3_w2", "eval_sr4_w2", "eval_rtn3_w2", "eval_gptq3_w2", "eval_sr3_w2")
# GPTAQ beside GPTQ at 4, 3 and 2 bits (its default, the paper's "later" fit, and a smaller weight)
GPTAQ = ("gptaq_w2", "gptaqlater_w2", "gptaq01_w2", "gptaqfull_w2", "gptqfull_w2", "gptaq3_w2", "gptq2_w2", "gptaq2_w2",
         "eval_gptaq_w2", "eval_gptaqlater_w2", "eval_gptaq01_w2", "eval_gptaqfull_w2", "eval_gptqfull_w2",
         "eval_gptaq3_w2", "eval_gptq2_w2", "eval_gptaq2_w2")
# --target-bits (issue 37): {W4A16 g64, W8A16 g64} at 4.5 and 5.0 stored bits per weight, GPTQ
SEARCH = ("tb45_w2", "tb50_w2", "eval_tb45_w2", "eval_tb50_w2", "w8_w2", "eval_w8_w2", "tbfp_w2", "eval_tbfp_w2",
          "tb45mse_w2", "eval_tb45mse_w2", "tb50mse_w2", "eval_tb50mse_w2")
# --rotate r1,r2[,r4] (issue 36): beside RTN / GPTQ / GPTAQ at 4, 3 and 2 bits, and the W4A4 float formats
ROTATE = ("rtnrot_w2", "gptqrot_w2", "gptaqrot_w2", "gptq3rot_w2", "gptq2rot_w2", "gptaq2rot_w2",
          "mxgptq_w2", "mxgptqrot_w2", "mxgptqrotb32_w2", "mxgptaqrotb32_w2", "nvgptqrot_w2", "nvgptqrotb16_w2",
          "nvgptaq_w2", "sr4rot_w2", "mxgptaqrot4b32_w2", "nvgptaqr4b16_w2", "nvgptaqserved_w2", "nvgptqserved_w2", "nvgptq_w2", "nvgptaq05served_w2", "nvgptaqrot4b16served_w2",
          "mxgptaqrot4b32served_w2", "nvgptaq015served_w2", "nvgptaqlaterserved_w2",
          "nvgptaqservedsm05_w2", "nvgptaqservedsm08_w2", "nvgptqservedsm08_w2")
ROTATE += tuple(f"eval_{r}" for r in ROTATE)
EXTRA = ("gptqoff_w2", "eval_gptqoff_w2", *SIGNROUND, *GPTAQ, *SEARCH, *ROTATE)
VARIANTS = {  # run prefix -> (algo, extra arguments)
    "gptqoff": ("gptq", ["--actorder", "off"]),
    "sr4": ("signround", ["--iters", "50"]),
    "sr3": ("signround", ["--iters", "50", "--scheme", "W3A16"]),
    "rtn3": ("rtn", ["--scheme", "W3A16"]),
    "gptq3": ("gptq", ["--scheme", "W3A16"]),
    "gptq2": ("gptq", ["--scheme", "W2A16"]),
    "gptaq": ("gptaq", []),
    "gptaqlater": ("gptaq", ["--gptaq-fit", "later"]),
    "gptaq01": ("gptaq", ["--gptaq-alpha", "0.1"]),
    "gptaqfull": ("gptaq", ["--int-grid", "full"]),
    "gptqfull": ("gptq", ["--int-grid", "full"]),
    "gptaq3": ("gptaq", ["--scheme", "W3A16"]),
    "gptaq2": ("gptaq", ["--scheme", "W2A16"]),
    "tb45": ("gptq", ["--target-bits", "4.5", "--candidates", "W4A16,W8A16"]),
    "tb50": ("gptq", ["--target-bits", "5.0", "--candidates", "W4A16,W8A16"]),
    "tb45mse": ("gptq", ["--target-bits", "4.5", "--candidates", "W4A16,W8A16", "--search-score", "mse"]),
    "tb50mse": ("gptq", ["--target-bits", "5.0", "--candidates", "W4A16,W8A16", "--search-score", "mse"]),
    "w8": ("gptq", ["--scheme", "W8A16"]),
    "tbfp": ("gptq", ["--target-bits", "5.5", "--candidates", "NVFP4A16,FP8_DYNAMIC"]),
    "rtnrot": ("rtn", ["--rotate", "r1,r2"]),
    "gptqrot": ("gptq", ["--rotate", "r1,r2"]),
    "gptaqrot": ("gptaq", ["--rotate", "r1,r2"]),
    "gptq3rot": ("gptq", ["--rotate", "r1,r2", "--scheme", "W3A16"]),
    "gptq2rot": ("gptq", ["--rotate", "r1,r2", "--scheme", "W2A16"]),
    "gptaq2rot": ("gptaq", ["--rotate", "r1,r2", "--scheme", "W2A16"]),
    "mxgptq": ("gptq", ["--scheme", "MXFP4"]),
    "mxgptqrot": ("gptq", ["--scheme", "MXFP4", "--rotate", "r1,r2"]),
    "mxgptqrotb32": ("gptq", ["--scheme", "MXFP4", "--rotate", "r1,r2", "--rotate-block", "32"]),
    "mxgptaqrotb32": ("gptaq", ["--scheme", "MXFP4", "--rotate", "r1,r2", "--rotate-block", "32"]),
    "nvgptqrot": ("gptq", ["--scheme", "NVFP4", "--rotate", "r1,r2"]),
    "nvgptqrotb16": ("gptq", ["--scheme", "NVFP4", "--rotate", "r1,r2", "--rotate-block", "16"]),
    "nvgptaq": ("gptaq", ["--scheme", "NVFP4"]),
    "mxgptaqrot4b32": ("gptaq", ["--scheme", "MXFP4", "--rotate", "r1,r2,r4", "--rotate-block", "32"]),
    "nvgptaqr4b16": ("gptaq", ["--scheme", "NVFP4", "--rotate", "r4", "--rotate-block", "16"]),
    "nvgptaqserved": ("gptaq", ["--scheme", "NVFP4", "--served-activations"]),
    "nvgptqserved": ("gptq", ["--scheme", "NVFP4", "--served-activations"]),
    "nvgptq": ("gptq", ["--scheme", "NVFP4"]),
    "nvgptaqrot4b16served": ("gptaq", ["--scheme", "NVFP4", "--rotate", "r1,r2,r4", "--rotate-block", "16",
                                       "--served-activations"]),
    "nvgptaq05served": ("gptaq", ["--scheme", "NVFP4", "--served-activations", "--gptaq-alpha", "0.5"]),
    "nvgptaq015served": ("gptaq", ["--scheme", "NVFP4", "--served-activations", "--gptaq-alpha", "0.15"]),
    "nvgptaqlaterserved": ("gptaq", ["--scheme", "NVFP4", "--served-activations", "--gptaq-fit", "later"]),
    "nvgptaqservedsm05": ("gptaq", ["--scheme", "NVFP4", "--served-activations", "--smooth", "0.5"]),
    "nvgptaqservedsm08": ("gptaq", ["--scheme", "NVFP4", "--served-activations", "--smooth", "0.8"]),
    "nvgptqservedsm08": ("gptq", ["--scheme", "NVFP4", "--served-activations", "--smooth", "0.8"]),
    "mxgptaqrot4b32served": ("gptaq", ["--scheme", "MXFP4", "--rotate", "r1,r2,r4", "--rotate-block", "32",
                                       "--served-activations"]),
    "sr4rot": ("signround", ["--iters", "50", "--rotate", "r1,r2"]),
}
PEERS = [  # measured on this benchmark (DESIGN.md), W4 symmetric group 64
    ("fp", "11.16", ""),
    ("plain RTN (absmax/7.5) = llm-compressor RTN", "16.03", ""),
    ("llm-compressor 0.14 GPTQ", "13.33", "491"),
    ("auto-round 0.16 opt-RTN", "13.42", "158"),
    ("auto-round 0.16 SignRound 50 iters", "11.64", "841"),
]
BLOCK_RE = re.compile(r"\[sq r0 [^\]]*\] block (\d+)/(\d+) done in ([\d.]+)s")
PPL_RE = re.compile(r"perplexity: ([\d.]+)")


def quant_cmd(run: str, out: Path) -> tuple[list[str], dict]:
    algo, world = run.split("_w")
    algo, extra = VARIANTS.get(algo, (algo, []))
    args = ["-m", "sq.ptq", "--model", MODEL, "--output", str(out), "--algo", algo, *QUANT, *extra]
    if int(world) == 1:
        cmd = [PY, *args]
    else:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
    return cmd, {"OMP_NUM_THREADS": "1"}


def eval_cmd(run: str) -> tuple[list[str], dict]:
    target = run.removeprefix("eval_")
    model = MODEL if target == "fp" else str(WORK / target)
    return [PY, "-m", "sq.eval", "--model", model, *EVAL], {}


def shell(cmd: list[str], env: dict) -> str:
    """The command as one could paste it (repo root, venv python)."""
    pre = " ".join(f"{k}={v}" for k, v in env.items())
    return (pre + " " if pre else "") + " ".join(["python" if c == PY else c for c in cmd])


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def execute(cmd: list[str], env: dict, log: Path, limit: float | None) -> tuple[int, float, bool, float]:
    """Run ``cmd`` (own session, output to ``log``); kill its process group past ``limit``.

    Returns (rc, wall s, killed, CPU s of every descendant that was waited for: torchrun waits
    for its ranks, so their CPU time counts; a killed run's ranks are not counted).
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env,
                                cwd=HERE.parent, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            killed = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            killed = True
    return rc, time.perf_counter() - t0, killed, _children_cpu() - cpu0


def do_run(run: str, w1_limit: float | None) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    log = WORK / f"{run}.log"
    rec: dict = {"run": run}
    if run.startswith("eval_"):
        cmd, env = eval_cmd(run)
        limit = None
    else:
        out = WORK / run
        shutil.rmtree(out, ignore_errors=True)
        cmd, env = quant_cmd(run, out)
        limit = w1_limit if run.endswith("_w1") else None
    rec["command"] = shell(cmd, env)
    rec["load_before"] = os.getloadavg()[0]
    print(f"[bench] {run}: {rec['command']}", flush=True)
    rc, wall, killed, cpu = execute(cmd, env, log, limit)
    rec.update(rc=rc, wall_s=round(wall, 1), cpu_s=round(cpu, 1), killed=killed, load_after=os.getloadavg()[0])
    text = log.read_text(errors="replace")
    if run.startswith("eval_"):
        m = PPL_RE.search(text)
        rec["ppl"] = float(m.group(1)) if m else None
    else:
        rec["block_s"] = [float(s) for _, _, s in BLOCK_RE.findall(text)]
        report = WORK / run / "sq_report.json"
        if rc == 0 and report.is_file():
            r = json.loads(report.read_text())
            rec["report_s"] = r["seconds"]
            rec["peak_rss_mib"] = [round(x["peak_rss_bytes"] / 2**20) for x in r["ranks"]]
            rec["block_s"] = [b["seconds"] for b in r["ranks"][0]["blocks"]]
            errs = [(v["rel_err"], v.get("rtn_rel_err")) for v in r["layers"].values()]
            rec["mean_rel_err"] = sum(e for e, _ in errs) / len(errs)
            if errs and errs[0][1] is not None:
                rec["mean_rtn_rel_err"] = sum(e for _, e in errs) / len(errs)
            if r.get("signround"):  # per block: best loss / starting (RTN) loss
                ratios = [t["loss_best"] / t["loss_first"] for t in r["signround"].values() if t["loss_first"]]
                rec["signround_loss_ratio"] = [round(x, 3) for x in ratios]
    if rc != 0 and not killed:
        print(text[-3000:], file=sys.stderr)
    print(f"[bench] {run}: rc={rc} wall={wall:.1f}s cpu={cpu:.1f}s killed={killed} "
          f"{ {k: rec[k] for k in ('ppl', 'report_s', 'peak_rss_mib') if k in rec} }", flush=True)
    with open(WORK / "results.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def latest() -> dict[str, dict]:
    recs = {}
    path = WORK / "results.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            recs[r["run"]] = r
    return recs


def table(recs: dict[str, dict]) -> str:
    fp = recs.get("eval_fp", {}).get("ppl")
    lines = ["| run | ranks x threads | quantize wall s | CPU s, all ranks | report s | peak RSS / rank MiB "
             "| perplexity | x fp |", "|---|---|---|---|---|---|---|---|"]
    if fp:
        lines.append(f"| fp (demo:smollm2, bf16 weights, fp32 eval) | - | - | - | - | - | {fp:.2f} | 1.00 |")
    for run, label in (("rtn_w2", "sq RTN"), ("gptq_w2", "sq GPTQ"), ("gptq_w1", "sq GPTQ"),
                       ("gptqoff_w2", "sq GPTQ --actorder off"), ("sr4_w2", "sq SignRound 50 iters"),
                       ("rtn3_w2", "sq RTN W3"), ("gptq3_w2", "sq GPTQ W3"), ("sr3_w2", "sq SignRound 50 iters W3"),
                       ("gptaq_w2", "sq GPTAQ"), ("gptaqlater_w2", "sq GPTAQ --gptaq-fit later"),
                       ("gptaq01_w2", "sq GPTAQ --gptaq-alpha 0.1"), ("gptqfull_w2", "sq GPTQ --int-grid full"),
                       ("gptaqfull_w2", "sq GPTAQ --int-grid full"), ("gptaq3_w2", "sq GPTAQ W3"),
                       ("gptq2_w2", "sq GPTQ W2"), ("gptaq2_w2", "sq GPTAQ W2"),
                       ("w8_w2", "sq GPTQ W8A16 g64"), ("tb45_w2", "sq GPTQ --target-bits 4.5 (W4A16, W8A16)"),
                       ("tb50_w2", "sq GPTQ --target-bits 5.0 (W4A16, W8A16)"),
                       ("tbfp_w2", "sq GPTQ --target-bits 5.5 (NVFP4A16, FP8_DYNAMIC)"),
                       *((r, f"sq {VARIANTS[r.split('_w')[0]][0].upper()} {' '.join(VARIANTS[r.split('_w')[0]][1])}")
                         for r in ROTATE if not r.startswith("eval_"))):
        q = recs.get(run)
        if not q:
            continue
        ppl = recs.get(f"eval_{run}", {}).get("ppl")
        ranks = run[-1]  # world size: the run name ends in _w1 or _w2
        wall = f"{q['wall_s']:.0f}" + (" (killed)" if q.get("killed") else "")
        rss = ", ".join(str(x) for x in q.get("peak_rss_mib", [])) or "-"
        head = f"| {label} | {ranks} x 1 | {wall} | {q.get('cpu_s', '-')} | {q.get('report_s', '-')} | {rss} |"
        lines.append(head + (f" {ppl:.2f} | {ppl / fp:.2f} |" if ppl and fp else " - | - |"))
    notes = []
    w1, w2 = recs.get("gptq_w1"), recs.get("gptq_w2")
    if w1 and w2:
        if not w1.get("killed") and w1.get("rc") == 0:
            notes.append(f"GPTQ speed-up 2 ranks vs 1 (wall): {w1['wall_s'] / w2['wall_s']:.2f}x; "
                         f"CPU s 2 ranks / 1 rank: {w2['cpu_s'] / w1['cpu_s']:.2f} (1.00 = no extra work)")
        n = min(len(w1.get("block_s", [])), len(w2.get("block_s", [])))
        if n:
            s1, s2 = sum(w1["block_s"][:n]), sum(w2["block_s"][:n])
            notes.append(f"GPTQ speed-up 2 ranks vs 1 over blocks 0..{n - 1} (per-block seconds): {s1 / s2:.2f}x "
                         f"({s1:.0f} s vs {s2:.0f} s)")
    for run in ("gptq_w2", "gptq_w1"):
        r = recs.get(run, {})
        if "mean_rtn_rel_err" in r:
            notes.append(f"{run}: mean per-layer output rel. error GPTQ {r['mean_rel_err']:.4f} vs RTN "
                         f"{r['mean_rtn_rel_err']:.4f} on the same Hessians")
    for run in ("sr4_w2", "sr3_w2"):
        ratios = recs.get(run, {}).get("signround_loss_ratio")
        if ratios:
            notes.append(f"{run}: block loss best / start (RTN) min {min(ratios):.2f}, median "
                         f"{sorted(ratios)[len(ratios) // 2]:.2f}, max {max(ratios):.2f} over {len(ratios)} blocks")
    for r in recs.values():
        notes.append(f"{r['run']}: load average {r['load_before']:.1f} -> {r['load_after']:.1f}, rc {r['rc']}")
    peers = ["", "| peer (DESIGN.md) | perplexity | seconds |", "|---|---|---|"]
    peers += [f"| {a} | {b} | {c or '-'} |" for a, b, c in PEERS]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes] + peers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS + EXTRA)}")
    p.add_argument("--w1-limit", type=float, default=None, help="kill the 1-rank GPTQ run after S seconds")
    p.add_argument("--table", action="store_true", help="only print the table of the recorded results")
    a = p.parse_args()
    if not a.table:
        from sq.resolve import resolve_model

        print(f"[bench] model {MODEL} -> {resolve_model(MODEL)}", flush=True)  # build once, outside the timings
        for run in a.runs.split(","):
            if run not in RUNS + EXTRA:
                p.error(f"unknown run {run!r}")
            do_run(run, a.w1_limit)
    print(table(latest()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
