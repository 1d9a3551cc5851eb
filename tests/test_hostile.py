"""Hostile inputs and concurrent runs (issue 15): the output folder, the run state and the weights.

Every row of ``CASES`` is refused cleanly at 1 and 2 ranks under the contract of
``hostile.run_hostile`` (exit 2 on every rank, an ``sq: error:`` line naming what is wrong, no
traceback, protected files untouched, no hang).  The scenario tests below the table check what
happens around a refusal: what a rerun does, what is kept, that two runs never mix.
Malformed input files: ``test_hostile_inputs.py``; links and remote code: ``test_hostile_links.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_edit import copy_ckpt, edit_tensors
from harness import run_cli
from hostile import Hostile, run_hostile, snapshot

GS = "32"
RTN = ["--algo", "rtn", "--group-size", GS]
GPTQ = ["--algo", "gptq", "--group-size", GS, "--nsamples", "4", "--seqlen", "16"]


def _argv(src, out, *extra) -> list[str]:
    return ["--model", str(src), "--output", str(out), *extra]


@pytest.fixture(scope="module")
def finished(checkpoints, tmp_path_factory) -> Path:
    """A finished RTN output of the llama fixture, with a user's notes beside it."""
    out = tmp_path_factory.mktemp("finished") / "out"
    res = run_cli(["sq.ptq", *_argv(checkpoints["llama"], out, *RTN)], 2, timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    (out / "NOTES.md").write_text("my notes\n")
    return out


@pytest.fixture(scope="module")
def nan_ckpt(checkpoints, tmp_path_factory) -> Path:
    path = copy_ckpt(checkpoints["llama"], tmp_path_factory.mktemp("nan") / "c")

    def poison(t):
        key = "model.layers.1.mlp.down_proj.weight"
        if key not in t:
            return t
        w = t[key].clone()
        w[3, 5] = float("nan")
        w[7, 1] = float("inf")
        return {**t, key: w}

    edit_tensors(path, poison)
    return path


# ---------------------------------------------------------------- the table


def seqlen_zero(tmp, ck):
    return Hostile(_argv(ck["llama"], tmp / "out", "--seqlen", "0"), r"--seqlen must be positive", protect=[ck["llama"]])


def output_is_model(tmp, ck):
    src = copy_ckpt(ck["llama"], tmp / "c")
    return Hostile(_argv(src, src, *RTN), r"--output .* is the model folder", protect=[src])


def output_links_to_model(tmp, ck):
    src = copy_ckpt(ck["llama"], tmp / "c")
    (tmp / "link").symlink_to(src)
    return Hostile(_argv(src, tmp / "link", *RTN), r"is the model folder", protect=[src, tmp / "link"])


def output_inside_model(tmp, ck):
    src = copy_ckpt(ck["llama"], tmp / "c")
    return Hostile(_argv(src, src / "q", *RTN), r"is inside the model folder", protect=[src])


def model_inside_output(tmp, ck):
    src = copy_ckpt(ck["llama"], tmp / "o" / "c")
    return Hostile(_argv(src, tmp / "o", *RTN), r"contains the model folder", protect=[tmp / "o"])


def output_under_a_file(tmp, ck):
    (tmp / "f").write_text("x")
    return Hostile(_argv(ck["llama"], tmp / "f" / "out", *RTN), r"is a file, so no folder can be made under it",
                   protect=[tmp / "f"])


def output_dangling_link(tmp, ck):
    (tmp / "out").symlink_to(tmp / "nowhere")
    return Hostile(_argv(ck["llama"], tmp / "out", *RTN), r"symbolic link to .*nowhere.*does not exist",
                   protect=[tmp / "out"])


def output_not_empty(tmp, ck):
    (tmp / "out").mkdir()
    (tmp / "out" / "NOTES.md").write_text("x")
    return Hostile(_argv(ck["llama"], tmp / "out", *RTN, "--resume", "never"), r"is not empty", protect=[tmp / "out"])


def resume_require_nothing(tmp, ck):
    return Hostile(_argv(ck["llama"], tmp / "out", *RTN, "--resume", "require"), r"holds no run to resume",
                   check_after=lambda t: _no_run_dir(t / "out"))


def corpus_too_short(tmp, ck):
    """Refused before the output folder exists, so the corrected command is not blocked by it."""
    return Hostile(_argv(ck["llama"], tmp / "out", *GPTQ[:-2], "--seqlen", "1"), r"at least 2 tokens",
                   check_after=lambda t: _no_run_dir(t / "out"))


def corrupt_run_json(tmp, ck):
    out = tmp / "out"
    (out / ".sq-run").mkdir(parents=True)
    (out / ".sq-run" / "run.json").write_bytes(b"\x00\xff binary")
    return Hostile(_argv(ck["llama"], out, *RTN), r"run.json is corrupt or was edited.*--resume never",
                   protect=[out])


def edited_run_json(tmp, ck):
    out = tmp / "out"
    (out / ".sq-run").mkdir(parents=True)
    (out / ".sq-run" / "run.json").write_text(json.dumps({"signature": {"args": {}}, "signature_sha256": "0" * 64}))
    return Hostile(_argv(ck["llama"], out, *RTN), r"run.json is corrupt or was edited", protect=[out])


def run_json_a_list(tmp, ck):
    out = tmp / "out"
    (out / ".sq-run").mkdir(parents=True)
    (out / ".sq-run" / "run.json").write_text("[1, 2]")
    return Hostile(_argv(ck["llama"], out, *RTN), r"run.json is corrupt", protect=[out])


def nonfinite_rtn(tmp, ck):
    src = ck.nan  # set by the test from the nan_ckpt fixture
    return Hostile(_argv(src, tmp / "out", *RTN),
                   r"model\.layers\.1\.mlp\.down_proj\.weight .*holds NaN or Inf.*--skip-nonfinite", protect=[src])


def nonfinite_gptq(tmp, ck):
    src = ck.nan
    return Hostile(_argv(src, tmp / "out", *GPTQ), r"down_proj\.weight .*holds NaN or Inf", protect=[src])


def live_lock_resume_never(tmp, ck):
    """A live run holds the folder: --resume never must not delete a byte of it."""
    from sq.resume import signed_json

    out = tmp / "out"
    (out / ".sq-run").mkdir(parents=True)
    (out / ".sq-run" / "run.json").write_bytes(signed_json("signature", {"args": {"scheme": "W4A16"}}))
    (out / "model-rank00000-block00000.safetensors").write_bytes(b"in progress")
    (out / "NOTES.md").write_text("mine")
    ck.holder = _hold_lock(out / ".sq-run" / "lock")
    return Hostile(_argv(ck["llama"], out, *RTN, "--resume", "never"), r"being written by another sq run \(pid \d+",
                   protect=[out])


def readonly_output(tmp, ck):
    mnt = tmp / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a read-only filesystem here")
    ck.unmount = mnt
    return Hostile(_argv(ck["llama"], mnt / "out", *RTN), r"is not writable \(read-only filesystem")


CASES = {f.__name__: f for f in (
    seqlen_zero, output_is_model, output_links_to_model, output_inside_model, model_inside_output,
    output_under_a_file, output_dangling_link, output_not_empty, resume_require_nothing, corpus_too_short,
    corrupt_run_json, edited_run_json, run_json_a_list, nonfinite_rtn, nonfinite_gptq, live_lock_resume_never,
    readonly_output,
)}


class _Fixtures:
    """The checkpoint factory plus per-case extras (the NaN checkpoint, things to clean up)."""

    def __init__(self, checkpoints, nan):
        self._ck, self.nan, self.holder, self.unmount = checkpoints, nan, None, None

    def __getitem__(self, name):
        return self._ck[name]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile(case, world, tmp_path, checkpoints, nan_ckpt):
    ck = _Fixtures(checkpoints, nan_ckpt)
    try:
        run_hostile(CASES[case](tmp_path, ck), world, tmp_path)
    finally:
        if ck.holder is not None:
            ck.holder.kill()
            ck.holder.wait()
        if ck.unmount is not None:
            subprocess.run(["umount", str(ck.unmount)])


def _no_run_dir(out: Path) -> None:
    assert not (out / ".sq-run").exists(), "a refusal left .sq-run/ behind"


def _hold_lock(lock: Path) -> subprocess.Popen:
    """Another process holding the folder's lock, as a live sq run's rank 0 does."""
    code = ("import fcntl, json, os, socket, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname()}).encode())\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ---------------------------------------------------------------- what happens around a refusal


def _index_files(out: Path) -> set[str]:
    return set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())


def test_finished_output_rerun(finished, checkpoints, tmp_path):
    """Completion is decided from the stored signature: the same command is complete, another is refused."""
    src = checkpoints["llama"]
    before = snapshot(finished)
    same = run_cli(["sq.ptq", *_argv(src, finished, *RTN)], 2, timeout=60)
    assert same.returncode == 0 and "already complete" in same.output, same.output[-3000:]
    for extra, field in ((["--scheme", "W8A16"], "args.scheme"), (["--algo", "gptq"], "algorithm.name")):
        res = run_cli(["sq.ptq", *_argv(src, finished, *RTN, *extra)], 2, timeout=60, stop_on_failure=False)
        assert res.codes == [2, 2] and "holds a finished sq checkpoint made with different settings" in res.stderr
        assert field in res.stderr and "Traceback" not in res.output
    other = run_cli(["sq.ptq", *_argv(checkpoints["qwen3_moe"], finished, "--algo", "rtn", "--group-size", "16")], 2, timeout=60,
                    stop_on_failure=False)
    assert other.codes == [2, 2] and "source." in other.stderr, other.stderr[-2000:]
    assert snapshot(finished) == before


def test_resume_never_replaces_only_what_sq_wrote(finished, checkpoints, tmp_path):
    out = tmp_path / "out"
    import shutil

    shutil.copytree(finished, out)
    (out / "eval-results").mkdir()
    (out / "eval-results" / "ppl.txt").write_text("11.2")
    res = run_cli(["sq.ptq", *_argv(checkpoints["llama"], out, *RTN, "--scheme", "W8A16", "--resume", "never")], 2,
                  timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    assert (out / "NOTES.md").read_text() == "my notes\n" and (out / "eval-results" / "ppl.txt").read_text() == "11.2"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["num_bits"] == 8
    assert not (out / ".sq-run").exists()
    assert _index_files(out) == {p.name for p in out.glob("*.safetensors")}  # no stale shard left


def test_refused_start_does_not_block_the_corrected_command(checkpoints, tmp_path):
    """A run that failed before completing any block (here: NaN weights at block 1 of 2) leaves
    nothing a corrected command must resume; the corrected command simply runs."""
    import shutil

    src = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    good = load_file(next(src.glob("*.safetensors")))  # noqa: F841 - the first shard exists
    edit_tensors(src, lambda t: {k: (v.clone().fill_(float("nan")) if k == "model.layers.0.self_attn.q_proj.weight"
                                     else v) for k, v in t.items()})
    out = tmp_path / "out"
    res = run_cli(["sq.ptq", *_argv(src, out, *RTN)], 2, timeout=60, stop_on_failure=False)
    assert res.codes == [2, 2] and "q_proj.weight" in res.stderr
    shutil.rmtree(src)
    copy_ckpt(checkpoints["llama"], src)  # the user fixes the checkpoint and reruns with other settings
    res = run_cli(["sq.ptq", *_argv(src, out, *RTN, "--scheme", "W8A16")], 2, timeout=120)
    assert res.returncode == 0, res.output[-3000:]


def test_skip_nonfinite_leaves_them_unquantized_and_resumes(nan_ckpt, tmp_path):
    """--skip-nonfinite: the NaN Linear is written as it is and listed in ignore; a run refused at
    that block continues with the flag instead of starting over."""
    from sq.testing.checkpoints import load_with_transformers

    out = tmp_path / "out"
    res = run_cli(["sq.ptq", *_argv(nan_ckpt, out, *RTN)], 2, timeout=60, stop_on_failure=False)
    assert res.codes == [2, 2]
    manifest = json.loads((out / ".sq-run" / "rank-00000" / "manifest.json").read_text())
    assert [e["block"] for e in manifest["blocks"]] == [0]  # block 0 done, kept for the rerun
    res = run_cli(["sq.ptq", *_argv(nan_ckpt, out, *RTN, "--skip-nonfinite")], 2, timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    assert "resuming at block 1" in res.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.down_proj" in qc["ignore"]
    report = json.loads((out / "sq_report.json").read_text())
    assert report["skipped_nonfinite"] == ["model.layers.1.mlp.down_proj"]
    assert "model.layers.1.mlp.down_proj" not in report["layers"]
    assert all(v["rel_err"] == v["rel_err"] for v in report["layers"].values())  # no NaN errors
    model = load_with_transformers(out, dtype=torch.float32)
    w = model.model.layers[1].mlp.down_proj.weight
    assert torch.isnan(w[3, 5]) and torch.isinf(w[7, 1])


def test_two_runs_on_one_folder_never_mix(checkpoints, tmp_path):
    """A second run with other flags and --resume never, started while the first writes, is refused
    before it touches anything; the first finishes alone and its output is consistent."""
    from sq.testing.checkpoints import load_with_transformers

    out = tmp_path / "out"
    first = {}
    slow = ["--algo", "gptq", "--group-size", "16", "--nsamples", "16", "--seqlen", "64"]
    t = threading.Thread(target=lambda: first.update(r=run_cli(
        ["sq.ptq", *_argv(checkpoints["qwen3_moe"], out, *slow)], 2, timeout=240)))
    t.start()
    deadline = time.monotonic() + 120
    while not (out / ".sq-run" / "run.json").exists():
        assert time.monotonic() < deadline and t.is_alive(), "the first run never took the folder"
        time.sleep(0.05)
    second = run_cli(["sq.ptq", *_argv(checkpoints["qwen3_moe"], out, "--algo", "rtn", "--group-size", "16",
                                       "--scheme", "W8A16", "--resume", "never")],
                     2, timeout=120, stop_on_failure=False)
    t.join()
    assert first["r"].returncode == 0, first["r"].output[-3000:]
    if second.codes != [0, 0]:  # refused while the first one ran (the usual case)
        assert second.codes == [2, 2] and "being written by another sq run" in second.stderr, second.output[-3000:]
        bits = {8 if "W8" in str(g) else g["weights"]["num_bits"] for g in json.loads(
            (out / "config.json").read_text())["quantization_config"]["config_groups"].values()}
        assert bits == {4}
    load_with_transformers(out)
    assert _index_files(out) == {p.name for p in out.glob("*.safetensors")}


def test_malformed_manifest_and_lock_are_redone_not_trusted(checkpoints, tmp_path):
    """An unfinished run whose manifest is binary / a list / forged (a path outside the folder) and
    whose lock is garbage: the rerun takes the lock, redoes the blocks, and never names the outside path."""
    out = tmp_path / "out"
    res = run_cli(["sq.ptq", *_argv(checkpoints["llama"], out, *RTN)], 2, timeout=60,
                  env={"SQ_FAULT": "after-shard-write:0:1"})
    assert res.returncode != 0 and (out / ".sq-run" / "run.json").exists()
    secret = tmp_path / "secret.safetensors"
    save_file({"x": torch.zeros(2)}, secret)
    m0 = out / ".sq-run" / "rank-00000" / "manifest.json"
    forged = {"rank": 0, "blocks": [{"block": 0, "files": {"../secret.safetensors": {
        "size": secret.stat().st_size, "sha256": __import__("hashlib").sha256(secret.read_bytes()).hexdigest(),
        "tensors": ["x"]}}}]}
    m0.write_text(json.dumps(forged))
    (out / ".sq-run" / "rank-00001" / "manifest.json").write_bytes(b"\x89PNG\x00")
    (out / ".sq-run" / "lock").write_text("[1, 2, 3]")
    res = run_cli(["sq.ptq", *_argv(checkpoints["llama"], out, *RTN)], 2, timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    assert "Traceback" not in res.output
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "x" not in index and all("/" not in f for f in index.values())
