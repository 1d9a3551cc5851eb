"""What a checkpoint folder holds: config, index, safetensors headers.

Everything here is read from file headers only (a few KB per file), identically on every
rank, so refusals decided from it are the same everywhere.  No tensor data is touched and
nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the checkpoint as its header describes it."""

    key: str
    file: str  # file name relative to the checkpoint folder
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # byte range inside the file's data section

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


@dataclass
class CheckpointSource:
    """A checkpoint folder scanned from headers; ``problems`` lists every file-level refusal."""

    root: Path
    config: dict
    tensors: dict[str, TensorInfo]
    files: list[str]
    problems: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def path(self, file: str) -> Path:
        return self.root / file


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Return (header dict, data start offset); raise ValueError on a torn or corrupt header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ValueError(f"header length {n} does not fit in the file ({size} bytes): truncated or not safetensors")
        blob = f.read(n)
    try:
        header = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not valid JSON ({e.__class__.__name__}): corrupt") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object: corrupt")
    data_len = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], info["shape"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {key!r} has a malformed header entry: corrupt") from None
        if not (0 <= begin <= end <= data_len):
            raise ValueError(f"tensor {key!r} data [{begin}, {end}) lies past the end of the data ({data_len} bytes): truncated")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {key!r} has unknown dtype {dtype!r}")
        numel = 1
        for s in shape:
            numel *= s
        if numel * _ST_DTYPES[dtype].itemsize != end - begin:
            raise ValueError(f"tensor {key!r} shape {shape} {dtype} does not match its {end - begin} bytes: corrupt")
    return header, 8 + n


def _inside(root: Path, name: str) -> bool:
    if os.path.isabs(name):
        return False
    resolved = (root / name).resolve()
    return resolved.parent == root.resolve() or root.resolve() in resolved.parents


def scan_checkpoint(root: str | os.PathLike) -> CheckpointSource:
    """Read config, index and every listed header; collect file-level problems (never raise on them)."""
    root = Path(root)
    problems: list[str] = []
    config: dict = {}
    if not root.is_dir():
        return CheckpointSource(root, {}, {}, [], [f"checkpoint folder {root} does not exist or is not a folder"])
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        problems.append(f"{cfg_path} is missing: every Hugging Face checkpoint needs a config.json")
    else:
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            problems.append(f"{cfg_path} is not valid JSON: {e}")

    present = sorted(p.name for p in root.iterdir() if p.is_file() and p.name.endswith(".safetensors"))
    index_path = root / INDEX_NAME
    files: list[str] = []
    weight_map: dict[str, str] = {}
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            problems.append(f"{index_path} is not a valid safetensors index ({e.__class__.__name__}: {e})")
        listed = sorted(set(weight_map.values()))
        for name in listed:
            if not _inside(root, name) or "/" in name or "\\" in name:
                problems.append(f"{INDEX_NAME} names {name!r}, a path outside the checkpoint folder {root}: refused")
            elif not (root / name).is_file():
                keys = sorted(k for k, v in weight_map.items() if v == name)
                problems.append(f"{INDEX_NAME} names {name!r} (e.g. key {keys[0]!r}, {len(keys)} keys) but the file is missing")
            else:
                files.append(name)
        stray = sorted(set(present) - set(listed))
        if stray:
            problems.append(
                f"{', '.join(stray)} in {root} {'is' if len(stray) == 1 else 'are'} not listed in {INDEX_NAME}; "
                "torch's HuggingFaceStorageReader reads every *.safetensors in the folder, so move it out")
    elif present:
        files = present
        if len(present) > 1:
            problems.append(f"{root} has {len(present)} safetensors files but no {INDEX_NAME}")
    else:
        pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        if pickles:
            problems.append(
                f"{root} holds only pickle checkpoints ({', '.join(pickles[:3])}); sq reads safetensors only "
                "because unpickling can run arbitrary code. Convert them to safetensors first")
        else:
            problems.append(f"{root} has no *.safetensors files")

    tensors: dict[str, TensorInfo] = {}
    for name in files:
        try:
            header, _ = read_safetensors_header(root / name)
        except (ValueError, OSError) as e:
            problems.append(f"{root / name}: {e}")
            continue
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if key in tensors:
                problems.append(f"tensor {key!r} is stored twice: in {tensors[key].file} and {name}")
                continue
            if weight_map and weight_map.get(key) != name:
                problems.append(f"tensor {key!r} is in {name} but {INDEX_NAME} puts it in {weight_map.get(key)!r}")
            tensors[key] = TensorInfo(key, name, _ST_DTYPES[info["dtype"]], tuple(info["shape"]),
                                      tuple(info["data_offsets"]))
    for key, name in weight_map.items():
        if key not in tensors and name in files:
            problems.append(f"{INDEX_NAME} lists {key!r} in {name} but that file does not hold it")
    return CheckpointSource(root, config, tensors, files, problems)
