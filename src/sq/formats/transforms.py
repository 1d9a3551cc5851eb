"""Online transforms a checkpoint's ``quantization_config.transform_config`` declares, on a transformers model.

transformers 5.24 with compressed-tensors 0.20 reads ``quantization_config`` but not its
``transform_config``: a checkpoint with online rotations (sq's ``--rotate r4``, llm-compressor's SpinQuant
R4) loads without them and computes something else, with nothing said.  ``apply_online_transforms`` hooks
every online ``input`` transform onto its modules, first of their forward pre-hooks (so before
compressed-tensors' activation quantization), with the matrix the checkpoint stores
(``<module>.<group>_input.weight``, unnormalized: divided by the square root of its order here, as vLLM
does).  The offline entries (``weight_input`` / ``weight_output``) are already in the stored weights.
Anything else online (``output``, ``q_attn``, ``k_cache``, per-module randomized matrices) is refused:
sq cannot apply it, and a model without it would be wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn

from sq.errors import SqError

__all__ = ["transform_groups", "apply_online_transforms", "blockwise"]

_OFFLINE = ("weight_input", "weight_output")


def blockwise(x: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
    """``x [..., n] -> x (I ⊗ qb)`` in ``x``'s dtype (computed in float32, float64 for float64): each group
    of ``qb``'s order along the last dimension times ``qb`` (an ``input`` transform with ``head_dim``)."""
    b = qb.shape[0]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dt).reshape(*x.shape[:-1], x.shape[-1] // b, b) @ qb.to(device=x.device, dtype=dt)
    return y.reshape(x.shape).to(x.dtype)


def transform_groups(config: dict) -> dict:
    """``{group: scheme fields}`` of a ``config.json``'s ``quantization_config.transform_config`` (``{}``: none)."""
    qc = config.get("quantization_config") or {}
    return dict(((qc.get("transform_config") or {}).get("config_groups")) or {})


def _stored(root: Path, suffix: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``root`` whose name ends with ``suffix`` (safetensors only)."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for k, f in weight_map.items() if k.endswith(suffix)})
    else:
        files = [p.name for p in root.glob("*.safetensors")]
    out = {}
    for f in files:
        path = (root / f).resolve()
        if root.resolve() not in path.parents:
            raise SqError(f"{root}: the index names {f!r}, outside the checkpoint folder")
        with safe_open(path, framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys() if k.endswith(suffix)})
    return out


def apply_online_transforms(model: nn.Module, source) -> int:
    """Hook the online input transforms of the checkpoint at ``source`` onto ``model``; the modules hooked.

    Raises:
        SqError: an online transform sq cannot apply, or a target module without a stored matrix.
    """
    from compressed_tensors.utils import match_named_modules

    root = Path(source)
    config = root / "config.json"
    groups = transform_groups(json.loads(config.read_text())) if config.is_file() else {}
    hooked = 0
    for group, scheme in groups.items():
        online = [a for a in scheme.get("apply") or [] if a.get("location") not in _OFFLINE]
        if not online:
            continue
        bad = sorted({a.get("location") for a in online} - {"input"})
        if bad or scheme.get("randomize"):
            why = f"location {', '.join(map(str, bad))}" if bad else "randomize (a matrix per module)"
            raise SqError(f"{root}: transform_config group {group!r} has an online transform sq cannot apply "
                          f"({why}); serve this checkpoint with vLLM")
        stored = _stored(root, f".{group}_input.weight")
        if not stored:
            raise SqError(f"{root}: transform_config group {group!r} is online but no *.{group}_input.weight "
                          "tensor is stored")
        shared = next(iter(stored.values()))
        for args in online:
            inverse = bool(args.get("inverse"))
            matched = list(match_named_modules(model, args["targets"], args.get("ignore") or []))
            if not matched:
                raise SqError(f"{root}: transform_config group {group!r} targets {args['targets'][:3]} match no "
                              f"module of the loaded {type(model).__name__}")
            for name, module in matched:
                h = stored.get(f"{name}.{group}_input.weight", shared).double()
                width = getattr(module, "in_features", None)
                if h.dim() != 2 or h.shape[0] != h.shape[1] or (width is not None and width % h.shape[0]):
                    raise SqError(f"{root}: {name}.{group}_input.weight has shape {tuple(h.shape)}: not a square "
                                  f"block of {name}'s input width {width}")
                q = (h.T if inverse else h) / math.sqrt(h.shape[0])
                q = q.to(torch.float32)
                module.register_forward_pre_hook(lambda _m, a, q=q: (blockwise(a[0], q), *a[1:]), prepend=True)
                hooked += 1
    return hooked
