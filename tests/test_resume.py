"""Crash and resume: SIGKILL at every fault point, rerun, and every output tensor is bit-identical.

The fault hook (``SQ_FAULT=point:rank[:block]``, read only by the CLI) SIGKILLs one rank at a
named point; the launcher then stops the other rank, as a dead node would.  The CLI runs on
ranks forked by ``harness.run_cli`` (torchrun's environment and stop-on-failure, without its
~6 s of imports per launch); ``test_killed_peer_ends_the_job_quickly`` keeps real torchrun.  The rerun is the very
same command.  Control runs are uninterrupted runs of the same job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from harness import run_cli, run_ranks, run_torchrun
from test_hostile import _hold_lock
from quant_ref import quantize_jobs
from test_ptq_moe import _same_bits

GS = 16
# Kill chains.  The first kill is at block 1; each later one (no block given) fires at the first
# block its rerun works on.  A rerun can restart past the killed block (the other rank's shard of
# it may survive from an earlier kill), so the order keeps at least one block for every point on
# the 2-block MoE fixture: the points that leave a block undone on one rank come first.
POINTS_GPTQ = ["calib:0:1", "manifest-replace:1", "after-shard-write:1", "mid-shard-write:0", "index-merge:0"]
POINTS_RTN = ["after-shard-write:0:1", "manifest-replace:0", "mid-shard-write:1", "index-merge:0"]


def _args(model, out, algo):
    a = ["sq.ptq", "--model", str(model), "--output", str(out), "--algo", algo, "--group-size", str(GS),
         "--nsamples", "4", "--seqlen", "16", "--timeout", "60"]
    if algo == "signround":
        a += ["--iters", "8", "--batch-size", "2"]
    return a


def _config(model, out, algo) -> dict:
    """``_args`` as PTQConfig fields."""
    job = dict(model=str(model), output=str(out), algo=algo, group_size=GS, nsamples=4, seqlen=16, timeout_s=60)
    if algo == "signround":
        job.update(iters=8, batch_size=2)
    return job


@pytest.fixture(scope="module")
def controls(checkpoints, tmp_path_factory):
    """Uninterrupted runs of every job the tests kill, in one pair of processes (the same
    ``quantize_model`` the CLI calls, one thread per rank as under the harness's torchrun)."""
    root = tmp_path_factory.mktemp("controls")
    jobs = [("llama", "rtn"), ("llama", "gptq"), ("qwen3_moe", "rtn"), ("qwen3_moe", "gptq"), ("llama", "signround")]
    out = {(arch, algo): root / f"{arch}-{algo}" for arch, algo in jobs}
    errors = run_ranks(quantize_jobs, 2, [_config(checkpoints[a], out[a, g], g) for a, g in jobs], timeout=600)[0]
    assert errors == [None] * len(jobs), errors
    return out


@pytest.fixture(scope="module")
def partial(checkpoints, tmp_path_factory):
    """A GPTQ run of the Llama killed after rank 0 wrote block 1's shard (copied by the tests that need one)."""
    out = tmp_path_factory.mktemp("partial") / "o"
    res = run_cli(_args(checkpoints["llama"], out, "gptq"), 2, timeout=300,
                       env={"SQ_FAULT": "after-shard-write:0:1"})
    assert res.returncode != 0 and (out / ".sq-run" / "run.json").exists()
    return out


def _n_blocks(ckpt: Path) -> int:
    return json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]


def _kill_chain(checkpoints, controls, tmp_path, arch, algo, faults, after_first=None):
    """Kill at each fault point in turn, every rerun resuming from the state the last kill left.

    Each killed rerun is a resume from the previous point: it must restart at a block the
    ranks agree on (never before the first killed block, never going back) and redo what
    the kill left unfinished; the last, uninterrupted rerun must end bit-identical to the
    control.  One launch per point plus one, instead of two per point.
    """
    out = tmp_path / "o"
    n_blocks = _n_blocks(checkpoints[arch])
    restarts = []
    for fault in [*faults, None]:
        env = {"SQ_FAULT": fault} if fault else {}
        res = run_cli(_args(checkpoints[arch], out, algo), 2, timeout=300, env=env)
        found = re.findall(rf"resuming at block (\d+) of {n_blocks}", res.output)
        if fault != faults[0]:
            # the whole log on failure (a killed rerun that never said where it resumed was seen once in
            # ~25 runs; its tail alone did not show why)
            assert len(found) == 1, (fault, res.codes, res.output)
            restarts.append(int(found[0]))
        if fault is None:
            assert res.returncode == 0, res.output[-3000:]
            break
        assert res.returncode != 0, f"the fault {fault} did not fire"
        assert f"fault injection: SIGKILL at {fault.split(':')[0]}" in res.output
        assert not (out / "model.safetensors.index.json").exists() or (out / ".sq-run").exists()
        if fault == faults[0] and after_first is not None:
            after_first(out)
    # block 0 was finished by both ranks before the first kill (at block 1); restart points never go
    # back; after the index-merge kill only the final stage is left
    assert restarts[0] >= 1 and restarts == sorted(restarts), restarts
    assert restarts[-1] == n_blocks, restarts
    assert _same_bits(controls[arch, algo], out) == []
    for name in ("model.safetensors.index.json", "config.json"):
        assert (out / name).read_text() == (controls[arch, algo] / name).read_text()
    assert not (out / ".sq-run").exists()
    assert json.loads((out / "sq_report.json").read_text())["resumed_from_block"] == n_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_gptq_killed_at_every_point_resumes_bit_identical(checkpoints, controls, tmp_path, arch):
    _kill_chain(checkpoints, controls, tmp_path, arch, "gptq", POINTS_GPTQ)


