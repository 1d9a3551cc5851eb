"""Process group, device mesh and rank-aware logging.

Only the entry points read the environment; everything below takes plain arguments.
A collective timeout is always set, so a dead peer ends the job instead of hanging it.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from sq.errors import DistError, SqError

DEFAULT_TIMEOUT_S = 600.0
T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    """What torchrun (or a single process) tells us about this rank."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_from_torchrun(environ: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables; (0, 1, 0) when absent."""
    environ = os.environ if environ is None else environ
    return (
        int(environ.get("RANK", 0)),
        int(environ.get("WORLD_SIZE", 1)),
        int(environ.get("LOCAL_RANK", 0)),
    )


def uses_nccl() -> bool:
    """Whether the default group runs NCCL (alone, or beside gloo for CPU tensors): sq then works on
    the rank's GPU."""
    return "nccl" in str(dist.get_backend())


def rank_device() -> torch.device:
    """Where this rank computes: its current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if uses_nccl() else torch.device("cpu")


def init_distributed(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    environ: dict[str, str] | None = None,
) -> DistEnv:
    """Initialize the default process group from torchrun's environment.

    NCCL on CUDA, gloo on CPU.  World size 1 without torchrun still gets a process group
    (a private in-memory store), so FSDP2 and DeviceMesh work unchanged in one process.
    A group that already exists (e.g. a training framework made it) is reused as is.
    """
    use_cuda = torch.cuda.is_available()
    teardown_at_exit()
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = env_from_torchrun(environ)[2]
    else:
        rank, world, local_rank = env_from_torchrun(environ)
        # on CUDA, gloo beside NCCL: NCCL refuses collectives on CPU tensors, which sq's small
        # collectives (report terms, flags) use
        backend = backend or ("cpu:gloo,cuda:nccl" if use_cuda else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        if world == 1 and "MASTER_ADDR" not in (os.environ if environ is None else environ):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    if use_cuda and uses_nccl():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# how long the interpreter, at exit, leaves the GIL to gloo's worker threads (see teardown_at_exit)
QUIESCE_S = 0.25


def _quiesce() -> None:
    if dist.is_initialized():
        time.sleep(QUIESCE_S)


@functools.cache
def teardown_at_exit() -> None:
    """Let gloo's worker threads finish with Python objects before the interpreter finalizes.

    A gloo worker destroys a finished collective's work object after the caller's ``wait`` returned;
    the work holds the collective's tensors, and dropping a Python-backed tensor takes the GIL.  A
    script that returns right after its last collective (``sq.load_sharded``, ``sq.quantize``) could
    reach ``Py_FinalizeEx`` inside that window: the worker's ``take_gil`` then exits the thread, whose
    forced unwind through a ``noexcept`` destructor is ``std::terminate`` -- "terminate called without
    an active exception", exit 1 after the work was done (a core dump shows
    ``AsyncAllgatherWork::~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit``; 4 of 70
    runs of a 2-rank load script).  An ``atexit`` hook, registered once by every sq entry point that uses
    the group, sleeps ``QUIESCE_S`` with the GIL released while the interpreter still runs; the CLI
    leaves through ``sq.cli.exit_process`` (``os._exit``) and never finalizes."""
    atexit.register(_quiesce)


@dataclass(frozen=True)
class ParallelDims:
    """How the world is split: experts across ``ep`` ranks, the rest data/FSDP parallel.

    The mesh is 2-D ``(dp, ep)`` with ``dp * ep == world``.  Dense block weights are
    FSDP2-sharded over the whole world (flattened mesh); routed experts are owned by
    ``ep`` groups and their rows split across ``dp``.
    """

    world_size: int
    ep: int = 1

    def __post_init__(self):
        if self.ep < 1:
            raise SqError(f"--ep must be >= 1, got {self.ep}")
        if self.world_size % self.ep:
            raise SqError(f"--ep {self.ep} does not divide the world size {self.world_size}")

    @property
    def dp(self) -> int:
        return self.world_size // self.ep

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp, self.ep), mesh_dim_names=("dp", "ep"))


def world_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over every rank (dense FSDP2 sharding)."""
    if mesh.ndim == 1:
        return mesh
    return mesh._flatten("world") if "world" not in (mesh.mesh_dim_names or ()) else mesh["world"]


