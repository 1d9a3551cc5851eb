"""Plan, refuse, shard and fill: the sharded loader's public steps.

    model = build_skeleton(dir)                 # meta
    plan = plan_load(model, dir)                # mapping + every refusal; model untouched
    apply_parallel(model, mesh)                 # FSDP2 / EP, still meta
    fill(model, plan, plan.root_names)          # materialize + DCP-fill this rank's shards
    fill(model, plan, plan.block_names[b]); ...; free(model, plan, plan.block_names[b])

``load_sharded`` runs all of it for the whole model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from sq.dist import ParallelDims, rank_device, teardown_at_exit
from sq.errors import LoadRefused
from sq.load.fill import (BoxTransform, SqStorageReader, Transposed, agree, dcp_read, fsdp_reset, module_of,
                          requests_for, set_device)
from sq.load.fp8 import ACCEPTED as FP8_ACCEPTED
from sq.load.fp8 import SCALE_SUFFIX, Fp8Layout, Fp8StorageReader, dequantize, detect_fp8
from sq.load.keymap import KeyMap, build_keymap, model_targets, numel
from sq.load.mxfp4 import ACCEPTED as MXFP4_ACCEPTED
from sq.load.mxfp4 import Mxfp4Layout, blocks_and_scales, detect_mxfp4
from sq.load.mxfp4 import dequantize as dequantize_mxfp4
from sq.anatomy import decoder_blocks
from sq.load.meta import build_skeleton, config_problems, tokenizer_problems
from sq.load.source import CheckpointSource, scan_checkpoint
from sq.parallel.fsdp import apply_parallel, fsdp_param_groups, root_param_problems

logger = logging.getLogger(__name__)

MIN_COVERAGE = 0.5  # below this fraction of parameters filled, the key scheme was not understood
QUANTIZED_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class LoadPlan:
    """Everything decided before any tensor is materialized; identical on every rank."""

    source: CheckpointSource
    keymap: KeyMap
    targets: dict[str, tuple[int, ...]]
    block_prefixes: list[str]
    block_names: list[list[str]]
    root_names: list[str]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # recomputed non-persistent buffers
    _reader: SqStorageReader | None = None
    state: dict[str, str] = field(default_factory=dict)  # target -> "meta" | "empty" | "filled"
    fp8: Fp8Layout | None = None  # FP8 block-scaled source: weights dequantized while read
    dtype: torch.dtype = torch.bfloat16  # the model's dtype (what FP8 / MXFP4 weights become)
    mxfp4: Mxfp4Layout | None = None  # MXFP4 source (gpt-oss): blocks + scales read as one dequantized tensor
    towers: dict[str, int] = field(default_factory=dict)  # side towers carried as stored -> their key count

    @property
    def carried(self) -> list[str]:
        """Checkpoint keys with no slot in the model; FP8 scales and MXFP4 blocks / scales are
        consumed, never listed (an MXFP4 tensor with no slot is listed under its dequantized name)."""
        return self.keymap.carried

    def transforms(self) -> dict[str, BoxTransform]:
        """The tensors the reader makes while reading them: MXFP4 pairs (dequantized) and checkpoint
        tensors stored transposed against their parameter (``keymap.transposed``), by key-map name."""
        out: dict[str, BoxTransform] = dict(self.mxfp4.pairs) if self.mxfp4 is not None else {}
        out.update({k: Transposed(self.source.tensors[k], dims) for k, dims in self.keymap.transposed.items()})
        return out

    def reader(self) -> SqStorageReader:
        if self._reader is None:
            if self.fp8 is not None:
                self._reader = Fp8StorageReader(self.source, self.fp8, transforms=self.transforms())
            else:
                self._reader = SqStorageReader(self.source, transforms=self.transforms())
        return self._reader

    def carried_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Each carried-over tensor's dtype and shape as rank 0 writes it (``read_carried``)."""
        out = {}
        for key in self.carried:
            if self.mxfp4 is not None and key in self.mxfp4.pairs:
                out[key] = (self.dtype, tuple(self.mxfp4.pairs[key].shape))
                continue
            info = self.source.tensors[key]
            out[key] = (self.dtype if self.fp8 is not None and key in self.fp8.scales else info.dtype, tuple(info.shape))
        return out

    def read_carried(self, key: str) -> torch.Tensor:
        """One carried-over tensor (rank 0 writes them, one at a time: ``sq.export.writer.write_streamed``): its
        bytes, except FP8 weights and MXFP4 tensors, dequantized.

        An FP8 source's MTP layer would otherwise land in the output as FP8 next to a
        compressed-tensors config that does not describe its scales; dequantized, it is what a
        full-precision source would have carried.
        """
        from safetensors import safe_open

        if self.mxfp4 is not None and key in self.mxfp4.pairs:
            return dequantize_mxfp4(self.source, self.mxfp4.pairs[key], self.dtype)
        info = self.source.tensors[key]
        with safe_open(str(self.source.path(info.file)), framework="pt") as f:
            t = f.get_tensor(key)
        if self.fp8 is not None and key in self.fp8.scales:
            s_info = self.source.tensors[self.fp8.scales[key]]
            with safe_open(str(self.source.path(s_info.file)), framework="pt") as f:
                scale = f.get_tensor(s_info.key)
            t = dequantize(t, scale, self.fp8.block, self.dtype)
        return t

    def check_filled(self, names) -> None:
        """Raise if any named tensor was materialized (or re-emptied) and not filled since."""
        bad = [n for n in names if self.state.get(n) != "filled"]
        if bad:
            raise LoadRefused([f"{n} is {self.state.get(n, 'meta')}, not filled from the checkpoint" for n in bad])