def test_signround_killed_mid_block_and_between_blocks_resumes_bit_identical(checkpoints, controls, tmp_path):
    """Both chains come back from the cache: a block re-tuned from rebuilt inputs would differ."""
    def both_chains_cached(out):
        from safetensors import safe_open

        with safe_open(str(out / ".sq-run" / "rank-00000" / "chain-00001.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert any(k.startswith("h") for k in keys) and any(k.startswith("f") for k in keys), keys

    _kill_chain(checkpoints, controls, tmp_path, "llama", "signround", POINTS_GPTQ, after_first=both_chains_cached)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_rtn_killed_at_every_point_resumes_bit_identical(checkpoints, controls, tmp_path, arch):
    _kill_chain(checkpoints, controls, tmp_path, arch, "rtn", POINTS_RTN)


def test_enospc_is_a_clean_error_then_resumes(checkpoints, controls, tmp_path):
    out = tmp_path / "o"
    res = run_cli(_args(checkpoints["llama"], out, "gptq"), 2, timeout=300, env={"SQ_FAULT": "enospc:1:1"})
    assert res.returncode != 0
    assert "sq: error: no space left on the device while writing" in res.stderr
    assert "model-rank00001-block00001.safetensors" in res.stderr
    assert not list(out.glob(".*.tmp"))
    res = run_cli(_args(checkpoints["llama"], out, "gptq"), 2, timeout=300)
    assert res.returncode == 0, res.output[-3000:]
    assert _same_bits(controls["llama", "gptq"], out) == []


def test_finished_output_is_never_touched(checkpoints, controls):
    done = controls["llama", "rtn"]
    before = {p.name: p.stat().st_mtime_ns for p in done.iterdir()}
    res = run_cli(_args(checkpoints["llama"], done, "rtn"), 2, timeout=120)
    assert res.returncode == 0 and "already complete" in res.stdout
    assert {p.name: p.stat().st_mtime_ns for p in done.iterdir()} == before


def _partial_run(partial, out):
    shutil.copytree(partial, out)


def test_signature_changes_are_refused_by_name(checkpoints, partial, tmp_path):
    out = tmp_path / "o"
    _partial_run(partial, out)
    manifest = (out / ".sq-run" / "rank-00000" / "manifest.json").read_text()
    base = dict(model=str(checkpoints["llama"]), output=str(out), algo="gptq", group_size=GS, nsamples=4, seqlen=16)
    changes = {"args.group_size": dict(group_size=32), "args.nsamples": dict(nsamples=6),
               "args.seqlen": dict(seqlen=8), "args.seed": dict(seed=1), "args.scheme": dict(scheme="W8A16"),
               "args.ignore": dict(ignore=("down_proj",)), "algorithm.name": dict(algo="rtn")}
    msgs = run_ranks(quantize_jobs, 2, [{**base, **c} for c in changes.values()], timeout=300)[0]
    for field, msg in zip(changes, msgs):
        assert msg is not None and field in msg and "--resume never" in msg, (field, msg)
    # a different world size is refused too
    world1 = run_ranks(quantize_jobs, 1, [base], timeout=120)[0][0]
    assert world1 is not None and "world_size" in world1
    # the source checkpoint changed on disk
    shard = sorted(Path(checkpoints["llama"]).glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        msg = run_ranks(quantize_jobs, 2, [base], timeout=120)[0][0]
        assert msg is not None and f"source.files.{shard.name}" in msg
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (out / ".sq-run" / "rank-00000" / "manifest.json").read_text() == manifest  # nothing touched


def test_resume_never_require_and_corrupt_state(checkpoints, controls, partial, tmp_path):
    base = dict(model=str(checkpoints["llama"]), algo="gptq", group_size=GS, nsamples=4, seqlen=16)
    fresh = tmp_path / "fresh"
    msg = run_ranks(quantize_jobs, 2, [dict(output=str(fresh), resume="require", **base)], timeout=120)[0][0]
    assert msg is not None and "holds no run to resume" in msg

    out = tmp_path / "o"
    _partial_run(partial, out)
    # corrupt the chain cache and a finished shard: both are detected and their blocks redone
    chain = next((out / ".sq-run" / "rank-00001").glob("chain-*.safetensors"))
    chain.write_bytes(chain.read_bytes()[:-7] + b"garbage")
    res = run_cli(_args(checkpoints["llama"], out, "gptq"), 2, timeout=300)
    assert res.returncode == 0, res.output[-3000:]
    assert json.loads((out / "sq_report.json").read_text())["resumed_from_block"] < 2
    assert _same_bits(controls["llama", "gptq"], out) == []

    again = tmp_path / "again"
    _partial_run(partial, again)
    (again / ".sq-run" / "rank-00000" / "manifest.json").write_text("{not json")
    res = run_cli(_args(checkpoints["llama"], again, "gptq") + ["--resume", "never"], 2, timeout=300)
    assert res.returncode == 0, res.output[-3000:]
    assert json.loads((again / "sq_report.json").read_text())["resumed_from_block"] == 0
    assert _same_bits(controls["llama", "gptq"], again) == []


def test_lock_refuses_a_live_run_and_takes_over_a_dead_one(checkpoints, partial, tmp_path):
    import socket

    out = tmp_path / "o"
    _partial_run(partial, out)
    lock = out / ".sq-run" / "lock"
    holder = _hold_lock(lock)  # a live run's rank 0 holds the flock for the whole run
    try:
        res = run_cli(_args(checkpoints["llama"], out, "gptq"), 2, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert res.returncode != 0 and "is being written by another sq run" in res.stderr
    # a record naming a live pid on this host without the flock is stale (the pid was reused)
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    res = run_cli(_args(checkpoints["llama"], out, "gptq"), 2, timeout=300)
    assert res.returncode == 0 and "taking over the lock of dead run" in res.output


def test_killed_peer_ends_the_job_quickly(checkpoints, tmp_path):
    start = time.monotonic()
    res = run_torchrun(_args(checkpoints["llama"], tmp_path / "o", "gptq"), 2, timeout=120,
                       env={"SQ_FAULT": "calib:1:0"})
    assert res.returncode != 0
    assert "rank      : 1" in res.stderr or "local_rank: 1" in res.stderr  # torchrun names the dead rank
    assert time.monotonic() - start < 90


def test_lock_of_the_same_slurm_job_on_another_host_is_taken_over(tmp_path, monkeypatch):
    """A requeued Slurm job may land on other nodes: its own old lock is taken over, another job's is not."""
    from sq.errors import SqError
    from sq.resume import RunState

    state = RunState(tmp_path / "o", 0)
    state.root.mkdir(parents=True)
    lock = state.root / "lock"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock.write_text(json.dumps({"pid": 1, "host": "node-a-that-is-gone", "slurm_job_id": "4242"}))
    state.take_lock()
    assert json.loads(lock.read_text())["slurm_job_id"] == "4242"
    lock.write_text(json.dumps({"pid": 1, "host": "node-a-that-is-gone", "slurm_job_id": "777"}))
    with pytest.raises(SqError, match="is locked by a run on host node-a-that-is-gone"):
        state.take_lock()
    monkeypatch.delenv("SLURM_JOB_ID")
    lock.write_text(json.dumps({"pid": 1, "host": "node-a-that-is-gone"}))
    with pytest.raises(SqError, match="if that run is dead, delete"):
        state.take_lock()


def test_a_rank_two_records_ahead_still_shares_a_restart_point(tmp_path):
    """The records run behind the computation: a rank killed while its files of block k are written
    (its main thread done with block k + 1, whose collectives let the other rank finish k + 1 and
    record it) has recorded blocks < k, the other rank blocks <= k + 1.  Both can restart at k only
    if the rank ahead still holds block k's inputs: three chains are kept, not two (with two, the
    rerun started over at block 0, an intermittent failure of the kill-chain tests)."""
    import torch

    from sq.resume import RunState

    def run_blocks(rank, recorded):
        state = RunState(tmp_path / "o", rank)
        for b in range(recorded):  # write_block(b): the block's files, the next block's inputs, the record
            f = tmp_path / "o" / f"r{rank}-b{b}.bin"
            f.write_bytes(b"x")
            state.write_chain(b + 1, [torch.full((2,), float(b))])
            state.record_block(b, {f.name: {"size": 1, "sha256": __import__("hashlib").sha256(b"x").hexdigest(),
                                            "tensors": []}})
        return state

    (tmp_path / "o").mkdir()
    k, n_blocks = 2, 5
    behind, ahead = run_blocks(0, k), run_blocks(1, k + 2)
    points = [set(s.restart_points(need_chain=True, n_blocks=n_blocks)) for s in (behind, ahead)]
    assert max(set.intersection(*points)) == k, points