# ---------------------------------------------------------------- agreement helpers


def all_ok(ok: bool, what: str) -> None:
    """Every rank learns whether every rank is fine; a failure elsewhere raises here too.

    Use it before a collective a failing rank would skip: all ranks call it with their
    local verdict, so either all go on or all raise.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    bad = [r for r, f in enumerate(flags) if not f]
    if bad and ok:
        raise DistError(f"{what} failed on rank(s) {bad}")


def rank0_stage(fn: Callable[[], T], what: str) -> T | None:
    """``fn()`` on rank 0, then every rank learns whether it worked before going on: a failure
    there fails the job on every rank (rank 0 re-raises its own error, the others a ``DistError``)
    and no rank tears down while rank 0 still works.  Returns ``fn``'s result on rank 0, None
    elsewhere."""
    result, err = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others heard of it
            err = e
    all_ok(err is None, what)
    if err is not None:
        raise err
    return result


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def run_on_rank0(fn: Callable[[], T], *, what: str, poll_s: float = 1.0) -> T:
    """``fn()`` on rank 0 only; every rank returns its result, or raises an error with its message.

    The other ranks wait in a series of short broadcasts (one per ``poll_s``) rather than
    one long one, so a download of hours never meets the collective timeout; rank 0 runs
    ``fn`` in a thread meanwhile.  ``fn``'s result must be picklable.  An ``SqError`` from
    ``fn`` is raised on every rank with the same problems; any other exception is re-raised
    on rank 0 and reported as a ``DistError`` on the others.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    if dist.get_rank() != 0:
        while (outcome := broadcast_object(None)) is None:
            pass
        kind, payload = outcome
        if kind == "ok":
            return payload
        raise SqError(payload) if kind == "refused" else DistError(payload)

    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["ok"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which re-raises it
            box["error"] = e

    thread = threading.Thread(target=work, name=f"sq rank 0: {what}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=poll_s)
        if thread.is_alive():
            broadcast_object(None)  # "still working": keeps every rank inside short collectives
    error = box.get("error")
    if error is None:
        broadcast_object(("ok", box["ok"]))
        return box["ok"]
    if isinstance(error, SqError):
        broadcast_object(("refused", error.problems))
    else:
        broadcast_object(("crashed", f"{what} failed on rank 0: {type(error).__name__}: {error}"))
    raise error


def all_reduce_min_int(value: int) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if uses_nccl():
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ---------------------------------------------------------------- logging


LOG_FORMAT = logging.Formatter("[sq r%(rank)d %(asctime)s] %(message)s", datefmt="%H:%M:%S")


class RankFilter(logging.Filter):
    """Let records through on rank 0, and warnings/errors on every rank."""

    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING


def setup_logging(rank: int, *, level: int = logging.INFO, all_ranks: bool = False, log_file: str | None = None):
    """Rank-aware logging for the ``sq`` logger tree: rank 0 by default, every rank on warnings."""
    logger = logging.getLogger("sq")
    logger.setLevel(level)
    for h in list(logger.handlers):
        logger.removeHandler(h)
    fmt = LOG_FORMAT
    stream = logging.StreamHandler()
    stream.setFormatter(fmt)
    stream.addFilter(RankFilter(rank, all_ranks))
    stream.addFilter(lambda record: not getattr(record, "file_only", False))  # shown by a progress bar
    logger.addHandler(stream)
    if log_file is not None:
        os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        fh.addFilter(RankFilter(rank, True))
        logger.addHandler(fh)
    logger.propagate = False
    return logger
