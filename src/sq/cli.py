"""What every sq command line shares: argparse that raises, and ``sq: error:`` on failure."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable

from sq.errors import SqError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default appended (``(default: 128)``) and the epilog's line breaks kept.

    Not for required options, on/off flags, or options without a default (their help says what
    happens then).
    """

    def _get_help_string(self, action):
        default = action.default
        if (action.required or default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or default == [] or "default" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)


class ArgParser(argparse.ArgumentParser):
    """argparse that raises ``SqError`` instead of exiting, so bad flags read like every sq error."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise SqError(message)


def positive_seconds(text: str) -> float:
    """argparse ``type`` of a timeout: a finite number of seconds above 0 (0 would fail every collective)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def run_cli(body: Callable[[], object]) -> int:
    """Run ``body``; an ``SqError`` becomes one ``sq: error:`` line per problem and exit code 2.

    The process group is torn down either way, so no rank lingers in a collective.  Before
    ``body`` runs (and so before any matmul), the CPU kernel caches are bounded
    (``sq.memory.bound_cpu_kernel_caches``: a MoE forward on CPU is a new shape per expert).
    """
    from sq.dist import destroy_distributed
    from sq.memory import bound_cpu_kernel_caches

    bound_cpu_kernel_caches()
    try:
        body()
        return 0
    except SqError as e:
        if _speaks(e.problems):
            for problem in summarize(e.problems):
                print(f"sq: error: {problem}", file=sys.stderr)
        sys.stderr.flush()
        _settle()
        return 2
    except Exception as e:  # noqa: BLE001 - only a collective's timeout is reported here; anything else re-raises
        if not collective_timed_out(e):
            raise
        print(f"sq: error: {_timeout_message()}", file=sys.stderr)
        sys.stderr.flush()
        return 3
    finally:
        try:
            destroy_distributed()
        except Exception:
            pass


def _job_store(prefix: str):
    """The process group's key-value store under ``prefix``: how ranks that may be stuck in a collective
    still tell each other things (which errors were printed, who timed out, who is leaving)."""
    import torch.distributed as dist

    return dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())


def collective_timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a collective or store operation that gave up waiting for another rank (gloo's
    "Timed out waiting ...ms", NCCL's watchdog, the store's socket timeout)."""
    import torch.distributed as dist

    kinds = (RuntimeError, TimeoutError, dist.DistError)
    text = str(e).lower()
    return isinstance(e, kinds) and ("timed out" in text or "timeout" in text)


def _timeout_message(window_s: float = 10.0) -> str:
    """This rank's ``sq: error:`` for a collective timeout: which ranks did not report the same within
    ``window_s`` (the one that stopped answering is among them), and that a rerun resumes.

    Each rank that timed out marks itself in the process group's key-value store; a rank that is
    stopped, dead or stuck cannot.  Where the store itself is gone (its host, rank 0 under torchrun,
    stopped or died), that is what is said."""
    import time

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    head = f"rank {rank}: a collective timed out (--timeout) waiting for another rank"
    tail = "rerun the same command: it resumes from the last block every rank finished"
    try:
        store = _job_store("sq-timeout/")
        store.set(str(rank), "1")
        deadline = time.monotonic() + window_s
        while True:
            silent = [r for r in range(world) if not store.check([str(r)])]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store's host is gone too
        return f"{head}; rank 0 (which hosts the job's key-value store) stopped answering too; {tail}"
    who = (f"rank(s) {silent} did not report the timeout within {window_s:.0f} s (stopped, dead or stuck)"
           if silent else "every rank reports it (a rank was too slow: a larger --timeout may help)")
    return f"{head}; {who}; {tail}"


def summarize(problems: list[str], keep: int = 3) -> list[str]:
    """One summary per cause: problems that differ only in numbers (layers, experts, shapes) are one
    cause; past ``keep`` of them, a count stands for the rest."""
    import re

    causes: dict[str, list[str]] = {}
    for p in problems:
        causes.setdefault(re.sub(r"\d+", "N", p), []).append(p)
    out = []
    for same in causes.values():
        out += same[:keep]
        if len(same) > keep:
            out.append(f"... and {len(same) - keep} more like the line above")
    return out


def _speaks(problems: list[str], timeout_s: float = 5.0) -> bool:
    """Whether this rank prints its problems: rank 0 always; another rank only where its problems
    differ from rank 0's (a refusal raised from shared facts is printed once, not once per rank).
    Compared through the process group's key-value store, not a collective (a rank may be stuck in one)."""
    import hashlib
    import time

    import torch.distributed as dist

    try:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return True
        store = _job_store("sq-errors/")
        digest = hashlib.sha256("\n".join(problems).encode()).hexdigest()
        rank = dist.get_rank()
        if rank == 0:
            store.set("0", digest)
            return True
        deadline = time.monotonic() + timeout_s
        while not store.check(["0"]):
            if time.monotonic() > deadline:
                return True  # rank 0 did not say: speak for oneself
            time.sleep(0.05)
        return store.get("0").decode() != digest
    except Exception:  # noqa: BLE001 - a store that is gone: better twice than never
        return True


def _settle(timeout_s: float = 10.0) -> None:
    """Wait until every rank is here (each has printed its errors) before any rank exits.

    torchrun stops the other ranks as soon as one exits non-zero: without this, a rank that
    printed first and left at once could get the others killed before they said anything.
    The wait runs on the process group's key-value store, not a collective: a rank still
    inside a collective (an error only this rank hit, such as a full disk while it writes)
    cannot hold it past ``timeout_s``, whatever the backend.  sq raises its refusals on every
    rank at the same point, so there every rank arrives within moments.
    """
    import time

    import torch.distributed as dist

    try:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        store = _job_store("sq-settle/")
        world, rank = dist.get_world_size(), dist.get_rank()
        deadline = time.monotonic() + timeout_s

        def wait_for(key: str, n: int) -> bool:
            while store.add(key, 0) < n:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
            return True

        store.add("arrived", 1)
        if wait_for("arrived", world) and rank != 0:
            store.add("seen", 1)
        elif rank == 0:
            # rank 0 hosts the store under torchrun: it leaves last, so no rank polls a closed store
            wait_for("seen", world - 1)
    except Exception:  # noqa: BLE001 - best effort: the error is already printed
        pass


def exit_process(code: int) -> None:
    """Leave a command-line run at once, after its process group is gone.

    ``os._exit`` skips interpreter finalization: a gloo group that FSDP2 or a DeviceMesh still
    references outlives ``destroy_process_group``, and joining its worker threads during
    finalization can abort the process ("terminate called without an active exception") after
    the work was done.  Every file sq writes is closed and fsynced before this point.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
