"""Model-free work planning: which checkpoint tensors are Linear weights (from the model transformers builds
on meta where it knows the architecture, else from names and shapes), grouped into units that go to ranks
by bytes, with the dense Linears row-split where that balances the ranks (``sq.modelfree``)."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from sq.errors import SqError
from sq.anatomy import quantized_init_refusal
from sq.formats.primitives import PerBlock
from sq.formats.schemes import check_group_size
from sq.formats.specs import spec_for
from sq.quant.recipe import scheme_tag

logger = logging.getLogger(__name__)

READ_AHEAD = 2  # units a rank reads ahead of the one it quantizes (memory: this many more units' tensors)

# a tensor of a numbered block: its first numbered component (``model.layers.3.``, Falcon's ``transformer.h.3.``,
# DBRX's ``transformer.blocks.3.``); the decoder is the list of them holding the most bytes
LAYER = re.compile(r"^(?P<prefix>[^.]+(?:\.[^.]*[^.\d][^.]*)*?)\.(?P<i>\d+)\.(?P<rest>.+)$")
EXPERT_KEY = re.compile(r"^(?P<group>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>[^.]+)\.weight$")
_PROJ = re.compile(r"(_proj|_proj_with_mqa|^w[1-3]|^fc\d|^dense(_h_to_4h|_4h_to_h)?|^query_key_value|^c_(attn|proj|fc)"
                   r"|^w[qkvo])$")
_ROUTER = {"gate", "router", "router_gate"}
_GATE_LEAVES = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}  # an expert's gate_up rows: gate first
SPLIT_SLACK = 0.10  # dense Linears are row-split while the busiest rank has over 10% more than an even share


@dataclass
class TensorSlot:
    """One checkpoint tensor a unit writes: ``key`` read (rows ``[lo, hi)`` of expert ``e`` of a fused
    3-D tensor when ``e`` is set), written under ``out_prefix`` (``None``: copied as it is)."""

    key: str
    out_prefix: str | None
    e: int | None = None
    lo: int = 0
    hi: int | None = None
    share: int = 0  # slots of a unit with the same value share one global scale (gate + up; not down)
    cols: tuple[int, int] | None = None  # copied as columns [c0, c1) of expert e, transposed to [out, in]
    # copied into a box of the tensor ``out_prefix`` names (shape, offsets, lengths, stack dim): a tensor the
    # checkpoint splits over several keys, written whole under the model's name (sq.load.layout.merged)
    box: tuple | None = None


@dataclass
class Unit:
    """What one rank quantizes together: Linears sharing a global scale, or tensors copied as they are."""

    block: int
    slots: list[TensorSlot]
    scheme: object = None  # QuantScheme, None for copied tensors
    name: str = ""  # module name (Linear) or experts prefix + index
    nbytes: int = 0


@dataclass
class Plan:
    blocks: list[str]  # layer prefixes, e.g. model.layers.0
    units: list[Unit]
    root: list[str]  # kept outside the layers (rank 0)
    carried: list[str]  # later layers (MTP): rank 0, FP8 dequantized
    dense: dict = field(default_factory=dict)  # module name -> scheme (quantized Linears)
    experts: dict = field(default_factory=dict)  # experts prefix -> (scheme, [out prefixes])
    unquantized: list[str] = field(default_factory=list)  # the config's ignore
    assignment: dict = field(default_factory=dict)
    carried_experts: list = field(default_factory=list)  # (model name, why) of routed experts written unquantized


def dtype_of(config: dict) -> torch.dtype:
    """The dtype the model path builds the model in (``sq.load.meta.build_skeleton``)."""
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else torch.bfloat16


def fp32_patterns(config: dict, dtype: torch.dtype) -> list[str]:
    """Name patterns transformers keeps in float32 for this architecture (the class's
    ``_keep_in_fp32_modules_strict`` under fp16/bf16, ``_keep_in_fp32_modules`` under fp16; e.g.
    DeepSeek-V3's router): read off the class, never built.  [] for an unknown architecture."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        )

        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.get("model_type")])
    except Exception:  # noqa: BLE001 - unknown to this transformers: stored dtypes rule
        return []
    out = []
    if dtype in (torch.float16, torch.bfloat16):
        out += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        out += list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    return out


