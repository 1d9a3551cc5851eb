"""Memory preflight (issue 38): each rank's predicted peak RSS (``sq.pipeline.footprint``, recorded in the report)
against the peak it measured (``VmHWM``), over the demo model's algorithms and the synthetic Qwen3-MoE checkpoints.

    .venv/bin/python bench/footprint.py run [--jobs demo-gptq,...]   # runs the jobs (torchrun, 2 ranks unless named)
    .venv/bin/python bench/footprint.py table                          # the markdown table of every finished job
    .venv/bin/python bench/footprint.py times [--repredict]            # predicted against measured seconds
    .venv/bin/python bench/footprint.py plan                           # DeepSeek-V3 / Kimi-K2 / Qwen3-235B planned

Jobs write to ``bench/_work/footprint/<job>``; the MoE jobs need ``bench/scale.py build --ckpts depth-L8,big``.
Memory is stable enough to compare across runs; the times in the table are only for orientation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "_work" / "footprint"
SCALE = ROOT / "bench" / "_work" / "scale"
DEMO = ["--model", "demo:smollm2", "--group-size", "64", "--seqlen", "512"]


def _moe(name: str) -> list[str]:
    found = sorted((SCALE / name).glob("qwen3moe-*"))
    return ["--model", str(found[0]) if found else str(SCALE / name), "--group-size", "128", "--seqlen", "128"]


DSV3_FP8 = WORK / "dsv3-fp8"  # a DeepSeek-V3 of 6 layers in the official FP8 block-scaled layout (built on first use)
DSV3_FP8_CONFIG = dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=6,
                       num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=128,
                       qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=64,
                       num_experts_per_tok=6, n_group=4, topk_group=2, first_k_dense_replace=1, vocab_size=8192)


def _dsv3_fp8() -> list[str]:
    if not (DSV3_FP8 / "config.json").exists():
        from sq.testing.checkpoints import build_deepseek_v3_fp8

        build_deepseek_v3_fp8(DSV3_FP8, weight_block_size=(128, 128), **DSV3_FP8_CONFIG)
    return ["--model", str(DSV3_FP8), "--group-size", "128", "--seqlen", "128"]


JOBS = {  # name: (ranks, arguments)
    "demo-rtn": (2, [*DEMO, "--algo", "rtn"]),
    "demo-gptq": (2, [*DEMO, "--algo", "gptq", "--nsamples", "32"]),
    "demo-gptq-128": (2, [*DEMO, "--algo", "gptq", "--nsamples", "128"]),
    "demo-gptq-float32": (2, [*DEMO, "--algo", "gptq", "--nsamples", "32", "--calib-dtype", "float32"]),
    "demo-gptq-1rank": (1, [*DEMO, "--algo", "gptq", "--nsamples", "32"]),
    "demo-awq": (2, [*DEMO, "--algo", "awq", "--nsamples", "32"]),
    "demo-signround": (2, [*DEMO, "--algo", "signround", "--iters", "10", "--nsamples", "32"]),
    "depthL8-gptq-ep2": (2, [*_moe("depth-L8"), "--algo", "gptq", "--nsamples", "8", "--ep", "2"]),
    "depthL8-gptq-ep1": (2, [*_moe("depth-L8"), "--algo", "gptq", "--nsamples", "8", "--ep", "1"]),
    "depthL8-gptq-1rank": (1, [*_moe("depth-L8"), "--algo", "gptq", "--nsamples", "8"]),
    "depthL8-rtn": (2, [*_moe("depth-L8"), "--algo", "rtn"]),
    "big-gptq-ep2": (2, [*_moe("big"), "--algo", "gptq", "--nsamples", "8", "--ep", "2"]),
    "big-gptq-ep1": (2, [*_moe("big"), "--algo", "gptq", "--nsamples", "8", "--ep", "1"]),
    "big-rtn": (2, [*_moe("big"), "--algo", "rtn"]),
    "dsv3fp8-gptq-ep2": (2, ["dsv3fp8", "--algo", "gptq", "--nsamples", "8", "--ep", "2"]),
    "dsv3fp8-rtn": (2, ["dsv3fp8", "--algo", "rtn"]),
    "depthL8-modelfree": (2, [*_moe("depth-L8"), "--algo", "rtn", "--model-free"]),
    "dsv3fp8-modelfree": (2, ["dsv3fp8", "--algo", "rtn", "--model-free"]),
}


# the giants, from their Hub config.json files (the fields their models read); built as header-only sparse
# checkpoints (sq.testing.checkpoints.build_sparse: bf16, fused experts; an FP8 source fills the same bf16 shards)
GIANTS = {
    "DeepSeek-V3": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
        norm_topk_prob=True, max_position_embeddings=163840, tie_word_embeddings=False)),
    "Kimi-K2": ("deepseek_v3", None),  # DeepSeek-V3's architecture: its fields but for these
    "Qwen3-235B-A22B": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, tie_word_embeddings=False)),
}
GIANTS["Kimi-K2"] = ("deepseek_v3", dict(
    GIANTS["DeepSeek-V3"][1], vocab_size=163840, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
    routed_scaling_factor=2.827, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=131072))
H200_GIB = 141e9 / 2**30  # an H200's 141 GB
NODE_GIB = 2048  # host memory of an 8 x H200 node (an assumption: 2 TiB)
# an H200's speeds as stated to sq.plan (assumptions, not measured: bf16 matmuls at about 40% of the 989 TFLOP/s
# peak, HBM at most of its 4.8 TB/s, a node's NVMe shared by its 8 ranks, NVLink per rank)
H200_STATED = dict(tflops=400, mem_gbs=4000, read_gbs=1.5, link_gbs=150)


def plan(nsamples: int, seqlen: int) -> None:
    from sq.plan import build_parser, plan_job
    from sq.ptq import config_from
    from sq.testing.checkpoints import build_sparse

    from sq.pipeline.timing import stated_rates

    rates = stated_rates(**H200_STATED)
    print(f"W4A16 group 128, GPTQ, {nsamples} x {seqlen} calibration, --ep = ranks, --device cuda, "
          f"{H200_GIB:.0f} GiB per GPU; predicted per rank (GiB); time at stated rates {H200_STATED}")
    print("| model | ranks | root | block | chain | activations | algorithm | heap | peak per GPU (rank 0) | fits | "
          "checkpoint GiB | resume state GiB | read GiB per rank | predicted hours (calibrate / solve) | "
          "seconds to plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (model_type, config) in GIANTS.items():
        src = WORK / "giants" / name
        if not (src / "model.safetensors").exists():
            build_sparse(src, model_type, tokenizer=False, **config)
        for ranks in (8, 16):
            argv = ["--model", str(src), "--output", str(WORK / "giants-out"), "--scheme", "W4A16", "--algo", "gptq",
                    "--group-size", "128", "--nsamples", str(nsamples), "--seqlen", str(seqlen), "--ep", str(ranks)]
            import time

            t = time.perf_counter()
            p, _ = plan_job(config_from(build_parser().parse_args(argv)), nproc_per_node=8, nnodes=ranks // 8,
                            device="cuda", gpu_memory=H200_GIB, host_memory=NODE_GIB, rates=rates)
            secs = time.perf_counter() - t
            m, t = p["memory"], p["time"]
            g = {k: m[k] / 2**30 for k in ("root", "block", "chain", "activations", "algorithm", "heap")}
            peak = (m["predicted_peak_rank0_bytes"] - m["base"]) / 2**30
            print(f"| {name} | {ranks} ({ranks // 8} x 8) | " + " | ".join(f"{v:.2f}" for v in g.values())
                  + f" | {peak:.1f} | {'yes' if m['need_bytes'] <= m['available_bytes'] else 'no'} | "
                  f"{p['predicted_output_bytes'] / 2**30:.0f} | {p['predicted_state_bytes'] / 2**30:.0f} | "
                  f"{max(t['predicted_read_bytes']) / 2**30:.0f} | {t['predicted_seconds'] / 3600:.1f} "
                  f"({t['phases']['calibrate'] / 3600:.1f} / {t['phases']['solve'] / 3600:.1f}) | {secs:.1f} |")


def run(names: list[str]) -> None:
    bin_ = Path(sys.executable).parent
    for name in names:
        ranks, args = JOBS[name]
        if args[0] == "dsv3fp8":  # built here, not at import
            args = [*_dsv3_fp8(), *args[1:]]
        out = WORK / name
        cmd = [str(bin_ / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), "-m", "sq.ptq",
               "--output", str(out), "--scheme", "W4A16", "--resume", "never", *args]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        WORK.mkdir(parents=True, exist_ok=True)
        with open(WORK / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        print(f"{name}: rc={rc}", flush=True)


def table() -> None:
    print("| job | ranks | phase | base | root / block / chain / activations / algorithm / heap MiB "
          "| predicted MiB per rank | measured MiB per rank | error | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in JOBS:
        try:
            r = json.loads((WORK / name / "sq_report.json").read_text())
        except OSError:
            continue
        if "memory" not in r:
            continue
        m, ranks = r["memory"], sorted(r["ranks"], key=lambda x: x["rank"])
        if r.get("mode") == "model-free":  # its own parts (sq.modelfree.footprint), in the same columns' order
            parts = " / ".join(str(m[k] >> 20) for k in ("units", "layer", "split", "heap")) + \
                " (model-free: units / layer / split / heap)"
        else:
            parts = " / ".join(str(m[k] >> 20) for k in ("root", "block", "chain", "activations", "algorithm", "heap"))
        pred = ", ".join(str(x["predicted_peak_bytes"] >> 20) for x in ranks)
        meas = ", ".join(str(x["peak_rss_bytes"] >> 20) for x in ranks)
        err = ", ".join(f"{x['predicted_peak_bytes'] / x['peak_rss_bytes'] - 1:+.1%}" for x in ranks)
        print(f"| {name} | {len(ranks)} | {m.get('phase', '')} | {m['base'] >> 20} | {parts} | {pred} | {meas} | "
              f"{err} | {r['seconds']:.0f} |")


def _repredicted(name: str, r: dict) -> dict:
    """The job's time as this code predicts it from the rates its run recorded (``sq.plan``'s prediction with
    those rates, after the start the run measured): a model refitted after a run is checked against it without
    running it again."""
    from sq.pipeline.timing import Rates
    from sq.plan import build_parser, plan_job
    from sq.ptq import config_from

    ranks, args = JOBS[name]
    if args[0] == "dsv3fp8":
        args = [*_dsv3_fp8(), *args[1:]]
    rates = {k: v for k, v in r["time"]["rates"].items() if k != "source"}
    a = build_parser().parse_args(["--output", str(WORK / f"{name}-plan"), "--scheme", "W4A16", *args])
    t = plan_job(config_from(a), nproc_per_node=ranks, rates=Rates(**rates, source="recorded"))[0]["time"]
    started = r["time"]["start_seconds"]  # (with the root's fill: the plan's own start is this process's)
    return {**t, "predicted_seconds": started + t["blocks_seconds"] + t["final_seconds"]}


def times(repredict: bool = False) -> None:
    """Predicted against measured seconds: the whole job, and each block phase summed over the blocks (the
    slowest rank's, as the prediction counts them).  ``repredict``: predicted by this code from the rates each
    run recorded (:func:`_repredicted`), not as the run predicted them."""
    print("| job | ranks | predicted s | measured s | error | phases predicted / measured s "
          "(fill, calibrate, solve, forward, write) | read MiB per rank (~: within 1% of predicted, else equal) |")
    print("|---|---|---|---|---|---|---|")
    for name in JOBS:
        try:
            r = json.loads((WORK / name / "sq_report.json").read_text())
        except OSError:
            continue
        t, ranks = r.get("time"), sorted(r["ranks"], key=lambda x: x["rank"])
        if not t:
            continue
        if repredict and r.get("mode") != "model-free":
            t = _repredicted(name, r)
        reads = ", ".join(f"{x['read_bytes'] / 2**20:.0f}{'' if x['read_bytes'] == x['predicted_read_bytes'] else '~'}"
                          for x in ranks if "read_bytes" in x)
        if r.get("mode") == "model-free":  # no blocks phases: each rank's layers in one stream
            print(f"| {name} | {len(ranks)} | {t['predicted_seconds']:.1f} | {r['seconds']:.1f} | "
                  f"{t['predicted_seconds'] / r['seconds'] - 1:+.0%} | (model-free: per rank "
                  f"{', '.join(f'{x:.1f}' for x in t['ranks_seconds'])} s predicted) | {reads} |")
            continue
        phases = ("fill", "calibrate", "solve", "forward", "write")
        meas = {k: sum(max(x["blocks"][b].get(k, 0) for x in ranks) for b in range(len(ranks[0]["blocks"])))
                for k in phases}
        cells = ", ".join(f"{t['phases'].get(k, 0):.1f}/{meas[k]:.1f}" for k in phases)
        print(f"| {name} | {len(ranks)} | {t['predicted_seconds']:.1f} | {r['seconds']:.1f} | "
              f"{t['predicted_seconds'] / r['seconds'] - 1:+.0%} | {cells} | {reads} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["run", "table", "times", "plan"])
    ap.add_argument("--repredict", action="store_true",
                    help="for times: predicted by this code from each run's recorded rates, not as the run predicted")
    ap.add_argument("--nsamples", type=int, default=512, help="for plan")
    ap.add_argument("--seqlen", type=int, default=2048, help="for plan")
    ap.add_argument("--jobs", default=",".join(n for n in JOBS if not n.startswith("big")),
                    help="comma-separated job names (default: all but big-*)")
    a = ap.parse_args()
    if a.cmd == "plan":
        return plan(a.nsamples, a.seqlen)
    if a.cmd == "times":
        return times(a.repredict)
    if a.cmd == "run":
        run([n for n in a.jobs.split(",") if n])
    table()
    times()


if __name__ == "__main__":
    main()
