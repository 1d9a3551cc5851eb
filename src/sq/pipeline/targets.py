"""What a job quantizes in each block, decided from the model and the recipe before anything is mutated,
and every refusal about it (group sizes, the EP split, row-shardable formats, NaN/Inf weights)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from sq.anatomy import (carried_experts, decoder_blocks, expert_params, experts_modules, quantized_init_problems,
                        quantized_layout_problems, routers)
from sq.errors import SqError
from sq.formats import specs
from sq.formats.schemes import QuantScheme, check_group_size
from sq.load.fill import local_box
from sq.quant import rtn
from sq.quant.activations import kv_cache_problems
from sq.quant.algorithms import Algorithm
from sq.quant.experts import export_slots, unquantized_experts_problems
from sq.quant.recipe import Assigner, scheme_tag
from sq.quant.work import ExpertGroup, Linear

logger = logging.getLogger(__name__)

__all__ = ["Targets", "plan_targets", "model_problems", "ep_problems", "nonfinite",
           "nonfinite_refusal", "config_groups", "auto_ep"]


@dataclass
class Targets:
    """What the job quantizes, decided from the model and the recipe before anything is mutated."""

    blocks: list[tuple[str, nn.Module]]
    linears: list[list[Linear]]  # per block
    experts: list[list[ExpertGroup]]  # per block
    unquantized: list[str]  # every unquantized Linear by name, and the MoE routers (vLLM builds them as Linears)
    assignment: dict[str, str]  # module -> scheme tag

    def linear_shapes(self, top: int | None = None) -> list[tuple[int, int]]:
        """The first block's distinct Linear shapes ``(in, out)``, largest first (``top``: that many): what the
        speed probes time (``sq.probe``'s calibration dtype, ``sq.pipeline.timing``'s rates)."""
        block = self.blocks[0][1] if self.blocks else None
        shapes = {(m.in_features, m.out_features) for m in block.modules() if isinstance(m, nn.Linear)} if block else ()
        return sorted(shapes, key=lambda s: (-s[0] * s[1], s))[:top]


def plan_targets(model: nn.Module, assigner: Assigner, weights, world: int) -> Targets:
    blocks = decoder_blocks(model)
    gates = set(routers(model))  # routers and shared-expert gates: never quantized (vLLM runs them unquantized)
    linears, k = [], 0
    for prefix, block in blocks:
        mine = []
        for n, m in block.named_modules():
            full = f"{prefix}.{n}"
            # (a zero-width Linear -- DeepSeek-V3's shared experts at n_shared_experts 0 -- has nothing to quantize)
            scheme = (assigner.assign(full) if isinstance(m, nn.Linear) and full not in gates
                      and m.in_features and m.out_features else None)
            if scheme is not None:
                ck = weights.ckpt_name(f"{full}.weight")
                mine.append(Linear(full, m, ck.removesuffix("weight"), k % world, scheme))  # round-robin writers
                k += 1
        linears.append(mine)
    experts = [[ExpertGroup(f"{prefix}.{n}", ex, assigner.assign(f"{prefix}.{n}")) for n, ex in experts_modules(block)]
               for prefix, block in blocks]
    experts = [[e for e in es if e[2] is not None] for es in experts]
    quantized = {l.name for ls in linears for l in ls}
    unquantized = sorted({n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized}
                         | {n for n, m in model.named_modules() if type(m).__name__.endswith("Router")} | gates)
    assignment = {l.name: scheme_tag(l.scheme) for ls in linears for l in ls}
    assignment.update({p: scheme_tag(s) for es in experts for p, _, s in es})
    return Targets(blocks, linears, experts, unquantized, assignment)



def model_problems(model, cfg, assigner: Assigner, algo: Algorithm, targets: Targets, calibrated: bool,
                   world: int | None = None) -> list[str]:
    """Refusals that depend on the model (identical on every rank): group sizes, EP split, the algorithm's own.
    ``world``: the job's world size (None: this process group's; ``sq.plan`` states the launch's)."""
    problems = []
    world = dist.get_world_size() if world is None else world
    problems += ep_problems(cfg.ep, world)
    for (prefix, block), lins in zip(targets.blocks, targets.linears):
        for n, ex in experts_modules(block):
            e, hidden, inter = ex._parameters["down_proj"].shape
            scheme = assigner.assign(f"{prefix}.{n}")
            for pname, width in ((expert_params(ex)[0], hidden), ("down_proj", inter)):
                try:
                    if scheme is not None:
                        check_group_size(f"{prefix}.{n}.{pname}", width, scheme)
                except SqError as err:
                    problems += err.problems
            if cfg.ep > 1 and e % cfg.ep:
                problems.append(f"{prefix}.{n}: {e} experts do not split evenly over --ep {cfg.ep}")
        for lin in lins:
            try:
                check_group_size(lin.name, lin.module.in_features, lin.scheme)
            except SqError as e:
                problems += e.problems
    problems += quantized_layout_problems(model)
    first = targets.linears[0] if targets.linears else []
    problems += quantized_init_problems(model, [(lin.name, lin.module) for lin in first])
    problems += model_experts_problems(model, cfg.allow_unquantized_experts)
    problems += row_shard_problems(targets)
    problems += kv_cache_problems(targets.blocks, cfg.kv_cache)
    problems += algo.refusals(model, assigner, world, cfg.ep)
    if calibrated and cfg.nsamples < world:
        problems.append(f"--nsamples {cfg.nsamples} is smaller than the world size {world}: "
                        "every rank needs calibration samples")
    if not targets.assignment:
        problems.append("nothing to quantize: every Linear is ignored or assigned no scheme")
    # plan_targets asked the assigner about every module it may quantize: a user pattern that
    # matched none of them (nor a Linear sq keeps in full precision) is a typo
    problems += assigner.unmatched_problems(targets.unquantized, allow=cfg.allow_unmatched)
    return problems


