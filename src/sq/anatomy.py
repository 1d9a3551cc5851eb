"""Model anatomy as data: what a decoder block, a fused expert group and a fused Linear group are.

Everything sq needs to know about a transformers model's layout, in one place:

- ``decoder_blocks``: the blocks the pipeline walks, in order;
- ``experts_modules``: transformers 5's fused routed experts (3-D ``gate_up_proj [E, 2I, H]`` /
  ``down_proj [E, H, I]``) and ``EXPERT_PARAMS``, their two projections;
- ``FUSED_PARTNERS``: Linears that serving engines fuse into one kernel (vLLM's ``qkv_proj``,
  ``gate_up_proj``, DeepSeek's ``fused_qkv_a_proj``); a per-tensor statistic (an NVFP4 global
  scale, an FP8 per-tensor scale) must be shared by the members of a group, or the fused
  weight is garbled.  ``partner_groups`` finds them among a block's quantized Linears.
"""

from __future__ import annotations

import torch.nn as nn

from sq.errors import LoadRefused

__all__ = ["decoder_blocks", "is_experts_module", "experts_modules", "EXPERT_PARAMS", "FUSED_PARTNERS",
           "partner_groups"]

EXPERT_PARAMS = ("gate_up_proj", "down_proj")

# sibling Linears (same parent module) that one engine kernel reads as one weight
FUSED_PARTNERS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),  # Mixtral's block_sparse_moe experts (gate, up)
    ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek-V3 MLA with q_lora_rank: vLLM's fused_qkv_a_proj
)


def decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder blocks, in order: the largest ``*.layers`` ModuleList (the text decoder in a VLM)."""
    best, best_n = None, -1
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and len(mod):
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = name, n
    if best is None:
        raise LoadRefused(f"{type(model).__name__} has no '*.layers' ModuleList of decoder blocks")
    blocks = model.get_submodule(best)
    return [(f"{best}.{i}", b) for i, b in enumerate(blocks)]


def is_experts_module(mod: nn.Module) -> bool:
    """transformers 5 fused experts: 3-D ``gate_up_proj`` / ``down_proj`` parameters."""
    p = mod._parameters
    return "down_proj" in p and p["down_proj"] is not None and p["down_proj"].dim() == 3


def experts_modules(block: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in block.named_modules() if is_experts_module(m)]


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
