"""MoE experts in the PTQ driver: per-expert Hessians, owned-rows quantization, checkpoint names.

transformers 5 keeps routed experts fused: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``.
Quantization is per expert and per projection, and row-independent, so a rank quantizes the
rows of the experts it holds (``local_box``) with that expert's Hessians:

- ``gate_up`` rows of expert e see the tokens entering expert e (``H_in[e]``, ``H x H``);
- ``down`` rows see ``act(x W_gate^T) * (x W_up^T)`` of those tokens (``H_mid[e]``, ``I x I``).

Calibration runs every rank's tokens past the owner: the experts' forward gathers the
hidden states of all ranks (world group) and each rank accumulates only its own experts'
Hessians, so no ``E x H x H`` tensor ever exists.  With "calibrate all experts" every token
feeds every expert's statistics while the routed output stays unchanged; an expert that sees
no token falls back to RTN and is counted.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from sq.anatomy import expert_leaves, expert_mid, expert_params
from sq.errors import SqError
from sq.load.fill import local_box
from sq.load.keymap import Piece
from sq.parallel.collectives import all_gather_rows
from sq.formats.compressed import compress_weight
from sq.formats.specs import ActivationObserver
from sq.quant import rtn
from sq.quant.gptq import GPTQ

logger = logging.getLogger(__name__)



@dataclass
class ExpertSlot:
    """One exported expert projection: rows ``[lo, hi)`` of ``param[e]`` -> checkpoint prefix."""

    param: str  # "gate_up_proj" (or "up_proj": up/down-only experts) | "down_proj"
    expert: int
    lo: int
    hi: int
    ckpt_prefix: str  # e.g. "model.layers.1.mlp.experts.3.gate_proj." (+ "weight_packed", ...)


def export_slots(prefix: str, experts: nn.Module, pieces: dict[str, list[Piece]] | None) -> list[ExpertSlot]:
    """Checkpoint-layout names of every expert projection, from the key map's boxes.

    A per-expert source (``experts.{e}.gate_proj.weight``, Mixtral's ``w1/w3/w2``) names its own
    boxes; a fused source (or a model in memory: ``pieces`` None) gets the per-expert names of the
    model's conversion mapping (``sq.anatomy.expert_leaves``: ``gate_proj`` / ``up_proj`` /
    ``down_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``), which vLLM's per-expert loaders read and
    transformers fuses back.
    Sorted by (expert, param, first row): an expert's slots of one param tile its rows in order.
    """
    pieces = pieces or {}
    slots = []
    for pname in expert_params(experts):
        target = f"{prefix}.{pname}"
        p = experts._parameters[pname]
        n_exp, rows = p.shape[0], p.shape[1]
        ps = pieces.get(target, [])
        if ps and all(x.stack_dim == 0 for x in ps):
            for x in ps:
                slots.append(ExpertSlot(pname, x.offsets[0], x.offsets[1], x.offsets[1] + x.lengths[1],
                                        x.ckpt_key.removesuffix("weight")))
            continue
        ckpt_prefix = ps[0].ckpt_key.rsplit(".", 1)[0] if ps else prefix
        leaves = expert_leaves(experts)[pname]  # the names transformers' conversion mapping fuses back
        step = rows // len(leaves)
        for e in range(n_exp):
            for j, leaf in enumerate(leaves):
                slots.append(ExpertSlot(pname, e, j * step, (j + 1) * step, f"{ckpt_prefix}.{e}.{leaf}."))
    return sorted(slots, key=lambda s: (s.expert, s.param, s.lo))


def whole_rows_stats(segments: list, what: str) -> dict | None:
    """One expert's all-reduced statistics as one dict, for the algorithms whose schemes have at most a
    global scale crossing rows (GPTQ, SignRound): its one segment covers every row of ``param[e]``."""
    if len(segments) != 1:
        raise SqError(f"{what}: expected one statistics segment per expert (a global scale), got {len(segments)}")
    return segments[0].stats


@dataclass
class SlotStats:
    """Cross-row statistics (``sq.quant.rtn.local_stats``, all-reduced) of rows ``[lo, hi)`` of
    ``param[e]``: one checkpoint tensor (an :class:`ExpertSlot`) where the scales are whole-tensor
    or 2-D blocks (FP8 per-tensor, FP8_BLOCK: gate and up each their own grid), or every row of
    ``param[e]`` where only a global scale crosses rows (NVFP4: gate and up share it, as vLLM
    fuses them)."""

    lo: int
    hi: int
    stats: dict[str, torch.Tensor]


def segment_rows(w: torch.Tensor, r0: int, lo: int, hi: int) -> tuple[torch.Tensor, int]:
    """The rows of segment ``[lo, hi)`` of ``param[e]`` among a rank's local rows ``w`` (rows
    ``[r0, r0 + len(w))`` of ``param[e]``), possibly none, and the first one's offset in the segment."""
    a, b = max(lo, r0), min(hi, r0 + w.shape[0])
    return (w[a - r0:b - r0] if b > a else w[:0]), max(a - lo, 0)


