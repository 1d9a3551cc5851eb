"""Small helpers to damage copies of fixture checkpoints for refusal tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def copy_ckpt(src, dst) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def edit_tensors(path, fn) -> None:
    """Apply ``fn(dict name->tensor) -> dict`` to every shard and rewrite the index to match."""
    path = Path(path)
    index = json.loads((path / INDEX).read_text())
    weight_map = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors = fn(load_file(path / f))
        save_file(tensors, path / f, metadata={"format": "pt"})
        weight_map.update({k: f for k in tensors})
    index["weight_map"] = weight_map
    (path / INDEX).write_text(json.dumps(index, indent=2))


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
    p = Path(path) / INDEX
    index = json.loads(p.read_text())
    index["weight_map"] = fn(index["weight_map"])
    p.write_text(json.dumps(index, indent=2))
