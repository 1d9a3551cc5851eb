"""Model anatomy as data: what a decoder block, a fused expert group and a fused Linear group are.

Everything sq needs to know about a transformers model's layout, in one place:

- ``decoder_blocks``: the blocks the pipeline walks, in order;
- ``experts_modules``: transformers 5's fused routed experts in the layout sq quantizes (3-D
  ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, gate and up concatenated, no biases, called
  as ``experts(hidden, top_k_index, top_k_weights)``; or up/down-only, ``up_proj [E, I, H]`` /
  ``down_proj [E, H, I]`` computing ``down(act(up x))``) and ``expert_params``, a module's two projections
  (``EXPERT_PARAMS`` / ``UP_DOWN_PARAMS``), with ``expert_mid``, what its ``down_proj`` reads.
  The layout is read from the module itself (the ``has_gate`` / ``is_transposed`` /
  ``is_concatenated`` / ``has_bias`` facts transformers' ``use_experts_implementation`` declares,
  the shapes, the forward's signature), never from names; ``annotate_experts`` also asks the
  model's conversion mapping for the per-expert checkpoint names transformers loads back into the
  fused tensors.  Experts in any other layout (gpt-oss' and Llama 4's ``[E, H, 2I]``, LongCat's
  zero-compute slots, GraniteMoE's fused-on-disk tensors without a per-expert layout) are not quantized:
  ``carried_experts`` names them with the reason, and a job refuses them unless
  ``--allow-unquantized-experts`` (``sq.pipeline.targets.model_experts_problems``);
- ``routers``: the Linears of an MoE block that score experts (out features = the number of
  experts) or gate a shared expert (out features 1): never quantized unless a recipe names them;
- ``FUSED_PARTNERS``: Linears that serving engines fuse into one kernel (vLLM's ``qkv_proj``,
  ``gate_up_proj``, DeepSeek's ``fused_qkv_a_proj``); a per-tensor statistic (an NVFP4 global
  scale, an FP8 per-tensor scale) must be shared by the members of a group, or the fused
  weight is garbled.  ``partner_groups`` finds them among a block's quantized Linears.
"""

from __future__ import annotations

import inspect
import logging
import re

import torch.nn as nn

from sq.errors import LoadRefused

logger = logging.getLogger(__name__)

__all__ = ["decoder_blocks", "is_experts_module", "experts_modules", "EXPERT_PARAMS", "UP_DOWN_PARAMS",
           "expert_params", "expert_mid", "FUSED_PARTNERS",
           "partner_groups", "expert_layout_problem", "annotate_experts", "carried_experts", "expert_leaves",
           "routers", "quantization_patch", "quantized_layout_problems", "config_size",
           "quantized_init_problems"]

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
UP_DOWN_PARAMS = ("up_proj", "down_proj")  # up/down-only experts (Nemotron-H): down(act(up x)), no gate


def expert_params(mod: nn.Module) -> tuple[str, str]:
    """The two fused projections of experts ``mod``, input side first: ``gate_up_proj`` (gate then up rows) and
    ``down_proj``, or ``up_proj`` and ``down_proj`` for up/down-only experts."""
    p = mod._parameters
    return UP_DOWN_PARAMS if p.get("gate_up_proj") is None and p.get("up_proj") is not None else EXPERT_PARAMS


def expert_mid(mod: nn.Module, x, w_in):
    """What expert ``mod``'s ``down_proj`` reads for inputs ``x`` and its input-side rows ``w_in``:
    ``act(x W_gate^T) * (x W_up^T)``, or ``act(x W_up^T)`` for up/down-only experts."""
    h = nn.functional.linear(x, w_in)
    if expert_params(mod) == UP_DOWN_PARAMS:
        return mod.act_fn(h)
    gate, up = h.chunk(2, dim=-1)
    return mod.act_fn(gate) * up

