"""Small helpers to damage copies of fixture checkpoints for refusal tests."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from safetensors.torch import load_file, save_file

from sq.files import INDEX_NAME


def copy_ckpt(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def edit_tensors(path, fn) -> None:
    """Apply ``fn(dict name->tensor) -> dict`` to every shard and rewrite the index to match."""
    path = Path(path)
    index = json.loads((path / INDEX_NAME).read_text())
    weight_map = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors = fn(load_file(path / f))
        save_file(tensors, path / f, metadata={"format": "pt"})
        weight_map.update({k: f for k in tensors})
    index["weight_map"] = weight_map
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2))


def edit_config(path, **changes) -> None:
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg_path.write_text(json.dumps(cfg, indent=2))


def edit_index(path, fn) -> None:
    p = Path(path) / INDEX_NAME
    index = json.loads(p.read_text())
    index["weight_map"] = fn(index["weight_map"])
    p.write_text(json.dumps(index, indent=2))


def read_header(file) -> tuple[dict, bytes]:
    """One safetensors file's header (parsed JSON) and its data section (raw bytes)."""
    raw = Path(file).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(file, header, data: bytes, *, length: int | None = None) -> None:
    """Write a safetensors file from a header (a dict, or raw bytes as they are) and data bytes.

    ``length`` overrides the 8-byte header length field (a lie about the header's size).
    """
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    Path(file).write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


def edit_header(file, fn) -> None:
    """Rewrite one safetensors file's header as ``fn(header dict)`` returns it; the data bytes are kept."""
    header, data = read_header(file)
    write_header(file, fn(header), data)


def load_refusal(path) -> str:
    """The ``LoadRefused`` message of building and planning ``path``; the skeleton must still be on meta."""
    import pytest

    from sq.errors import LoadRefused
    from sq.load.loader import plan_load
    from sq.load.meta import build_skeleton

    model = None
    with pytest.raises(LoadRefused) as e:
        model = build_skeleton(path)
        plan_load(model, path)
    if model is not None:
        assert all(p.device.type == "meta" for p in model.parameters()), "refusal after mutation"
    return str(e.value)
