"""Crash and resume: the run signature, per-rank manifests, the chain cache, the lock, fault points.

Layout under the output folder::

    .sq-run/run.json                      signature (what must match to resume) + its sha256
    .sq-run/lock                          pid and host of the running job (rank 0)
    .sq-run/rank-NNNNN/manifest.json      blocks completed in order, with the files written
                                          (size, sha256, tensor names)
    .sq-run/rank-NNNNN/chain-BBBBB.safetensors   this rank's inputs of block BBBBB (quantized chain;
                                               SignRound: and the full-precision chain)

A block is recorded only after its files are renamed into place and its chain file written;
every file goes temp -> fsync -> rename -> fsync(folder).  On start each rank verifies its
manifest (sizes and checksums: torn or corrupt files are redone, never trusted) and the ranks
agree on the largest block index every one of them can restart from.  Blocks before it are
kept; everything after is redone exactly as an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from sq.errors import SqError
from sq.files import (INDEX_NAME, RUN_DIR, SHARD_PATTERN, safetensors_bytes, sha256_bytes, sha256_file,
                      write_bytes_atomic)

logger = logging.getLogger(__name__)

FAULT_POINTS = ("calib", "search", "after-shard-write", "mid-shard-write", "manifest-replace", "index-merge", "enospc", "stop")


# ---------------------------------------------------------------- fault injection (tests only)


@dataclass(frozen=True)
class Fault:
    """``point:rank[:block]`` from the test-only ``SQ_FAULT`` variable: SIGKILL there (``stop``: SIGSTOP
    when the block's solve starts, a rank that hangs without dying)."""

    point: str
    rank: int
    block: int | None = None

    @classmethod
    def parse(cls, spec: str | None) -> Fault | None:
        if not spec:
            return None
        parts = spec.split(":")
        if parts[0] not in FAULT_POINTS or len(parts) not in (2, 3):
            raise SqError(f"SQ_FAULT={spec!r}: expected POINT:RANK[:BLOCK] with POINT one of {', '.join(FAULT_POINTS)}")
        return cls(parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None)

    def hit(self, point: str, rank: int, block: int | None = None) -> bool:
        return self.point == point and self.rank == rank and (self.block is None or self.block == block)


def maybe_die(fault: Fault | None, point: str, rank: int, block: int | None = None) -> None:
    if fault is not None and fault.hit(point, rank, block):
        how = signal.SIGSTOP if point == "stop" else signal.SIGKILL
        logger.warning("fault injection: %s at %s (rank %d, block %s)", how.name, point, rank, block)
        os.kill(os.getpid(), how)


# ---------------------------------------------------------------- verification (writes: sq.files)


def file_ok(path: Path, record: dict) -> bool:
    try:
        return path.stat().st_size == record["size"] and sha256_file(path) == record["sha256"]
    except (OSError, KeyError):
        return False


# ---------------------------------------------------------------- signature


def source_identity(source, hashes: dict[str, str] | None = None, samples: dict[str, str] | None = None) -> dict:
    """Config and index content, every tensor's header entry, and every shard's name, size and
    mtime with ``samples``' digest of a few blocks of each tensor (``--verify-source stat``), or with ``hashes``
    (``--verify-source content``: ``sq.agree.content_hashes``) its SHA-256."""
    root = Path(source.root)
    ident = {"config_sha256": sha256_file(root / "config.json")}
    index = root / INDEX_NAME
    if index.is_file():
        ident["index_sha256"] = sha256_file(index)
    headers = hashlib.sha256()
    for key in sorted(source.tensors):
        t = source.tensors[key]
        headers.update(f"{key}\0{t.file}\0{t.dtype}\0{list(t.shape)}\0{list(t.offsets)}\n".encode())
    ident["headers_sha256"] = headers.hexdigest()
    ident["files"] = {}
    for f in source.files:
        st = (root / f).stat()
        ident["files"][f] = {"size": st.st_size, **({"sha256": hashes[f]} if hashes else {"mtime_ns": st.st_mtime_ns}),
                             **({"sample_sha256": samples[f]} if samples and f in samples else {})}
    return ident


def signature_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two signatures."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += signature_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def describe_diff(changed: list[str], limit: int = 8) -> str:
    """``signature_diff``'s names for a message: a section with many changed fields (a whole
    assignment, another model's source) is named once with its count, so nothing important is cut."""
    groups: dict[str, list[str]] = {}
    for name in changed:
        groups.setdefault(name.split(".")[0], []).append(name)
    parts = []
    for top, names in groups.items():
        names.sort(key=lambda n: n != f"{top}.name")  # a section's name says the most: first
        parts += names if len(names) <= 2 else [f"{names[0]} and {len(names) - 1} more {top}.* fields"]
    return ", ".join(parts[:limit] + ([f"... {len(parts) - limit} more"] if len(parts) > limit else []))


# ---------------------------------------------------------------- run state


class RunState:
    """This rank's view of ``OUT/.sq-run``."""

    def __init__(self, out: Path, rank: int, *, enabled: bool = True):
        self.out = Path(out)
        self.root = self.out / RUN_DIR
        self.rank = rank
        self.enabled = enabled
        self.dir = self.root / f"rank-{rank:05d}"
        self.manifest = {"rank": rank, "blocks": []}

    # -- whole-run files (rank 0 writes them)
    def read_signature(self) -> dict | None:
        """The unfinished run's signature, or None where there is none.

        Raises ``SqError`` when ``run.json`` is unreadable, not the shape sq writes, or edited
        (its stored sha256 no longer matches): such a run can only be started over.
        """
        p = self.root / "run.json"
        if not p.is_file():
            return None
        sig = read_signed_json(p, "signature")
        if sig is None:
            raise SqError(f"{p} is corrupt or was edited (not the signature sq wrote); rerun with --resume never "
                          "to start over")
        return sig

    def write_signature(self, sig: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.root / "run.json", signed_json("signature", sig))

    def take_lock(self) -> None:
        """Hold this folder for the life of the process, or refuse.

        Same host: an exclusive ``flock`` on ``.sq-run/lock``, held open until the process ends (the
        kernel drops it when the process dies, so a killed run never leaves a live lock).  Across
        hosts (a shared filesystem whose locks may not reach other nodes): the pid/host record
        written into the file; a requeued Slurm job takes over its own lock.
        """
        import fcntl

        if getattr(self, "_lock_fd", None) is not None:  # taken again by the same run: start afresh
            os.close(self._lock_fd)
            self._lock_fd = None
        self.root.mkdir(parents=True, exist_ok=True)
        lock = self.root / "lock"
        me = {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held = _read_lock(fd)
            os.close(fd)
            raise SqError(f"{self.out} is being written by another sq run (pid {held.get('pid')} on "
                          f"{held.get('host')}); wait for it or stop it") from None
        held = _read_lock(fd)
        requeued = held.get("slurm_job_id") is not None and held.get("slurm_job_id") == me["slurm_job_id"]
        if held.get("host") not in (None, me["host"]) and not requeued:
            os.close(fd)
            raise SqError(f"{self.out} is locked by a run on host {held['host']} (pid {held.get('pid')}); "
                          f"if that run is dead, delete {lock}")
        if held.get("pid") not in (None, me["pid"]):
            logger.warning("taking over the lock of %s run pid %s on %s",
                           "Slurm job %s's previous" % held["slurm_job_id"] if requeued else "dead",
                           held.get("pid"), held.get("host"))
        data = json.dumps(me).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._lock_fd = fd  # held until the process ends (never closed: closing would drop the lock)

    def clear(self, owned) -> list[str]:
        """``--resume never`` / replacing a run: remove what sq wrote (``owned(name)``), nothing else.

        The lock file stays (this process holds it).  Returns the names removed.
        """
        removed = []
        for p in sorted(self.out.iterdir()):
            if p.name == RUN_DIR:
                for q in p.iterdir():
                    if q.name != "lock":
                        _remove(q)
                removed.append(RUN_DIR)
            elif owned(p.name):
                _remove(p)
                removed.append(p.name)
        return removed

    def any_block_done(self) -> bool:
        """Whether any rank's manifest records a completed block (worth keeping for a resume)."""
        for m in self.root.glob("rank-*/manifest.json"):
            manifest = _valid_manifest(_read_json(m))
            if manifest is not None and manifest["blocks"]:
                return True
        return False

    def finish(self) -> None:
        """After the final index and config exist: the run folder goes."""
        shutil.rmtree(self.root, ignore_errors=True)

    # -- this rank's manifest and chain
    def load_manifest(self) -> None:
        """Read this rank's manifest; one that is unreadable or not the shape sq writes is ignored
        (its blocks are redone), never trusted."""
        p = self.dir / "manifest.json"
        if not p.is_file():
            return
        manifest = _valid_manifest(_read_json(p))
        if manifest is None or manifest.get("rank") != self.rank:
            logger.warning("rank %d: manifest %s is corrupt; its blocks will be redone", self.rank, p)
            return
        self.manifest = manifest

    def verified_blocks(self) -> int:
        """Length of the prefix of recorded blocks whose files all verify (in order 0, 1, ...)."""
        n = 0
        for i, entry in enumerate(self.manifest["blocks"]):
            if entry.get("block") != i:
                break
            if not all(file_ok(self.out / f, rec) for f, rec in entry["files"].items()):
                logger.warning("rank %d: block %d's files do not verify; redoing from there", self.rank, i)
                break
            n += 1
        return n

    def chain_ok(self, block: int) -> bool:
        rec = self.manifest.get("chains", {}).get(str(block))
        return rec is not None and file_ok(self.dir / self.chain_name(block), rec)

    def restart_points(self, need_chain: bool, n_blocks: int) -> list[int]:
        """Block indices this rank can restart from: 0, any later one whose inputs are cached, and
        ``n_blocks`` (only the final stage left) once every block verified."""
        n = self.verified_blocks()
        return [b for b in range(n + 1) if b in (0, n_blocks) or not need_chain or self.chain_ok(b)]

    def truncate(self, k: int) -> dict[str, str]:
        """Keep blocks < k; return their index fragment {tensor: file}."""
        self.manifest["blocks"] = self.manifest["blocks"][:k]
        self.manifest["chains"] = {b: r for b, r in self.manifest.get("chains", {}).items() if int(b) <= k}
        frag = {}
        for entry in self.manifest["blocks"]:
            for f, rec in entry["files"].items():
                frag.update({t: f for t in rec["tensors"]})
        return frag

    @staticmethod
    def chain_name(block: int) -> str:
        return f"chain-{block:05d}.safetensors"

    def write_chain(self, block: int, hidden: list[torch.Tensor], fp: list[torch.Tensor] | None = None) -> None:
        """Cache this rank's inputs of ``block``: the quantized chain, and the full-precision one
        where the algorithm needs both (SignRound's targets)."""
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"h{i:06d}": h for i, h in enumerate(hidden)}
        tensors.update({f"f{i:06d}": h for i, h in enumerate(fp or [])})
        data = safetensors_bytes(tensors)
        write_bytes_atomic(self.dir / self.chain_name(block), data)
        self.manifest.setdefault("chains", {})[str(block)] = {"size": len(data), "sha256": sha256_bytes(data)}

    def read_chain(self, block: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(quantized chain, full-precision chain; empty unless written)."""
        t = st_load((self.dir / self.chain_name(block)).read_bytes())
        return [t[k] for k in sorted(t) if k[0] == "h"], [t[k] for k in sorted(t) if k[0] == "f"]

    def record_block(self, block: int, files: dict[str, dict], fault: Fault | None = None,
                     skipped: list[str] = ()) -> None:
        """Mark ``block`` done (after its files and chain are in place); keep the last three chains.
        ``skipped``: Linears of the block left unquantized for NaN/Inf (the final config lists them)."""
        entry = {"block": block, "files": files}
        if skipped:
            entry["skipped_nonfinite"] = list(skipped)
        self.manifest["blocks"].append(entry)
        for b in list(self.manifest.get("chains", {})):
            # a rank's records can be two blocks ahead of another's: the records follow the background
            # files, so a rank killed while its files of block k are written (its main thread done with
            # block k + 1, which let the others finish and record k + 1) has recorded blocks < k only.
            # Both restart at k where the rank ahead still holds block k's inputs: chains k-1.. are kept
            if int(b) < block - 1:
                del self.manifest["chains"][b]
                (self.dir / self.chain_name(int(b))).unlink(missing_ok=True)
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        data = json.dumps(self.manifest, indent=1).encode()
        die = None
        if fault is not None and fault.hit("manifest-replace", self.rank, block):
            die = lambda: maybe_die(fault, "manifest-replace", self.rank, block)  # noqa: E731
        write_bytes_atomic(self.dir / "manifest.json", data, die_midway=die)


def signed_json(key: str, obj: dict) -> bytes:
    """``{key: obj, key_sha256: ...}``: a file sq can tell apart from one edited by hand."""
    return json.dumps({key: obj, f"{key}_sha256": signature_sha(obj)}, indent=2, sort_keys=True).encode()


def signature_sha(obj: dict) -> str:
    return sha256_bytes(json.dumps(obj, sort_keys=True).encode())


def read_signed_json(path: Path, key: str) -> dict | None:
    """``obj`` of a file written by ``signed_json``; None if unreadable, malformed or edited."""
    doc = _read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get(key), dict):
        return None
    if doc.get(f"{key}_sha256") != signature_sha(doc[key]):
        return None
    return doc[key]


def _read_json(path: Path):
    """Parsed JSON, or None for anything unreadable (binary, truncated, a folder, ...)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(64 << 20).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


_SHA = re.compile(r"^[0-9a-f]{64}$")


def _valid_file_record(name, rec) -> bool:
    return (isinstance(name, str) and SHARD_PATTERN.match(name) is not None and isinstance(rec, dict)
            and isinstance(rec.get("size"), int) and not isinstance(rec.get("size"), bool)
            and (rec.get("sha256") is None or (isinstance(rec.get("sha256"), str) and _SHA.match(rec["sha256"])))
            and isinstance(rec.get("tensors"), list) and all(isinstance(t, str) for t in rec["tensors"]))


def _valid_manifest(m) -> dict | None:
    """``m`` if it has the shape ``record_block`` writes (file names are sq's own shard names, so a
    forged entry can never bring a path from outside the folder into the index), else None."""
    if not isinstance(m, dict) or not isinstance(m.get("blocks"), list):
        return None
    for entry in m["blocks"]:
        if not (isinstance(entry, dict) and isinstance(entry.get("block"), int) and isinstance(entry.get("files"), dict)
                and all(_valid_file_record(f, r) for f, r in entry["files"].items())
                and isinstance(entry.get("skipped_nonfinite", []), list)
                and all(isinstance(n, str) for n in entry.get("skipped_nonfinite", []))):
            return None
    chains = m.get("chains", {})
    if not isinstance(chains, dict) or not all(
            isinstance(b, str) and b.isdigit() and isinstance(r, dict) and isinstance(r.get("size"), int)
            and isinstance(r.get("sha256"), str) for b, r in chains.items()):
        return None
    return m


def _read_lock(fd: int) -> dict:
    """The holder recorded in an open lock file ({} when empty or not what sq writes)."""
    try:
        held = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(held, dict):
        return {}
    return {k: v for k, v in held.items() if k in ("pid", "host", "slurm_job_id") and isinstance(v, (int, str))}


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()
