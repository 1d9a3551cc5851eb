"""Expert parallelism for transformers' fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``).

Under ``--ep E`` the experts are split by index across the ``ep`` mesh dimension and each
expert's rows across ``dp``: placements ``(Shard(1), Shard(0))`` on the ``(dp, ep)`` mesh, so
every rank holds ``1 / world`` of every block's expert weights and reads only that.

The forward (calibration only, no autograd) gathers the tokens of the ep group, runs them
through this rank's experts (rows gathered within dp, one expert at a time), and sums the
partial outputs across the ep group; each rank keeps its own tokens' rows.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from sq.anatomy import expert_mid, expert_params
from sq.parallel.collectives import all_gather_rows, row_counts


def expert_placements():
    return (Shard(1), Shard(0))  # (dp: rows, ep: experts)


def shard_experts(experts: nn.Module, mesh: DeviceMesh) -> None:
    """Turn the fused expert parameters (still on meta) into DTensors on the (dp, ep) mesh."""
    for name in expert_params(experts):
        p = experts._parameters.get(name)
        if p is None or isinstance(p, DTensor):
            continue
        dt = distribute_tensor(p.data, mesh, expert_placements(), src_data_rank=None)
        experts._parameters[name] = nn.Parameter(dt, requires_grad=False)
    experts._sq_ep_mesh = mesh
    experts.forward = types.MethodType(ep_forward, experts)


def local_expert_range(n_experts: int, mesh: DeviceMesh) -> range:
    """Experts this rank's ep coordinate owns (torch.chunk split, as DTensor's Shard(0))."""
    ep, r = mesh.size(1), mesh.get_local_rank(1)
    size = -(-n_experts // ep)
    return range(min(r * size, n_experts), min((r + 1) * size, n_experts))


@torch.no_grad()
def ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    mesh: DeviceMesh = self._sq_ep_mesh
    ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
    ep = dist.get_world_size(ep_group)
    n_local_tokens = hidden_states.shape[0]
    # [T_r, H] per ep rank -> [sum T_r, H]: all tokens of the group, in rank order
    counts = row_counts(n_local_tokens, ep_group, hidden_states.device) if ep > 1 else [n_local_tokens]
    width = hidden_states.shape[1]
    h_all, idx_all, w_all = (all_gather_rows(t, counts, group=ep_group)
                             for t in (hidden_states, top_k_index, top_k_weights))
    out = torch.zeros(h_all.shape[0], width, dtype=hidden_states.dtype, device=hidden_states.device)
    first = expert_params(self)[0]  # gate_up_proj, or up_proj (up/down-only experts)
    experts = local_expert_range(self._parameters["down_proj"].shape[0], mesh)
    # [E_local, rows_dp, cols] -> [E_local, rows, cols]: this rank's experts with every row
    # cast to the tokens' dtype, as FSDP2's mixed precision casts the experts it holds (--ep 1), so
    # that ep 1 and ep > 1 compute the same
    gate_up = all_gather_rows(self._parameters[first].to_local(), dim=1, group=dp_group).to(hidden_states.dtype)
    down = all_gather_rows(self.down_proj.to_local(), dim=1, group=dp_group).to(hidden_states.dtype)
    for i, e in enumerate(experts):
        token_idx, pos = torch.where(idx_all == e)
        if token_idx.numel() == 0:
            continue
        x = h_all[token_idx]
        y = nn.functional.linear(expert_mid(self, x, gate_up[i]), down[i])
        out.index_add_(0, token_idx, (y * w_all[token_idx, pos, None]).to(out.dtype))
    dist.all_reduce(out, group=ep_group)
    start = sum(counts[: mesh.get_local_rank(1)])
    return out[start:start + n_local_tokens]
