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
# modeling_llama: the Llama fixture most CLI tests build is ~2 s of CPU to import in each rank.
# matplotlib's figure and Agg canvas: every finished job draws sq_report.png on rank 0 (0.5 s of imports).
_PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "safetensors.torch", "sq.pipeline.job",
            "sq.load.meta", "sq.quant.signround", "sq.ptq", "transformers.models.llama.modeling_llama",
            "matplotlib.figure", "matplotlib.backends.backend_agg"]


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
        dist.init_process_group(  # NCCL with gloo beside it for CPU tensors, as sq.dist does
            "cpu:gloo,cuda:nccl" if backend == "nccl" else backend, store=store, rank=rank, world_size=world,
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
    codes: list[int | None] | None = None  # each rank's exit code (run_cli only)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _rank_env(env: dict[str, str] | None) -> dict[str, str]:
    """The caller's environment for a launched rank: one torch thread, unbuffered, then ``env``."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}


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
    full_env = _rank_env(env)
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


def _cli_rank(module, argv, rank, world, port, env, cwd, threads, log_prefix):
    """One rank of ``run_cli``: torchrun's environment, stdout/stderr into files, ``python -m``."""
    import runpy

    import torch

    for fd, suffix in ((1, "out"), (2, "err")):
        f = os.open(f"{log_prefix}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # line-buffered, as PYTHONUNBUFFERED would be: a SIGKILLed rank keeps what it printed
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    os.chdir(cwd)
    torch.set_num_threads(threads)
    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught exception in ``python -m`` would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free right now (all held open together, then released)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_cli(
    module_and_args: list[str],
    nproc: int,
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    stop_on_failure: bool = True,
) -> TorchrunResult:
    """``run_torchrun``'s contract with ranks forked from the preloaded forkserver instead.

    Each rank gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR/PORT), one torch thread unless ``env`` sets OMP_NUM_THREADS, and runs
    ``python -m MODULE ARGS`` as ``__main__``; as under torchrun, the first rank to exit
    non-zero (or die) has the others killed, and the return code is non-zero.  stdout and
    stderr are each rank's streams, rank by rank.  A torchrun launch spends ~6 s of the
    2 cores importing torch in three fresh interpreters; this spends none.  Real torchrun
    stays where the launcher is the subject (its error report, Slurm templates, memory of
    a fresh process).  ``stop_on_failure=False`` lets every rank finish on its own (within
    ``timeout``) so a test can check each rank's exit code (``TorchrunResult.codes``).
    """
    full_env = _rank_env(env)
    threads = int(full_env["OMP_NUM_THREADS"])
    ctx = _context("forkserver")
    (port,) = free_ports(1)
    with tempfile.TemporaryDirectory(prefix="sq-cli-") as tmp:
        logs = [os.path.join(tmp, f"rank{r}") for r in range(nproc)]
        procs = [ctx.Process(target=_cli_rank, args=(module_and_args[0], module_and_args[1:], r, nproc, port,
                                                     full_env, cwd or os.getcwd(), threads, logs[r]))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.exitcode is None for p in procs):
                if stop_on_failure and any(p.exitcode not in (None, 0) for p in procs):
                    break  # torchrun stops the group when one rank fails
                if time.monotonic() > deadline:
                    raise RanksTimedOut(f"{' '.join(module_and_args)} on {nproc} forked ranks timed out after "
                                        f"{timeout:.0f}s\n{_read_logs(logs)[1][-4000:]}")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
        codes = [p.exitcode for p in procs]
        out, err = _read_logs(logs)
    failed = [(r, c) for r, c in enumerate(codes) if c not in (0, None)]
    if failed:
        err += "".join(f"sq-test-launcher: rank {r} exited with {c}\n" for r, c in failed)
    return TorchrunResult(1 if failed or None in codes else 0, out, err, codes)


def _read_logs(logs: list[str]) -> tuple[str, str]:
    def read(path):
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    return "".join(read(f"{p}.out") for p in logs), "".join(read(f"{p}.err") for p in logs)


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
