"""Real widths: one rank's share of a DeepSeek-V3 / Kimi-K2 / Qwen3-235B layer, measured beside its plan.

    .venv/bin/python bench/realwidth.py solve [--models DeepSeek-V3,...]   # each Linear's solve at its real shape
    .venv/bin/python bench/realwidth.py jobs [--jobs dsv3-16-ep2,...]     # one-layer jobs: plan vs measured
    .venv/bin/python bench/realwidth.py table                             # markdown of every finished job

``solve``: one process, one thread: a float32 Hessian of each distinct input width of the model's MoE layer
(``sq.testing.realwidth``'s shapes; inputs of rank 512 plus noise, like an attention output), prepared
(``GPTQ._prepare``: permuted copy, inverse factor) and swept over the Linear's rows, W4A16 g128 with act-order:
seconds and peak RSS growth of each.  ``jobs``: synthetic one-layer checkpoints at the real widths in the Hub's
layout (FP8 128 x 128 blocks where the model ships so; ``bench/_work/realwidth/``, built once), each quantized
by ``torchrun --nproc-per-node 2 -m sq.ptq`` (GPTQ W4A16 g128, 16 x 512 calibration, ``OMP_NUM_THREADS=1``)
after ``sq.plan`` predicted it: the plan's per-rank peak and time against the report's measured ones.  Results go
to ``bench/_work/realwidth/results.jsonl``; ``docs/benchmarks.md`` ("Real widths") keeps the table.
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
WORK = ROOT / "bench" / "_work" / "realwidth"
RESULTS = WORK / "results.jsonl"
CALIB = ["--nsamples", "16", "--seqlen", "512"]
# name: (model, experts, ranks, --ep, more sq.ptq flags)
JOBS = {
    "dsv3-16-ep2": ("DeepSeek-V3", 16, 2, 2, []),
    "dsv3-64-ep2": ("DeepSeek-V3", 64, 2, 2, []),
    "qwen3-235b-16-ep2": ("Qwen3-235B-A22B", 16, 2, 2, []),
    "kimi-k2-16-ep2": ("Kimi-K2", 16, 2, 2, []),
}


def _ckpt(model: str, experts: int) -> Path:
    from sq.testing.realwidth import build_real_width

    path = WORK / f"{model}-{experts}"
    if not (path / "config.json").exists():
        build_real_width(path, model, layers=1, experts=experts)
    return path


def _argv(model: str, experts: int, ep: int, out: Path, extra: list[str]) -> list[str]:
    return ["--model", str(_ckpt(model, experts)), "--output", str(out), "--scheme", "W4A16", "--algo", "gptq",
            "--group-size", "128", *CALIB, "--ep", str(ep), *extra]


def jobs(names: list[str]) -> None:
    bin_ = Path(sys.executable).parent
    for name in names:
        model, experts, ranks, ep, extra = JOBS[name]
        out = WORK / "out" / name
        argv = _argv(model, experts, ep, out, extra)
        plan = subprocess.run([str(bin_ / "python"), "-m", "sq.plan", *argv, "--nproc-per-node", str(ranks), "--json"],
                              capture_output=True, text=True, cwd=ROOT)
        row = {"job": name, "model": model, "experts": experts, "ranks": ranks, "ep": ep, "extra": extra}
        try:
            p = json.loads(plan.stdout)
        except json.JSONDecodeError:
            row["plan_error"] = (plan.stdout + plan.stderr)[-2000:]
            p = None
        if p is not None:
            m = p["memory"]
            row.update(plan_peak=m["predicted_peak_rank0_bytes"], plan_parts={k: m.get(k) for k in (
                "base", "root", "block", "chain", "activations", "algorithm", "heap", "phase")},
                plan_seconds=p["time"]["predicted_seconds"], plan_fits=m["need_bytes"] <= m["available_bytes"],
                plan_collective_bytes=p["time"]["collective_bytes_per_block"])
        if p is not None and row["plan_fits"]:
            t = time.perf_counter()
            with open(WORK / f"{name}.log", "w") as log:
                rc = subprocess.call([str(bin_ / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), "-m",
                                      "sq.ptq", *argv, "--resume", "never"], stdout=log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
            row.update(rc=rc, wall=time.perf_counter() - t)
            if rc == 0:
                r = json.loads((out / "sq_report.json").read_text())
                row.update(peaks=[x["peak_rss_bytes"] for x in sorted(r["ranks"], key=lambda x: x["rank"])],
                           predicted=[x["predicted_peak_bytes"] for x in sorted(r["ranks"], key=lambda x: x["rank"])],
                           seconds=r["seconds"], job_predicted_seconds=r["time"]["predicted_seconds"],
                           experts_rtn=r.get("experts", {}).get("rtn"))
        print(json.dumps(row), flush=True)
        with open(RESULTS, "a") as f:
            f.write(json.dumps(row) + "\n")


def solve(models: list[str]) -> None:
    import torch

    from sq.formats.schemes import get_scheme
    from sq.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    from sq.quant.gptq import GPTQ, GPTQConfig
    from sq.testing.realwidth import real_config

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for name in models:
        _, c = real_config(name, layers=1)
        h = c["hidden_size"]
        if "q_lora_rank" in c:  # MLA
            heads, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            shapes = {"q_a_proj": (h, c["q_lora_rank"]), "q_b_proj": (c["q_lora_rank"], heads * (nope + rope)),
                      "kv_a_proj_with_mqa": (h, c["kv_lora_rank"] + rope),
                      "kv_b_proj": (c["kv_lora_rank"], heads * (nope + vd)), "o_proj": (heads * vd, h)}
        else:
            hd, heads, kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
            shapes = {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd),
                      "o_proj": (heads * hd, h)}
        i = c["moe_intermediate_size"]
        shapes.update({"expert gate_proj": (h, i), "expert down_proj": (i, h)})
        for lin, (n_in, n_out) in shapes.items():
            x = (torch.randn(8192, min(512, n_in), generator=gen) @ torch.randn(min(512, n_in), n_in, generator=gen)
                 + 0.1 * torch.randn(8192, n_in, generator=gen)).to(torch.bfloat16)
            g = GPTQ(n_in)
            g.add_batch(x[None])
            del x
            w = (torch.randn(n_out, n_in, generator=gen) / n_in**0.5).to(torch.bfloat16)
            _ = g.H
            reset_peak_rss()
            base = rss_bytes()
            t = time.perf_counter()
            g._prepare(GPTQConfig(actorder=True), torch.device("cpu"), lin)
            t_prep = time.perf_counter() - t
            t = time.perf_counter()
            g.quantize(w, get_scheme("W4A16", 128), actorder=True)
            t_sweep = time.perf_counter() - t
            row = {"solve": name, "linear": lin, "in": n_in, "out": n_out, "dtype": str(g.H.dtype),
                   "prepare_s": round(t_prep, 2), "sweep_s": round(t_sweep, 2),
                   "peak_growth_gib": round((peak_rss_bytes() - base) / 2**30, 3),
                   "hessian_gib": round(g.H.numel() * g.H.element_size() / 2**30, 3)}
            print(json.dumps(row), flush=True)
            with open(RESULTS, "a") as f:
                f.write(json.dumps(row) + "\n")
            del g, w


def table() -> None:
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines()] if RESULTS.exists() else []
    print("| Linear | in x out | Hessian | prepare s | sweep s | peak growth GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "solve" in r:
            print(f"| {r['solve']} {r['linear']} | {r['in']} x {r['out']} | {r['hessian_gib']} GiB {r['dtype']} | "
                  f"{r['prepare_s']} | {r['sweep_s']} | {r['peak_growth_gib']} |")
    print()
    print("| job | experts | ranks / --ep | plan peak GiB (rank 0) | measured peak GiB (ranks) | plan / measured | "
          "plan s | measured s | plan / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "job" not in r:
            continue
        if "peaks" not in r:
            why = "does not fit (refused by the plan)" if r.get("plan_fits") is False else f"rc {r.get('rc')}"
            print(f"| {r['job']} | {r['experts']} | {r['ranks']} / {r['ep']} | "
                  f"{r.get('plan_peak', 0) / 2**30:.2f} | {why} | | | | |")
            continue
        peak = max(r["peaks"])
        print(f"| {r['job']} | {r['experts']} | {r['ranks']} / {r['ep']} | {r['plan_peak'] / 2**30:.2f} | "
              + ", ".join(f"{x / 2**30:.2f}" for x in r["peaks"])
              + f" | {r['plan_peak'] / peak:.2f} | {r['plan_seconds']:.0f} | {r['seconds']:.0f} | "
              f"{r['plan_seconds'] / r['seconds']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["solve", "jobs", "table"])
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--models", default="DeepSeek-V3,Kimi-K2,Qwen3-235B-A22B")
    a = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    if a.what == "jobs":
        jobs(a.jobs.split(","))
    elif a.what == "solve":
        solve(a.models.split(","))
    else:
        table()


if __name__ == "__main__":
    main()