def _nonpersistent(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every non-persistent buffer of the model: full name -> (owning module, leaf name)."""
    return {f"{mname}.{b}" if mname else b: (mod, b) for mname, mod in model.named_modules()
            for b in sorted(mod._non_persistent_buffers_set) if mod._buffers.get(b) is not None}


def _init_like_transformers(model: nn.Module, nonpers: dict[str, tuple[nn.Module, str]]) -> dict[str, torch.Tensor]:
    """The non-persistent buffers as transformers' own loader sets them on a meta-built model.

    ``from_pretrained`` builds on meta, gives every non-persistent buffer an empty tensor, flags
    each loaded tensor ``_is_hf_initialized`` and runs ``initialize_weights``: every module's
    ``_init_weights`` (rotary ``inv_freq``, Gemma's ``embed_scale``, the whole model's for Falcon-H1's
    per-layer ``mup_vector``), whose ``transformers.initialization`` functions skip flagged tensors.
    The same here: every parameter and persistent buffer (still on meta) is flagged, each
    non-persistent buffer is a CPU placeholder, and what the traversal wrote (its version counter
    moved) is returned.  The RNG is forked and seeded, so a buffer drawn at random would still be
    the same on every rank.  The model is left as it was found (meta buffers, no flags).
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return {}
    originals = {n: mod._buffers[b] for n, (mod, b) in nonpers.items()}
    holders: dict[int, torch.Tensor] = {}  # id(original) -> placeholder (a buffer registered twice stays shared)
    for t in originals.values():
        if id(t) not in holders:
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            holders[id(t)] = h.fill_(float("nan")) if h.is_floating_point() else h.zero_()
    versions = {k: h._version for k, h in holders.items()}
    flagged = [t for t in [*model.parameters(), *model.buffers()]
               if id(t) not in holders and not getattr(t, "_is_hf_initialized", False)]
    mod_flags = {mod: mod.__dict__.get("_is_hf_initialized") for mod in model.modules()}
    try:
        for n, (mod, b) in nonpers.items():
            mod._buffers[b] = holders[id(originals[n])]
        for t in flagged:
            t._is_hf_initialized = True
        for mod in mod_flags:
            mod._is_hf_initialized = False
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model.initialize_weights()
    except Exception as e:  # noqa: BLE001 - an _init_weights that trips on meta tensors: the fallback decides
        logger.debug("transformers' initialize_weights failed on the meta model: %s", e)
        versions = {k: h._version for k, h in holders.items()}  # nothing it wrote is trusted
    finally:
        for n, (mod, b) in nonpers.items():
            mod._buffers[b] = originals[n]
        for t in flagged:
            del t._is_hf_initialized
        for mod, flag in mod_flags.items():
            if flag is None:
                mod.__dict__.pop("_is_hf_initialized", None)
            else:
                mod._is_hf_initialized = flag
    return {n: holders[id(t)] for n, t in originals.items() if holders[id(t)]._version != versions[id(t)]}


def _fresh_instance(model: nn.Module, mod: nn.Module) -> nn.Module | None:
    """A fresh CPU instance of ``mod``'s class built from the nearest ``config`` above it, or None."""
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    cfg, m = getattr(mod, "config", None), mod
    while cfg is None and m in parents:
        m = parents[m]
        cfg = getattr(m, "config", None)
    with torch.device("cpu"):
        for make in (lambda: type(mod)(config=cfg, device="cpu"), lambda: type(mod)(cfg)):
            try:
                return make()
            except Exception:  # noqa: BLE001 - a constructor of another signature
                continue
    return None


def _fresh_buffers(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Non-persistent buffers (rotary ``inv_freq``, Gemma's ``embed_scale``, Falcon-H1's ``mup_vector``)
    recomputed on CPU, the same on every rank; after ``to_empty`` they hold garbage, and the
    checkpoint does not store them.

    First the way transformers' loader does (:func:`_init_like_transformers`); a buffer its
    ``_init_weights`` leaves alone is taken from a fresh CPU instance of its module's class (built
    from the config, as transformers' non-meta ``from_config`` would); a buffer neither gives is refused.
    """
    nonpers = _nonpersistent(model)
    out = _init_like_transformers(model, nonpers) if nonpers else {}
    problems, fresh = [], {}
    for name, (mod, b) in nonpers.items():
        if name in out:
            continue
        if mod not in fresh:
            fresh[mod] = _fresh_instance(model, mod)
        value = None if fresh[mod] is None else fresh[mod]._buffers.get(b)
        if value is None:
            owner = name.rpartition(".")[0]
            problems.append(f"cannot recompute non-persistent buffer {b!r} of {owner or 'the model'} "
                            f"({type(mod).__name__}): neither transformers' _init_weights nor a fresh "
                            "instance of the module sets it, and it is not in the checkpoint")
            continue
        out[name] = value.detach()
    return {n: out[n].detach().clone() for n in nonpers if n in out}, problems


def plan_load(model: nn.Module, source: CheckpointSource | str | Path, *, trust_remote_code: bool = False,
              allow_quantized: bool = False) -> LoadPlan:
    """Map keys and run every refusal; raise ``LoadRefused`` listing all problems. Mutates nothing."""
    if not isinstance(source, CheckpointSource):
        source = scan_checkpoint(source)
    problems = list(source.problems)
    problems += config_problems(source.config, source.root, trust_remote_code=trust_remote_code,
                                allow_quantized=allow_quantized)
    problems += tokenizer_problems(source.root, trust_remote_code=trust_remote_code)
    fp8, fp8_problems = detect_fp8(source)
    mx, mx_problems = detect_mxfp4(source)
    packed = set() if mx is None else blocks_and_scales(source)  # read through their tensor, or named
    if not allow_quantized:
        problems += fp8_problems + mx_problems
        # in an FP8 source, detect_fp8 has checked (or named) every float8 tensor
        checked = (torch.float8_e4m3fn, torch.float8_e5m2) if fp8 is not None else ()
        qt = sorted(k for k, t in source.tensors.items()
                    if t.dtype in QUANTIZED_DTYPES and t.dtype not in checked and k not in packed)
        if qt and not (mx is None and mx_problems):  # uint8 blocks without an MXFP4 config: named above
            problems.append(f"{len(qt)} checkpoint tensors hold int/fp8 data (e.g. {qt[0]!r} "
                            f"{source.tensors[qt[0]].dtype} in {source.tensors[qt[0]].file}): already quantized; "
                            f"of quantized sources only FP8 block-scaled ones ({FP8_ACCEPTED}) and MXFP4 ones "
                            f"({MXFP4_ACCEPTED}) are read")
    problems += root_param_problems(model)
    targets, aliases = model_targets(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    # an FP8 source's scales are consumed by their weights: mapped to nothing, never carried over; an MXFP4
    # pair stands in the key map as the one tensor it dequantizes to
    scale_keys = set() if fp8 is None else {k for k in source.tensors if k.endswith(".weight" + SCALE_SUFFIX)}
    ckpt = {k: t for k, t in source.tensors.items() if k not in scale_keys and k not in packed}
    if mx is not None:
        ckpt.update(mx.tensors(dtype))
    keymap = build_keymap(model, ckpt)
    towers = carry_side_towers(model, keymap, targets)
    problems += [message for _, message in keymap.unsliceable.values()]
    problems += keymap.problems if mx is None else mx.describe(keymap.problems)
    for key in sorted(keymap.transposed):  # one transform per tensor: a transposed one is read as stored bytes
        if (fp8 is not None and key in fp8.scales) or (mx is not None and key in mx.pairs):
            problems.append(f"checkpoint {key!r} ({ckpt[key].file}) is stored transposed against its parameter and "
                            f"{'FP8 block-scaled' if mx is None or key not in mx.pairs else 'MXFP4'}: sq does not read "
                            "a tensor both dequantized and transposed")
    for note in keymap.notes:
        logger.warning("%s", note)

    filled_numel = 0
    # a weight file that could not be read is named once above; the tensors it would fill are not
    # listed one by one after it (nor the coverage they take down)
    unread = bool(source.unreadable)
    for t, shape in targets.items():
        ps = keymap.pieces.get(t, [])
        covered = sum(numel(p.lengths) for p in ps)
        filled_numel += min(covered, numel(shape))
        if unread:
            continue
        if not ps:
            kind = "buffer" if t not in dict(model.named_parameters()) else "parameter"
            problems.append(f"model {kind} {t!r} {list(shape)} has no checkpoint key"
                            + (" (a persistent buffer the checkpoint cannot fill)" if kind == "buffer" else ""))
        elif covered < numel(shape) and not any(t in p for p in keymap.problems):
            problems.append(f"model tensor {t!r} {list(shape)} is only partly filled: {covered} of "
                            f"{numel(shape)} elements from {len(ps)} checkpoint keys")
    total = sum(numel(s) for s in targets.values())
    if total and filled_numel / total < MIN_COVERAGE and not unread:
        problems.append(f"only {100 * filled_numel / total:.1f}% of the model's {total} parameter elements map to "
                        f"checkpoint keys: the key scheme is not understood (checkpoint keys look like "
                        f"{sorted(source.tensors)[:2]}, model keys like {sorted(targets)[:2]})")
    both = keymap.ckpt_keys() & set(keymap.carried)
    if both:
        problems.append(f"checkpoint tensors both filled and carried over: {sorted(both)[:5]}")
    buffers, buf_problems = _fresh_buffers(model)
    problems += buf_problems
    if problems:
        raise LoadRefused(problems)

    blocks = decoder_blocks(model)
    prefixes = [name for name, _ in blocks]
    block_names = [[t for t in targets if t.startswith(p + ".")] for p in prefixes]
    in_blocks = {t for names in block_names for t in names}
    root_names = [t for t in targets if t not in in_blocks]
    state = {t: "meta" for t in targets}
    return LoadPlan(source, keymap, targets, prefixes, block_names, root_names, buffers, state=state,
                    fp8=fp8, dtype=dtype, mxfp4=mx, towers=towers)


def carry_side_towers(model: nn.Module, keymap: KeyMap, targets: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Carry as stored each side tower (a module beside the text model: a VLM's vision tower or projector)
    that holds a tensor transformers' conversion builds with operations sq cannot read as slices (Kimi-K2.5's
    ``wqkv`` split and permuted into q / k / v): every checkpoint key of the tower is copied to the output as it
    is (transformers converts it when loading the output, as it does the source), and the tower's tensors leave
    ``targets``, never filled nor written. The text model is never a side tower: a tensor of it that needs such
    operations stays refused.  Edits ``keymap`` and ``targets``; returns tower prefix -> carried key count."""
    if not keymap.unsliceable:
        return {}
    stack = decoder_blocks(model)[0][0].rpartition(".")[0]  # the decoder stack's ModuleList
    text = stack.rpartition(".")[0]  # the text model holding it (embeddings, final norm)
    spine = {".".join(text.split(".")[:i]) for i in range(len(text.split(".")) + 1)}  # the text model and its parents
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    heads = {n for n, m in model.named_modules() if out_emb is not None and m is out_emb}

    def tower(t: str) -> str | None:
        parts = t.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix not in spine:  # the first component off the path to the text model
                parent = ".".join(parts[:i - 1])
                return None if parent == text or prefix in heads else prefix
        return None

    counts: dict[str, int] = {}
    for prefix in sorted({tower(t) for t in keymap.unsliceable} - {None}):
        inside = [t for t in targets if t.startswith(prefix + ".")]
        keys = {p.ckpt_key for t in inside for p in keymap.pieces.pop(t, [])}
        keys |= {k for t in inside for k in keymap.unsliceable.pop(t, ([], ""))[0]}
        for t in inside:
            del targets[t]
        keymap.carried.extend(sorted(keys - set(keymap.carried)))
        counts[prefix] = len(keys)
        logger.warning("%s carried as stored (%d checkpoint tensors, unquantized): transformers builds some of "
                       "its tensors with conversion operations sq cannot read as slices", prefix, len(keys))
    return counts


def _retie(model: nn.Module, plan: LoadPlan, names) -> None:
    """Point tied aliases (``lm_head.weight``) back at their canonical parameter after a swap."""
    names = set(names)
    for alias, canon in plan.keymap.aliases.items():
        if canon in names:
            src_mod, src_leaf = module_of(model, canon)
            mod, leaf = module_of(model, alias)
            mod._parameters[leaf] = src_mod._parameters[src_leaf]


def _expand_to_modules(model: nn.Module, plan: LoadPlan, names) -> list[str]:
    """Materialization is per module: include every target of the modules that own ``names``."""
    leaves = {module_of(model, n)[0] for n in names}
    return [t for t in plan.targets if module_of(model, t)[0] in leaves]


def _next_block(plan: LoadPlan, names) -> list[str]:
    """The names of the block filled after ``names`` (block 0 after the root tensors), or []."""
    first = names[0] if names else None
    if first is None or first not in plan.state:
        return []
    b = next((i for i, p in enumerate(plan.block_prefixes) if first.startswith(p + ".")), -1)
    return plan.block_names[b + 1] if b + 1 < len(plan.block_names) else []


def _prefetch(plan: LoadPlan, tensors: dict[str, torch.Tensor], names) -> None:
    """Ask the kernel to start reading this rank's byte ranges of ``names`` (their shards may be
    on meta: only the boxes are computed).  A hint: a failure here is ignored, the read reports it."""
    if not names:
        return
    try:
        boxes = []
        for n in names:
            if n in tensors and n in plan.keymap.pieces:
                reqs, _ = requests_for(tensors[n], plan.keymap.pieces[n])
                boxes += [(r.ckpt_key, r.storage_offsets, r.lengths) for r in reqs]
        plan.reader().will_need(boxes)
    except Exception as e:  # noqa: BLE001 - only a hint
        logger.debug("prefetch of %d tensors skipped: %s", len(names), e)


@torch.no_grad()
def fill(model: nn.Module, plan: LoadPlan, names, *, device: torch.device | str = "cpu",
         prefetch: bool = True, map_files: bool = False) -> None:
    """Materialize and fill this rank's shards of ``names`` (collective: same names on every rank).

    Each rank reads its own boxes (no collective); one agreement afterwards makes every rank
    raise the same ``LoadRefused`` if any rank's shards were not covered or not read.  With
    ``prefetch``, the byte ranges of the next block (:func:`_next_block`) are handed to the
    kernel's read-ahead once this call's reads are done, so the disk works while the caller
    computes on this block.  With ``map_files`` (CPU only), a parameter whose whole local shard is
    one contiguous box of the checkpoint's dtype becomes a view of a private file mapping instead
    of a copy (:func:`_map_params`; ``load_sharded``'s default).
    """
    names = _expand_to_modules(model, plan, names)
    set_device(model, names, device)
    mapped = _map_params(model, plan, names) if map_files and torch.device(device).type == "cpu" else set()
    _retie(model, plan, names)
    for n in names:
        plan.state[n] = "empty"
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    requests, problems = [], []
    for n in names:
        if n in mapped:
            continue
        t = params[n] if n in params else buffers[n]
        reqs, covered = requests_for(t, plan.keymap.pieces[n])
        requests += reqs
        local = t.to_local() if hasattr(t, "to_local") else t
        if covered != local.numel():
            problems.append(f"{n}: {covered} of {local.numel()} local elements covered")
    if not problems:  # a rank short of coverage reads nothing: it raises below, with the others
        try:
            dcp_read(plan.source, requests, reader=plan.reader())
        except LoadRefused as e:
            problems = e.problems
        if prefetch:
            _prefetch(plan, {**buffers, **params}, _next_block(plan, names))
    agree(problems)  # every rank raises the same error here, or none does
    for n in names:
        plan.state[n] = "filled"
    # non-persistent buffers of the touched modules: recompute, never trust to_empty's garbage
    leaves = {module_of(model, n)[0] for n in names}
    for bname, value in plan.buffers.items():
        mod, leaf = module_of(model, bname)
        if mod in leaves or mod._buffers[leaf].device.type == "meta":
            mod._buffers[leaf] = value.to(device)


def _map_params(model: nn.Module, plan: LoadPlan, names) -> set[str]:
    """Swap in file-mapped local shards for the named parameters whose whole local shard is one
    contiguous box in the checkpoint's dtype (:meth:`SqStorageReader.file_view`); returns their names.

    The new parameter keeps the old one's DTensor mesh, placements and global shape; FSDP2's
    records are re-pointed at it (``reset_sharded_param``, the path of ``load_state_dict(assign=True)``).
    A shard FSDP2 pads (uneven split) is left to the copy path: its padded buffer would be a copy.
    The mapped ranges get the reads' ``WILLNEED`` hint: the kernel reads them ahead of the touch.
    """
    reader, mapped, leaves, hints = plan.reader(), set(), set(), []
    padded_size = None  # id(FSDP2 sharded parameter) -> its padded local size, built once per call
    for n in names:
        mod, leaf = module_of(model, n)
        p = mod._parameters.get(leaf)
        if p is None or n in plan.keymap.aliases or n not in plan.keymap.pieces:
            continue
        reqs, covered = requests_for(p, plan.keymap.pieces[n])
        local = p.to_local() if isinstance(p, DTensor) else p
        if len(reqs) != 1 or covered != local.numel() or tuple(reqs[0].dest.shape) != tuple(local.shape):
            continue
        if isinstance(p, DTensor):
            padded_size = _fsdp_padded_sizes(model) if padded_size is None else padded_size
            if padded_size.get(id(p), tuple(local.shape)) != tuple(local.shape):
                continue
        r = reqs[0]
        view = reader.file_view(r.ckpt_key, r.storage_offsets, r.lengths, local.dtype)
        if view is None:
            continue
        if isinstance(p, DTensor):
            view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        mod._parameters[leaf] = nn.Parameter(view, requires_grad=p.requires_grad)
        mapped.add(n)
        leaves.add(mod)
        hints.append((r.ckpt_key, r.storage_offsets, r.lengths))
    if leaves:
        fsdp_reset(model, leaves)
        reader.will_need(hints)
    return mapped


def _fsdp_padded_sizes(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """id(sharded parameter) -> the local size FSDP2 keeps it at (padded where dim 0 does not divide
    by the mesh); parameters FSDP2 does not manage (expert-parallel experts) are absent."""
    from torch.distributed.fsdp import FSDPModule

    return {id(fp.sharded_param): tuple(fp.padded_sharded_param_size)
            for mod in model.modules() if isinstance(mod, FSDPModule)
            for group in fsdp_param_groups(mod) for fp in group.fsdp_params}


@torch.no_grad()
def free(model: nn.Module, plan: LoadPlan, names) -> None:
    """Release the named tensors' memory back to meta."""
    names = _expand_to_modules(model, plan, names)
    set_device(model, names, "meta")
    _retie(model, plan, names)
    for n in names:
        plan.state[n] = "meta"


def load_sharded(checkpoint_dir: str | Path, *, ep: int = 1, mesh=None, dtype: torch.dtype | None = None,
                 trust_remote_code: bool = False, device: torch.device | str | None = None,
                 compute_dtype: torch.dtype | None = None, map_files: bool = True) -> nn.Module:
    """Build, plan, shard and fill the whole model inside an initialized process group.

    ``map_files`` (CPU): a parameter whose local shard is one contiguous range of a checkpoint file in
    the checkpoint's dtype is a view of a private copy-on-write mapping of that file, read when first
    touched (writes copy the touched pages, never reach the file); False copies every shard in now.
    As with transformers' mmapped tensors, the files must not be truncated or rewritten in place
    while the model uses them (replacing them with new files is safe).

    ``compute_dtype``: the dtype its forwards compute in (FSDP2 mixed precision: the shards keep
    ``dtype``); ``torch.float32`` makes ``sq.quantize``'s calibration about twice as fast on a CPU
    without native bfloat16 matmuls.  None: the parameters' dtype.

    Returns the model with DTensor parameters (this rank's shards filled); ``model.sq_plan``
    holds the ``LoadPlan`` (carried-over keys, block names) for the steps that follow.
    """
    if not dist.is_initialized():
        raise LoadRefused("load_sharded needs an initialized process group (sq.dist.init_distributed())")
    teardown_at_exit()  # the caller's process group: its last collectives must settle before finalization
    if device is None:
        device = rank_device()
    model = build_skeleton(checkpoint_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    plan = plan_load(model, checkpoint_dir, trust_remote_code=trust_remote_code)
    if mesh is None:
        mesh = ParallelDims(dist.get_world_size(), ep).build_mesh(torch.device(device).type)
    apply_parallel(model, mesh, compute_dtype=compute_dtype)
    fill(model, plan, plan.root_names, device=device, map_files=map_files)
    for names in plan.block_names:
        fill(model, plan, names, device=device, map_files=map_files)
    plan.reader().drop_maps()
    model.sq_plan = plan
    return model
