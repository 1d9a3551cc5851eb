"""What every sq command line shares: argparse that raises, and ``sq: error:`` on failure."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable

from sq.errors import SqError


class ArgParser(argparse.ArgumentParser):
    """argparse that raises ``SqError`` instead of exiting, so bad flags read like every sq error."""

    def error(self, message: str):
        raise SqError(message)


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
        for problem in e.problems:
            print(f"sq: error: {problem}", file=sys.stderr)
        sys.stderr.flush()
        _settle()
        return 2
    finally:
        try:
            destroy_distributed()
        except Exception:
            pass


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
        store = dist.PrefixStore("sq-settle/", dist.distributed_c10d._get_default_store())
        world = dist.get_world_size()
        deadline = time.monotonic() + timeout_s
        if store.add("arrived", 1) >= world:
            return
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if store.add("arrived", 0) >= world:
                return
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
