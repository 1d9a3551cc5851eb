"""Checkpoint keys -> model keys, as data.

Rules, in order; each model tensor takes at most one checkpoint key per region:

0. ``transposed``: a converter of transformers' conversion mapping made of one ``Transpose`` (Qwen3-VL-MoE's
   ``mlp.experts.gate_up_proj`` / ``down_proj``, stored ``[E, H, 2I]`` / ``[E, I, H]`` on the Hub) matches the
   key, and the stored shape is the parameter's with those two dimensions swapped: the key fills the whole
   parameter, read transposed (``KeyMap.transposed``).  Which orientation is stored is proven from the
   shapes, by transformers' own rule: ``Transpose(check_dims=True)`` reads a tensor whose shape already is
   the parameter's as it is (so a tensor square on those dimensions is never transposed: its orientation
   cannot be told from shapes, and transformers does not transpose it either; noted in ``KeyMap.notes``);
   without ``check_dims`` it always transposes.
1. ``exact``: the checkpoint key is a model key (or a tied alias of one).
2. ``conversion``: transformers' own conversion mapping for this model
   (``get_model_conversion_mapping``: ``WeightRenaming`` and ``WeightConverter``).  A converter
   made of ``MergeModulelist`` / ``Concatenate`` places each per-expert checkpoint tensor in a
   box of the fused parameter; the box is computed from the expert index in the key, never
   from the order keys arrive in, so a missing expert is refused by name instead of shifting
   the others into its slot.
3. ``suffix``: the longest unique trailing-component suffix (a VLM nests the language model
   under another prefix).  Only leading components without digits may be dropped, so
   ``model.layers.61.shared_head.norm.weight`` (DeepSeek MTP) can never land on
   ``model.norm.weight``; a suffix several model keys share is ambiguous and left unmapped.

Keys that no rule maps are *carried over* (copied raw by the exporter).
"""

from __future__ import annotations

import copy
import heapq

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch.nn as nn

from sq.load.source import TensorInfo


@dataclass(frozen=True)
class Piece:
    """Checkpoint tensor ``ckpt_key`` fills the box ``offsets + shape`` of model tensor ``target``.

    ``stack_dim`` is the target dimension the checkpoint tensor lacks (experts stacked by
    ``MergeModulelist``); every other target dimension is a checkpoint dimension in order.
    """

    ckpt_key: str
    target: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]  # extent in target coordinates (1 on stack_dim)
    stack_dim: int | None = None
    rule: str = "exact"


