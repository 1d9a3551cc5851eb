"""Model-free quantization: data-free schemes straight from the safetensors shards, no model built.

``python -m sq.ptq --model-free`` (or automatically, when transformers cannot build the
architecture and the job needs no calibration data) reads the index and the headers, decides
from names and shapes which tensors are Linear weights, and quantizes each with round-to-nearest
-- the very functions the model path's ``rtn_rows`` calls (``rtn.qparams``, ``rtn.quantize``), then
``compress_weight`` -- so the output equals ``sq.ptq --algo rtn``'s tensor for tensor.

Classification (docs/model-free.md), inside decoder layers ``<prefix>.layers.<i>.`` with
``i < num_hidden_layers`` (later layers -- DeepSeek's MTP -- are carried over as they are):

- where transformers knows the ``model_type``, from the model it builds on meta (``sq.load.layout``):
  the whole ``.weight`` of a non-router ``nn.Linear`` in a decoder block is quantized, per-expert
  tensors the conversion mapping stacks are quantized per expert, a fused 3-D tensor only where its
  per-expert names load back; everything else (norms, conv, SSM parameters, routers, 3-D tensors
  with no per-expert layout transformers loads) is carried as it is; a tensor the Hub stores transposed
  against its parameter (the conversion mapping's ``Transpose``, Qwen3-VL-MoE's experts) is carried as
  stored where its parameter would be carried, and refused by name where it would be quantized;
- otherwise from names and shapes: 2-D projections (``*_proj``, ``w1/w2/w3``, ``fc1/fc2``...) and
  per-expert ``experts.<e>.<proj>.weight`` quantized, 1-D tensors and routers kept, anything else
  (every 3-D tensor: its orientation cannot be proven) refused by name (``--ignore`` keeps it).

Outside the layers everything is kept; ``lm_head`` is listed in ``ignore``.  FP8 block-scaled
sources are dequantized per tile (``sq.load.fp8.dequantize``) into the config's dtype, their scales
dropped.  MXFP4 sources (gpt-oss) are refused: the model path reads them (``sq.load.mxfp4``).
NVFP4-style global scales are shared by fused partners (``sq.anatomy.partner_groups``;
an expert's gate and up), which always land on one unit: one rank, or all of them row-split together.

Work: units (a partner group of Linears, one expert of a group, a layer's other tensors) go to
ranks by bytes, greedily; when a few dense Linears leave ranks unbalanced, their rows are split
over every rank (``split_by_bytes``, ``_split_pass``: statistics that span rows all-reduced once,
rows gathered to one writer).  Each rank reads its units a few ahead in a thread, quantizes, and
hands each layer to a writer thread that writes ``model-rank{r}-block{b}`` and records the layer in
its manifest (``sq.resume``), so reading, quantizing and writing overlap; rank 0 writes the root and
carried tensors, config, report and, last, the index.  The only collectives between the refusals
and the final stage are the row-split pass's, before the first layer.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load

from sq.agree import agree, argument_facts, content_hashes
from sq.dist import uses_nccl
from sq.errors import SqError
from sq.export import writer
from sq.formats.compressed import compress_weight
from sq.files import CARRIED_NAME, safetensors_bytes, shard_name
from sq.load import fp8, mxfp4
from sq.load.meta import config_problems, model_type_problems, tokenizer_problems
from sq.load.fill import data_start, pread_into
from sq.load.source import open_checked, scan_checkpoint
from sq.memory import trim_heap
from sq.quant import rtn
from sq.quant.algorithms import rtn_codes
from sq.formats.specs import required_reductions, spec_for
from sq.run import Run, raise_all, signature
from sq.formats.primitives import PerBlock
from sq.quant.recipe import make_assigner, scheme_tag
from sq.formats.schemes import check_group_size
from sq.report import block_progress
from sq.resume import source_identity

logger = logging.getLogger(__name__)

__all__ = ["wanted", "quantize_checkpoint", "classify", "Plan"]

_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<i>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"^(?P<group>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>[^.]+)\.weight$")
_PROJ = re.compile(r"(_proj|_proj_with_mqa|^w[1-3]|^fc\d|^dense(_h_to_4h|_4h_to_h)?|^query_key_value|^c_(attn|proj|fc)"
                   r"|^w[qkvo])$")
_ROUTER = {"gate", "router", "router_gate"}
_GATE_LEAVES = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}  # an expert's gate_up rows: gate first
READ_AHEAD = 2  # units a rank reads ahead of the one it quantizes (memory: this many more units' tensors)
SPLIT_SLACK = 0.10  # dense Linears are row-split while the busiest rank has over 10% more than an even share


@dataclass
class Slot:
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
    slots: list[Slot]
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


def _dtype_of(config: dict) -> torch.dtype:
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
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

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
        n = c.get("num_hidden_layers") if isinstance(c, dict) else None
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
    for k, t in tensors.items():
        m = _LAYER.match(k)
        if m:
            counts[m["prefix"]] = counts.get(m["prefix"], 0) + t.nbytes
    prefix = max(counts, key=counts.get) if counts else None
    n_layers = _num_layers(source.config)
    layers: dict[int, list[str]] = {}
    root, carried, problems = [], [], []
    for k in sorted(tensors):
        m = _LAYER.match(k)
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
        rename = lambda name: layout.names.get(name) or base(name)  # noqa: E731
        role = lambda k, t: _role_by_layout(layout, k)  # noqa: E731
    for b in range(n):
        problems += _classify_layer(plan, b, layers.get(b, []), tensors, assigner, rename, role)
    if layout is not None:  # every Linear left unquantized and every router, by model name (as the model path)
        quantized = {rename(nm) for nm in plan.dense}
        plan.unquantized = sorted({*(nm for nm in layout.linears if nm not in quantized), *layout.routers,
                                   *plan.unquantized})
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
    per_expert = _EXPERT.match(k) if len(t.shape) == 2 else None
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
            moved += [Slot(k, name.removesuffix("weight"), x, cols=(c0, c1)) for name, x, c0, c1 in r[1]]
        elif r[0] == "merged":  # one box of a tensor written whole under the model's name
            target, *box = r[1]
            moved.append(Slot(k, target, box=tuple(box)))
        elif r[0] == "expert":
            experts.setdefault(r[1], []).append((k, r[2], r[3], r[4] if len(r) > 4 else ()))
        elif r[0] == "router":
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
            slots = [Slot(dense[nm], nm + ".") for nm in names]
            plan.units.append(Unit(b, slots, scheme, names[0], sum(tensors[s.key].nbytes for s in slots)))
    for group, entries in experts.items():
        problems += _expert_units(plan, b, group, entries, tensors, assigner, kept, rename)
    if kept or moved:
        nbytes = sum(tensors[k].nbytes for k in kept) + sum(
            tensors[s.key].nbytes if s.cols is None else
            tensors[s.key].nbytes * (s.cols[1] - s.cols[0]) // math.prod(tensors[s.key].shape[::2]) for s in moved)
        plan.units.append(Unit(b, [Slot(k, None) for k in kept] + moved, None, f"{plan.blocks[b]} (kept)", nbytes))
    return problems


def _expert_units(plan: Plan, b: int, group: str, entries, tensors, assigner, kept: list[str], rename) -> list[str]:
    """One unit per expert: its gate and up (sharing a global scale) and down."""
    scheme = assigner.assign(rename(group))
    if scheme is None:
        kept.extend(k for k, *_ in entries)
        return []
    problems: list[str] = []
    per: dict[int, list[Slot]] = {}
    for k, e, leaf, leaves in entries:
        shape = tensors[k].shape
        if e is None:  # fused 3-D: written per expert under the names sq.load.layout proved load back
            step = shape[1] // len(leaves)
            for x in range(shape[0]):
                for j, nm in enumerate(leaves):
                    per.setdefault(x, []).append(Slot(k, f"{group}.{x}.{nm}.", x, j * step, (j + 1) * step,
                                                      share=1 if leaf == "down_proj" else 0))
        else:
            per.setdefault(e, []).append(Slot(k, k.removesuffix("weight"), share=0 if leaf in _GATE_LEAVES else 1))
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
    return unit.scheme is not None and all(s.e is None and not _EXPERT.match(s.key) for s in unit.slots)


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


def _row_ranges(rows: int, scheme, world: int) -> list[tuple[int, int]]:
    """Each rank's rows ``[lo, hi)`` of a row-split weight: contiguous, in rank order, cut at scale
    block boundaries (FP8_BLOCK's 128 rows) so every block's scale comes from one rank's rows; per-
    channel and per-group scales are row-independent, so any row boundary keeps their groups whole."""
    g = spec_for(scheme).granularity
    step = g.rows if isinstance(g, PerBlock) else 1
    n = -(-rows // step)
    return [(min(rows, r * n // world * step), min(rows, (r + 1) * n // world * step)) for r in range(world)]


class _Reader:
    """Checkpoint tensors by positional reads (``os.preadv`` into a tensor's own memory), converted
    to what the model path holds: the config's dtype (float32 where transformers keeps a module in
    float32), FP8 block-scaled weights dequantized per tile.

    Why not ``safe_open``: a plain read releases the GIL while the disk works, so the read-ahead
    thread (``_ReadAhead``) truly overlaps reading with quantizing, and a row range or one expert
    of a fused tensor reads exactly its bytes.  ``fetch`` only reads (the thread's half);
    ``convert`` only computes (the caller's).  Safe to use from two threads."""

    def __init__(self, source, layout, dtype: torch.dtype):
        self.source, self.layout, self.dtype = source, layout, dtype
        self.files: dict[str, tuple] = {}  # file -> (open file, start of its data section)
        self.lock = threading.Lock()
        fp32 = fp32_patterns(source.config, dtype)
        self.fp32 = re.compile("|".join(re.escape(p) for p in fp32)) if fp32 else None

    def _file(self, name: str) -> tuple[int, int]:
        """(fd, start of the data section) of ``name``, opened once under the loader's link rule."""
        with self.lock:
            if name not in self.files:
                path = self.source.path(name)
                f = open_checked(path.parent, path.name)
                try:
                    start = data_start(f.fileno(), path)
                except OSError:
                    f.close()
                    raise SqError(f"{path} is shorter than a safetensors header") from None
                self.files[name] = (f, start)
            f, start = self.files[name]
            return f.fileno(), start

    def close(self) -> None:
        with self.lock:
            for f, _ in self.files.values():
                f.close()
            self.files.clear()

    def read(self, key: str, lo: int = 0, hi: int | None = None, e: int | None = None) -> torch.Tensor:
        """``key`` as stored: whole, or rows ``[lo, hi)`` of its first dimension, or of expert ``e``'s
        rows of a fused 3-D tensor (rows of a C-contiguous tensor are one byte range: only it is read)."""
        info = self.source.tensors[key]
        fd, data = self._file(info.file)
        if e is None and lo == 0 and hi is None:
            first, shape = 0, info.shape
            nbytes = info.nbytes
        else:
            rows, inner = (info.shape[0], info.shape[1:]) if e is None else (info.shape[1], info.shape[2:])
            hi = rows if hi is None else hi
            row_bytes = info.dtype.itemsize * math.prod(inner)
            first, shape, nbytes = ((e or 0) * rows + lo) * row_bytes, (hi - lo, *inner), (hi - lo) * row_bytes
        buf = torch.empty(nbytes, dtype=torch.uint8)
        path = self.source.path(info.file)
        try:
            pread_into(fd, buf, data + info.offsets[0] + first, path)
        except EOFError:
            raise SqError(f"{path} ends inside tensor {key}: the file is truncated") from None
        return buf.view(info.dtype).reshape(shape)

    def fetch(self, key: str, lo: int = 0, hi: int | None = None, e: int | None = None):
        """What ``convert`` needs for these rows: (rows as stored, their FP8 scale rows or None)."""
        raw = self.read(key, lo, hi, e)
        if e is not None or self.layout is None or key not in self.layout.scales:
            return raw, None
        br = self.layout.block[0]
        return raw, self.read(self.layout.scales[key], lo // br, -(-(lo + len(raw)) // br))

    def fetch_unit(self, unit: Unit) -> list:
        return [self.fetch(s.key, s.lo, s.hi, s.e) for s in unit.slots]

    def convert(self, key: str, fetched, lo: int = 0, expert: bool = False, cast: bool = True) -> torch.Tensor:
        """Fetched rows from row ``lo`` in the model's dtype (``cast``; else as stored, FP8 dequantized:
        carried tensors); ``expert``: rows of a fused experts tensor (never float32, never FP8-scaled)."""
        t, scale = fetched
        if scale is not None:
            out = torch.empty(t.shape, dtype=self.dtype)
            br = self.layout.block[0]
            fp8.dequantize_into(out, t, scale, (lo - lo // br * br, 0), self.layout.block)
            return out
        if not (cast and t.is_floating_point()):
            return t
        if expert or self.fp32 is None or not self.fp32.search(key):
            return t.to(self.dtype)
        return t.to(torch.float32)

    def weight(self, key: str, cast: bool = True) -> torch.Tensor:
        return self.convert(key, self.fetch(key), cast=cast)


class _ReadAhead:
    """This rank's units' tensors read by a background thread, at most ``depth`` units ahead of the
    one being quantized, handed out in order by ``get``.

    Why: the disk reads the next units while the CPU quantizes this one, so a rank runs at the
    pace of the slower of the two instead of their sum.  ``depth`` bounds the memory (the unit being
    quantized and ``depth`` read ones).  An exception in the thread is raised, as it is, by the
    ``get`` of the unit it happened on."""

    def __init__(self, reader: _Reader, units: list[Unit], depth: int = 2):
        self.q: queue.Queue = queue.Queue()
        self.room = threading.Semaphore(depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(reader, units), name="sq-read-ahead", daemon=True)
        self.thread.start()

    def _run(self, reader: _Reader, units: list[Unit]) -> None:
        for u in units:
            self.room.acquire()
            if self.stop.is_set():
                return
            try:
                self.q.put((reader.fetch_unit(u), None))
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                self.q.put((None, e))
                return

    def get(self) -> list:
        """The next unit's fetched slots; the previous unit's place is free for one more read."""
        fetched, error = self.q.get()
        self.room.release()
        if error is not None:
            raise error
        return fetched

    def close(self) -> None:
        self.stop.set()
        self.room.release()  # a thread waiting for room wakes and sees the stop
        self.thread.join()


def _rtn(w: torch.Tensor, scheme, stats, row_offset: int = 0) -> dict:
    """``rtn_rows``'s codes and scales of rows ``w`` (``rtn_codes``: the same calls), without the
    dequantized copy the model path writes back into its model and this path never reads (for
    FP8_BLOCK it is most of the time)."""
    qp, q = rtn_codes(w, scheme, stats, row_offset)
    return {"q": q, "scale": qp.scale, "zero_point": qp.zero_point, "global_scale": qp.global_scale}


def _compress(parts: dict, scheme, shape) -> dict:
    return compress_weight((parts["q"], parts["scale"], parts["zero_point"]), scheme, tuple(shape),
                           global_scale=parts["global_scale"])


def _nonfinite_problem(key: str, dense: bool) -> str:
    return (f"{key} holds NaN or Inf values: its scales would be NaN. Fix the checkpoint"
            + (", or pass --skip-nonfinite to leave such Linears unquantized" if dense else
               "; --skip-nonfinite leaves dense Linears only: leave these experts out with --ignore"))


def _share_global(slots: list[Slot], stats: list) -> None:
    """One global scale per fused weight (the model path's rule): slots with the same ``share`` take
    the max of their ``global_absmax`` (slots left out, e.g. for NaN, have ``None`` stats)."""
    for share in {s.share for s in slots}:
        members = [st for s, st in zip(slots, stats) if s.share == share and st and "global_absmax" in st]
        if len(members) > 1:
            shared = torch.stack([st["global_absmax"] for st in members]).amax(0)
            for st in members:
                st["global_absmax"] = shared.clone()


def _quantize_unit(unit: Unit, fetched: list, reader: _Reader,
                   skip_nonfinite: bool) -> tuple[dict, list[str], list[str]]:
    """The unit's output tensors (from its ``fetch_unit``), the Linears left unquantized for NaN/Inf, and refusals."""
    if unit.scheme is None:
        out = {}
        for s, f in zip(unit.slots, fetched):
            if s.box is not None:  # a piece of a tensor written whole: into its box
                shape, offsets, lengths, stack_dim = s.box
                piece = reader.convert(s.key, f)
                whole = out.setdefault(s.out_prefix, torch.empty(shape, dtype=piece.dtype))
                box = whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
                box.copy_(piece.unsqueeze(stack_dim) if stack_dim is not None else piece)
            elif s.cols is None:
                out[s.key] = reader.convert(s.key, f)
            else:  # one expert's [in, out] columns, written as the [out, in] weight transformers loads
                out[s.out_prefix + "weight"] = reader.convert(s.key, f, expert=True)[:, s.cols[0]:s.cols[1]].T.contiguous()
        return out, [], []
    ws = [reader.convert(s.key, f, s.lo, expert=s.e is not None) for s, f in zip(unit.slots, fetched)]
    del fetched
    bad = [i for i, w in enumerate(ws) if not rtn.all_finite(w)]
    out, skipped = {}, []
    if bad:
        dense = unit.slots[0].e is None and not _EXPERT.match(unit.slots[0].key)
        if not (skip_nonfinite and dense):
            return {}, [], [_nonfinite_problem(unit.slots[i].key, dense) for i in bad]
        for i in bad:  # left as they are, listed in ignore; their partners share a scale without them
            out[unit.slots[i].key] = ws[i]
            skipped.append(unit.slots[i].out_prefix.removesuffix("."))
        keep = [i for i in range(len(ws)) if i not in bad]
        unit = Unit(unit.block, [unit.slots[i] for i in keep], unit.scheme, unit.name)
        ws = [ws[i] for i in keep]
    stats = [rtn.local_stats(w, unit.scheme) or None for w in ws]
    _share_global(unit.slots, stats)
    for s, w, st in zip(unit.slots, ws, stats):
        for rel, v in _compress(_rtn(w, unit.scheme, st), unit.scheme, w.shape).items():
            out[s.out_prefix + rel] = v
    return out, skipped, []


def _my_rows(unit: Unit, rank: int, world: int, rows: Callable[[str], int]) -> Unit:
    """The part of a row-split unit this rank reads: its rows of every slot."""
    slots = []
    for s in unit.slots:
        lo, hi = _row_ranges(rows(s.key), unit.scheme, world)[rank]
        slots.append(Slot(s.key, s.out_prefix, None, lo, hi, s.share))
    return Unit(unit.block, slots, unit.scheme, unit.name)


def _reduced_stats(units: list[Unit], parts: list[Unit], reader: _Reader) -> tuple[list[list], list[list[bool]]]:
    """Every row-split slot's cross-row statistics (NVFP4's global absmax, FP8_BLOCK's block absmax)
    and whether it holds NaN/Inf, over all ranks' rows: ONE all_reduce (max; a min statistic travels
    negated) of everything at once.  float64 holds every float32 statistic exactly."""
    chunks, where = [], []  # where: (unit, slot, stat, op, shape, dtype) per chunk after each flag
    ahead = _ReadAhead(reader, parts)
    try:
        for ui, (u, part) in enumerate(zip(units, parts)):
            for si, (s, f) in enumerate(zip(part.slots, ahead.get())):
                w = reader.convert(s.key, f, s.lo)
                chunks.append(torch.tensor([0.0 if rtn.all_finite(w) else 1.0], dtype=torch.float64))
                for red in required_reductions(u.scheme):
                    t = red.local(w, row_offset=s.lo, rows=reader.source.tensors[s.key].shape[0])
                    where.append((ui, si, red.stat, red.op, t.shape, t.dtype))
                    chunks.append(t.to(torch.float64).flatten() * (-1.0 if red.op == "min" else 1.0))
                del w
    finally:
        ahead.close()
    flat = torch.cat(chunks)
    if uses_nccl():
        flat = flat.cuda()
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    flat = flat.cpu()
    stats = [[{} for _ in u.slots] for u in units]
    bad = [[False] * len(u.slots) for u in units]
    at, w_i = 0, 0
    for ui, u in enumerate(units):
        for si in range(len(u.slots)):
            bad[ui][si] = bool(flat[at] > 0)
            at += 1
            while w_i < len(where) and where[w_i][:2] == (ui, si):
                _, _, stat, op, shape, dtype = where[w_i]
                n = math.prod(shape)
                stats[ui][si][stat] = (flat[at:at + n] * (-1.0 if op == "min" else 1.0)).reshape(shape).to(dtype)
                at, w_i = at + n, w_i + 1
    return stats, bad


def _split_pass(units: list[Unit], owners: list[int], reader: _Reader, skip_nonfinite: bool) -> dict[int, tuple]:
    """Row-split Linears (``split_by_bytes``): every rank reads and quantizes its rows of each, with the
    statistics that span rows reduced over all ranks, and the unit's owner gathers the codes and
    scales, compresses the whole tensor and writes it with its layer.  Returns the owner's output,
    ``{layer: (tensors, Linears left unquantized for NaN/Inf)}``.

    It runs before the first layer, on every rank alike (the same units from the same plan), so its
    collectives -- one all_reduce, then one gather per unit -- never wait for a rank that has left;
    the main loop keeps none.  A rank reads its rows twice (statistics, then codes) rather than
    holding them across the all_reduce: memory stays one unit's rows, plus the owner's compressed
    outputs until their layers are written.  The codes equal the whole tensor's: each row's scales
    see the same reduced statistics (``rtn.quantize`` with the row offset), as on the model path's
    row shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = lambda key: reader.source.tensors[key].shape[0]  # noqa: E731
    parts = [_my_rows(u, rank, world, rows) for u in units]
    stats, bad = _reduced_stats(units, parts, reader)
    refused = [_nonfinite_problem(s.key, True) for u, b in zip(units, bad) for s, x in zip(u.slots, b) if x]
    if refused and not skip_nonfinite:
        raise SqError(refused)  # every rank holds the same reduced flags: all refuse together
    ready: dict[int, tuple[dict, list]] = {}
    ahead = _ReadAhead(reader, parts)
    try:
        for ui, (u, part, owner) in enumerate(zip(units, parts, owners)):
            st = [None if b else (x or None) for x, b in zip(stats[ui], bad[ui])]
            _share_global(u.slots, st)
            mine = {}  # "slot.part" -> this rank's rows of it (codes, row scales; the rows themselves for NaN/Inf)
            for si, (s, f) in enumerate(zip(part.slots, ahead.get())):
                if s.hi > s.lo:
                    w = reader.convert(s.key, f, s.lo)
                    res = {"w": w} if bad[ui][si] else _rtn(w, u.scheme, st[si], row_offset=s.lo)
                    mine.update({f"{si}.{k}": v for k, v in res.items() if v is not None})
            # as safetensors bytes: exact for every dtype (pickled float8 tensors do not load back)
            got = [None] * world if rank == owner else None
            dist.gather_object(safetensors_bytes(mine), got, dst=owner)
            del mine
            if rank == owner:
                pieces = [st_load(g) for g in got]
                tensors, skipped = ready.setdefault(u.block, ({}, []))
                for si, s in enumerate(u.slots):
                    by_rank = [{k.partition(".")[2]: v for k, v in p.items() if k.startswith(f"{si}.")} for p in pieces]
                    tensors.update(_assemble(s, u.scheme, [r for r in by_rank if r],
                                             reader.source.tensors[s.key].shape, skipped))
            del got
    finally:
        ahead.close()
    return ready


def _assemble(slot: Slot, scheme, pieces: list[dict], shape, skipped: list[str]) -> dict:
    """One row-split weight's output from every rank's rows, in rank (= row) order."""
    if "w" in pieces[0]:  # NaN/Inf with --skip-nonfinite: kept as it is, listed in ignore
        skipped.append(slot.out_prefix.removesuffix("."))
        return {slot.key: torch.cat([p["w"] for p in pieces])}
    rows = rtn.scales_follow_rows(scheme)  # else every rank computed the whole scale (2-D blocks)
    whole = {"q": torch.cat([p["q"] for p in pieces]), "global_scale": pieces[0].get("global_scale")}
    for k in ("scale", "zero_point"):
        whole[k] = None if k not in pieces[0] else torch.cat([p[k] for p in pieces]) if rows else pieces[0][k]
    return {slot.out_prefix + rel: v for rel, v in _compress(whole, scheme, shape).items()}


def data_free_problems(cfg, assigner, why: str) -> list[str]:
    """Refusals of a job model-free quantization cannot run: anything that needs calibration data."""
    reason = cfg.data_reason(assigner)
    if reason is None:
        return []
    return [f"{why}: model-free quantization reads no calibration data, but {reason} needs it; use --algo rtn with "
            "a data-free scheme (W4A16, W8A16, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, MXFP4A16, ...), or drop "
            "--model-free so the model is built"]


def wanted(cfg, model_free: bool) -> bool:
    """Whether ``sq.ptq`` takes the model-free path: on request, or when transformers cannot build
    the architecture (unknown ``model_type``; remote code not allowed) and the job is data-free.
    Call on every rank (a hub id is resolved, rank 0 downloading)."""
    if model_free:
        return True
    from sq.resolve import resolve_model_dist
    from sq.load.source import read_config

    try:
        src = resolve_model_dist(cfg.model)
        raw = read_config(src)
        assigner = make_assigner(cfg.scheme, cfg.group_size, cfg.ignore, cfg.recipe)
    except SqError:
        return False  # the model path names the problem
    model_type = raw.get("model_type")
    # an architecture transformers does not know, or code the user did not allow; a config without a
    # (string) model_type is broken, not new: the model path names it
    unbuildable = isinstance(model_type, str) and model_type != "" and (
        bool(model_type_problems(raw, Path(src), trust_remote_code=cfg.trust_remote_code))
        or (bool(raw.get("auto_map")) and not cfg.trust_remote_code))
    if unbuildable and cfg.data_reason(assigner) is None and not cfg.problems():
        logger.info("transformers cannot build %s (model_type %r); quantizing it model-free", src, model_type)
        return True
    return False


def _prepare(cfg):
    """Every refusal, identical on every rank, before anything is written: (plan, reader, source, assigner)."""
    from sq.resolve import resolve_model_dist

    problems = list(cfg.problems())
    assigner = None
    try:
        assigner = make_assigner(cfg.scheme, cfg.group_size, cfg.ignore, cfg.recipe)
    except SqError as e:
        problems += e.problems
    if assigner is not None:
        problems += data_free_problems(cfg, assigner, "--model-free")
    raise_all(problems, "argument checks")
    src = Path(resolve_model_dist(cfg.model))
    source = scan_checkpoint(src)
    problems = list(source.problems)
    layout = None
    if not problems:
        problems += config_problems(source.config, src, trust_remote_code=True)  # no model code runs here
        problems += tokenizer_problems(src, trust_remote_code=cfg.trust_remote_code)  # copied: the user's word
        layout, fp8_problems = fp8.detect_fp8(source)
        problems += fp8_problems
        if mxfp4.is_mxfp4(source.config):  # read by the model path only: one line, whatever else is wrong
            problems.append(f"{src / 'config.json'}: the source is MXFP4 (quant_method 'mxfp4': gpt-oss' "
                            "*_blocks / *_scales experts); model-free quantization does not read it: run without "
                            "--model-free (the model path dequantizes each rank's experts while reading them)")
        else:
            problems += mxfp4.detect_mxfp4(source)[1]  # blocks / scales without an MXFP4 config
    plan = None
    if not problems:
        plan, more = classify(source, assigner, layout.scale_keys if layout is not None else set())
        problems += more
        if not plan.assignment:
            problems.append("nothing to quantize: every Linear is ignored or assigned no scheme")
        # classify asked the assigner about every tensor it may quantize, by checkpoint and model name
        problems += assigner.unmatched_problems(plan.unquantized, allow=cfg.allow_unmatched)
    problems += writer.output_path_problems(cfg.output, src)
    raise_all(problems, "checkpoint checks")
    return plan, _Reader(source, layout, _dtype_of(source.config)), source, assigner


def _signature(cfg, plan: Plan, source, assigner, world: int, split: list[str]) -> dict:
    """What a resumed run must share; ``row_split`` (the row-split Linear groups, which decide who
    writes what) only when there are any, so signatures without splits stay as they were."""
    hashes = content_hashes(source) if cfg.verify_source == "content" else None
    return {"mode": "model-free", **signature(
        source=source_identity(source, hashes), args=cfg.signature_args(calibrated=False),
        algorithm=cfg.algo.signature(), schemes=assigner.to_dict(), assignment=plan.assignment, world=world,
        blocks=plan.blocks, **({"row_split": split} if split else {}))}


@torch.no_grad()
def quantize_checkpoint(cfg) -> dict:
    """``sq.ptq --model-free``: a checkpoint folder in, a compressed-tensors checkpoint out, no model
    built.  Runs inside an initialized process group; the report on rank 0, ``{}`` elsewhere."""
    t_start = time.perf_counter()
    agree(argument_facts(cfg), "arguments")  # before any collective the arguments decide
    plan, reader, source, assigner = _prepare(cfg)
    try:
        return _run(cfg, plan, reader, source, assigner, t_start)
    finally:
        reader.close()


def _run(cfg, plan: Plan, reader: _Reader, source, assigner, t_start: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    split_at = os.environ.get("SQ_MODELFREE_SPLIT_BYTES")  # tests only: force row splits of small Linears
    owner, split = split_by_bytes(plan.units, world, int(split_at) if split_at else None)
    sig = _signature(cfg, plan, source, assigner, world, [plan.units[i].name for i in split])
    run = Run(cfg.output, bookkeeping=cfg.bookkeeping, fault=cfg.fault)
    if not run.claim(sig, cfg.resume, [], config=source.config):
        return {"complete": True}
    n = len(plan.blocks)
    start = run.restart(n, need_chain=False)
    split_set = set(split)
    mine = [u for i, (u, r) in enumerate(zip(plan.units, owner)) if r == rank and i not in split_set]
    problems: list[str] = []
    logger.info("model-free: %s -> %s on %d rank(s): %d units, this rank %d (%.1f MB)%s, from layer %d",
                source.root, run.out, world, len(plan.units), len(mine), sum(u.nbytes for u in mine) / 1e6,
                f" and its rows of {len(split)} row-split Linear groups "
                f"({sum(plan.units[i].nbytes for i in split) / world / 1e6:.1f} MB)" if split else "", start)
    todo_split = [i for i in split if plan.units[i].block >= start]  # the same list on every rank
    ready = _split_pass([plan.units[i] for i in todo_split], [owner[i] for i in todo_split], reader,
                        cfg.skip_nonfinite) if todo_split else {}
    progress = block_progress(n, start, bar=rank == 0)
    todo = sorted((u for u in mine if u.block >= start), key=lambda u: u.block)
    ahead = _ReadAhead(reader, todo, READ_AHEAD)
    try:
        i = 0
        for b in range(start, n):
            t_block = time.perf_counter()
            run.fault_point("stop", b)
            tensors, bad = ready.pop(b, ({}, []))
            while i < len(todo) and todo[i].block == b:
                t, sk, pr = _quantize_unit(todo[i], ahead.get(), reader, cfg.skip_nonfinite)
                tensors.update(t)
                bad += sk
                problems += pr
                i += 1
            if problems:
                break
            run.write_block(b, tensors, bad)
            del tensors
            trim_heap()
            progress.step(b, time.perf_counter() - t_block)
        run.files.close()  # every submitted layer recorded; the writer's error, if any, raised here
    finally:
        ahead.close()
        run.files.close(check=False)
    progress.close()
    every = [None] * world
    dist.all_gather_object(every, problems)  # every rank meets here, done or refused
    problems = [p for ps in every for p in ps]
    if problems:
        raise SqError(problems)
    return _finish(cfg, run, plan, reader, source, start, t_start)


def _finish(cfg, run: Run, plan: Plan, reader: _Reader, source, start: int, t_start: float) -> dict:
    """Rank 0: root and carried tensors, config, side files, report, the index last; every rank learns how it went."""
    out = run.out
    all_frags, all_skipped, _ = run.gather()

    def final() -> dict:  # rank 0
        frags = list(all_frags)
        frags.append(writer.write_tensors(out, shard_name(0, None), {k: reader.weight(k) for k in plan.root}))
        frags.append(writer.write_tensors(out, CARRIED_NAME, {k: reader.weight(k, cast=False)
                                                              for k in plan.carried}))
        skip = sorted({s for ss in all_skipped for s in ss})
        report = {"mode": "model-free", "args": cfg.to_dict(), "source": str(source.root),
                  "assignment": plan.assignment, "world_size": run.world, "ignored_linears": sorted(plan.unquantized),
                  "carried_over": plan.carried, "skipped_nonfinite": skip, "resumed_from_block": start,
                  "seconds": round(time.perf_counter() - t_start, 3)}
        run.write_final(source.config, _config_groups(plan, set(skip)), sorted({*plan.unquantized, *skip}), report,
                        frags, lambda: writer.copy_side_files(source.root, out))
        return report

    return run.final(final)


# transformers' usual module order inside a layer (the model path lists Linears in module order)
_LEAF_ORDER = {leaf: i for i, leaf in enumerate(
    ("q_proj", "q_a_proj", "q_b_proj", "k_proj", "kv_a_proj_with_mqa", "kv_b_proj", "v_proj", "o_proj",
     "gate_proj", "w1", "up_proj", "w3", "down_proj", "w2"))}


def _module_order(name: str) -> tuple:
    """Sort key approximating module registration order: layer, attention before MLP, known leaves in
    transformers' order (the config's group order and target lists then match the model path's)."""
    m = _LAYER.match(name)
    layer, rest = (int(m["i"]), m["rest"]) if m else (-1, name)
    parent, _, leaf = rest.rpartition(".")
    return (layer, 0 if "attn" in parent or "attention" in parent else 1, parent, _LEAF_ORDER.get(leaf, 99), leaf)


def _config_groups(plan: Plan, skipped: set[str]) -> dict:
    """``{scheme: targets}`` as the model path builds them: the largest group ``Linear``, others by name."""
    members: dict = {}
    for name, scheme in sorted(plan.dense.items(), key=lambda kv: _module_order(kv[0])):
        if name not in skipped:
            members.setdefault(scheme, []).append(name)
    for group, (scheme, names) in plan.experts.items():
        members.setdefault(scheme, []).extend(names)
    if len(members) <= 1:
        return {s: ["Linear"] for s in members}
    biggest = max(members, key=lambda s: len(members[s]))
    return {s: (["Linear"] if s == biggest else names) for s, names in members.items()}