def slot_rows(slots: list[ExpertSlot]) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """``(expert, param)`` -> the ``[lo, hi)`` rows of ``param[expert]`` each of its checkpoint
    tensors holds, in row order (``slots`` as :func:`export_slots` sorts them)."""
    out: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for s in slots:
        out.setdefault((s.expert, s.param), []).append((s.lo, s.hi))
    return out


def local_experts(experts: nn.Module) -> range:
    """Global indices of the experts whose rows this rank holds."""
    _, off = local_box(experts._parameters["down_proj"])
    n = local_box(experts._parameters["down_proj"])[0].shape[0]
    return range(off[0], off[0] + n)


def is_ep_param(p: torch.Tensor) -> bool:
    """An expert tensor sharded by ``sq.parallel.expert`` (rows over dp, experts over ep)."""
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "ep")


@dataclass
class ExpertCalibration:
    """Per-expert statistics of the experts this rank holds, filled by a wrapped forward:
    GPTQ Hessians (``hessians``) and/or the absmax of each expert's inputs and of its down
    projection's inputs (``absmax``: static activation scales, ``sq.quant.activations``)."""

    experts: nn.Module
    calibrate_all: bool
    device: torch.device
    on: bool = True
    hessians: bool = True
    absmax: bool = False
    h_in: dict[int, GPTQ] = field(default_factory=dict)
    h_mid: dict[int, GPTQ] = field(default_factory=dict)
    amax_in: dict[int, torch.Tensor] = field(default_factory=dict)  # float32 [1] per local expert
    amax_mid: dict[int, torch.Tensor] = field(default_factory=dict)
    routed: dict[int, int] = field(default_factory=dict)  # tokens the router sent to each local expert (all ranks')
    # GPTAQ (sq.quant.forward.paired_forward): a forward while ``capturing`` runs on the full-precision
    # chain and keeps the gathered expert inputs; the next, on the quantized chain, gives every
    # accumulator the cross term of the same tokens.  Only with calibrate-all, where every expert
    # sees every token on both chains (routed tokens differ between the chains: no pairs)
    paired: bool = False
    capturing: bool = False
    fp_h: torch.Tensor | None = None

    def __post_init__(self):
        ex = self.experts
        hidden, inter = ex._parameters["down_proj"].shape[1], ex._parameters["down_proj"].shape[2]
        self.mine = local_experts(ex)
        # calibrate-all: every expert sees every token, so all gate/up input Hessians are one matrix
        # (accumulated once, not once per expert: 256x less work and memory on DeepSeek-V3)
        # experts' Hessians in float32 whatever their width: a rank holds one per owned expert (dense ones:
        # sq.quant.gptq.hessian_dtype)
        f32 = torch.float32
        shared = GPTQ(hidden, device=self.device, dtype=f32) if self.calibrate_all and self.hessians else None
        for e in self.mine:
            if self.hessians:
                self.h_in[e] = shared if shared is not None else GPTQ(hidden, device=self.device, dtype=f32)
                self.h_mid[e] = GPTQ(inter, device=self.device, dtype=f32)
            if self.absmax:
                self.amax_in[e] = torch.zeros(1, dtype=torch.float32, device=self.device)
                self.amax_mid[e] = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._had_own_forward = "forward" in ex.__dict__  # EP installs a per-module forward
        self._orig = ex.forward
        ex.forward = types.MethodType(self._make_forward(), ex)

    def _make_forward(self):
        calib, orig = self, self._orig

        def forward(module, hidden_states, top_k_index, top_k_weights):
            out = orig(hidden_states, top_k_index, top_k_weights)
            pairs = calib.paired and calib.calibrate_all and calib.hessians
            if calib.capturing and not pairs:  # (the same on every rank: no gather skipped by one alone)
                return out
            # every rank joins the gather (dummy batches send no tokens)
            mine_h = hidden_states if calib.on else hidden_states[:0]
            mine_i = top_k_index if calib.on else top_k_index[:0]
            # [T_r, H], [T_r, k] on each rank -> [sum T_r, H], [sum T_r, k]
            h_all, idx_all = all_gather_rows(mine_h), all_gather_rows(mine_i)
            if calib.capturing:
                calib.fp_h = h_all
                return out
            if not len(calib.mine) or h_all.shape[0] == 0:
                return out
            h_fp = calib.fp_h if pairs else None
            p = module._parameters[expert_params(module)[0]]  # gate_up_proj, or up_proj (up/down-only)
            gate_up = full_expert_rows(p.to_local(), p) if is_ep_param(p) else p  # [E_local, 2I (I), H]
            gate_up = gate_up.to(h_all.dtype)  # as the experts' own forward computes (sq.parallel.expert)
            first = calib.mine.start if is_ep_param(p) else 0
            if calib.calibrate_all and calib.hessians:
                calib.h_in[calib.mine.start].add_batch(h_all, h_fp)  # the one shared accumulator
            if calib.calibrate_all and calib.absmax:
                a = _absmax(h_all)
                for e in calib.mine:
                    torch.maximum(calib.amax_in[e], a, out=calib.amax_in[e])
            hit = [(idx_all == e).any(dim=-1) for e in calib.mine]
            for e, m in zip(calib.mine, hit):
                calib.routed[e] = calib.routed.get(e, 0) + int(m.sum())
            for e, m in zip(calib.mine, hit):
                x = h_all if calib.calibrate_all else h_all[m]
                if x.shape[0] == 0:
                    continue
                w = gate_up[e - first]
                mid = expert_mid(module, x, w)
                if not calib.calibrate_all:
                    if calib.hessians:
                        calib.h_in[e].add_batch(x)
                    if calib.absmax:
                        torch.maximum(calib.amax_in[e], _absmax(x), out=calib.amax_in[e])
                if calib.hessians:
                    mid_fp = None
                    if h_fp is not None:  # the same expert on the full-precision chain's tokens
                        mid_fp = expert_mid(module, h_fp, w)
                    calib.h_mid[e].add_batch(mid, mid_fp)
                if calib.absmax:
                    torch.maximum(calib.amax_mid[e], _absmax(mid), out=calib.amax_mid[e])
            return out

        return forward

    def release(self) -> None:
        """Drop the full-precision pass's gathered inputs (``paired``)."""
        self.fp_h = None

    def remove(self) -> None:
        if self._had_own_forward:
            self.experts.forward = self._orig
        else:
            del self.experts.__dict__["forward"]