def ep_problems(ep: int | None, world: int) -> list[str]:
    """``--ep`` against the world size (the ranks: torchrun's --nproc-per-node x --nnodes); None is auto."""
    if ep is None or ep <= 0 or world % ep == 0:
        return []  # (a non-positive --ep is refused among the argument checks)
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [f"--ep {ep} does not divide the world size {world} (the ranks: --nproc-per-node x --nnodes); "
            f"give one of {', '.join(map(str, divisors))}, or --ep auto"]


# the carried layouts model-free quantizes per expert (sq.load.layout._linear_slabs)
_MODEL_FREE_QUANTIZES = ("up/down-only experts", "zero-compute or identity experts")


def model_experts_problems(model: nn.Module, allow: bool) -> list[str]:
    """The refusal for routed experts the model path would carry in full precision, one line per cause
    (``--allow-unquantized-experts``: none; they are logged, and the report and summary name them)."""
    return unquantized_experts_problems(
        carried_experts(model), allow,
        lambda why: ("; or quantize them model-free (--model-free --algo rtn), which quantizes these experts per "
                     "expert" if any(k in why for k in _MODEL_FREE_QUANTIZES) else ""))


def row_shard_problems(targets: Targets) -> list[str]:
    """The row-independence contract, enforced: every rank quantizes only its rows, so a scheme whose
    scales read statistics across rows must declare them as reductions (``sq.formats.specs``; the
    ``reduce`` stage all-reduces them before any rank solves; on fused experts per checkpoint tensor:
    gate, up and down of each expert apart)."""
    dense = {l.scheme for ls in targets.linears for l in ls}
    experts = {s for es in targets.experts for _, _, s in es}
    problems = []
    for scheme in sorted(dense | experts, key=scheme_tag):
        try:
            specs.check_row_shardable(scheme)
        except SqError as e:
            problems += e.problems
            continue
    return problems


