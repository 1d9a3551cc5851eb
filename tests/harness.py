"""Multi-rank test harness: run a function on N gloo ranks in fresh processes.

Each rank joins a process group through a FileStore in a fresh temp folder, so tests
running side by side never fight over ports.  The harness returns every rank's result,
fails with the failing rank's traceback, and kills every process after ``timeout`` so a
hung rank fails the test instead of freezing CI.

Ranks are forked from a forkserver that imported torch, transformers and sq once (a spawned
rank spends ~3 s of CPU importing them: the largest part of a small multi-rank test on 2
cores).  The server never computes, so no thread pool is forked.  Each rank gets the caller's
current environment and working directory; a test that needs a module to *import* under its
environment (huggingface_hub reads HF_HUB_OFFLINE at import) passes ``start="spawn"``, as do
NCCL ranks.
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


# What the forkserver imports once; a rank unpickling its function imports the rest.
_PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "safetensors.torch", "sq.quant.blockwise",
            "sq.load.meta", "sq.quant.signround", "sq.ptq"]


def _context(start: str):
    if start == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first forkserver run)
    return ctx


def _child(fn, rank, world, store_path, args, kwargs, out_q, threads, collective_timeout, backend, env, cwd):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
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
    start: str = "forkserver",
    **kwargs,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results by rank.

    ``backend`` is gloo (CPU) or nccl (one GPU per rank, ``tests_gpu/``).  ``start``:
    "forkserver" (default, see the module doc) or "spawn" (a bare interpreter; NCCL always).

    ``fn`` must be importable (module level).  The first rank to raise fails the call with
    its traceback; the remaining ranks are killed.  Past ``timeout`` every rank is killed
    and the ranks that had not answered are named.
    """
    if start not in ("forkserver", "spawn"):
        raise ValueError(f"start must be 'forkserver' or 'spawn', got {start!r}")
    ctx = _context("spawn" if backend == "nccl" else start)
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sq-harness-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, store_path, args, kwargs, out_q, threads, collective_timeout, backend,
                      dict(os.environ), os.getcwd()),
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