def _num_layers(config: dict) -> int | None:
    for c in (config, config.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "n_layers"):  # GPT-BigCode's and DBRX's spellings
            n = c.get(key) if isinstance(c, dict) else None
            if isinstance(n, int):
                return n
    return None


def renamer(model_type) -> Callable[[str], str]:
    """Checkpoint module name -> the model's (transformers' own renaming rules for a known
    ``model_type``, e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``; the identity otherwise): what
    ``--ignore`` / ``--recipe`` match and the config's ``ignore`` lists, as on the model path."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        rules = [r for r in (get_checkpoint_conversion_mapping(model_type) or []) if isinstance(r, WeightRenaming)]
    except Exception:  # noqa: BLE001 - an unknown architecture, an older transformers: names as stored
        rules = []
    if not rules:
        return lambda name: name
    return lambda name: apply_renamings(name + ".weight", rules).removesuffix(".weight")


def classify(source, assigner, fp8_scales: set[str]) -> tuple[Plan, list[str]]:
    """Which tensors are quantized, kept or refused: from the model transformers builds on meta where
    it knows the architecture (``sq.load.layout``), else from names and shapes only."""
    from sq.load.layout import checkpoint_layout

    tensors = {k: v for k, v in source.tensors.items() if k not in fp8_scales}
    counts: dict[str, int] = {}
    ends: dict[str, int] = {}
    for k, t in tensors.items():
        m = LAYER.match(k)
        if m:
            counts[m["prefix"]] = counts.get(m["prefix"], 0) + t.nbytes
            ends[m["prefix"]] = max(ends.get(m["prefix"], 0), int(m["i"]) + 1)
    n_layers = _num_layers(source.config)
    # a list exactly as long as the config's layers, else one longer (MTP layers past them), before any other (a
    # VLM's mergers: Qwen3-VL's three deepstack mergers outweigh a tiny two-layer text model)
    counts = ({p: n for p, n in counts.items() if ends[p] == n_layers}
              or {p: n for p, n in counts.items() if n_layers is None or ends[p] >= n_layers} or counts)
    prefix = max(counts, key=counts.get) if counts else None
    layers: dict[int, list[str]] = {}
    root, carried, problems = [], [], []
    for k in sorted(tensors):
        m = LAYER.match(k)
        if m is None or m["prefix"] != prefix:
            root.append(k)
        elif n_layers is not None and int(m["i"]) >= n_layers:
            carried.append(k)
        else:
            layers.setdefault(int(m["i"]), []).append(k)
    n = max(layers) + 1 if layers else 0
    plan = Plan([f"{prefix}.{i}" for i in range(n)], [], root, carried)
    layout = checkpoint_layout(source.root, tensors) if isinstance(source.config.get("model_type"), str) else None
    base = renamer(source.config.get("model_type"))
    if layout is None:
        if any(k.startswith("lm_head.") for k in tensors) or not any(k.startswith("lm_head.") for k in source.tensors):
            plan.unquantized.append("lm_head")  # the model path lists it, tied or not
        for k in root:  # Linears outside the decoder (a vision tower's): kept, listed as the model path lists them
            t = tensors[k]
            if len(t.shape) == 2 and k.endswith(".weight") and not re.search(r"embed|^lm_head\.|\.wte\.|\.wpe\.", k):
                plan.unquantized.append(base(k.removesuffix(".weight")))
        rename, role = base, _role_by_name
    else:
        for note in layout.notes:
            logger.info("model-free: %s", note)
        plan.carried_experts = list(layout.carried_experts)
        rename = lambda name: layout.names.get(name) or base(name)  # noqa: E731
        role = lambda k, t: _role_by_layout(layout, k)  # noqa: E731
    for b in range(n):
        problems += _classify_layer(plan, b, layers.get(b, []), tensors, assigner, rename, role)
    if layout is not None:  # every Linear left unquantized and every router, by model name (as the model path)
        quantized = {rename(nm) for nm in plan.dense}
        plan.unquantized = sorted({*(nm for nm in layout.linears if nm not in quantized), *layout.routers,
                                   *plan.unquantized})
        problems += quantized_init_refusal(layout.model_class, [n for n in layout.init_failing if n in quantized])
    return plan, problems


def _role_by_layout(layout, k: str) -> tuple:
    if k in layout.refused:  # stored transposed where the model's layout would quantize or split it
        return ("refuse", layout.refused[k])
    if k in layout.linear:
        return ("dense",)
    if k in layout.expert:
        return ("expert", *layout.expert[k])
    if k in layout.fused:
        group, leaf, leaves = layout.fused[k]
        return ("expert", group, None, leaf, leaves)
    if k in layout.transposed:
        return ("transposed", layout.transposed[k])
    if k in layout.merged:
        return ("merged", layout.merged[k])
    return ("kept",)


def _role_by_name(k: str, t) -> tuple:
    """A tensor's role from its name and shape alone (an architecture transformers cannot build):
    a 3-D tensor's orientation cannot be proven from a name, so it is refused, never guessed."""
    per_expert = EXPERT_KEY.match(k) if len(t.shape) == 2 else None
    leaf = k.removesuffix(".weight").rsplit(".", 1)[-1]
    if per_expert and _PROJ.search(per_expert["leaf"]):
        return ("expert", per_expert["group"], int(per_expert["e"]), per_expert["leaf"])
    if len(t.shape) == 2 and k.endswith(".weight") and leaf in _ROUTER:
        return ("router",)
    if len(t.shape) == 2 and k.endswith(".weight") and _PROJ.search(leaf):
        return ("dense",)
    if len(t.shape) <= 1:
        return ("kept",)
    return ("refuse",)