def take_solved(solved, local: torch.Tensor) -> tuple:
    """One projection's solved local experts (``Algorithm.solve_experts``, taken one at a time): each one's
    dequantized rows written into ``local [n, rows, in]`` (the quantized chain) and its codes, scales and zero
    points copied into stacks ``[n, ...]`` as it comes, so only the stacks and one expert's solve are ever held
    (a list of every expert's ``Solved``, stacked at the end, held its dequantized rows and its codes twice).
    Returns ``(q, scale, zero_point, global scales)``, the first three None where no expert was solved."""
    stacks: list = [None, None, None]
    gs = []
    for i, s in enumerate(solved):
        local[i].copy_(s.deq)
        for j, t in enumerate((s.q, s.scale, s.zero_point)):
            if t is not None:
                if stacks[j] is None:
                    stacks[j] = t.new_empty((local.shape[0], *t.shape))
                stacks[j][i].copy_(t)
        gs.append(s.global_scale)
        del s
    return (*stacks, gs)


def _absmax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as float32 ``[1]`` (0 for no values): the activation observers' statistic."""
    return ActivationObserver.local(x).float()


def full_expert_rows(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's experts with every row: ``local [n, rows_dp, cols]`` -> ``[n, rows, cols]``, any dtype.

    ``local`` is ``p``'s local shard or a tensor shaped like it (quantized rows, scales): under EP
    its rows are gathered within the dp group; otherwise the rank already holds whole experts.
    """
    if not is_ep_param(p):
        return local
    return all_gather_rows(local, dim=1, group=p.device_mesh.get_group("dp"))


def export_experts(eprefix: str, ex: nn.Module, qdata: dict, pieces, scheme, acts=None) -> dict[str, torch.Tensor]:
    """Compressed per-expert tensors under checkpoint-layout names, written by the rank holding them.

    Under EP with dp > 1 an expert's rows are spread over the dp group: they are gathered there
    and the dp rank ``e % dp`` writes the expert.  Scales that follow rows are gathered and sliced
    like the rows; whole / block scales come one grid per slot (``[n_local, n_slots, *grid]``, the
    same on every dp rank: ``Algorithm.solve_expert``), slot k of an expert taking grid k.
    """
    tensors = {}
    mine = local_experts(ex)
    p0 = ex._parameters["down_proj"]
    dp_rank, dp = (p0.device_mesh.get_local_rank(0), p0.device_mesh.size(0)) if is_ep_param(p0) else (0, 1)
    follow = rtn.scales_follow_rows(scheme)
    full = {}
    for pname in expert_params(ex):
        p = ex._parameters[pname]
        q, scale, zp, gs = qdata[pname]
        if q is None:
            continue
        full[pname] = (full_expert_rows(q, p),
                       *((full_expert_rows(t, p) if follow else t) if t is not None else None for t in (scale, zp)), gs)
    seen: dict[tuple[int, str], int] = {}
    for slot in export_slots(eprefix, ex, pieces):
        k = seen[slot.expert, slot.param] = seen.get((slot.expert, slot.param), -1) + 1  # slot k of param[e]
        if slot.expert not in mine or slot.expert % dp != dp_rank or slot.param not in full:
            continue
        q, scale, zp, gs = full[slot.param]
        i = slot.expert - mine.start
        sl = slice(slot.lo, slot.hi) if follow else k
        w = (q[i, slot.lo:slot.hi], scale[i, sl], zp[i, sl] if zp is not None else None)
        act = (acts or {}).get((eprefix, slot.expert, "mid" if slot.param == "down_proj" else "in"))
        for rel, v in compress_weight(w, scheme, tuple(w[0].shape), activation_scales=act,
                                      global_scale=gs[i].clone() if gs[i] is not None else None).items():
            tensors[slot.ckpt_prefix + rel] = v
    return tensors


def experts_report(tokens: dict[str, dict[int, tuple[int, int]]], rtn_names: list[str], calibrate_all: bool) -> dict:
    """The report's ``experts``: the policy for experts few or no calibration tokens reach, stated, and each
    experts module's tokens per expert (``routed``: where the router sent them; ``calibrated``: what its
    statistics saw), with the experts rounded to nearest instead (named)."""
    policy = ("calibrate-all-experts: every expert's Hessians see every calibration token (the routed output is "
              "unchanged), so no expert goes without; routed counts show where the router sent them"
              if calibrate_all else
              "routed: each expert's Hessians see the tokens routed to it; an expert no token reached is rounded to "
              "nearest (RTN) and named in rtn")
    modules = {}
    for eprefix, per in sorted(tokens.items()):
        n = max(per) + 1 if per else 0
        modules[eprefix] = {"routed": [per.get(e, (0, 0))[0] for e in range(n)],
                            "calibrated": [per.get(e, (0, 0))[1] for e in range(n)]}
    return {"policy": policy, "rtn": rtn_names, "tokens": modules}


ALLOW_UNQUANTIZED_EXPERTS = "--allow-unquantized-experts"


def unquantized_experts_problems(carried: list[tuple[str, str]], allow: bool, hint=lambda why: "") -> list[str]:
    """The refusal for routed experts sq would write in full precision (``carried``: ``(module, why)``, as
    ``sq.anatomy.carried_experts`` gives them), one line per cause; [] under ``allow``
    (``--allow-unquantized-experts``: logged, and the report and summary name them).  Routed experts hold most of
    an MoE's weights: a "W4A16" output with them in bf16 is not what the user asked for.  ``hint(why)``: what
    else the caller's path offers for that cause, appended to its line."""
    by_reason: dict[str, list[str]] = {}
    for name, why in carried:
        by_reason.setdefault(why, []).append(name)
    if allow:
        for why, names in by_reason.items():
            logger.warning("routed experts left unquantized (%s): %d module(s), e.g. %s: %s", ALLOW_UNQUANTIZED_EXPERTS,
                           len(names), names[0], why)
        return []
    return [f"routed experts sq cannot quantize: {names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''} "
            f"({why}); they would be written in full precision beside quantized Linears. Pass "
            f"{ALLOW_UNQUANTIZED_EXPERTS} (sq.quantize: allow_unquantized_experts=True) to write them so{hint(why)}"
            for why, names in by_reason.items()]


def unquantized_experts_report(carried: list[tuple[str, str]]) -> list[dict]:
    """``sq_report.json``'s ``unquantized_experts``: every routed-experts module written in full precision."""
    return [{"module": name, "reason": why} for name, why in carried]
