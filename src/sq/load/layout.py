"""What each checkpoint tensor is, read off the model transformers builds on the meta device.

Model-free quantization (``sq.modelfree``) never fills a model, but when transformers knows the
``model_type`` the model skeleton on meta (no memory, no reads) says what names cannot: which
checkpoint tensor is the weight of an ``nn.Linear`` in a decoder block, which is a router, which
per-expert tensor the conversion mapping stacks into a fused expert parameter, and whether a fused
3-D tensor stored fused on disk can be written per expert at all (only where transformers'
conversion mapping loads those per-expert names back into the same boxes of the same parameter).

``checkpoint_layout`` maps every checkpoint key to its model parameter (``sq.load.keymap``) and
classifies it:

- ``linear``: maps whole (no box, rule ``exact`` / ``conversion`` renaming / ``suffix``) onto the
  ``.weight`` of an ``nn.Linear`` inside a decoder block that is not a router;
- ``expert``: a per-expert ``[out, in]`` tensor the conversion mapping stacks into a fused expert
  parameter (``MergeModulelist``);
- ``fused``: a 3-D ``experts.gate_up_proj`` / ``down_proj`` stored fused in transformers' own
  orientation (``[E, 2I, H]`` / ``[E, H, I]``) whose per-expert names the conversion mapping loads
  back into exactly the rows they came from;
- everything else is carried as it is (norms, conv, SSM parameters, biases, buffers, embeddings,
  routers, 3-D tensors with no per-expert layout transformers loads back).

A checkpoint tensor the key map reads transposed (rule ``transposed``: the conversion mapping's
``Transpose`` and the shapes prove the Hub stores it with two dimensions swapped, Qwen3-VL-MoE's
experts) is classified by its parameter's shape; it is carried as stored where the same tensor in the
model's layout would be carried whole, and refused by name (``Layout.refused``) where that tensor would
be quantized or split per expert: model-free reads rows as stored and never transposes them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn as nn

from sq.anatomy import (EXPERT_PARAMS, carried_experts, decoder_blocks, expert_layout_problem, expert_leaves,
                        is_experts_module, quantization_patch, quantized_init_failing, routers)
from sq.load.keymap import note_once
from sq.load.source import TensorInfo

logger = logging.getLogger(__name__)

__all__ = ["Layout", "checkpoint_layout"]

_FUSED_PARAMS = (*EXPERT_PARAMS, "up_proj")  # fused experts' projections (up_proj: up/down-only experts)
_EXPERT_KEY = re.compile(r"^(?P<group>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>[^.]+)\.weight$")


@dataclass
class Layout:
    linear: dict[str, str] = field(default_factory=dict)  # checkpoint key -> model module name
    expert: dict[str, tuple[str, int, str]] = field(default_factory=dict)  # key -> (ckpt group, e, leaf)
    # 3-D key -> (ckpt group, its param, the per-expert names its rows are written under, in row order)
    fused: dict[str, tuple[str, str, tuple[str, ...]]] = field(default_factory=dict)
    # 3-D key stored [E, in, out] -> per-expert [out, in] pieces: (written name, expert, column range),
    # carried unquantized (transformers loads such experts as per-expert Linears only)
    transposed: dict[str, list[tuple[str, int, int, int]]] = field(default_factory=dict)
    # unquantized tensors the checkpoint splits over several keys (per-expert keys of carried experts,
    # Kimi's q/k/v conv weights) -> (model name, its shape, the key's box: offsets, lengths, stack dim):
    # written whole under the model's name, as the model path writes them (CheckpointWeights.ckpt_tensors)
    merged: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int | None]] = field(
        default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # checkpoint module / experts prefix -> model name
    linears: list[str] = field(default_factory=list)  # every nn.Linear of the model (model names)
    routers: list[str] = field(default_factory=list)  # router modules (listed in ignore, as the model path)
    notes: list[str] = field(default_factory=list)  # one line per kind of tensor carried for want of a layout
    refused: dict[str, str] = field(default_factory=dict)  # checkpoint key -> why model-free cannot write it
    # (model name, why) of every routed-experts module whose weights are written unquantized
    carried_experts: list[tuple[str, str]] = field(default_factory=list)
    # the block Linears (model names) whose quantized form the model's _init_weights cannot load (Falcon)
    init_failing: list[str] = field(default_factory=list)
    model_class: str = ""


def _whole(piece, shape) -> bool:
    return piece.stack_dim is None and all(o == 0 for o in piece.offsets) and tuple(piece.lengths) == tuple(shape)


def checkpoint_layout(root: str | Path, tensors: dict[str, TensorInfo]) -> Layout | None:
    """The layout facts of ``tensors`` (the checkpoint at ``root``), or None where transformers
    cannot build the architecture (an unknown ``model_type``, remote code) or the checkpoint does not
    fit the model it builds: the caller falls back on names and shapes."""
    from sq.load.keymap import build_keymap, model_targets
    from sq.load.meta import build_skeleton

    try:
        model = build_skeleton(root)
        blocks = decoder_blocks(model)
        km = build_keymap(model, tensors)
    except Exception as e:  # noqa: BLE001 - anything transformers trips on: the name path decides
        logger.info("model-free: no model layout for %s (%s); classifying by names and shapes", root, e)
        return None
    if km.problems:
        logger.info("model-free: %s does not fit the model transformers builds (%s); classifying by names and "
                    "shapes", root, km.problems[0])
        return None
    targets, _ = model_targets(model)
    modules = dict(model.named_modules())
    block_of = {prefix: b for prefix, b in blocks}
    gates = set(routers(model))  # routers and shared-expert gates, by shape (as the model path)
    lay = Layout(linears=[n for n, m in modules.items() if isinstance(m, nn.Linear)],
                 routers=sorted(gates | {n for n, m in modules.items() if type(m).__name__.endswith("Router")}))
    for target, pieces in km.pieces.items():
        mod_name, _, pname = target.rpartition(".")
        mod = modules.get(mod_name)
        block = next((p for p in block_of if target.startswith(p + ".")), None)
        for p in pieces:
            key, info = p.ckpt_key, tensors[p.ckpt_key]
            m = _EXPERT_KEY.match(key)
            if (p.stack_dim is not None and m and len(info.shape) == 2 and block is not None
                    and (is_experts_module(mod) or _linear_slabs(mod, pname, info))):
                lay.expert[key] = (m["group"], int(m["e"]), m["leaf"])
                lay.names[m["group"]] = mod_name
            elif key in km.transposed:  # judged in the model's layout: carried as stored, or refused
                if len(info.shape) == 3 and pname in _FUSED_PARAMS and mod is not None:
                    _fused(lay, model, key, info, mod_name, pname, km.transposed[key])
                elif isinstance(mod, nn.Linear) and pname == "weight" and block is not None and mod_name not in gates:
                    lay.refused[key] = _transposed_refusal(key, info, target, targets[target], "a quantized Linear")
            elif (isinstance(mod, nn.Linear) and pname == "weight" and block is not None and len(pieces) == 1
                  and _whole(p, targets[target]) and key.endswith(".weight")
                  and mod_name not in gates):
                lay.linear[key] = mod_name
                lay.names[key.removesuffix(".weight")] = mod_name
            elif (len(info.shape) == 3 and pname in _FUSED_PARAMS and mod is not None
                  and _whole(p, targets[target])):
                _fused(lay, model, key, info, mod_name, pname)
            elif block is not None and not _whole(p, targets[target]):
                lay.merged[key] = (target, tuple(targets[target]), p.offsets, p.lengths, p.stack_dim)
    quantized = set(lay.names.values())
    lay.carried_experts = [(n, why) for n, why in carried_experts(model) if n not in quantized]
    lay.model_class = type(model).__name__
    lay.init_failing = quantized_init_failing(model, [(n, modules[n]) for n in sorted(set(lay.linear.values()))])
    return lay


def _linear_slabs(mod: nn.Module, pname: str, info: TensorInfo) -> bool:
    """Routed experts sq's model path does not quantize as fused experts, but whose per-expert checkpoint
    tensors are each one expert's ``[out, in]`` Linear (``F.linear(x, param[e])``), stacked by the conversion
    mapping (``MergeModulelist``): up/down-only experts (Nemotron-H: ``up_proj [E, I, H]``, ``down_proj
    [E, H, I]``) and experts beside zero-compute slots (LongCat-Flash: ``gate_up_proj [E+Z, 2I, H]``,
    ``down_proj [E, H, I]``; the identity slots' gate / up rows are stored and loaded, never computed).
    Model-free quantizes each such tensor as a Linear; transformers dequantizes and stacks them back."""
    if getattr(mod, "is_transposed", False) or not getattr(mod, "is_concatenated", True):
        return False
    p = mod._parameters
    up, gu, down = p.get("up_proj"), p.get("gate_up_proj"), p.get("down_proj")
    extra = [n for n, t in p.items() if t is not None and n not in ("up_proj", "gate_up_proj", "down_proj")]
    if down is None or down.dim() != 3 or extra or getattr(mod, "has_bias", False):
        return False
    e, hidden, inter = down.shape
    if up is not None and gu is None and tuple(up.shape) == (e, inter, hidden):  # up / down only
        want = {"up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    elif (gu is not None and up is None and gu.dim() == 3 and gu.shape[0] > e
          and tuple(gu.shape[1:]) == (2 * inter, hidden)):
        want = {"gate_up_proj": (inter, hidden), "down_proj": (hidden, inter)}  # zero-compute slots beside
    else:
        return False
    return tuple(info.shape) == want.get(pname)


def _transposed_refusal(key: str, info: TensorInfo, target: str, shape, what: str) -> str:
    return (f"{key} {list(info.shape)} ({info.file}) is stored transposed against model {target!r} "
            f"{list(shape)} (transformers' conversion mapping transposes it while loading), and in the model's "
            f"layout it is {what}: model-free reads rows as stored and never transposes them; the model path "
            "(without --model-free) reads it")


def _fused(lay: Layout, model: nn.Module, key: str, info: TensorInfo, mod_name: str, pname: str,
           transposed: tuple[int, int] | None = None) -> None:
    """A 3-D expert tensor stored fused: split per expert only where the conversion mapping loads the
    per-expert names back into the very rows they are read from; otherwise carried (noted).  A tensor
    stored transposed (``transposed``: its swapped dimensions) is judged in the model's layout and
    refused where that would split it."""
    from sq.load.keymap import build_keymap

    group, _, leaf = key.rpartition(".")
    stored = info
    if transposed is not None:
        from sq.load.keymap import swap_dims

        info = TensorInfo(info.key, info.file, info.dtype, swap_dims(info.shape, transposed), info.offsets)
    e, rows, cols = info.shape
    mod = model.get_submodule(mod_name)
    # the per-expert names the model path writes too (the conversion mapping's: gate_proj / up_proj / down_proj,
    # Mixtral's w1 / w3 / w2), each an equal share of the rows
    leaves = expert_leaves(mod).get(leaf, ())
    step = rows // len(leaves) if leaves and rows % len(leaves) == 0 else 0
    boxes = {f"{group}.{x}.{nm}.weight": (x, j * step, step) for x in range(e) for j, nm in enumerate(leaves)}
    # split per expert only in the layout sq proves from the module ([E, out, in], gate then up)
    ok = bool(step) and expert_layout_problem(mod) is None
    if ok:
        fake = {k: TensorInfo(k, info.file, info.dtype, (n, cols), (0, 0)) for k, (_, _, n) in boxes.items()}
        try:
            km = build_keymap(model, fake)
            got = {} if km.problems else {p.ckpt_key: (p.target, p.offsets, p.stack_dim)
                                          for ps in km.pieces.values() for p in ps}
        except Exception:  # noqa: BLE001 - no mapping to prove it with: carried
            got = {}
        want = f"{mod_name}.{pname}"
        ok = all(got.get(k) == (want, (x, lo, 0), 0) for k, (x, lo, _) in boxes.items())
    if ok and transposed is not None:
        lay.refused[key] = _transposed_refusal(key, stored, f"{mod_name}.{pname}", info.shape,
                                               f"quantized per expert ({', '.join(leaves)})")
        return
    if ok:
        lay.fused[key] = (group, leaf, leaves)
        lay.names[group] = mod_name
        return
    if transposed is not None and quantization_patch(model.get_submodule(mod_name)) is not None:
        lay.refused[key] = _transposed_refusal(key, stored, f"{mod_name}.{pname}", info.shape,
                                               "written per expert (transformers' quantized layout)")
        return
    if _patched_split(lay, model, key, info, mod_name):
        return
    note_once(lay.notes, key, f"{list(stored.shape)} is carried unquantized: stored fused"
              f"{' (transposed against the model)' if transposed is not None else ''}, and transformers' conversion "
              f"mapping for this model loads no per-expert layout back into it")


def _patched_split(lay: Layout, model: nn.Module, key: str, info: TensorInfo, mod_name: str) -> bool:
    """Experts transformers swaps for per-expert Linears when it loads a compressed-tensors checkpoint
    (``MODULES_TO_PATCH_FOR_QUANTIZATION``: Llama4's ``[E, H, 2I]`` / ``[E, I, H]``, stored as the
    model computes ``x @ w``): a fused tensor there loads only as those per-expert ``[out, in]``
    weights, so each expert's slab is written transposed under their names (carried, listed in
    ``ignore``).  The patched module's own Linear shapes prove the orientation; False where they
    do not (a square slab, another layout)."""
    mod = model.get_submodule(mod_name)
    patch = quantization_patch(mod)
    group, _, leaf = key.rpartition(".")
    e, rows, cols = info.shape
    if patch is None or rows == cols or leaf not in EXPERT_PARAMS:
        return False
    try:
        import torch

        with torch.device("meta"):
            patched = patch(model.config.get_text_config())
        shapes = {nm: tuple(patched[0].get_submodule(nm).weight.shape) for nm in ("gate_proj", "up_proj", "down_proj")}
    except Exception:  # noqa: BLE001 - a patch this code does not know how to read: carried fused
        return False
    if len(patched) != e:
        return False
    if leaf == "gate_up_proj" and cols % 2 == 0 and shapes["gate_proj"] == shapes["up_proj"] == (cols // 2, rows):
        parts = [("gate_proj", 0, cols // 2), ("up_proj", cols // 2, cols)]
    elif leaf == "down_proj" and shapes["down_proj"] == (cols, rows):
        parts = [("down_proj", 0, cols)]
    else:
        return False
    lay.transposed[key] = [(f"{group}.{x}.{nm}.weight", x, lo, hi) for x in range(e) for nm, lo, hi in parts]
    lay.linears += [f"{mod_name}.{x}.{nm}" for x in range(e) for nm, _, _ in parts]
    note_once(lay.notes, key, f"{list(info.shape)} is carried unquantized, per expert and transposed to [out, in] "
              f"({', '.join(nm for nm, _, _ in parts)}): the only layout transformers loads back for "
              f"{type(mod).__name__} in a compressed-tensors checkpoint")
    return True
