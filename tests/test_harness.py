"""The harness itself: results come back, a raising rank fails with its traceback, a hang times out."""

import time

import pytest
import torch
import torch.distributed as dist

from harness import RankFailed, RanksTimedOut, run_cli, run_ranks


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world, t.item()


def _raise_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()
    return rank


def _hang_on_one(rank, world):
    if rank == 1:
        time.sleep(600)
    return rank


def test_results_from_all_ranks():
    out = run_ranks(_sum_ranks, 3, timeout=60)
    assert out == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_raising_rank_fails_with_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed) as e:
        run_ranks(_raise_on_one, 2, timeout=60, collective_timeout=20)
    assert "rank 1 failed" in str(e.value) and "boom from rank one" in str(e.value)
    assert "Traceback" in str(e.value)
    assert time.monotonic() - start < 50


def test_hanging_rank_times_out():
    start = time.monotonic()
    # rank 1 hangs; rank 0 normally answers first, but on a loaded machine it may still be importing
    with pytest.raises(RanksTimedOut, match=r"rank\(s\) \[(0, )?1\] did not finish within 5s"):
        run_ranks(_hang_on_one, 2, timeout=5)
    assert time.monotonic() - start < 50


def test_run_cli_gives_ranks_torchruns_environment_and_their_output():
    res = run_cli(["cli_probe", "ok", "--flag"], 2, timeout=60)
    assert res.returncode == 0, res.output
    assert res.stdout.splitlines() == ["rank 0/2 sum 3 threads 1 argv ['ok', '--flag']",
                                       "rank 1/2 sum 3 threads 1 argv ['ok', '--flag']"]
    assert res.stderr.splitlines() == ["rank 0 to stderr", "rank 1 to stderr"]


@pytest.mark.parametrize("what, code", [("kill", -9), ("exit", 3)])
def test_run_cli_stops_the_group_when_one_rank_dies(what, code):
    start = time.monotonic()
    res = run_cli(["cli_probe", what], 2, timeout=60)
    assert res.returncode != 0
    assert f"rank 1 exited with {code}" in res.stderr and "rank 1 to stderr" in res.stderr  # kept what it printed
    assert time.monotonic() - start < 30  # rank 0 was stopped, not waited for
