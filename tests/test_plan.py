"""The disk preflight and ``sq.plan``: the prediction against what real jobs write, and the refusal that comes
on every rank before the output folder is touched (the memory preflight: tests/test_footprint.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import run_cli, run_python

CALIB = ["--nsamples", "8", "--seqlen", "32"]


def _ptq(src: Path, out: Path, world: int, *args: str):
    argv = ["sq.ptq", "--model", str(src), "--output", str(out), *args]
    return run_python(argv, timeout=300) if world == 1 else run_cli(argv, world, timeout=300)


def _checkpoint_bytes(out: Path) -> int:
    """The checkpoint as served: its safetensors and the files copied from the source (not sq's own report,
    picture, logs or resume state)."""
    return sum(f.stat().st_size for f in out.iterdir()
               if f.is_file() and not f.name.startswith("sq_") and not f.name.endswith(".index.json")
               and f.name != "config.json")


CASES = {
    "gptq-2ranks": ("llama_ckpt", 2, ["--scheme", "W4A16", "--group-size", "32", "--algo", "gptq", *CALIB]),
    "fp8-dynamic": ("llama_ckpt", 1, ["--scheme", "FP8_DYNAMIC", "--algo", "rtn"]),
    "moe-ep2": ("qwen3_moe_ckpt", 2, ["--scheme", "W4A16", "--group-size", "16", "--algo", "rtn", "--ep", "2"]),
    "signround-fp-chain": ("llama_ckpt", 1, ["--scheme", "W4A16", "--group-size", "32", "--algo", "signround",
                                             "--iters", "2", *CALIB]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_predicted_checkpoint_size_is_what_is_written(case, request, tmp_path):
    fixture, world, args = CASES[case]
    out = tmp_path / "out"
    res = _ptq(request.getfixturevalue(fixture), out, world, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    disk = json.loads((out / "sq_report.json").read_text())["disk"]
    written = _checkpoint_bytes(out)
    assert abs(disk["predicted_output_bytes"] - written) <= 0.02 * written, (disk, written)
    assert disk["free_bytes"] > 0 and disk["in_output_bytes"] == 0
    calibrated = "--nsamples" in args
    assert (disk["predicted_state_bytes"] > 0) == calibrated, disk


def test_a_search_is_predicted_at_its_budget(llama_ckpt, tmp_path):
    """``--target-bits``: the dense Linears counted at the budget, which the search never exceeds."""
    out = tmp_path / "out"
    res = _ptq(llama_ckpt, out, 1, "--algo", "gptq", "--group-size", "32", "--target-bits", "6",
               "--candidates", "W4A16,W8A16", *CALIB)
    assert res.returncode == 0, res.stderr[-3000:]
    disk = json.loads((out / "sq_report.json").read_text())["disk"]
    written = _checkpoint_bytes(out)
    assert written <= disk["predicted_output_bytes"] <= 1.25 * written, (disk, written)


def test_the_demo_model_predicted_within_one_percent(smollm2_ckpt, tmp_path):
    """The real 135M model: the whole folder sq leaves (report, picture and logs included) within 3% of the
    prediction, the checkpoint itself within 1%."""
    out = tmp_path / "out"
    res = _ptq(smollm2_ckpt, out, 1, "--scheme", "W4A16", "--group-size", "64", "--algo", "rtn")
    assert res.returncode == 0, res.stderr[-3000:]
    disk = json.loads((out / "sq_report.json").read_text())["disk"]
    folder = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert abs(disk["predicted_output_bytes"] - _checkpoint_bytes(out)) <= 0.01 * _checkpoint_bytes(out), disk
    assert abs(disk["predicted_output_bytes"] - folder) <= 0.03 * folder, (disk, folder)


@pytest.fixture
def small_disk(tmp_path):
    """A real 128 KiB filesystem (tmpfs), where the tiny Llama's W8A16 checkpoint (~0.4 MiB) cannot fit."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_job_the_disk_cannot_hold_is_refused_before_writing(llama_ckpt, small_disk):
    out = small_disk / "out"
    res = _ptq(llama_ckpt, out, 2, "--scheme", "W8A16", "--group-size", "32", "--algo", "rtn")
    assert res.returncode != 0
    assert f"sq: error: --output {out}: the job needs about" in res.stderr, res.stderr[-3000:]
    assert "MiB free" in res.stderr and "--no-preflight" in res.stderr
    assert not out.exists()  # refused before the folder was made
    # --no-preflight: tried, and the disk filling up is the clean error it always was
    res = _ptq(llama_ckpt, out, 2, "--scheme", "W8A16", "--group-size", "32", "--algo", "rtn", "--no-preflight")
    assert res.returncode != 0
    assert "no space left on the device while writing" in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("world,args", [
    (2, ["--scheme", "W4A16", "--group-size", "32", "--algo", "gptq", "--calib-dtype", "float32", *CALIB]),
    (1, ["--scheme", "FP8_DYNAMIC", "--algo", "rtn"]),
], ids=["gptq-2ranks", "rtn-fp8"])
def test_plan_predicts_what_the_job_then_reports(llama_ckpt, tmp_path, world, args):
    """``python -m sq.plan`` + the job's own arguments: the numbers the job's preflight then records, exactly,
    with no weight read and no process group."""
    out = tmp_path / "out"
    planned = run_python(["sq.plan", "--model", str(llama_ckpt), "--output", str(out), "--json",
                          "--nproc-per-node", str(world), *args], timeout=300)
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan = json.loads(planned.stdout.strip().splitlines()[-1])
    assert plan["fits"] and not out.exists()
    res = _ptq(llama_ckpt, out, world, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "sq_report.json").read_text())
    disk, memory = report["disk"], report["memory"]
    assert plan["predicted_output_bytes"] == disk["predicted_output_bytes"], (plan, disk)
    assert plan["predicted_state_bytes"] == disk["predicted_state_bytes"], (plan, disk)
    # the same prediction: the plan's is the largest rank's, each rank's own is in the report (the base is each
    # process's own, measured)
    for part in ("root", "chain", "final"):
        assert plan["memory"][part] == memory[part], (part, plan["memory"], memory)
    grown = max(r["predicted_peak_bytes"] - r["base_rss_bytes"] for r in report["ranks"])
    assert plan["memory"]["predicted_peak_bytes"] - plan["memory"]["base"] == grown, (plan["memory"], report["ranks"])
    human = run_python(["sq.plan", "--model", str(llama_ckpt), "--output", str(tmp_path / "o2"), *args], timeout=300)
    assert human.returncode == 0 and "verdict          fits" in human.stdout, human.stdout + human.stderr[-2000:]


