"""The time prediction (``sq.pipeline.timing``): the checkpoint bytes each rank reads, predicted exactly from the
load plan and the parallel layout, against what real jobs' readers asked the files for; the report's predicted
seconds beside the measured ones; ``sq.plan``'s time for this machine (probed) and for a stated one; the probes'
cache.  How close the seconds come: ``bench/footprint.py times`` (docs/benchmarks.md) -- never asserted on time
here, as this machine's speed varies with its load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import run_cli, run_python

CALIB = ["--nsamples", "8", "--seqlen", "32"]

CASES = {  # fixture, ranks, arguments
    "dense-gptq-2ranks": ("llama", 2, ["--scheme", "W4A16", "--group-size", "32", "--algo", "gptq", *CALIB]),
    "moe-ep2": ("qwen3_moe", 2, ["--scheme", "W4A16", "--group-size", "16", "--algo", "rtn", "--ep", "2"]),
    "moe-fsdp-3ranks": ("qwen3_moe_fused", 3, ["--scheme", "W8A16", "--group-size", "16", "--algo", "rtn", "--ep", "1"]),
    "fp8-source-ep2": ("deepseek_v3_fp8", 2, ["--scheme", "W4A16", "--group-size", "16", "--algo", "rtn", "--ep", "2"]),
}


def _ptq(src: Path, out: Path, world: int, *args: str):
    argv = ["sq.ptq", "--model", str(src), "--output", str(out), *args]
    return run_python(argv, timeout=300) if world == 1 else run_cli(argv, world, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_read_per_rank_are_predicted_exactly(case, checkpoints, tmp_path):
    """Dense FSDP2 chunks, experts split by --ep (and by row over dp), an FP8 source's weights with the scale
    blocks their boxes touch: each rank's reader asks for exactly the predicted bytes, and the report keeps the
    predicted seconds by phase beside the measured ones."""
    fixture, world, args = CASES[case]
    out = tmp_path / "out"
    res = _ptq(checkpoints[fixture], out, world, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "sq_report.json").read_text())
    ranks = sorted(report["ranks"], key=lambda r: r["rank"])
    assert len(ranks) == world
    for r in ranks:
        assert r["read_bytes"] > 0 and r["read_bytes"] == r["predicted_read_bytes"], (case, r["rank"])
    t = report["time"]
    assert t["predicted_seconds"] == pytest.approx(t["start_seconds"] + t["blocks_seconds"] + t["final_seconds"],
                                                   abs=0.01)
    assert len(t["blocks"]) == len(ranks[0]["blocks"]) and all(s > 0 for s in t["blocks"])
    assert t["blocks_seconds"] == pytest.approx(sum(t["blocks"]), abs=0.01)
    assert t["predicted_read_bytes"] == [r["read_bytes"] for r in ranks]
    assert t["rates"]["source"] in ("probe", "cached") and t["rates"]["gemm"] > 0
    calibrated = "--nsamples" in args
    assert (t["phases"]["calibrate"] > 0) == calibrated and (t["phases"]["forward"] > 0) == calibrated
    assert t["phases"]["fill"] > 0 and t["phases"]["solve"] > 0 and t["phases"]["write"] > 0
    if world > 1 and "--ep" in args:  # the ranks read different experts, as much each
        assert ranks[0]["read_bytes"] == pytest.approx(ranks[1]["read_bytes"], rel=0.2)


def _plan(src: Path, *args: str) -> dict:
    res = run_python(["sq.plan", "--model", str(src), "--output", "/nonexistent/out", "--json", *args], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_plan_reads_what_the_job_reads(checkpoints, tmp_path):
    """``sq.plan`` predicts the bytes every rank of the job will read (it has no rank of its own)."""
    src, args = checkpoints["qwen3_moe"], ["--scheme", "W4A16", "--group-size", "16", "--algo", "rtn", "--ep", "2"]
    out = tmp_path / "out"
    res = _ptq(src, out, 2, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    measured = [r["read_bytes"] for r in sorted(json.loads((out / "sq_report.json").read_text())["ranks"],
                                                key=lambda r: r["rank"])]
    plan = _plan(src, *args, "--nproc-per-node", "2")
    assert plan["time"]["predicted_read_bytes"] == measured
    assert plan["time"]["rates"]["source"] in ("probe", "cached")


def test_plan_for_a_stated_machine_scales_with_the_job(checkpoints):
    """Stated rates (``--tflops``, the bandwidths): the same prediction wherever it runs; more samples cost
    more calibration, more ranks less compute per rank, RTN no calibration at all."""
    src = checkpoints["llama"]
    stated = ["--device", "cuda", "--gpu-memory", "80", "--tflops", "400", "--mem-bandwidth", "2000",
              "--seqlen", "32", "--group-size", "32"]
    one = _plan(src, *stated, "--algo", "gptq", "--nsamples", "8")["time"]
    again = _plan(src, *stated, "--algo", "gptq", "--nsamples", "8")["time"]
    more = _plan(src, *stated, "--algo", "gptq", "--nsamples", "32")["time"]
    two = _plan(src, *stated, "--algo", "gptq", "--nsamples", "32", "--nproc-per-node", "2")["time"]
    rtn = _plan(src, *stated, "--algo", "rtn")["time"]
    assert one["rates"]["source"] == "stated" and one["phases"] == again["phases"]
    assert more["phases"]["calibrate"] > 2 * one["phases"]["calibrate"] > 0
    assert more["phases"]["forward"] > 2 * one["phases"]["forward"] > 0
    assert two["phases"]["forward"] < more["phases"]["forward"]
    assert rtn["phases"]["calibrate"] == 0 and rtn["phases"]["forward"] == 0 and rtn["phases"]["solve"] > 0
    assert sum(two["predicted_read_bytes"]) == one["predicted_read_bytes"][0]  # the ranks split the checkpoint
    assert one["collectives_per_block"] == 0 < two["collectives_per_block"] and two["collective_bytes_per_block"] > 0


def test_plan_on_a_gpu_without_its_speeds_predicts_no_time(checkpoints):
    plan = _plan(checkpoints["llama"], "--device", "cuda", "--gpu-memory", "80", "--algo", "rtn", "--group-size", "32")
    assert plan["time"] is None


def test_rates_are_probed_once_per_machine_and_job_shape(tmp_path, monkeypatch):
    from sq.formats.schemes import get_scheme
    from sq.pipeline.timing import probe_rates

    monkeypatch.setenv("SQ_CACHE_DIR", str(tmp_path))
    kw = dict(shapes=[(64, 128), (128, 64)], heads=4, seqlen=32, compute_dtype=torch.float32,
              device=torch.device("cpu"), scheme=get_scheme("W4A16", 32), hessian_width=64)
    first = probe_rates(**kw)
    second = probe_rates(**kw)
    assert first.source == "probe" and second.source == "cached"
    assert first.gemm == second.gemm and first.column == second.column > 0 and first.factor > 0
    assert len(list((tmp_path / "rates").glob("*.json"))) == 1
    assert probe_rates(**{**kw, "seqlen": 64}).source == "probe"  # another job shape: measured again


@pytest.mark.parametrize("fixture,exact", [("llama", True), ("deepseek_v3_fp8", False)])
def test_model_free_predicts_each_ranks_reads(fixture, exact, checkpoints, tmp_path):
    """``--model-free``: each rank reads its units whole and its rows of the row-split ones, as predicted before
    anything is written (an FP8 source's scale rows besides: within 1%); the report has the predicted seconds."""
    out = tmp_path / "out"
    res = _ptq(checkpoints[fixture], out, 2, "--model-free", "--algo", "rtn", "--scheme", "W4A16", "--group-size", "16")
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "sq_report.json").read_text())
    ranks = sorted(report["ranks"], key=lambda r: r["rank"])
    assert len(ranks) == 2 and all(r["read_bytes"] > 0 for r in ranks)
    for r in ranks:
        if exact:
            assert r["read_bytes"] == r["predicted_read_bytes"]
        else:
            assert r["read_bytes"] == pytest.approx(r["predicted_read_bytes"], rel=0.01)
    t = report["time"]
    assert t["predicted_seconds"] > 0 and len(t["ranks_seconds"]) == 2 and t["rates"]["read"] > 0