# sibling Linears (same parent module) that one engine kernel reads as one weight
FUSED_PARTNERS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),  # Mixtral's block_sparse_moe experts (gate, up)
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek-V3 MLA with q_lora_rank: vLLM's fused_qkv_a_proj
)


def decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder blocks, in order: the ModuleList of blocks holding the most parameters (the text decoder in a
    VLM), whatever it is called (``model.layers``, Falcon's and GPT-BigCode's ``transformer.h``, DBRX's
    ``transformer.blocks``).  A block is a module with submodules of its own (not a bare Linear or a
    list of lists); a ModuleList nested inside a block (per-expert lists) holds less than the stack.  Where
    the (text) config counts its layers, only lists of that length are candidates (a VLM's merger list of a
    vision tower is not its text decoder, however small the decoder); a list inside another's blocks is not."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_layers = config_size(cfg, "num_hidden_layers")
    found = []
    for name, mod in model.named_modules():
        if not (isinstance(mod, nn.ModuleList) and len(mod)):
            continue
        if not all(len(b._modules) and not isinstance(b, nn.ModuleList) for b in mod):
            continue
        found.append((sum(p.numel() for p in mod.parameters()), len(mod) == n_layers, name))
    # a list inside another's blocks (LongCat's per-layer ``mlps``, per-expert lists) is not the stack
    found = [f for f in found if not any(f[2].startswith(g[2] + ".") for g in found)]
    counted = [f for f in found if f[1]] or found
    best, best_n = None, 0
    for n, _, name in counted:
        if n > best_n:
            best, best_n = name, n
    if best is None:
        raise LoadRefused(f"{type(model).__name__} has no ModuleList of decoder blocks")
    blocks = model.get_submodule(best)
    return [(f"{best}.{i}", b) for i, b in enumerate(blocks)]