def test_plan_refuses_what_the_disk_cannot_hold(llama_ckpt, small_disk):
    out = small_disk / "out"
    res = run_python(["sq.plan", "--model", str(llama_ckpt), "--output", str(out), "--scheme", "W8A16",
                      "--group-size", "32", "--algo", "rtn", "--json"], timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["fits"] is False
    assert f"sq: error: --output {out}: the job needs about" in res.stderr


def test_plan_of_a_scheme_that_cannot_apply_is_one_clear_error(llama_ckpt, tmp_path):
    res = run_python(["sq.plan", "--model", str(llama_ckpt), "--output", str(tmp_path / "o"), "--algo", "rtn",
                      "--group-size", "48"], timeout=300)
    # the job's own refusal (sq.pipeline.checks, shared with sq.ptq), before anything is predicted
    assert res.returncode == 2 and ("sq: error: model.layers.0.self_attn.q_proj: group size 48 does not divide "
                                    "in_features 64 (scheme W4A16)") in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("extra", [[], ["--model-free"]])
def test_plan_of_a_hub_id_downloads_nothing(extra, tmp_path):
    """sq.plan reads headers only: a hub id (not downloaded yet) is one clear error, before the model-free
    decision -- which resolves the model the way sq.ptq's ranks do -- could fetch anything."""
    res = run_python(["sq.plan", "--model", "someorg/not-downloaded", "--output", str(tmp_path / "o"), "--algo", "rtn",
                      *extra], timeout=300, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert res.returncode == 2 and "is not one (download it first" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "hf").exists() and "Traceback" not in res.stderr