@dataclass
class KeyMap:
    pieces: dict[str, list[Piece]] = field(default_factory=dict)  # target -> pieces
    carried: list[str] = field(default_factory=list)  # checkpoint keys with no slot
    problems: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # tied alias -> canonical name
    # checkpoint key -> the two dimensions it is stored with swapped against its target (rule ``transposed``):
    # its piece is in the target's coordinates, the reader transposes (sq.load.fill.Transposed)
    transposed: dict[str, tuple[int, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the shapes could not prove (logged by the planner)
    # target -> (its checkpoint keys, the refusal) where transformers' conversion needs operations sq cannot read
    # as slices (split, permute): a problem unless the loader carries the target's whole tower as stored
    unsliceable: dict[str, tuple[list[str], str]] = field(default_factory=dict)

    def ckpt_keys(self) -> set[str]:
        return {p.ckpt_key for ps in self.pieces.values() for p in ps}

    def rules(self) -> dict[str, str]:
        """checkpoint key -> rule that mapped it (for tests and the report)."""
        return {p.ckpt_key: p.rule for ps in self.pieces.values() for p in ps}


def model_targets(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Fillable tensors of ``model``: unique parameters and persistent buffers, and tied aliases."""
    targets: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[name] = seen[id(p)]
            continue
        seen[id(p)] = name
        targets[name] = tuple(p.shape)
    for mod_name, mod in model.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is None or bname in mod._non_persistent_buffers_set:
                continue
            targets[f"{mod_name}.{bname}" if mod_name else bname] = tuple(buf.shape)
    return targets, aliases


def _split_transforms(model: nn.Module):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    try:
        transforms = get_model_conversion_mapping(model)
    except Exception:  # a model transformers has no mapping machinery for
        transforms = []
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _legacy_regex_renames(model: nn.Module) -> list[tuple[re.Pattern, str]]:
    """Older models' ``_checkpoint_conversion_mapping`` (regex -> replacement)."""
    mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    return [(re.compile(k), v) for k, v in mapping.items()]


def _transpose_of(converter):
    """The ``Transpose`` op of a converter made of that op alone, else None."""
    from transformers.core_model_loading import Transpose

    ops = list(getattr(converter, "operations", []))
    return ops[0] if len(ops) == 1 and type(ops[0]) is Transpose else None


def swap_dims(shape, dims: tuple[int, int]) -> tuple[int, ...]:
    """``shape`` (or offsets, lengths) with the two dimensions ``dims`` swapped."""
    out = list(shape)
    a, b = dims
    out[a], out[b] = out[b], out[a]
    return tuple(out)


def _pattern_index_regex(pattern: str) -> re.Pattern:
    """``mlp.experts.*.gate_proj.weight`` -> regex capturing the expert index.

    transformers' source patterns are regexes (``\\.experts.*.w1.weight``) whose ``*`` it reads as
    ``.*``; here the ``*`` is the expert index."""
    return re.compile(pattern.replace("*", r"(?P<expert>\d+)") + r"(?!\w)")


def _has_digit_component(parts: list[str]) -> bool:
    return any(p.isdigit() for p in parts)


class _SuffixIndex:
    def __init__(self, names):
        self.index: dict[str, set[str]] = defaultdict(set)
        for n in names:
            parts = n.split(".")
            for i in range(len(parts)):
                self.index[".".join(parts[i:])].add(n)

    def lookup(self, key: str) -> str | None:
        parts = key.split(".")
        for i in range(1, len(parts) - 1):  # keep at least two components
            if _has_digit_component(parts[:i]):
                return None
            found = self.index.get(".".join(parts[i:]))
            if found:
                return next(iter(found)) if len(found) == 1 else None
        return None


def build_keymap(model: nn.Module, tensors: dict[str, TensorInfo]) -> KeyMap:
    """Map every checkpoint key to a box of a model tensor, or to ``carried``; collect problems."""
    from transformers.core_model_loading import apply_renamings

    targets, aliases = model_targets(model)
    km = KeyMap(aliases=aliases)
    pieces: dict[str, list[Piece]] = defaultdict(list)
    unresolved: list[str] = []
    converter_hits: dict[str, list[tuple[str, int, int]]] = defaultdict(list)  # target -> (key, pattern j, expert)

    def canonical(name: str) -> str | None:
        if name in targets:
            return name
        return aliases.get(name)

    def full_piece(key: str, target: str, rule: str) -> Piece:
        return Piece(key, target, (0,) * len(targets[target]), tuple(tensors[key].shape), None, rule)

    renamings, converters = _split_transforms(model)
    legacy = _legacy_regex_renames(model)
    base_prefix = getattr(model, "base_model_prefix", "") or ""

    def rename(key: str) -> str:
        renamed = apply_renamings(key, renamings) if renamings else key
        for rx, repl in legacy:
            renamed = rx.sub(repl, renamed)
        return renamed

    def resolve(target_name: str) -> str | None:
        # transformers adds or strips the base-model prefix (loading a ForXxx from a bare model)
        t = canonical(target_name)
        if t is None and base_prefix:
            if target_name.startswith(base_prefix + "."):
                t = canonical(target_name[len(base_prefix) + 1:])
            else:
                t = canonical(f"{base_prefix}.{target_name}")
        return t

    # 0. a Transpose converter: the orientation is proven from the shapes, as transformers decides it
    # (on copies: a converter's matching is stateful in transformers, and rule 2 runs the originals)
    handled = _transposed(km, tensors, targets, copy.deepcopy(converters), rename, resolve, pieces)

    # 1. exact
    for key in sorted(tensors):
        if key in handled:
            continue
        t = canonical(key)
        if t is not None:
            pieces[t].append(full_piece(key, t, "exact"))
        else:
            unresolved.append(key)

    # 2. conversion mapping
    still: list[str] = []
    conv_of: dict[str, object] = {}
    for key in unresolved:
        renamed = rename(key)
        converter, pattern = None, None
        for conv in converters:
            out, pat = conv.rename_source_key(renamed)
            if pat is not None:
                converter, pattern, target_name = conv, pat, out
                break
        if converter is None:
            target_name = renamed
        t = resolve(target_name)
        if t is None or (converter is None and renamed == key):
            still.append(key)
            continue
        if converter is None:
            pieces[t].append(full_piece(key, t, "conversion"))
            continue
        j = converter.source_patterns.index(pattern)
        m = _pattern_index_regex(pattern).search(renamed) if "*" in pattern else None
        expert = int(m.group("expert")) if m else -1
        converter_hits[t].append((key, j, expert))
        conv_of[t] = converter

    for t, hits in converter_hits.items():
        _converter_pieces(km, t, hits, conv_of[t], tensors, targets, pieces)

    # 3. longest unique suffix (on the renamed key as well as the raw one)
    suffix = _SuffixIndex(targets)
    for key in still:
        renamed = apply_renamings(key, renamings) if renamings else key
        t = None
        for cand in dict.fromkeys([renamed, key]):
            t = suffix.lookup(cand)
            if t is not None:
                break
        if t is None or pieces.get(t):
            km.carried.append(key)
            continue
        pieces[t].append(full_piece(key, t, "suffix"))

    km.pieces = dict(pieces)
    _check_pieces(km, targets, tensors)
    return km


def _converter_pieces(km: KeyMap, t: str, hits: list[tuple[str, int, int]], conv, tensors: dict[str, TensorInfo],
                      targets: dict[str, tuple[int, ...]], pieces: dict[str, list[Piece]]) -> None:
    """The boxes of target ``t`` that the per-expert / concatenated checkpoint keys ``hits`` ((key, pattern
    index, expert)) of one converter fill; every odd shape or missing (pattern, expert) pair named."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(conv, "operations", []))
    kinds = [type(op) for op in ops]
    merge = ops[0] if kinds[:1] == [MergeModulelist] else None
    concat = ops[-1] if kinds and kinds[-1] is Concatenate else None
    if kinds not in ([MergeModulelist], [MergeModulelist, Concatenate], [Concatenate]):
        keys, message = km.unsliceable.get(t, ([], None))
        km.unsliceable[t] = (keys + [k for k, _, _ in hits], message or (
            f"{t}: checkpoint keys {hits[0][0]!r}... need conversion operations "
            f"{[k.__name__ for k in kinds]}, which sq cannot read as slices; convert the checkpoint first"))
        return
    stack_dim = merge.dim if merge is not None else None
    # extent of pattern j along the concat dim, in target coordinates
    extent: dict[int, int] = {}
    for key, j, _ in hits:
        shape = list(tensors[key].shape)
        if stack_dim is not None:
            shape.insert(stack_dim, 1)
        if concat is not None:
            extent.setdefault(j, shape[concat.dim])
    # every expert of pattern j must have the same shape: name the odd ones out
    by_pattern: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for key, j, _ in hits:
        by_pattern[j].append(tuple(tensors[key].shape))
    usual = {j: max(set(shapes), key=shapes.count) for j, shapes in by_pattern.items()}
    for key, j, _ in hits:
        if tuple(tensors[key].shape) != usual[j]:
            km.problems.append(
                f"shape mismatch: checkpoint {key!r} is {list(tensors[key].shape)} ({tensors[key].file}) but "
                f"the other experts' are {list(usual[j])} (model {t!r} is {list(targets[t])})")
    for key, j, expert in hits:
        shape = list(tensors[key].shape)
        if stack_dim is not None:
            shape.insert(stack_dim, 1)
        offsets = [0] * len(shape)
        if stack_dim is not None:
            offsets[stack_dim] = expert
        if concat is not None:
            offsets[concat.dim] = sum(extent.get(jj, 0) for jj in range(j))
        pieces[t].append(Piece(key, t, tuple(offsets), tuple(shape), stack_dim, "conversion"))
    # name every missing (pattern, expert) pair: never stack the rest into the wrong slots
    if stack_dim is not None:
        n_experts = targets[t][stack_dim]
        have = {(j, e) for _, j, e in hits}
        example = {j: (k, e) for k, j, e in hits}
        for j, pat in enumerate(conv.source_patterns):
            if j not in example:
                km.problems.append(f"{t}: no checkpoint key matches {pat!r}")
                return
            k0, e0 = example[j]
            for e in range(n_experts):
                if (j, e) not in have:
                    mm = _pattern_index_regex(pat).search(k0)
                    missing = (k0[:mm.start("expert")] + str(e) + k0[mm.end("expert"):] if mm
                               else f"{pat} (expert {e})")
                    km.problems.append(
                        f"{t}: expert {e} has no checkpoint tensor {missing!r} (pattern {pat!r}); "
                        f"refusing to stack the other experts into its slot")


def _transposed(km: KeyMap, tensors: dict[str, TensorInfo], targets: dict[str, tuple[int, ...]], converters,
                rename, resolve, pieces: dict[str, list[Piece]]) -> set[str]:
    """Map every key a one-``Transpose`` converter matches onto its whole target; return those keys.

    transformers' ``Transpose(d0, d1, check_dims=True)`` transposes a tensor only where its shape differs
    from the parameter's; without ``check_dims`` always.  The same decision here, from the headers: a key
    whose stored shape is the parameter's with ``d0`` / ``d1`` swapped (and that transformers transposes) is
    rule ``transposed`` (read transposed); one stored as the parameter is, and that transformers reads as it
    is, maps as usual (``exact``, or ``conversion`` where the converter renames it); any other shape is a
    shape mismatch.  A tensor square on ``d0`` / ``d1`` cannot show its orientation: it is read as
    transformers reads it, and said so once per kind in ``km.notes``.
    """
    handled: set[str] = set()
    if not any(_transpose_of(c) is not None for c in converters):
        return handled
    for key in sorted(tensors):
        renamed = rename(key)
        for conv in converters:  # the first converter that matches, as transformers picks it
            out, pat = conv.rename_source_key(renamed)
            if pat is not None:
                break
        else:
            continue
        if _transpose_of(conv) is None:
            continue
        t = resolve(out)
        if t is None:
            continue  # no parameter of that name: the usual rules decide (carried, or a problem)
        op = _transpose_of(conv)
        info, want = tensors[key], tuple(targets[t])
        stored = tuple(info.shape)
        nd = len(stored)
        dims = (op.dim0 % nd, op.dim1 % nd) if nd and -nd <= min(op.dim0, op.dim1) and max(op.dim0, op.dim1) < nd \
            else None
        handled.add(key)
        swapped = swap_dims(stored, dims) if dims is not None else None
        as_stored = stored == want and bool(op.check_dims)
        if dims is not None and swapped == want and not as_stored:
            km.transposed[key] = dims
            pieces[t].append(Piece(key, t, (0,) * nd, want, None, "transposed"))
            rule = "transposed"
        elif as_stored:
            pieces[t].append(Piece(key, t, (0,) * nd, want, None, "exact" if key == t else "conversion"))
            rule = "as stored"
        else:
            km.problems.append(
                f"shape mismatch: checkpoint {key!r} is {list(stored)} ({info.file}) but model {t!r} is "
                f"{list(want)}, nor is it that shape with dimensions {op.dim0} and {op.dim1} swapped, as transformers' "
                f"conversion mapping reads it (Transpose({op.dim0}, {op.dim1}, check_dims={bool(op.check_dims)}))")
            continue
        if dims is not None and stored[dims[0]] == stored[dims[1]]:
            note_once(km.notes, key, f"{list(stored)} is square on dimensions {list(dims)}: its orientation cannot "
                      f"be proven from shapes; read {'transposed' if rule == 'transposed' else 'as stored'}, as "
                      f"transformers' Transpose({op.dim0}, {op.dim1}, check_dims={bool(op.check_dims)}) reads it")
    return handled


def note_once(notes: list[str], key: str, says: str) -> None:
    """Add ``"<kind of key> <says>"`` to ``notes`` unless there: one note for every layer's and expert's
    key of a kind (their indices read ``N``), not one per key."""
    kind = re.sub(r"\.\d+\.", ".N.", key)
    note = f"{kind} {says}"
    if note not in notes:
        notes.append(note)


def _check_pieces(km: KeyMap, targets: dict[str, tuple[int, ...]], tensors: dict[str, TensorInfo]) -> None:
    """Shapes fit, boxes do not overlap, every box lands inside its target."""
    for t, ps in km.pieces.items():
        shape = targets[t]
        for p in ps:
            src = tuple(tensors[p.ckpt_key].shape)
            if len(p.lengths) != len(shape) or any(o + n > s for o, n, s in zip(p.offsets, p.lengths, shape)):
                where = "" if all(o == 0 for o in p.offsets) else f" at offset {list(p.offsets)}"
                km.problems.append(
                    f"shape mismatch: checkpoint {p.ckpt_key!r} is {list(src)} ({tensors[p.ckpt_key].file}) but "
                    f"model {t!r} is {list(shape)}{where}")
            elif p.stack_dim is None and len(ps) == 1 and tuple(p.lengths) != shape:
                km.problems.append(
                    f"shape mismatch: checkpoint {p.ckpt_key!r} is {list(src)} ({tensors[p.ckpt_key].file}) but "
                    f"model {t!r} is {list(shape)}")
        # overlaps: a sweep along dim 0 compares each box only with the boxes still open there (for
        # stacked experts the 2-3 pieces of one expert), O(n log n) instead of all pairs' O(n^2): 0.1 s of
        # planning for 50 layers x 256 experts (docs/benchmarks.md, "Scale")
        if len(ps) < 2:  # one box overlaps nothing (and a 0-dim tensor has no dim 0 to sweep along)
            continue
        boxes = sorted(ps, key=lambda p: p.offsets)
        open_: list[tuple[int, int, Piece]] = []  # (end on dim 0, order, piece)
        found = []
        for i, b in enumerate(boxes):
            while open_ and open_[0][0] <= b.offsets[0]:
                heapq.heappop(open_)
            for _, j, a in open_:
                if all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in
                       zip(a.offsets, a.lengths, b.offsets, b.lengths)):
                    found.append((j, i, a, b))
            heapq.heappush(open_, (b.offsets[0] + b.lengths[0], i, b))
        for _, _, a, b in sorted(found, key=lambda x: (x[0], x[1])):
            km.problems.append(f"{a.ckpt_key!r} and {b.ckpt_key!r} both fill the same part of {t!r}")


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