def _refusal(k: str, t) -> str:
    pattern = re.escape(k.removesuffix(".weight"))
    if len(t.shape) == 3:
        what = ("a 3-D tensor whose orientation (which dimension is the experts', the output's, the input's) "
                "cannot be proven without the model, and transformers does not know this architecture")
    else:
        what = ("not a tensor model-free quantization can classify (a projection, an expert, a router, a "
                "norm) without the model")
    return f"{k} {list(t.shape)}: {what}; pass --ignore '{pattern}' to leave it as it is"


def _classify_layer(plan: Plan, b: int, keys: list[str], tensors, assigner, rename, role) -> list[str]:
    problems, dense, experts, kept, moved = [], {}, {}, [], []
    for k in keys:
        t = tensors[k]
        r = role(k, t)
        if r[0] == "transposed":  # carried per expert as [out, in] (sq.load.layout)
            moved += [TensorSlot(k, name.removesuffix("weight"), x, cols=(c0, c1)) for name, x, c0, c1 in r[1]]
        elif r[0] == "merged":  # one box of a tensor written whole under the model's name
            target, *box = r[1]
            moved.append(TensorSlot(k, target, box=tuple(box)))
        elif r[0] == "expert":
            experts.setdefault(r[1], []).append((k, r[2], r[3], r[4] if len(r) > 4 else ()))
        elif r[0] == "router":
            plan.unquantized.append(rename(k.removesuffix(".weight")))
            kept.append(k)
        elif r[0] == "dense" and t.nbytes == 0:  # a zero-width Linear (no shared experts): nothing to quantize
            plan.unquantized.append(rename(k.removesuffix(".weight")))
            kept.append(k)
        elif r[0] == "dense":
            dense[k.removesuffix(".weight")] = k
        elif r[0] == "kept":
            kept.append(k)
        elif (assigner.assign(k.removesuffix(".weight")) is None  # the user keeps it (--ignore, recipe): by
              or assigner.assign(rename(k.removesuffix(".weight"))) is None):  # checkpoint or model name
            plan.unquantized.append(rename(k.removesuffix(".weight")))
            kept.append(k)
        else:
            problems.append(_refusal(k, t) if len(r) == 1 else f"{r[1]}; pass --ignore "
                            f"'{re.escape(k.removesuffix('.weight'))}' to leave it as it is")
    for name, key in dense.items():
        scheme = assigner.assign(rename(name))
        if scheme is None:
            plan.unquantized.append(rename(name))
            kept.append(key)
            continue
        try:
            check_group_size(name, tensors[key].shape[1], scheme)
        except SqError as e:
            problems += e.problems
        plan.dense[name] = scheme
        plan.assignment[rename(name)] = scheme_tag(scheme)
    from sq.anatomy import partner_groups

    for group in partner_groups([nm for nm in dense if nm in plan.dense]):
        by_scheme: dict = {}
        for nm in group:  # partners share a global scale only under one scheme
            by_scheme.setdefault(plan.dense[nm], []).append(nm)
        for scheme, names in by_scheme.items():
            slots = [TensorSlot(dense[nm], nm + ".") for nm in names]
            plan.units.append(Unit(b, slots, scheme, names[0], sum(tensors[s.key].nbytes for s in slots)))
    for group, entries in experts.items():
        problems += _expert_units(plan, b, group, entries, tensors, assigner, kept, rename)
    if kept or moved:
        nbytes = sum(tensors[k].nbytes for k in kept) + sum(
            tensors[s.key].nbytes if s.cols is None else
            tensors[s.key].nbytes * (s.cols[1] - s.cols[0]) // math.prod(tensors[s.key].shape[::2]) for s in moved)
        plan.units.append(Unit(b, [TensorSlot(k, None) for k in kept] + moved, None, f"{plan.blocks[b]} (kept)", nbytes))
    return problems


def _expert_units(plan: Plan, b: int, group: str, entries, tensors, assigner, kept: list[str], rename) -> list[str]:
    """One unit per expert: its gate and up (sharing a global scale) and down."""
    scheme = assigner.assign(rename(group))
    if scheme is None:
        kept.extend(k for k, *_ in entries)
        return []
    problems: list[str] = []
    per: dict[int, list[TensorSlot]] = {}
    for k, e, leaf, leaves in entries:
        shape = tensors[k].shape
        if e is None:  # fused 3-D: written per expert under the names sq.load.layout proved load back
            step = shape[1] // len(leaves)
            for x in range(shape[0]):
                for j, nm in enumerate(leaves):
                    per.setdefault(x, []).append(TensorSlot(k, f"{group}.{x}.{nm}.", x, j * step, (j + 1) * step,
                                                      share=1 if leaf == "down_proj" else 0))
        else:
            per.setdefault(e, []).append(TensorSlot(k, k.removesuffix("weight"), share=0 if leaf in _GATE_LEAVES else 1))
        width = shape[-1]
        try:
            check_group_size(f"{group}.{leaf}", width, scheme)
        except SqError as err:
            problems += [p for p in err.problems if p not in problems]
    outs = []
    for e in sorted(per):
        slots = per[e]
        nbytes = sum(tensors[s.key].nbytes * (s.hi - s.lo) // (tensors[s.key].shape[0] * tensors[s.key].shape[1])
                     if s.e is not None else tensors[s.key].nbytes for s in slots)
        plan.units.append(Unit(b, slots, scheme, f"{group}.{e}", nbytes))
        outs += [s.out_prefix.removesuffix(".") for s in slots]
    plan.experts[group] = (scheme, sorted(outs))
    plan.assignment[rename(group)] = scheme_tag(scheme)
    return problems


def _splittable(unit: Unit) -> bool:
    """A dense Linear group (experts are spread by index, copied tensors cost only their read)."""
    return unit.scheme is not None and all(s.e is None and not EXPERT_KEY.match(s.key) for s in unit.slots)


def _place(units: list[Unit], world: int, split: set[int]) -> tuple[list[int], int]:
    """Owner rank of each whole unit, largest first to the least loaded rank, every rank starting with
    its even share of the ``split`` units; and the busiest rank's bytes."""
    spread = sum(units[i].nbytes for i in split)
    load, owner = [spread // world + (r < spread % world) for r in range(world)], [0] * len(units)
    for i in sorted((i for i in range(len(units)) if i not in split), key=lambda i: (-units[i].nbytes, i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + max(units[i].nbytes, 1)
    return owner, max(load)


def split_by_bytes(units: list[Unit], world: int, split_at: int | None = None) -> tuple[list[int], list[int]]:
    """(owner rank of each unit, the units whose rows are spread over every rank), deterministic.

    Whole units go largest first to the least loaded rank.  That balances while units are many and
    small against a rank's share; when a few dense Linears dominate (few layers for many ranks, one
    huge projection) the busiest rank ends well above an even share however they are placed.  Then
    the largest dense Linear group is split by rows over every rank, then the next, while that
    lowers the busiest rank's load and it stays over ``SPLIT_SLACK`` above an even share.  A split
    unit's owner (the rank that writes it; ``owner``) takes turns over the ranks.  ``split_at``
    (tests): also split every dense Linear group of at least that many bytes.
    """
    split = {i for i, u in enumerate(units) if split_at is not None and world > 1 and _splittable(u)
             and u.nbytes >= split_at}
    owner, busiest = _place(units, world, split)
    even = sum(u.nbytes for u in units) / world
    while world > 1 and busiest > even * (1 + SPLIT_SLACK):
        rest = [i for i, u in enumerate(units) if i not in split and _splittable(u)]
        if not rest:
            break
        i = min(rest, key=lambda i: (-units[i].nbytes, i))
        trial, trial_busiest = _place(units, world, split | {i})
        if trial_busiest >= busiest:
            break
        split.add(i)
        owner, busiest = trial, trial_busiest
    for k, i in enumerate(sorted(split)):
        owner[i] = k % world
    return owner, sorted(split)


def row_ranges(rows: int, scheme, world: int) -> list[tuple[int, int]]:
    """Each rank's rows ``[lo, hi)`` of a row-split weight: contiguous, in rank order, cut at scale
    block boundaries (FP8_BLOCK's 128 rows) so every block's scale comes from one rank's rows; per-
    channel and per-group scales are row-independent, so any row boundary keeps their groups whole."""
    g = spec_for(scheme).granularity
    step = g.rows if isinstance(g, PerBlock) else 1
    n = -(-rows // step)
    return [(min(rows, r * n // world * step), min(rows, (r + 1) * n // world * step)) for r in range(world)]


def my_rows(unit: Unit, rank: int, world: int, rows: Callable[[str], int]) -> Unit:
    """The part of a row-split unit this rank reads: its rows of every slot."""
    slots = []
    for s in unit.slots:
        lo, hi = row_ranges(rows(s.key), unit.scheme, world)[rank]
        slots.append(TensorSlot(s.key, s.out_prefix, None, lo, hi, s.share))
    return Unit(unit.block, slots, unit.scheme, unit.name)


# transformers' usual module order inside a layer (the model path lists Linears in module order)
_LEAF_ORDER = {leaf: i for i, leaf in enumerate(
    ("q_proj", "q_a_proj", "q_b_proj", "k_proj", "kv_a_proj_with_mqa", "kv_b_proj", "v_proj", "o_proj",
     "gate_proj", "w1", "up_proj", "w3", "down_proj", "w2"))}


def module_order(name: str) -> tuple:
    """Sort key approximating module registration order: layer, attention before MLP, known leaves in
    transformers' order (the config's group order and target lists then match the model path's)."""
    m = LAYER.match(name)
    layer, rest = (int(m["i"]), m["rest"]) if m else (-1, name)
    parent, _, leaf = rest.rpartition(".")
    return (layer, 0 if "attn" in parent or "attention" in parent else 1, parent, _LEAF_ORDER.get(leaf, 99), leaf)


def config_groups(plan: Plan, skipped: set[str]) -> dict:
    """``{scheme: targets}`` as the model path builds them: the largest group ``Linear``, others by name."""
    members: dict = {}
    for name, scheme in sorted(plan.dense.items(), key=lambda kv: module_order(kv[0])):
        if name not in skipped:
            members.setdefault(scheme, []).append(name)
    for group, (scheme, names) in plan.experts.items():
        members.setdefault(scheme, []).extend(names)
    if len(members) <= 1:
        return {s: ["Linear"] for s in members}
    biggest = max(members, key=lambda s: len(members[s]))
    return {s: (["Linear"] if s == biggest else names) for s, names in members.items()}
