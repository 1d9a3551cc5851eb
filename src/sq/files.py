"""File names of the checkpoint and output layout, and durable writes: the one definition of each.

A leaf module (the standard library, torch/safetensors and ``sq.errors`` only), so the loader,
the writer, resume, the report and hub/demo resolution all name the same files.

Output folder (see docs/resume.md)::

    model.safetensors.index.json          written last: a folder with an index is finished
    config.json, SIDE_FILES               the source's, copied (config: with quantization_config)
    model-rank{r:05d}-{root|block{b:05d}}.safetensors    each rank's shards
    model-carried.safetensors             tensors carried over unquantized (rank 0)
    sq_report.json, sq_report.png         the report
    sq_logs/rank-NNNNN.log                per-rank logs (kept across resumes)
    .sq-run/                              resume state until the run finishes (sq.resume)

Every file is written as temp file -> flush -> fsync -> rename -> fsync of the folder; a crash
leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from sq.errors import SqError

# ---------------------------------------------------------------- checkpoint layout (Hub format)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# What transformers reads next to the weights besides config.json (generation config, every
# tokenizer format it knows; none of them pickle): checked at scan time (sq.load.source), copied
# into the output (sq.export.writer), downloaded with a hub model (sq.hub).
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip

# ---------------------------------------------------------------- output layout

RUN_DIR = ".sq-run"
LOG_DIR = "sq_logs"
REPORT_NAME = "sq_report.json"
REPORT_PNG = "sq_report.png"
CARRIED_NAME = "model-carried.safetensors"
SHARD_PATTERN = re.compile(r"^model-rank\d{5}-(root|block\d{5})\.safetensors$")


def shard_name(rank: int, block: int | None) -> str:
    """Rank ``rank``'s shard of block ``block`` (``None``: the root tensors); matches ``SHARD_PATTERN``."""
    tail = "root" if block is None else f"block{block:05d}"
    return f"model-rank{rank:05d}-{tail}.safetensors"


def written_by_sq(name: str) -> bool:
    """Whether a top-level name in an output folder is one sq writes (or its temp file).

    ``--resume never`` and replacing a run remove exactly these: a user's ``NOTES.md`` or
    ``eval-results/`` next to them stays.
    """
    if name.startswith(".") and name.endswith(".tmp"):
        name = name[1:-4]
    return (name in (INDEX_NAME, "config.json", REPORT_NAME, REPORT_PNG, CARRIED_NAME, LOG_DIR, RUN_DIR, *SIDE_FILES)
            or SHARD_PATTERN.match(name) is not None)


# ---------------------------------------------------------------- durable writes


def nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest existing ancestor (where a folder at ``path`` would be
    made; a relative path ends at ``.``'s parent chain as given)."""
    path = Path(path)
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _no_space(path: Path) -> SqError:
    return SqError(f"no space left on the device while writing {path}; free space and rerun the same "
                   "command to resume")


def write_bytes_atomic(path: Path, data: bytes, *, die_midway=None) -> None:
    """temp -> write -> fsync -> rename -> fsync(folder).  ENOSPC becomes a clean error naming the file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            half = len(data) // 2 if die_midway is not None else 0
            if die_midway is not None:  # fault injection: half the bytes on disk, then the hook
                f.write(data[:half])
                f.flush()
                os.fsync(f.fileno())
                die_midway()
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        if e.errno == 28:  # ENOSPC
            tmp.unlink(missing_ok=True)
            raise _no_space(path) from None
        raise


def atomic_write(path: Path, write_fn: Callable[[Path], object]) -> None:
    """``write_fn(tmp_path)``, then fsync and rename into place (ENOSPC: a clean error naming the file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write_fn(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == 28:  # ENOSPC
            raise _no_space(path) from None
        raise
    except BaseException:  # nothing half-written left behind (a refusal or an interrupt mid-file)
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``$SQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/sq``, else ``~/.cache/sq``."""
    if environ.get("SQ_CACHE_DIR"):
        return Path(environ["SQ_CACHE_DIR"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "sq"