def nonfinite(linears: list[Linear], experts, device) -> list[str]:
    """The block's quantized weights holding NaN or Inf on any rank (collective; the same list on every rank)."""
    names = [l.name for l in linears] + [f"{e}.{p}" for e, ex, _ in experts for p in expert_params(ex)]
    if not names:
        return []
    local = [local_box(l.module.weight)[0] for l in linears]
    local += [local_box(ex._parameters[p])[0] for _, ex, _ in experts for p in expert_params(ex)]
    flags = torch.tensor([not rtn.all_finite(t) for t in local], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [n for n, f in zip(names, flags.tolist()) if f]


def nonfinite_refusal(bad: list[str], linears: list[Linear], weights, skip: bool) -> list[str]:
    """Refusals for non-finite weights ([] where ``--skip-nonfinite`` may leave them unquantized)."""
    dense = {l.name for l in linears}
    problems = []
    for n in bad:
        if n in dense and not skip:
            problems.append(f"{n}.weight (checkpoint key {weights.ckpt_name(n + '.weight')!r}) holds NaN or Inf "
                            "values: its scales would be NaN. Fix the checkpoint, or pass --skip-nonfinite to leave "
                            "such Linears unquantized")
        elif n not in dense:
            problems.append(f"{n} holds NaN or Inf values in some experts; --skip-nonfinite leaves dense Linears "
                            "only: fix the checkpoint, or leave these experts out with --ignore / a recipe")
    return problems


def config_groups(targets: Targets, weights) -> dict:
    """``{scheme: targets}`` for ``quantization_config``: the largest group targets ``Linear``, the
    others their modules by exact name (compressed-tensors and vLLM prefer an exact name to a class)."""
    members: dict[QuantScheme, list[str]] = {}
    for ls in targets.linears:
        for l in ls:
            members.setdefault(l.scheme, []).append(l.ckpt_prefix.removesuffix("."))
    for es in targets.experts:
        for eprefix, ex, scheme in es:
            names = sorted({s.ckpt_prefix.removesuffix(".") for s in export_slots(eprefix, ex, weights.expert_pieces)})
            members.setdefault(scheme, []).extend(names)
    if len(members) <= 1:
        return {s: ["Linear"] for s in members}
    biggest = max(members, key=lambda s: len(members[s]))
    return {s: (["Linear"] if s == biggest else names) for s, names in members.items()}


def auto_ep(model, world: int, algo) -> int:
    """``--ep auto``: the world size for an MoE whose experts split evenly over it, so each rank holds
    and computes only its experts and the tokens move to them (at ``--ep 1`` every rank gathers a
    whole MoE block: 666 MiB of the 30.5 GB checkpoint run's peak per rank); else the largest
    divisor of the world that splits every experts module evenly; 1 for a dense model and for an
    algorithm that tunes experts under FSDP2 only.  Every choice writes the same bits (tests:
    --ep 1 vs 2); the resolved value is what the resume signature records."""
    counts = sorted({ex._parameters["down_proj"].shape[0] for _, b in decoder_blocks(model)
                     for _, ex in experts_modules(b)})
    if not counts or world == 1:
        return 1
    if not algo.expert_parallel:
        logger.info("--ep auto: 1 (--algo %s holds experts under FSDP2)", algo.config.name)
        return 1
    ep = max(d for d in range(1, world + 1) if world % d == 0 and all(c % d == 0 for c in counts))
    if ep < world:
        logger.info("--ep auto: %s experts do not split evenly over %d ranks; --ep %d",
                    "/".join(map(str, counts)), world, ep)
    return ep


def check_finite(targets: Targets, b: int, device, weights, skip: bool, calibrated: bool) -> tuple[list[str], list]:
    """Block ``b``'s Linears holding NaN/Inf: refused (the same list on every rank: they refuse together), or
    under ``--skip-nonfinite`` dropped from ``targets`` and, in a calibrated job, read as 0 by the calibration
    forwards (so the Linears after them calibrate on finite inputs): returns them and ``(weight, stored)``
    pairs for :func:`restore_nonfinite`, which puts the stored values back before the block is written."""
    linears, experts = targets.linears[b], targets.experts[b]
    bad = nonfinite(linears, experts, device)
    if not bad:
        return bad, []
    refused = nonfinite_refusal(bad, linears, weights, skip)
    if refused:
        raise SqError(refused)
    logger.warning("block %d: %s hold NaN/Inf values; left unquantized (--skip-nonfinite)", b, ", ".join(bad))
    targets.linears[b] = [lin for lin in linears if lin.name not in bad]
    saved = [(w, w.clone()) for w in (local_box(lin.module.weight)[0] for lin in linears if lin.name in bad)] \
        if calibrated else []
    for w, _ in saved:
        torch.nan_to_num_(w, nan=0.0, posinf=0.0, neginf=0.0)
    return bad, saved


def restore_nonfinite(saved: list) -> None:
    """The skipped Linears' stored values back (NaN/Inf included): :func:`check_finite`'s pairs, emptied."""
    for w, raw in saved:
        w.copy_(raw)
    saved.clear()
