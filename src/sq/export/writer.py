"""Output folder: per-rank shard files, carried-over tensors, config, tokenizer, merged index.

Every rank writes only its own files (``model-rank{r:05d}-block{b:05d}.safetensors``) and
remembers what it wrote as an index fragment ``{tensor name: file name}``; rank 0 merges
the fragments into ``model.safetensors.index.json`` as the very last file, so a folder
with an index is a finished checkpoint.

Every file is written as temp file -> flush -> fsync -> rename -> fsync of the folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from sq.errors import SqError
from sq.files import (INDEX_NAME, REPORT_NAME, RUN_DIR, SIDE_FILES, atomic_write, nearest_existing, safetensors_bytes,
                      sha256_bytes, write_bytes_atomic)
from sq.load.source import ST_DTYPES, open_checked
from sq.resume import read_signed_json

__all__ = [
    "output_dir_problems",
    "output_path_problems",
    "finished_signature",
    "write_tensors",
    "write_json",
    "copy_side_files",
    "merge_index",
]

# File names (INDEX_NAME, shard_name, SIDE_FILES, ...) and atomic writes: sq.files.


def output_path_problems(out: str | Path, model_dir: str | Path | None = None) -> list[str]:
    """Refuse an ``--output`` that cannot be a folder sq writes into, whatever it holds:
    a file, a link to nowhere, a path under a file, a read-only place, the model's own folder."""
    out = Path(out)
    if out.is_symlink() and not out.exists():
        return [f"--output {out} is a symbolic link to {os.readlink(out)!r}, which does not exist"]
    if out.exists() and not out.is_dir():
        return [f"--output {out} exists and is not a directory"]
    first = nearest_existing(out)  # where the folder will be made
    if first.exists() and not first.is_dir():
        return [f"--output {out}: {first} is a file, so no folder can be made under it"]
    if first.exists() and not os.access(first, os.W_OK | os.X_OK):
        return [f"--output {out}: {first} is not writable (read-only filesystem or no permission)"]
    if model_dir is not None:
        m, o = Path(model_dir).resolve(), out.resolve()
        if o == m or m in o.parents or o in m.parents:
            what = "is" if o == m else ("is inside" if m in o.parents else "contains")
            return [f"--output {out} {what} the model folder {model_dir}; sq never writes into its source: "
                    "choose a separate folder"]
    return []


def output_dir_problems(out: str | Path) -> list[str]:
    """Refuse an output folder that already holds anything (never overwrite)."""
    out = Path(out)
    if out.is_dir() and any(p.name != RUN_DIR for p in out.iterdir()):
        return [f"--output {out} is not empty; choose a new or empty directory"]
    return []


def finished_signature(out: str | Path) -> dict | None:
    """The run signature a finished sq output records in its report (None if not an sq output)."""
    out = Path(out)
    if not (out / INDEX_NAME).is_file() or not (out / REPORT_NAME).is_file():
        return None
    return read_signed_json(out / REPORT_NAME, "run_signature")


def write_shard(out: Path, name: str, tensors: Mapping[str, torch.Tensor], *, die_midway=None,
                checksum: bool = True, timings: dict[str, float] | None = None) -> dict | None:
    """Write one safetensors file atomically; return its record (size, sha256, tensor names) or None.

    The bytes are serialized once in memory, hashed, then written, so the checksum costs no re-read.
    ``timings["checksum"]`` (if given) accumulates the seconds spent hashing.
    """
    if not tensors:
        return None
    data = safetensors_bytes(dict(tensors))
    write_bytes_atomic(Path(out) / name, data, die_midway=die_midway)
    t = time.perf_counter()
    sha = sha256_bytes(data) if checksum else None
    if timings is not None:
        timings["checksum"] = timings.get("checksum", 0.0) + time.perf_counter() - t
    return {"size": len(data), "sha256": sha, "tensors": sorted(tensors)}


def write_tensors(out: Path, name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Write one safetensors file atomically; return its index fragment (empty if nothing to write)."""
    rec = write_shard(out, name, tensors)
    return {k: name for k in rec["tensors"]} if rec else {}


def write_streamed(out: Path, name: str, specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                   produce: Callable[[str], torch.Tensor]) -> dict[str, str]:
    """Write one safetensors file atomically from tensors made one at a time: ``specs`` gives each one's dtype and
    shape up front (the header goes first), ``produce(key)`` makes it when its bytes are due, and it is written
    and dropped before the next.  Returns its index fragment (empty if nothing to write).

    Why: the carried tensors (an MTP layer: ~11 GB of FP8 on DeepSeek-V3, twice that dequantized) and a root read
    whole from the checkpoint were held at once with their serialized copy (``write_tensors``); now one tensor at
    a time.  The tensors go largest element first, then by name, so each starts at a multiple of its element
    size, as the library's own writer orders them."""
    if not specs:
        return {}
    order = sorted(specs, key=lambda k: (-specs[k][0].itemsize, k))
    header: dict = {"__metadata__": {"format": "pt"}}
    at = 0
    for k in order:
        dtype, shape = specs[k]
        n = math.prod(shape) * dtype.itemsize
        header[k] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for k in order:
                t = produce(k).detach().to("cpu").contiguous()
                if (t.dtype, tuple(t.shape)) != (specs[k][0], tuple(specs[k][1])):
                    raise SqError(f"{Path(out) / name}: {k} came as {t.dtype} {list(t.shape)}, planned as "
                                  f"{specs[k][0]} {list(specs[k][1])}")
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                del t

    atomic_write(Path(out) / name, write)
    return {k: name for k in order}


_ST_NAMES = {dt: name for name, dt in ST_DTYPES.items()}


def write_json(path: Path, obj) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"
    atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text))


def copy_side_files(src: Path, out: Path) -> list[str]:
    """Tokenizer files and generation_config.json, copied as they are.

    Each is opened by ``sq.load.source.open_checked``: a link that leaves the checkpoint folder
    (other than a hub-cache blob) is refused, not followed, even if it appeared after the scan.
    """
    copied = []
    for name in SIDE_FILES:
        p = Path(src) / name
        if p.is_file():
            with open_checked(src, name) as f:
                atomic_write(Path(out) / name, lambda tmp, f=f: _copy_stream(f, tmp))
            copied.append(name)
    return copied


def _copy_stream(f, dest: Path) -> None:
    with open(dest, "wb") as g:
        shutil.copyfileobj(f, g)


def merge_index(out: Path, fragments: list[Mapping[str, str]], *, before_write=None) -> dict:
    """Merge every rank's ``{tensor: file}`` fragments into the index (refusing duplicates)."""
    out = Path(out)
    weight_map: dict[str, str] = {}
    dups = []
    for frag in fragments:
        for k, f in frag.items():
            if k in weight_map:
                dups.append(f"{k} written twice ({weight_map[k]}, {f})")
            weight_map[k] = f
    if dups:
        raise SqError(dups[:10])
    total = 0
    for f in sorted(set(weight_map.values())):
        with safe_open(str(out / f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * _itemsize(sl.get_dtype())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    if before_write is not None:
        before_write()
    write_json(out / INDEX_NAME, index)
    return index


_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
          "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _itemsize(dtype: str) -> int:
    return _SIZES.get(dtype, 1)
