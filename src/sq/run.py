"""One run's lifecycle, the same for every source of work (the block pipeline, model-free).

    refuse together -> agree on the job -> claim the output folder (verdict on rank 0; lock, clear, sign)
    -> agree on the restart point (manifests) -> per block: write_block (a background thread, one block
    behind: shard, chain cache, manifest) -> finish (every rank's fragments gathered; rank 0 writes the
    config, side files, report and, last, the merged index; the run folder removed)

A driver (``sq.pipeline.blocks``, ``sq.modelfree.quantize``) decides what each block's tensors are;
this module decides what happens to the folder, in what order, and where a test's fault (``SQ_FAULT``)
fires, so a kill at any point leaves the same resumable state whichever driver ran.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from sq.agree import agree, job_facts
from sq.dist import all_ok, broadcast_object, rank0_stage
from sq.errors import SqError
from sq.export import writer
from sq.files import LOG_DIR, REPORT_NAME, RUN_DIR, shard_name, written_by_sq
from sq.formats.compressed import quantization_config
from sq.report import add_log_file, remove_log_file
from sq.resume import (
    Fault,
    RunState,
    describe_diff,
    maybe_die,
    signature_diff,
    signature_sha,
)

logger = logging.getLogger(__name__)

__all__ = ["Run", "raise_all", "claim_output", "output_verdict", "versions", "signature"]


def raise_all(problems: list[str], what: str) -> None:
    """Every rank raises together (the same problems where they are the same), or none does."""
    all_ok(not problems, what)
    if problems:
        raise SqError(problems)


def versions() -> dict[str, Any]:
    import compressed_tensors
    import transformers

    from sq.version import __version__

    return {"sq": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "compressed_tensors": compressed_tensors.__version__}


def signature(*, source, args: dict, algorithm: dict, schemes: dict, assignment: dict, world: int, blocks: list,
              **extra) -> dict:
    """What a resumed run must share with the run it continues: the source, the job's settings that change
    bits, the algorithm's config, the resolved module -> scheme assignment, the world, the blocks; ``extra``
    (a driver's own facts) after them."""
    return {"source": source, "args": args, "algorithm": algorithm, "schemes": schemes, "assignment": assignment,
            "world_size": world, "blocks": blocks, "versions": versions(), **extra}


def output_verdict(out: Path, sig: dict, resume: str, state: RunState) -> dict:
    """What to do with ``--output`` (rank 0, read-only): ``{"action", "problems"}``.

    action: ``fresh`` (empty or new), ``resume`` (an unfinished run of the same signature),
    ``replace`` (remove what sq wrote there, keep anything else, start over), ``complete``
    (a finished output of the same signature).  Completion and resumption are decided from the
    stored signature, never from the mere presence of files.
    """
    def verdict(action, *problems):
        return {"action": action, "problems": list(problems)}

    again = "rerun with the same command, or pass --resume never to start over"
    try:
        unfinished = state.read_signature()
    except SqError as e:
        return verdict("replace") if resume == "never" else verdict("refuse", *e.problems)
    if unfinished is not None:
        if resume == "never":
            return verdict("replace")
        changed = signature_diff(unfinished, sig)
        if not changed:
            return verdict("resume")
        if not state.any_block_done():  # nothing worth keeping: a refused or failed start
            logger.info("%s holds an unfinished run with other settings that completed no block; starting over", out)
            return verdict("replace")
        return verdict("refuse", f"{out} holds an unfinished run with different settings ({describe_diff(changed)}); "
                                 f"{again}")
    if resume == "require":
        return verdict("refuse", f"--resume require: {out} holds no run to resume")
    finished = writer.finished_signature(out)
    if finished is not None:
        changed = signature_diff(finished, sig)
        if resume == "never":
            return verdict("replace")
        if not changed:
            return verdict("complete")
        return verdict("refuse", f"{out} holds a finished sq checkpoint made with different settings "
                                 f"({describe_diff(changed)}); choose another folder, or pass --resume never to replace it")
    problems = writer.output_dir_problems(out)  # anything but .sq-run/ there: never overwritten
    if problems:
        return verdict("refuse", *problems)
    if (out / RUN_DIR).is_dir() and any(p.name != "lock" for p in (out / RUN_DIR).iterdir()):
        return verdict("replace")  # a run folder that never got a signature (killed while starting)
    return verdict("fresh")


def output_problems(out: Path, resume: str) -> list[str]:
    """What ``--output`` holds, refused as the job refuses it where that does not need the run's signature
    (``sq.run.output_verdict``): an unreadable run record, ``--resume require`` with nothing to resume, a
    folder holding files sq did not write.  A folder holding an unfinished run or a finished output is planned
    as the job would continue it (whether its settings match is decided by the job, which computes them)."""
    out = Path(out)
    if not out.is_dir():
        return [f"--resume require: {out} holds no run to resume"] if resume == "require" else []
    try:
        unfinished = RunState(out, rank=0).read_signature()
    except SqError as e:
        return [] if resume == "never" else e.problems
    if unfinished is not None:
        return []
    if resume == "require":
        return [f"--resume require: {out} holds no run to resume"]
    if writer.finished_signature(out) is not None:
        return []
    return writer.output_dir_problems(out)


def claim_output(out: Path, sig: dict, resume: str, state: RunState, rank: int) -> str:
    """Decide on rank 0, refuse together, then take the folder (lock first, then clear, then sign).
    Returns the action; ``complete`` means there is nothing to do."""
    verdict = broadcast_object(output_verdict(out, sig, resume, state) if rank == 0 else None)
    raise_all(verdict["problems"], "output folder checks")
    if verdict["action"] == "complete":
        return "complete"
    problems = []
    if rank == 0:
        try:
            state.take_lock()
            # under the lock, the folder must still be what the verdict was made from
            if output_verdict(out, sig, resume, state) != verdict:
                raise SqError(f"{out} changed while this run was starting (another sq run?); run the command again")
            if verdict["action"] == "replace":
                removed = state.clear(written_by_sq)
                logger.info("removed the previous run's files from %s: %s", out, ", ".join(removed) or "none")
            if verdict["action"] != "resume":
                state.write_signature(sig)
        except SqError as e:
            problems += e.problems
        except OSError as e:
            problems.append(f"cannot write to --output {out}: {e.strerror or e}")
    raise_all(problems, "taking the output folder")
    return verdict["action"]


def _no_space_injected() -> None:
    """``SQ_FAULT=enospc:RANK:BLOCK`` (tests): the disk fills up halfway through that block's file."""
    raise OSError(28, "No space left on device (injected)")


class BlockFiles:
    """One background thread for each block's file I/O (serialization, fsyncs), at most one block
    behind the computation: ``submit`` first waits for the previous block's files, so the manifest
    records blocks in order and ranks stay within one block of each other, as resume expects (a kill
    anywhere leaves what a sequential loop killed there leaves).  An error (ENOSPC) or a fault there
    surfaces on the next ``submit`` or on ``close``; after one, nothing more is written."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sq-files")
        self._pending: Future | None = None
        # False (--fit-memory's choice): each block's files written before the next block starts, so its tensors
        # and their serialized bytes are gone by then; the files are the same
        self.overlap = True

    def wait(self) -> float:
        """Seconds spent waiting for the pending block's files (0 if none)."""
        if self._pending is None:
            return 0.0
        t = time.perf_counter()
        pending, self._pending = self._pending, None
        pending.result()
        return time.perf_counter() - t

    def submit(self, fn: Callable[[], None]) -> float:
        waited = self.wait()
        self._pending = self._pool.submit(fn)
        return waited if self.overlap else waited + self.wait()

    def close(self, check: bool = True) -> None:
        """Wait for what was submitted; ``check``: raise its error, if any."""
        try:
            self.wait()
        except BaseException:
            if check:
                raise
        finally:
            self._pool.shutdown(wait=True)


class Run:
    """The output folder and resume state of one job on this rank, from the claim to the final stage."""

    def __init__(self, out: str | Path, *, bookkeeping: bool = True, fault: str | None = None):
        self.out = Path(out)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.state = RunState(self.out, self.rank, enabled=bookkeeping)
        self.bookkeeping = bookkeeping
        self.fault = Fault.parse(fault)
        self.files = BlockFiles()
        self.fragments: dict[str, str] = {}  # checkpoint key -> the file of this rank's that holds it
        self.skipped: list[str] = []  # Linears left unquantized for NaN/Inf, in block order
        self.book_s: dict[int, float] = {}  # resume bookkeeping seconds by block (checksums, chain, manifest)
        self.sig: dict = {}

    def claim(self, sig: dict, resume: str, problems: list[str], **facts) -> bool:
        """Every rank agrees on the job (``sq.agree``: signature, output, ``facts``), refuses ``problems``
        together, then the folder is claimed; False when it already holds this job's finished output."""
        self.sig = sig
        agree(job_facts(sig, output=str(self.out.absolute()), **facts), "job")
        raise_all(problems, "model and output checks")
        if claim_output(self.out, sig, resume, self.state, self.rank) == "complete":
            logger.info("%s is already complete (same model and settings); nothing to do", self.out)
            return False
        return True

    @contextlib.contextmanager
    def log_file(self):
        """This rank's log appended to ``OUT/sq_logs/rank-RRRRR.log`` while the claimed run goes on."""
        handler = add_log_file(self.out / LOG_DIR / f"rank-{self.rank:05d}.log")
        try:
            yield
        finally:
            remove_log_file(handler)

    def recorded_signature(self) -> dict | None:
        """The signature this folder's unfinished run, else its finished output, recorded (None: none,
        or unreadable: the claim names that), read by rank 0 and the same on every rank."""
        def read() -> dict | None:
            for read_sig in (self.state.read_signature, lambda: writer.finished_signature(self.out)):
                try:
                    sig = read_sig()
                except SqError:
                    continue
                if sig:
                    return sig
            return None

        return broadcast_object(read() if self.rank == 0 else None)

    def restart(self, n_blocks: int, need_chain: bool) -> int:
        """The largest block every rank can restart from; the manifests' blocks before it kept, their
        fragments and skipped Linears taken back."""
        self.state.load_manifest()
        points = [None] * self.world
        dist.all_gather_object(points, self.state.restart_points(need_chain=need_chain, n_blocks=n_blocks))
        start = max(set.intersection(*(set(p) for p in points)))
        self.fragments = self.state.truncate(start)
        self.skipped = [n for entry in self.state.manifest["blocks"] for n in entry.get("skipped_nonfinite", [])]
        if start:
            logger.info("resuming at block %d of %d (blocks before it verified on every rank)", start, n_blocks)
        return start

    def fault_point(self, point: str, b: int) -> None:
        """Test-only (``SQ_FAULT``) kill or stop inside block ``b``'s computation, fired once every rank's
        files of the blocks before ``b`` are durable: the files run up to one block behind, so without this
        wait what the kill leaves (and where the rerun resumes) would depend on timing."""
        f = self.fault
        if f is None or f.point != point or (f.block is not None and f.block != b):
            return
        self.files.wait()
        dist.barrier()
        maybe_die(f, point, self.rank, b)

    def write_block(self, b: int, tensors: dict[str, torch.Tensor], skipped: list[str],
                    chain: list | None = None, fp_chain: list | None = None) -> float:
        """Block ``b``'s shard of this rank, then the next block's calibration inputs (``chain``; the
        full-precision ``fp_chain`` where kept), then the manifest entry that marks ``b`` done, in that order,
        in the background.  Returns the seconds spent waiting for the previous block's files."""
        rank, fault = self.rank, self.fault
        shard = shard_name(rank, b)
        die = None
        if fault is not None and fault.hit("mid-shard-write", rank, b):
            die = lambda: maybe_die(fault, "mid-shard-write", rank, b)  # noqa: E731
        elif fault is not None and fault.hit("enospc", rank, b):
            die = _no_space_injected
        self.skipped += skipped

        def files() -> None:
            book = {}  # resume bookkeeping: checksum, chain cache, manifest (reported on its own)
            rec = writer.write_shard(self.out, shard, tensors, die_midway=die, checksum=self.bookkeeping, timings=book)
            maybe_die(fault, "after-shard-write", rank, b)
            if rec:
                self.fragments.update({k: shard for k in rec["tensors"]})
            t_book = time.perf_counter()
            if chain is not None:
                self.state.write_chain(b + 1, chain, fp_chain)
            self.state.record_block(b, {shard: rec} if rec else {}, fault, skipped=skipped)
            self.book_s[b] = book.get("checksum", 0.0) + time.perf_counter() - t_book

        return self.files.submit(files)

    def gather(self, mine: Any = None) -> tuple[list[dict], list[list[str]], list]:
        """After the last block (one collective): every rank's fragments, skipped Linears and ``mine``."""
        every = [None] * self.world
        dist.all_gather_object(every, (self.fragments, self.skipped, mine))
        frags, skipped, mine_all = zip(*every)
        return list(frags), list(skipped), list(mine_all)

    def final(self, stage: Callable[[], dict]) -> dict:
        """Rank 0's final stage, every rank waiting for its verdict; the report on rank 0, ``{}`` elsewhere."""
        return rank0_stage(stage, "writing the config, report and index") or {}

    def write_final(self, config: dict, groups: dict, unquantized: list[str], report: dict, frags: list[dict],
                    side_files: Callable[[], list], kv_cache=None, before_index: Callable[[], None] | None = None,
                    transforms: dict | None = None) -> None:
        """Rank 0: the config with its ``quantization_config``, the side files, the report (with the run's
        signature, which a rerun compares itself with), ``before_index``; the merged index last, which
        makes the folder a checkpoint; then the run folder goes."""
        config = dict(config)
        config["quantization_config"] = quantization_config(groups, unquantized, kv_cache_scheme=kv_cache,
                                                            transform_config=transforms)
        writer.write_json(self.out / "config.json", config)
        report["side_files"] = side_files()
        report["run_signature"], report["run_signature_sha256"] = self.sig, signature_sha(self.sig)
        writer.write_json(self.out / REPORT_NAME, report)
        if before_index is not None:
            before_index()
        writer.merge_index(self.out, frags, before_write=lambda: maybe_die(self.fault, "index-merge", 0))
        self.state.finish()
