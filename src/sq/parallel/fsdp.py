"""FSDP2 over a meta model: one unit per decoder block, the root holding the rest.

Every block weight is sharded on dim 0 over every rank: output rows of a Linear, and the
expert index of a fused ``[E, out, in]`` expert tensor, so with ``ep == 1`` each rank holds
whole experts (an uneven split is fine on dim 0; FSDP2 refuses uneven splits on other
dims).  With ``ep > 1`` experts become (dp, ep) DTensors (``sq.parallel.expert``) that FSDP2
ignores: split by index across ``ep`` and by rows across ``dp``.

``unsharded(block)`` keeps a block's units gathered while SignRound tunes it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from sq.dist import world_mesh
from sq.errors import LoadRefused
from sq.anatomy import decoder_blocks, experts_modules
from sq.parallel.expert import shard_experts


def root_param_problems(model: nn.Module) -> list[str]:
    """FSDP2 would fold parameters held directly by the root into the root unit unseen."""
    own = [n for n, p in model._parameters.items() if p is not None]
    return [f"the root module {type(model).__name__} holds parameters directly ({', '.join(own)}); "
            "sq shards the decoder blocks and the root's submodules, not bare root parameters"] if own else []


def apply_parallel(model: nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard a meta model in place: EP on experts (if the mesh has ep > 1), FSDP2 on blocks and root.

    ``compute_dtype``: forwards compute in it (FSDP2 casts each unit's gathered parameters and its
    floating inputs; the shards keep the checkpoint's dtype); the expert-parallel forward casts its
    experts' weights to the tokens' dtype the same way.  None: the parameters' own dtype.
    """
    problems = root_param_problems(model)
    if problems:
        raise LoadRefused(problems)
    flat = world_mesh(mesh)
    ep = mesh.size(1) if mesh.ndim == 2 else 1
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype)

    # sq never trains a weight: every parameter a constant.  FSDP2 then holds parameters of mixed dtypes
    # in one unit (its uniform-dtype rule binds only parameters that want a gradient; the all-gather
    # carries mixed dtypes as bytes, or casts them all to ``compute_dtype``): a float32 router, norm or
    # state parameter (DeepSeek's ``e_score_correction_bias``, Kimi-Linear's ``A_log``) beside bf16
    # weights, wherever it sits in the block, needs no unit of its own.
    for p in model.parameters():
        p.requires_grad_(False)
    for _, block in decoder_blocks(model):
        ignored = set()
        experts = experts_modules(block)
        if ep > 1:
            for _, ex in experts:
                shard_experts(ex, mesh)
                ignored.update(p for p in ex.parameters(recurse=False))
        fully_shard(block, mesh=flat, reshard_after_forward=True, ignored_params=ignored or None, mp_policy=mp)
    fully_shard(model, mesh=flat, reshard_after_forward=True, mp_policy=mp)
    return model


def main_dtype(module: nn.Module, ignored=()) -> torch.dtype | None:
    """The dtype of most of ``module``'s parameter elements (ties by name: the same on every rank);
    None without parameters.  Read before any forward (FSDP2 then registers its sharded parameters,
    in the checkpoint's dtype, whatever the forwards compute in)."""
    numel: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p not in ignored:
            numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
    return max(sorted(numel, key=str), key=numel.get) if numel else None


def fsdp_param_groups(mod: nn.Module) -> list:
    """An FSDP2 module's parameter groups (no public getter): torch 2.13 keeps a list
    (``_fsdp_param_groups``), torch 2.11 one group or None (``_fsdp_param_group``, which 2.13 keeps
    too); this reads either, so sq loads under both."""
    state = mod._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class unsharded:
    """Keep ``block``'s FSDP2 units (the block and any sub-unit) unsharded across forwards and backwards.

    SignRound runs a block's forward and backward many times per block, and every calibration
    forward runs its batches one after the other; resharding after each would all-gather the
    block's weights again every step.  Each unit's own resharding settings (a training
    framework's choice, under ``sq.quantize``) are read before and put back after.  Nested use is
    fine: a unit an enclosing ``unsharded`` holds is left to it.
    """

    _held: set[int] = set()  # ids of the units an open ``unsharded`` keeps gathered

    def __init__(self, block: nn.Module):
        self.units = [m for m in block.modules() if isinstance(m, FSDPModule) and id(m) not in unsharded._held]

    @staticmethod
    def _settings(m) -> tuple[bool, bool]:
        groups = fsdp_param_groups(m)  # FSDP2 keeps them on the unit's parameter group (no public getter)
        try:
            return groups[0].post_forward_mesh_info is not None, bool(groups[0].reshard_after_backward)
        except (AttributeError, IndexError):
            return True, True

    def __enter__(self):
        self.saved = [self._settings(m) for m in self.units]
        for m in self.units:
            unsharded._held.add(id(m))
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.unshard()
        return self

    def __exit__(self, *exc):
        for m, (fwd, bwd) in zip(self.units, self.saved):
            unsharded._held.discard(id(m))
            m.set_reshard_after_forward(fwd, recurse=False)
            m.set_reshard_after_backward(bwd, recurse=False)
            m.reshard()