def config_size(cfg, key: str) -> int | None:
    """Config size ``key`` (``head_dim``, ``num_key_value_heads``): the largest over the layers where it is a
    per-layer attribute (Gemma 4's full-attention layers with ``global_head_dim``: transformers refuses to
    read the global value of a heterogeneous config), None where the config has no positive int of it."""
    try:
        value = getattr(cfg, key, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: it varies by layer
        values = [getattr(layer, key, None) for layer in getattr(cfg, "per_layer_config", ())]
        value = max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _fused_3d(mod: nn.Module) -> bool:
    p = mod._parameters
    return ("down_proj" in p and p["down_proj"] is not None and p["down_proj"].dim() == 3
            and p.get(expert_params(mod)[0]) is not None)


def _three_d(mod: nn.Module) -> list:
    """``mod``'s own 3-D parameters: fused experts of any layout (``[E, ., .]``, more than one slot); not a
    convolution's kernel (a linear-attention / SSM ``conv1d``) nor a 3-D vector (SigLIP's ``probe [1, 1, H]``)."""
    if isinstance(mod, nn.modules.conv._ConvNd):
        return []
    return [t for t in mod._parameters.values() if t is not None and t.dim() == 3 and t.shape[0] > 1]


def expert_layout_problem(mod: nn.Module) -> str | None:
    """Why fused experts ``mod`` are not in the layout sq quantizes, or None when they are.

    The layout: ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``, Linear
    orientation, no other parameters, called as ``forward(hidden, top_k_index, top_k_weights)``.  Proven
    from the facts transformers declares on the module and from the shapes: ``down_proj [E, H, I]``
    against ``gate_up_proj [E, 2I, H]`` cannot be mistaken for the transposed ``[E, I, H]`` / ``[E, H, 2I]``.
    """
    p = mod._parameters
    first, _ = names = expert_params(mod)
    gated = names == EXPERT_PARAMS
    gu, down = p.get(first), p.get("down_proj")
    if gated and (not getattr(mod, "has_gate", True) or gu is None):
        return "up/down-only experts (no gated gate_up_proj)"
    if not gated and (getattr(mod, "has_gate", False) or not callable(getattr(mod, "act_fn", None))):
        return "up/down-only experts whose activation sq cannot read (no act_fn)"
    if getattr(mod, "is_transposed", False):
        return "experts stored transposed ([E, in, out], not nn.Linear's [E, out, in])"
    if not getattr(mod, "is_concatenated", True):
        return "gate and up rows interleaved in gate_up_proj"
    extra = sorted(n for n, t in p.items() if t is not None and n not in names)
    if extra or getattr(mod, "has_bias", False):
        return f"experts with parameters sq does not quantize as part of them ({', '.join(extra) or 'biases'})"
    if gu.dim() != 3 or down.dim() != 3:
        return f"{first} {list(gu.shape)} / down_proj {list(down.shape)} are not both 3-D"
    (e, two_i, h), (e2, h2, i) = gu.shape, down.shape
    if e != e2:
        return f"{e} {first} slots but {e2} down_proj slots (zero-compute or identity experts)"
    if h2 != h or two_i != (2 if gated else 1) * i:
        return (f"{first} {list(gu.shape)} / down_proj {list(down.shape)} are not "
                f"[E, {'2I' if gated else 'I'}, H] / [E, H, I] (a transposed layout)")
    try:
        params = list(inspect.signature(type(mod).forward).parameters)[1:]
    except (TypeError, ValueError):
        params = []
    if len(params) < 3:
        return f"{type(mod).__name__}.forward takes ({', '.join(params)}), not (hidden, top_k_index, top_k_weights)"
    return None


def is_experts_module(mod: nn.Module) -> bool:
    """Fused experts sq quantizes: 3-D ``gate_up_proj`` / ``down_proj`` in its layout, not set aside by
    :func:`annotate_experts`."""
    return (_fused_3d(mod) and expert_layout_problem(mod) is None
            and getattr(mod, "_sq_carried_reason", None) is None)


def experts_modules(block: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in block.named_modules() if is_experts_module(m)]


def carried_experts(model: nn.Module) -> list[tuple[str, str]]:
    """``(name, reason)`` of every routed-experts module of the decoder blocks left unquantized (carried as it
    is): fused experts not in sq's layout, and expert modules that keep their experts in 2-D parameters of their
    own (DBRX's ``experts.mlp`` ``w1`` / ``v1`` / ``w2``, ``[E * I, H]``), which no per-expert layout loads.  A
    3-D tensor outside the decoder blocks (a vision tower's position table) is not an expert."""
    out = []
    for prefix, block in decoder_blocks(model):
        for rel, mod in block.named_modules():
            name = f"{prefix}.{rel}" if rel else prefix
            if _three_d(mod):
                why = getattr(mod, "_sq_carried_reason", None) or expert_layout_problem(mod)
                if why is not None:
                    out.append((name, why))
            elif (not isinstance(mod, nn.Linear) and "expert" in type(mod).__name__.lower()
                  and any(p is not None and p.dim() == 2 for p in mod._parameters.values())):
                shapes = {k: list(p.shape) for k, p in mod._parameters.items() if p is not None}
                out.append((name, f"{type(mod).__name__} keeps its experts in 2-D parameters of its own ({shapes}), "
                                  "not per-expert Linears nor fused [E, ., .] tensors: no per-expert layout of them "
                                  "loads quantized"))
    return out


def expert_leaves(mod: nn.Module) -> dict[str, tuple[str, ...]]:
    """``{param: per-expert leaf names}`` that transformers' conversion mapping stacks into ``param``
    (``{"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}`` by default; Mixtral's
    ``w1, w3`` / ``w2``), as :func:`annotate_experts` found them."""
    if getattr(mod, "_sq_leaves", None):
        return mod._sq_leaves
    if expert_params(mod) == UP_DOWN_PARAMS:
        return {"up_proj": ("up_proj",), "down_proj": ("down_proj",)}
    return {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


_LITERAL_LEAF = re.compile(r"^\\?\.(\w+)\\?\.weight$")


def _per_expert_converters(model: nn.Module) -> list:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    try:
        transforms = get_model_conversion_mapping(model)
    except Exception:  # noqa: BLE001 - a model transformers has no mapping machinery for
        return []
    out = []
    for t in transforms:
        ops = [type(o) for o in getattr(t, "operations", [])]
        if isinstance(t, WeightConverter) and ops in ([MergeModulelist], [MergeModulelist, Concatenate]):
            out.append(t)
    return out


def annotate_experts(model: nn.Module) -> list[tuple[str, str]]:
    """Decide, once per model, which fused experts sq quantizes and under which per-expert names.

    Quantized experts are written per expert (``experts.{e}.gate_proj.weight_packed``...): the layout
    vLLM's per-expert loaders read and transformers fuses back at load.  That needs a per-expert
    converter in the model's conversion mapping for both fused tensors; its source patterns give the
    leaf names (``gate_proj`` / ``up_proj``, Mixtral's ``w1`` / ``w3``).  Experts in another layout, or
    with no such converter, are marked carried (written unquantized in the checkpoint's layout).
    Returns ``(name, reason)`` for every experts module carried.
    """
    converters = _per_expert_converters(model)
    for name, mod in model.named_modules():
        if not _fused_3d(mod) or expert_layout_problem(mod) is not None:
            continue
        leaves: dict[str, tuple[str, ...]] = {}
        names = expert_params(mod)
        for pname in names:
            full = f"{name}.{pname}"
            for conv in converters:
                target = conv.target_patterns[0].replace("*", ".*")
                if not re.search(target + "$", full):
                    continue
                tails = [src.split("*", 1)[-1] for src in conv.source_patterns]
                found = [m.group(1) for m in (_LITERAL_LEAF.match(t) for t in tails) if m]
                if len(found) == len(tails) and len(found) == (2 if pname == "gate_up_proj" else 1):  # gate + up
                    leaves[pname] = tuple(found)
                    break
        if len(leaves) == len(names):
            mod._sq_leaves = leaves
            mod._sq_carried_reason = None
        else:
            mod._sq_carried_reason = ("transformers has no per-expert layout for them (no per-expert conversion "
                                      "mapping), so no quantized checkpoint of them would load")
    carried = carried_experts(model)
    by_reason: dict[str, list[str]] = {}
    for name, why in carried:
        by_reason.setdefault(why, []).append(name)
    for why, names in by_reason.items():  # one line per cause, not per layer
        logger.info("experts carried unquantized (%d module(s), e.g. %s): %s", len(names), names[0], why)
    return carried


def routers(model: nn.Module) -> list[str]:
    """Names of the modules with a 2-D ``weight`` that score experts or gate a shared expert: inside the
    parent of a fused-experts module (any layout), outside the experts, with ``E`` (the number of expert
    slots) or 1 output rows.  Read from shapes, whatever the module is called (``gate``, ``router``,
    ``router.classifier``, ``gate.wg``, ``shared_expert_gate``)."""
    found: list[str] = []
    for name, mod in model.named_modules():
        three_d = _three_d(mod)
        if not three_d:
            continue
        counts = {t.shape[0] for t in three_d}
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        for sub_name, sub in parent.named_modules():
            full = f"{parent_name}.{sub_name}" if parent_name and sub_name else (parent_name or sub_name)
            if sub is mod or full.startswith(name + ".") or full == name:
                continue
            w = sub._parameters.get("weight")
            if w is not None and w.dim() == 2 and (w.shape[0] in counts or w.shape[0] == 1):
                found.append(full)
    return sorted(set(found))


def partner_groups(names: list[str]) -> list[list[str]]:
    """``names`` (module names) grouped by ``FUSED_PARTNERS``: siblings of one group share a
    parent; every other name is a group of its own.  Order follows ``names``."""
    group_of: dict[str, tuple[str, int]] = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        for i, members in enumerate(FUSED_PARTNERS):
            if leaf in members:
                group_of[n] = (parent, i)
    groups: dict[tuple, list[str]] = {}
    for n in names:
        groups.setdefault(group_of.get(n, (n, -1)), []).append(n)
    return list(groups.values())


def quantization_patch(mod: nn.Module) -> type | None:
    """The class transformers puts in place of ``mod`` when it loads a compressed-tensors checkpoint
    (``MODULES_TO_PATCH_FOR_QUANTIZATION``: Llama 4's fused ``[E, H, 2I]`` experts become
    ``SequentialLlama4TextExperts``, per-expert Linears), or None: a quantized checkpoint must hold
    that class's layout."""
    try:
        from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION as patched
    except ImportError:
        return None
    entry = patched.get(type(mod).__name__)
    methods = [str(getattr(m, "value", m)) for m in (entry or {}).get("quantization_methods", [])]
    return entry["module_name"] if entry and "compressed-tensors" in methods else None


def quantized_layout_problems(model: nn.Module) -> list[str]:
    """Modules transformers swaps for another layout when it loads a compressed-tensors checkpoint
    (:func:`quantization_patch`): refused by name until sq writes that layout."""
    found: dict[type, list[str]] = {}
    for name, mod in model.named_modules():
        if quantization_patch(mod) is not None:
            found.setdefault(type(mod), []).append(name)
    return [f"{cls.__name__} ({names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}): transformers "
            f"loads a quantized checkpoint of this model with these modules replaced by "
            f"{quantization_patch(model.get_submodule(names[0])).__name__} (per-expert Linears), a layout sq does "
            "not write yet; no quantized output of this model would load"
            for cls, names in found.items()]


def quantized_init_problems(model: nn.Module, linears: list[tuple[str, nn.Module]]) -> list[str]:
    """Quantized Linears (``(name, module)``, one block's) transformers cannot load: the model's own
    ``_init_weights`` reads ``.weight`` of the Linear or of its parent's Linears, which a compressed-tensors
    Linear does not have (Falcon's ``FalconLinear``, GPT-BigCode's ``c_proj``), so loading the output fails.
    Proven by running that ``_init_weights`` with each weight taken away, on meta parameters only (real
    weights are never touched: an in-memory model is not probed)."""
    return quantized_init_refusal(type(model).__name__, quantized_init_failing(model, linears))


def quantized_init_failing(model: nn.Module, linears: list[tuple[str, nn.Module]]) -> list[str]:
    """The names of ``linears`` whose quantized form the model's ``_init_weights`` cannot load
    (:func:`quantized_init_problems`' probe)."""
    init = getattr(model, "_init_weights", None)
    if init is None:
        return []
    failing = []
    for name, lin in linears:
        w = lin._parameters.get("weight")
        if w is None or not w.is_meta:
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        del lin._parameters["weight"]
        try:
            for mod in (lin, parent):
                try:
                    init(mod)
                except AttributeError as e:
                    if "weight" in str(e):
                        failing.append(name)
                        break
                except Exception:  # noqa: BLE001 - another failure of an init on meta: not this probe's finding
                    break
        finally:
            lin._parameters["weight"] = w
    return failing


def quantized_init_refusal(model_class: str, failing: list[str]) -> list[str]:
    """:func:`quantized_init_failing`'s finding as the refusal, with the ``--ignore`` that keeps them."""
    if not failing:
        return []
    leaves = sorted({n.rpartition(".")[2] for n in failing})
    return [f"{model_class}: transformers cannot load a quantized checkpoint of it: its _init_weights "
            f"reads .weight of {failing[0]}{f' and {len(failing) - 1} more' if len(failing) > 1 else ''}, which a "
            f"quantized (compressed-tensors) Linear does not have; keep them unquantized with "
            f"--ignore 're:.*\\.({'|'.join(leaves)})$'"]