def test_the_carried_layer_is_counted_at_the_end_on_rank_0(checkpoints):
    """DeepSeek-V3's MTP layer has no slot in the model: rank 0 reads it (FP8 weights dequantized to the model's
    dtype) and writes it at the end; the memory and time of that final stage count it."""
    from sq.load.loader import plan_load
    from sq.load.meta import build_skeleton
    from sq.pipeline.footprint import CARRIED_COPIES, carried_bytes

    src = checkpoints["deepseek_v3_fp8"]
    plan = plan_load(build_skeleton(src), src)
    assert plan.carried and all(".layers.3." in k for k in plan.carried)  # the MTP layer (3 decoder layers)
    each = [int(torch.Size(plan.source.tensors[k].shape).numel()) for k in plan.carried]
    assert carried_bytes(plan, torch.bfloat16) == 2 * sum(each)  # FP8 and bf16 tensors alike, at 2 bytes each
    assert carried_bytes(plan, torch.bfloat16, largest=True) == 2 * max(each)  # written one at a time
    stated = ["--device", "cuda", "--gpu-memory", "80", "--tflops", "400", "--algo", "rtn", "--group-size", "16"]
    planned = _plan(src, *stated)
    m = planned["memory"]
    # on a GPU job rank 0 reads and writes them in host memory, beside nothing else the GPU holds
    assert m["predicted_host_peak_rank0_bytes"] - m["base"] >= m["host_final"] >= CARRIED_COPIES * 2 * max(each)
    assert m["predicted_host_peak_bytes"] - m["base"] == m["host_block"]
