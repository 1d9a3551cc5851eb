"""Multi-rank test harness: run a function on N gloo ranks in spawned processes.

Each rank joins a process group through a FileStore in a fresh temp folder, so tests
running side by side never fight over ports.  The harness returns every rank's result,
fails with the failing rank's traceback, and kills every process after ``timeout`` so a
hung rank fails the test instead of freezing CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


class RankFailed(AssertionError):
    pass


class RanksTimedOut(AssertionError):
    pass


def _child(fn, rank, world, store_path, args, kwargs, out_q, threads, collective_timeout, backend):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        result = fn(rank, world, *args, **kwargs)
        out_q.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        out_q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout: float = 120.0,
    threads: int = 1,
    collective_timeout: float = 60.0,
    backend: str = "gloo",
    **kwargs,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results by rank.

    ``backend`` is gloo (CPU) or nccl (one GPU per rank, ``tests_gpu/``).

    ``fn`` must be importable (module level).  The first rank to raise fails the call with
    its traceback; the remaining ranks are killed.  Past ``timeout`` every rank is killed
    and the ranks that had not answered are named.
    """
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sq-harness-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, store_path, args, kwargs, out_q, threads, collective_timeout, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise RanksTimedOut(f"rank(s) {missing} did not finish within {timeout:.0f}s")
                try:
                    rank, ok, payload = out_q.get(timeout=min(left, 0.5))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results
                            and p.exitcode not in (0, None)]
                    if dead:
                        # Give its queued message a moment to arrive before blaming a silent death.
                        try:
                            rank, ok, payload = out_q.get(timeout=2.0)
                        except queue.Empty:
                            raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                    else:
                        continue
                if not ok:
                    raise RankFailed(f"rank {rank} failed:\n{payload}")
                results[rank] = payload
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


@dataclass
class TorchrunResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_torchrun(
    module_and_args: list[str],
    nproc: int,
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> TorchrunResult:
    """``torchrun --nproc-per-node N -m MODULE ARGS...`` as a subprocess with a timeout.

    Each rank runs one torch thread (``OMP_NUM_THREADS=1``) unless ``env`` says otherwise.
    A run past ``timeout`` has its whole process group killed and raises ``RanksTimedOut``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", *module_and_args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise RanksTimedOut(f"torchrun {' '.join(module_and_args)} timed out after {timeout:.0f}s\n"
                            f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}")
    return TorchrunResult(proc.returncode, out, err)


def run_python(module_and_args: list[str], *, timeout: float = 300.0, env=None, cwd=None) -> TorchrunResult:
    """``python -m MODULE ARGS...`` (one process) with a timeout."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", *module_and_args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise RanksTimedOut(f"python -m {' '.join(module_and_args)} timed out after {timeout:.0f}s\n{err[-4000:]}")
    return TorchrunResult(proc.returncode, out, err)
