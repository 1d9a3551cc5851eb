"""Where the PTQ driver's weights come from, and what their checkpoint names are.

The driver (``sq.pipeline.job``) walks decoder blocks; for each it asks its weight source to
``fill`` the block's tensors before quantizing and to ``free`` them after.  Two sources:

- ``CheckpointWeights``: a checkpoint folder, read one block at a time into FSDP2 / EP shards
  (``sq.load``); output names are the checkpoint's own keys (the key map run backwards).
- ``ModelWeights``: a model already in memory and already FSDP2-sharded (a training job's
  model, through ``sq.api.quantize``); nothing is read or freed, output names are the model's
  own parameter names (what ``save_pretrained`` writes for a dense causal LM), routed experts
  transformers' per-expert names (``mlp.experts.{e}.gate_proj``...); experts held by the caller's
  expert parallelism are viewed on an sq ``(dp, ep)`` mesh for the job (``prepare`` / ``restore``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from sq.agree import verified_identity
from sq.anatomy import decoder_blocks, expert_params, experts_modules
from sq.errors import SqError
from sq.export import writer
from sq.files import CARRIED_NAME
from sq.load.loader import LoadPlan, fill, free


class CheckpointWeights:
    """Block tensors streamed from a checkpoint through the load plan."""

    in_memory = False

    def __init__(self, model: nn.Module, plan: LoadPlan, src: Path, device: torch.device, *,
                 verify_source: str = "stat"):
        self.model, self.plan, self.src, self.device = model, plan, Path(src), device
        self.verify_source = verify_source

    @property
    def root_names(self) -> list[str]:
        return self.plan.root_names

    @property
    def config(self) -> dict:
        """The source's config.json as read (a copy: callers may edit it)."""
        return dict(self.plan.source.config)

    def block_names(self, b: int) -> list[str]:
        return self.plan.block_names[b]

    def fill(self, names) -> None:
        fill(self.model, self.plan, names, device=self.device)

    @property
    def bytes_read(self) -> int:
        """The checkpoint bytes this rank's loads asked the files for."""
        return self.plan.reader().bytes_read

    def free(self, names) -> None:
        free(self.model, self.plan, names)

    def _one_key(self, target: str) -> str | None:
        """The checkpoint key that fills ``target`` whole, or None where several keys (boxes) fill it."""
        pieces = self.plan.keymap.pieces.get(target, [])
        if (len(pieces) != 1 or pieces[0].stack_dim is not None
                or tuple(pieces[0].lengths) != tuple(self.plan.targets[target]) or any(pieces[0].offsets)):
            return None
        return pieces[0].ckpt_key

    def ckpt_name(self, target: str) -> str:
        """The checkpoint key that fills ``target`` whole (dense: exact or suffix rule)."""
        key = self._one_key(target)
        if key is None:
            n = len(self.plan.keymap.pieces.get(target, []))
            raise SqError(f"{target} is filled from {n} checkpoint piece(s) (fused/stacked layout); "
                          "only one-to-one dense tensors can be exported yet")
        return key

    def ckpt_tensors(self, target: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` to write unquantized model tensor ``target`` (its whole ``value``) under: its
        checkpoint key where one key fills it; the model's own name where the checkpoint splits it
        (per-expert keys of experts left unquantized, Kimi's q/k/v conv weights): transformers 5 stacks
        or concatenates such keys while loading an unquantized checkpoint, but not while loading a
        compressed-tensors one, where the model's name loads as it is.  A key stored transposed against
        ``target`` (Qwen3-VL-MoE's experts on the Hub, ``keymap.transposed``) is written transposed back,
        as the checkpoint stores it: transformers reads either orientation there (its ``Transpose``
        conversion checks the shapes), vLLM's loader for such a model only the checkpoint's."""
        key = self._one_key(target)
        dims = self.plan.keymap.transposed.get(key) if key is not None else None
        if dims is not None:
            return {key: value.transpose(*dims).contiguous()}
        return {key or target: value.clone()}

    @property
    def expert_pieces(self) -> dict:
        return self.plan.keymap.pieces

    @property
    def carried(self) -> list[str]:
        return list(self.plan.carried)

    def identity(self) -> dict:
        """The source's identity for the resume signature (a collective with ``--verify-source content``)."""
        return verified_identity(self.plan.source, self.verify_source)

    def write_extras(self, out: Path) -> dict[str, str]:
        """Checkpoint tensors the model has no slot for (rank 0): byte for byte, except FP8 block-scaled
        weights, which are dequantized (their scales have no place in a compressed-tensors config)."""
        return writer.write_streamed(out, CARRIED_NAME, self.plan.carried_specs(), self.plan.read_carried)

    def write_side_files(self, out: Path) -> list[str]:
        return writer.copy_side_files(self.src, out)

    def describe(self) -> str:
        return str(self.src)


class ModelWeights:
    """An in-memory model whose decoder blocks are FSDP2-sharded on dim 0 over the whole world.

    Routed experts (transformers' fused ``gate_up_proj`` / ``down_proj``) may be FSDP2-sharded with
    their block (each rank whole experts), or DTensors the caller's expert parallelism placed on a
    mesh of its own (ignored by FSDP2): experts split (``Shard(0)``) over one mesh dimension, an
    expert's rows (``Shard(1)``) over at most one other, every other dimension of size 1.  That mesh
    is read off the DTensors; for the job (``prepare`` .. ``restore``) such experts are seen through
    views on an sq ``(dp, ep)`` mesh over the same ranks (sharing storage: the dequantized values
    land in the caller's tensors) with sq's calibration forward; the caller's parameters and
    forward come back after.  Expert outputs take transformers' per-expert checkpoint names
    (``mlp.experts.{e}.gate_proj.weight_packed``...), which vLLM and transformers load.
    """

    in_memory = True

    def __init__(self, model: nn.Module, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        self.touched = False  # whether the job began quantizing a block in place (sq.api marks the model)
        blocks = decoder_blocks(model)
        if not blocks:
            raise SqError(f"{type(model).__name__}: no decoder blocks found (expected a ModuleList of decoder blocks)")
        persistent = _persistent_names(model)
        self._blocks = [[n for n in persistent if n.startswith(p + ".")] for p, _ in blocks]
        in_blocks = {n for names in self._blocks for n in names}
        self._root = [n for n in persistent if n not in in_blocks]
        world = dist.get_world_size()
        problems = _distributed_loading_problems(model)
        if problems:
            raise SqError(problems)
        managed = _fsdp_managed(model)
        self._ep_layouts: list[tuple[str, nn.Module, _EPLayout]] = []  # experts the caller runs expert-parallel
        for (prefix, block), names in zip(blocks, self._blocks):
            expert_params = {id(p) for _, ex in experts_modules(block) for p in ex.parameters(recurse=False)}
            for n, p in block.named_parameters():
                if id(p) in expert_params:
                    continue
                if world > 1 and not (isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),)
                                      and p.device_mesh.size() == world):
                    problems.append(f"{prefix}.{n}: expected an FSDP2 parameter sharded on dim 0 over all "
                                    f"{world} ranks (fully_shard each decoder layer), got "
                                    f"{type(p).__name__} {getattr(p, 'placements', '')}")
                    break
            for n, ex in experts_modules(block):
                layout, why = _expert_layout(f"{prefix}.{n}", ex, managed, world)
                if why:
                    problems += why
                elif layout is not None:
                    self._ep_layouts.append((f"{prefix}.{n}", ex, layout))
        eps = sorted({lay.ep for _, _, lay in self._ep_layouts})
        if len(eps) > 1:
            problems.append(f"experts are split over expert-parallel groups of different sizes ({eps}); "
                            "sq runs one expert-parallel size per job")
        self.ep = eps[0] if len(eps) == 1 else 1
        self._saved: list = []
        if problems:
            raise SqError(problems[:3] + ([f"... and {len(problems) - 3} more"] if len(problems) > 3 else []))

    def prepare(self) -> None:
        """Collective (every rank, after the checks agreed): expert-parallel experts onto sq (dp, ep) views
        and sq's calibration forward.  ``restore`` undoes it."""
        import types

        from torch.distributed.device_mesh import DeviceMesh

        from sq.parallel.expert import ep_forward

        meshes: dict = {}
        for name, ex, lay in self._ep_layouts:
            key = (lay.ranks, lay.dp, lay.ep)
            if key not in meshes:
                meshes[key] = (lay.mesh if lay.native else
                               DeviceMesh(lay.mesh.device_type, torch.tensor(lay.ranks).reshape(lay.dp, lay.ep),
                                          mesh_dim_names=("dp", "ep")))
            mesh = meshes[key]
            saved = {"params": {k: ex._parameters[k] for k in expert_params(ex)},
                     "forward": ex.__dict__.get("forward"), "mesh": ex.__dict__.get("_sq_ep_mesh")}
            self._saved.append((ex, saved))
            for k in expert_params(ex):
                p = ex._parameters[k]
                local = p.to_local()
                view = DTensor.from_local(local, mesh, (Shard(1), Shard(0)), run_check=False,
                                          shape=p.shape, stride=p.stride())
                if view.to_local().data_ptr() != local.data_ptr():  # never expected: a view is a view
                    raise SqError(f"{name}.{k}: cannot view the local shard on sq's (dp, ep) mesh in place")
                ex._parameters[k] = nn.Parameter(view, requires_grad=False)
            ex._sq_ep_mesh = mesh
            ex.forward = types.MethodType(ep_forward, ex)

    def restore(self) -> None:
        """The caller's expert parameters (holding the dequantized values) and forward, back in place."""
        for ex, saved in reversed(self._saved):
            for k, p in saved["params"].items():
                ex._parameters[k] = p
            for attr in ("forward", "_sq_ep_mesh"):
                value = saved["forward" if attr == "forward" else "mesh"]
                if value is None:
                    ex.__dict__.pop(attr, None)
                else:
                    setattr(ex, attr, value)
        self._saved = []

    @property
    def root_names(self) -> list[str]:
        return self._root

    def block_names(self, b: int) -> list[str]:
        return self._blocks[b]

    bytes_read = None  # nothing is read

    def fill(self, names) -> None:  # already in memory; a block's weights are about to become dequantized values
        if names is not self._root:
            self.touched = True

    def free(self, names) -> None:  # the caller's model keeps its (now fake-quantized) weights
        pass

    def ckpt_name(self, target: str) -> str:
        return target

    def ckpt_tensors(self, target: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {target: value.clone()}

    expert_pieces = None

    @property
    def config(self) -> dict:
        config = self.model.config.to_dict()
        config["architectures"] = [self.model_class]  # as save_pretrained writes it
        return config

    @property
    def model_class(self) -> str:
        """The model's own class name (FSDP2 wraps it in a generated ``FSDP<Name>`` subclass)."""
        from torch.distributed.fsdp import FSDPModule

        return next(c.__name__ for c in type(self.model).__mro__ if not issubclass(c, FSDPModule))

    carried: list[str] = []

    def identity(self) -> dict:
        """Class, names, shapes and dtypes: an in-memory model cannot prove its values unchanged."""
        h = hashlib.sha256()
        for n, p in self.model.state_dict().items():
            h.update(f"{n}:{tuple(p.shape)}:{p.dtype};".encode())
        return {"in_memory": self.model_class, "tensors_sha256": h.hexdigest(),
                "config_sha256": hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str)
                                                .encode()).hexdigest()}

    def write_extras(self, out: Path) -> dict[str, str]:
        return {}

    def write_side_files(self, out: Path) -> list[str]:
        """Tokenizer (if given) and generation config, through their own ``save_pretrained``."""
        before = {p.name for p in Path(out).iterdir()}
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)
        gen = getattr(self.model, "generation_config", None)
        if gen is not None:
            gen.save_pretrained(out)
        return sorted({p.name for p in Path(out).iterdir()} - before - {"config.json"})

    def describe(self) -> str:
        return f"in-memory {self.model_class}"


def _persistent_names(model: nn.Module) -> list[str]:
    """Parameters (tied ones once) and persistent buffers, in module order."""
    names = [n for n, _ in model.named_parameters()]
    for mod_name, mod in model.named_modules():
        for b in mod._buffers:
            if b not in mod._non_persistent_buffers_set and mod._buffers[b] is not None:
                names.append(f"{mod_name}.{b}" if mod_name else b)
    return names


@dataclass(frozen=True)
class _EPLayout:
    """Experts a caller's expert parallelism holds: ``ranks`` in sq's (dp, ep) order."""

    mesh: object  # the caller's DeviceMesh
    ranks: tuple[int, ...]
    dp: int
    ep: int
    native: bool  # already sq's own layout (sq.load_sharded(..., ep=N))


def _fsdp_managed(model: nn.Module) -> set[int]:
    """ids of the parameters an FSDP2 unit manages (those it unshards for each forward)."""
    from torch.distributed.fsdp import FSDPModule

    ids = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)  # no public getter (torch 2.13)
            for fp in getattr(group, "fsdp_params", None) or []:
                ids.add(id(fp.sharded_param))
    return ids


def _expert_layout(name: str, ex: nn.Module, managed: set[int], world: int) -> tuple[_EPLayout | None, list[str]]:
    """How ``ex``'s fused experts are held: FSDP2 with their block (None), or the caller's expert
    parallelism (an ``_EPLayout``); or the problems that make the layout one sq cannot quantize."""
    params = [(k, ex._parameters[k]) for k in expert_params(ex)]
    what = lambda k, p: (f"{name}.{k}: {type(p).__name__} "  # noqa: E731
                         f"{tuple(p.placements) if isinstance(p, DTensor) else ''} "
                         f"{'on mesh ' + str(p.device_mesh.mesh_dim_names or '') + ' ' + str(tuple(p.device_mesh.shape)) if isinstance(p, DTensor) else ''}".rstrip())
    if world == 1 and not any(isinstance(p, DTensor) for _, p in params):
        return None, []
    if all(isinstance(p, DTensor) and id(p) in managed for _, p in params):
        for k, p in params:
            if tuple(p.placements) != (Shard(0),) or p.device_mesh.size() != world:
                return None, [f"{what(k, p)}: FSDP2 experts must be sharded on dim 0 over all {world} ranks"]
        return None, []
    layouts = []
    for k, p in params:
        if not isinstance(p, DTensor):
            return None, [f"{what(k, p)}: the experts are replicated on every rank; shard them with their decoder "
                          "layer (fully_shard) or over an expert-parallel mesh (Shard(0) on the experts)"]
        if id(p) in managed:
            return None, [f"{what(k, p)}: one expert projection is FSDP2-managed and the other is not; "
                          "shard both the same way"]
        mesh = p.device_mesh
        if mesh.size() != world:
            return None, [f"{what(k, p)}: the experts' mesh covers {mesh.size()} of the {world} ranks; "
                          "sq needs a mesh over every rank (each rank quantizes the rows it holds)"]
        ep_dim = dp_dim = None
        for d, pl in enumerate(p.placements):
            size = mesh.size(d)
            if pl == Shard(0) and ep_dim is None:
                ep_dim = d
            elif pl == Shard(1) and dp_dim is None:
                dp_dim = d
            elif size > 1:
                dim_name = mesh.mesh_dim_names[d] if mesh.mesh_dim_names else d
                return None, [f"{what(k, p)}: {pl!r} over mesh dimension {dim_name!r} of {size} ranks -- experts "
                              "replicated (or split otherwise) on some ranks and sharded on others; sq quantizes "
                              "experts split by index (Shard(0)) over one mesh dimension and by rows (Shard(1)) "
                              "over at most one other. Reshard them so, or save the model and run sq.ptq"]
        order = [d for d in (dp_dim, ep_dim) if d is not None]
        rest = [d for d in range(mesh.ndim) if d not in order]
        ranks = tuple(mesh.mesh.permute(*order, *rest).reshape(-1).tolist())
        dp = mesh.size(dp_dim) if dp_dim is not None else 1
        ep = mesh.size(ep_dim) if ep_dim is not None else 1
        native = mesh.mesh_dim_names == ("dp", "ep") and tuple(p.placements) == (Shard(1), Shard(0))
        layouts.append(_EPLayout(mesh, ranks, dp, ep, native))
    if layouts[0].ranks != layouts[1].ranks or (layouts[0].dp, layouts[0].ep) != (layouts[1].dp, layouts[1].ep):
        return None, [f"{name}: {params[0][0]} and down_proj are placed differently ({what(*params[0])}; "
                      f"{what(*params[1])}); shard both the same way"]
    return layouts[0], []


def _distributed_loading_problems(model: nn.Module) -> list[str]:
    """transformers' own distributed loading (``DistributedConfig``): its FSDP2 layout (``fsdp_size``)
    is sq's and goes through; tensor parallelism (``tp_size`` > 1) and its expert parallelism
    (``ep_size`` > 1: experts FSDP-sharded over ``efsdp`` inside ``ep``, run by its own dispatch)
    are refused with what to do."""
    if getattr(model, "_device_mesh", None) is None:  # set by transformers' distributed loading only
        return []
    tp = int(getattr(model, "_tp_size", None) or 1)
    ep = max((p.device_mesh.size(p.device_mesh.mesh_dim_names.index("ep")) for p in model.parameters()
              if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ()) and "efsdp"
              in (p.device_mesh.mesh_dim_names or ())), default=1)
    if tp == 1 and ep == 1:
        return []
    how = f"tensor parallelism (tp_size={tp})" if tp > 1 else f"expert parallelism (ep_size={ep})"
    from torch.distributed.fsdp import FSDPModule

    cls = next(c.__name__ for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    return [f"{cls} was loaded by transformers' distributed loading with {how}; sq.quantize "
            "takes FSDP2-sharded decoder layers (DistributedConfig(fsdp_size=WORLD) is fine) with experts "
            "split by index. Load it with sq.load_sharded(path, ep=N) instead, or save it "
            "(model.save_pretrained) and run sq.ptq on the checkpoint"]
