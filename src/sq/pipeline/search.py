"""Mixed precision under a bit budget (``--target-bits B --candidates W4A16,W8A16``): score, allocate,
write a recipe, then quantize with it.

Inside the job, after the output folder is claimed and before the first block is quantized
(``sq.pipeline.blocks``):

1. **Score.**  Every *unit* is quantized with each candidate, alone, as the job will quantize it
   (``score_solver``: GPTQ against the unit's Hessian on these inputs for a GPTQ-family job, else
   round-to-nearest), and its block run again on the full-precision chain (this rank's calibration
   windows); the score is how far the block's output moved, over every rank's tokens
   (``--search-score``, ``search_score``):

   - ``fisher`` (``_fisher_pass``; ``auto`` without routed experts): each output element's change
     times the next-token loss's gradient there, squared and summed -- the diagonal Fisher's
     estimate of the loss's rise.  The chain is run forward once, each block's inputs kept on disk
     (this rank's own); the loss's gradient is taken at the last block's outputs through the model's
     own head (``sq.quant.forward.head_grads``); then the blocks from the last to the first are
     scored, the gradient carried back through each (``block_grads``).
   - ``mse`` (``_mse_pass``; ``auto`` with routed experts, whose expert-parallel forward has no
     backward): the block output's mean squared error, blocks in order.

   On SmolLM2 at 4.5 bits (docs/benchmarks.md) GPTQ-scored Fisher chose best (12.13); ``mse`` scored
   12.39 with either quantizer, Fisher on RTN errors 12.85-12.92 (it upgrades early blocks whose RTN
   error GPTQ removes anyway); each token's state over its RMS under ``mse``, 12.95.

   A unit is the Linears that read one input tensor (q/k/v, gate/up: an engine fuses them, so they
   must share a scheme), found by the forward itself, or one Linear.  Each rank quantizes its own
   rows (the scores are all-reduced), so the weights in memory stay one block's.
2. **Allocate** (``allocate``): every unit starts at its cheapest candidate; the upgrade with the
   most score removed per stored bit that still fits is taken until none fits.  Bits are counted as
   the format stores them (``effective_bits``: codes, scales, zero points, global scales).
3. **Recipe.**  The choice is written as a recipe (``OUT/sq_recipe.yaml``, a file to edit and
   rerun with ``--recipe``), and the job quantizes with it.

Resumable: each block's scores are kept in ``.sq-run/search/`` (rank 0 writes, every rank reads the
same); a rerun scores only the blocks left (the chain through the scored ones is still run: a forward
each under ``mse``; the forward chain, then a forward and backward each under ``fisher``), and once
the recipe is written it is read back as it is.  A routed-experts module is one unit (a recipe names
experts by their module), scored under candidates whose scales follow rows alone.
"""

from __future__ import annotations

import contextlib

import dataclasses
import json
import logging
import math
import re
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from sq.anatomy import expert_params
from sq.errors import SqError
from sq.files import write_bytes_atomic
from sq.formats.compressed import compress_weight
from sq.formats.schemes import PRESET_NAMES, QuantScheme, get_scheme, with_int_grid
from sq.formats.specs import activation_observers, required_reductions
from sq.load.fill import local_box
from sq.pipeline.targets import model_problems, plan_targets
from sq.quant import rtn
from sq.quant.algorithms.gptq_hessians import Counting
from sq.quant.gptq import GPTQConfig
from sq.quant.forward import CALIB_BATCH, InputLeaders, block_forward, block_grads, capture_block0, head_grads
from sq.quant.work import Linear
from sq.run import raise_all

__all__ = ["effective_bits", "allocate", "apply_search", "cost_dtype", "Unit", "SEARCH_DIR", "RECIPE_FILE",
           "search_problems"]

logger = logging.getLogger(__name__)

SEARCH_DIR = "search"  # under OUT/.sq-run
RECIPE_FILE = "sq_recipe.yaml"


@dataclass
class Unit:
    """Linears that must share a scheme (one input tensor), or one routed-experts module, scored and
    chosen together."""

    names: list[str]
    shapes: list[list[int]]  # each Linear's [out, in]
    scores: dict[str, float]  # candidate -> block-output mean squared error (inf: not allowed here)
    choice: str | None = None

    @property
    def params(self) -> int:
        return sum(o * i for o, i in self.shapes)

    def key(self) -> str:
        return " + ".join(self.names)


@lru_cache(maxsize=None)
def stored_tensors(scheme: QuantScheme, out_features: int, in_features: int, dtype: torch.dtype) -> dict[str, int]:
    """The tensors ``scheme`` writes for an ``[out, in]`` weight of ``dtype`` (codes, scales, zero points,
    global scales, the shape record, activation scales) and the bytes of each, as compressed-tensors
    stores them."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    solved = rtn.rtn_rows(w, scheme)
    declared = (o.tensor(solved.scale.dtype) for o in activation_observers(scheme))  # as the format declares them
    tensors = compress_weight((solved.q, solved.scale, solved.zero_point), scheme, tuple(w.shape),
                              global_scale=solved.global_scale,
                              activation_scales={t.name: torch.ones(t.shape, dtype=t.dtype) for t in declared})
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def _bits(scheme: QuantScheme, out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """Stored bits of ``scheme`` on an ``[out, in]`` weight of ``dtype``, byte by byte (``stored_tensors``)."""
    return 8 * sum(stored_tensors(scheme, out_features, in_features, dtype).values())


def _expert_shapes(ex) -> list[tuple[int, int]]:
    """Every expert's two projections, ``[out, in]`` each (``E x`` gate/up then down), as a unit's shapes."""
    n_experts = ex._parameters["down_proj"].shape[0]
    return [tuple(int(d) for d in ex._parameters[pn].shape[1:]) for pn in expert_params(ex)] * n_experts


def effective_bits(scheme: QuantScheme, out_features: int, in_features: int,
                   dtype: torch.dtype = torch.bfloat16) -> float:
    """Stored bits per weight of ``scheme`` on an ``[out, in]`` weight (``_bits``)."""
    return _bits(scheme, out_features, in_features, dtype) / (out_features * in_features)


def allocate(units: list[Unit], cost, target: float) -> float:
    """Choose each unit's candidate so that the stored bits per weight stay <= ``target`` and the
    summed score is low: all at their cheapest allowed candidate, then the best upgrade per bit
    that fits, until none does (ties: the earlier unit, then the cheaper candidate).  Sets
    ``Unit.choice``; returns the bits per weight reached.  ``cost(unit, candidate)``: its stored bits."""
    total = sum(u.params for u in units)
    budget = target * total

    for u in units:
        allowed = [c for c, s in u.scores.items() if math.isfinite(s)]
        if not allowed:
            raise SqError(f"{u.key()}: no candidate scheme applies to it (group sizes?)")
        u.choice = min(allowed, key=lambda c: (cost(u, c), u.scores[c]))
    used = sum(cost(u, u.choice) for u in units)
    if used > budget * (1 + 1e-12):
        raise SqError(f"--target-bits {target:g} is below what the cheapest candidates store "
                      f"({used / total:.4f} bits per weight)")
    while True:
        best = None
        for i, u in enumerate(units):
            for c, s in u.scores.items():
                extra = cost(u, c) - cost(u, u.choice)
                gain = u.scores[u.choice] - s
                if extra <= 0 or gain <= 0 or not math.isfinite(s) or used + extra > budget * (1 + 1e-12):
                    continue
                rate = gain / extra
                if best is None or rate > best[0]:
                    best = (rate, i, c, extra)
        if best is None:
            return used / total
        _, i, c, extra = best
        units[i].choice = c
        used += extra


def search_problems(cfg, model, algo, targets, world: int, dtype: torch.dtype) -> list[str]:
    """Refusals of ``--target-bits`` (identical on every rank), before anything is written: the
    settings, each candidate as the algorithm would take it on this model, and the budget against
    what the cheapest candidates store on ``dtype`` weights (``cost_dtype``, as the allocation counts)."""
    from sq.quant.recipe import make_assigner

    out = []
    if cfg.target_bits is None:
        return out
    if not (0 < cfg.target_bits < 64):  # (NaN fails too)
        out.append(f"--target-bits must be the stored bits per weight, a number above 0 and below 64 (codes, scales "
                   f"and zero points: W4A16 stores about 4.1 at group size 128), got {cfg.target_bits:g}")
    if len(cfg.candidates) < 2:
        out.append(f"--candidates: give at least two schemes to choose from, got {list(cfg.candidates)}")
    for c in cfg.candidates:
        try:
            assigner = make_assigner(c, cfg.group_size, cfg.ignore, None, cfg.grid)
        except SqError as e:
            out += [f"--candidates {c}: {m}" for m in e.problems]
            continue
        out += [f"--candidates {c}: {m}" for m in algo.refusals(model, assigner, world, cfg.ep or 1)
                if "group size" not in m]  # a group size one Linear's width refuses: that unit cannot take it
    if not algo.calibrated:
        out.append(f"--target-bits scores every layer on calibration data; --algo {cfg.algo.name} reads none "
                   "(use gptq, gptaq, awq or signround)")
    if cfg.recipe is not None:
        out.append("--target-bits writes the recipe itself; it cannot be given beside --recipe")
    if cfg.search_score == "fisher" and any(targets.experts):
        out.append("--search-score fisher carries the loss's gradient back through every block; a routed-experts "
                   "block's forward is not differentiable across ranks yet: use --search-score mse (auto's choice here)")
    if any(targets.experts):
        reducing = [c for c in cfg.candidates if c in PRESET_NAMES and required_reductions(get_scheme(c, group_size=cfg.group_size))]
        if reducing:
            out.append(f"--candidates {', '.join(reducing)}: scales with a statistic across a weight's rows "
                       "(global or per-tensor) are not scored on routed experts yet; this model has them")
    if not out:  # the budget against the least any allocation can store, before hours of scoring
        floor = _least_bits(targets, _candidate_schemes(cfg), dtype)
        if floor is not None and floor > cfg.target_bits:
            out.append(f"--target-bits {cfg.target_bits:g} is below what the cheapest candidates store on this "
                       f"model ({floor:.4f} bits per weight)")
    return out


def _least_bits(targets, schemes: dict[str, QuantScheme], dtype: torch.dtype) -> float | None:
    """The stored bits per weight of every searched weight at its cheapest allowed candidate (a lower
    bound of any allocation: fused partners may not all allow the same one), for ``dtype`` weights."""
    bits = params = 0
    for b, lins in enumerate(targets.linears):
        shapes = [(l.module.out_features, l.module.in_features) for l in lins]
        for _, ex, _ in targets.experts[b]:
            shapes += _expert_shapes(ex)
        for o, i in shapes:
            costs = [_bits(sc, o, i, dtype) for sc in schemes.values() if _allowed(sc, i)]
            if costs:
                bits += min(costs)
                params += o * i
    return bits / params if params else None


def cost_dtype(weight_dtype: torch.dtype | None) -> torch.dtype:
    """The weight dtype bits are counted for (scales are stored in it): the checkpoint's."""
    return weight_dtype or torch.bfloat16


def _candidate_schemes(cfg) -> dict[str, QuantScheme]:
    return {c: with_int_grid(get_scheme(c, group_size=cfg.group_size), cfg.grid) for c in cfg.candidates}


def _allowed(scheme: QuantScheme, in_features: int) -> bool:
    """A candidate applies to a weight whose width its groups divide (else that unit cannot take it)."""
    return not (scheme.strategy == "group" and scheme.group_size and in_features % scheme.group_size)


def _allowed_experts(scheme: QuantScheme, shapes) -> bool:
    """A candidate applies to an experts module when its groups divide both projections' widths and its
    scales follow the rows alone (no statistic across an expert's rows: NVFP4's global scale, FP8's
    per-tensor scale are not scored on experts yet)."""
    return all(_allowed(scheme, i) for _, i in shapes) and not required_reductions(scheme)


def _score_block(block, linears, experts, schemes, inputs, steps, dummy, autocast,
                 grads=None, gptq: dict | None = None) -> tuple[list[Unit], list]:
    """Every unit of the block x every candidate: the block's output error with that unit alone
    quantized (collective: every rank runs the same forwards on its own samples) -- by GPTQ under the
    ``gptq`` settings against the unit's Hessian on these inputs (summed over the ranks), else by
    RTN; ``grads``: the loss's gradient at the block's outputs, weighing the error (``fisher``).
    Units: the dense Linears grouped by the input they read, then each routed-experts module whole (a
    recipe names experts by their module: all its experts take one scheme)."""
    counting = Counting(linears, dummy[0].device) if gptq is not None else None  # Hessians, and the leaders
    leaders = counting.leaders if counting is not None else InputLeaders()

    def see(name):
        def hook(module, args, output):  # returns None: the output stands
            leaders.of(name, args[0])
        return hook

    hooks = [] if counting is not None else [lin.module.register_forward_hook(see(lin.name)) for lin in linears]
    try:
        ref = block_forward(block, inputs, steps, dummy, counters=[counting] if counting is not None else (),
                            autocast=autocast)
    finally:
        for h in hooks:
            h.remove()
        counting.remove() if counting is not None else leaders.release()
    if counting is not None:
        counting.all_reduce()  # every rank's tokens
    lead = leaders.lead
    dense: dict[str, list[Linear]] = {}
    for lin in linears:
        dense.setdefault(lead.get(lin.name, lin.name), []).append(lin)
    numel = torch.tensor([float(sum(y.numel() for y in ref))], dtype=torch.float64)
    dist.all_reduce(numel)

    def score(quantize) -> float:
        """The block's output error with ``quantize()``'s changes to the local weights (it returns the
        tensors it changed, with their saved values, to put back)."""
        saved = quantize()
        try:
            got = block_forward(block, inputs, steps, dummy, autocast=autocast)
        finally:
            for local, orig in saved:
                local.data.copy_(orig)
        err = torch.zeros(1, dtype=torch.float64)
        for i, (a, b) in enumerate(zip(got, ref)):
            d = a.double() - b.double()
            err += (d if grads is None else d * grads[i]).square().sum()
        dist.all_reduce(err)
        return float(err / numel)

    def dense_rtn(lins, scheme):
        def quantize():
            work = SimpleNamespace(linears=[Linear(l.name, l.module, l.ckpt_prefix, l.owner, scheme) for l in lins],
                                   row_offset={}, linear_stats={})
            rtn.reduce_linear_stats(work)  # collective: NVFP4's global scale over the ranks' rows
            saved = []
            for lin in lins:
                local, _ = local_box(lin.module.weight)
                saved.append((local, local.detach().clone()))
                stats = work.linear_stats.get(lin.name)
                if gptq is not None:  # this rank's rows: GPTQ's rows are solved independently of each other
                    got = counting.gptq[lead[lin.name]].quantize(local.detach(), scheme, name=lin.name, stats=stats,
                                                                 **gptq).weight
                else:
                    got = rtn.rtn_rows(local.detach(), scheme, stats, work.row_offset.get(lin.name, 0)).deq
                local.data.copy_(got)
            return saved
        return quantize

    def experts_rtn(ex, scheme):
        def quantize():  # row-local schemes only (_allowed_experts): each local expert's rows alone
            saved = []
            for pname in expert_params(ex):
                local, _ = local_box(ex._parameters[pname])
                saved.append((local, local.detach().clone()))
                for i in range(local.shape[0]):
                    if local.shape[1]:
                        local[i].data.copy_(rtn.rtn_rows(local[i].detach(), scheme).deq)
            return saved
        return quantize

    out = []
    for lins in dense.values():
        scores = {c: score(dense_rtn(lins, sc)) if all(_allowed(sc, lin.module.in_features) for lin in lins)
                  else math.inf for c, sc in schemes.items()}
        out.append(Unit([l.name for l in lins], [[l.module.out_features, l.module.in_features] for l in lins], scores))
    for eprefix, ex, _ in experts:
        shapes = _expert_shapes(ex)
        scores = {c: score(experts_rtn(ex, sc)) if _allowed_experts(sc, shapes) else math.inf
                  for c, sc in schemes.items()}
        out.append(Unit([eprefix], [list(sh) for sh in shapes], scores))
    return out, ref


def apply_search(p) -> None:
    """``--target-bits`` in the pipeline ``p``: the recipe chosen by ``run_search`` (or the one an earlier
    run of the job chose) becomes the job's assignment; the refusals are checked again for it, on every rank."""
    recipe = run_search(p)
    cfg = dataclasses.replace(p.cfg, recipe=str(recipe))
    p.assigner = cfg.assigner()
    p.targets = plan_targets(p.model, p.assigner, p.weights, p.world)
    p.observing = cfg.observes(p.assigner)
    raise_all(model_problems(p.model, cfg, p.assigner, p.algo, p.targets, p.calibrated), "the searched recipe's checks")
    p._drop_skipped()


def run_search(p) -> Path:
    """The search for the pipeline ``p`` (``sq.pipeline.blocks._Pipeline``, claimed, root filled): scores
    (resumed from ``.sq-run/search``), allocation, the recipe written to ``OUT/sq_recipe.yaml``.
    Returns the recipe's path; every rank gets the same recipe."""
    cfg, rank = p.cfg, p.rank
    state = p.run.state.root / SEARCH_DIR
    keep = p.run.state.enabled  # resume bookkeeping (off only in benchmarks)
    recipe_path = p.out / RECIPE_FILE
    done = [None]
    if rank == 0 and (state / "search.json").is_file():
        done[0] = json.loads((state / "search.json").read_text())
    dist.broadcast_object_list(done, src=0)
    if done[0] is not None:
        logger.info("--target-bits: the search finished in an earlier run; its recipe is reused")
        if rank == 0:
            write_bytes_atomic(recipe_path, done[0]["recipe_text"].encode())
        dist.barrier()
        p.search_report = done[0]["report"]
        return recipe_path

    schemes = _candidate_schemes(cfg)
    n_blocks = len(p.targets.blocks)
    have = [None]
    if rank == 0:
        have[0] = {b: json.loads((state / f"block-{b:05d}.json").read_text()) for b in range(n_blocks)
                   if (state / f"block-{b:05d}.json").is_file()}
    dist.broadcast_object_list(have, src=0)
    scored: dict[int, list[dict]] = have[0]
    if scored:
        logger.info("--target-bits: scores of %d block(s) kept from an earlier run", len(scored))
    score = search_score(cfg, p.targets)
    if len(scored) == n_blocks:  # every block scored in an earlier run: no forward is needed
        units = [Unit(**u) for b in range(n_blocks) for u in scored[b]]
    else:
        units = (_fisher_pass if score == "fisher" else _mse_pass)(p, schemes, scored, state if keep else None)
    dtype = cost_dtype(p.weight_dtype)

    def cost(u: Unit, c: str) -> int:
        return sum(_bits(schemes[c], o, i, dtype) for o, i in u.shapes)

    reached = allocate(units, cost, cfg.target_bits)
    text = recipe_text(units, cfg, reached)
    counts = {c: sum(u.params for u in units if u.choice == c) for c in schemes}
    total = sum(counts.values())
    report = {"target_bits": cfg.target_bits, "score": score,
              "score_quantizer": "gptq" if score_solver(cfg.algo) is not None else "rtn", "bits_reached": round(reached, 6), "candidates": list(cfg.candidates),
              "recipe": RECIPE_FILE, "share_of_weights": {c: round(n / total, 6) for c, n in counts.items()},
              "bits_per_weight": {c: round(sum(cost(u, c) for u in units) / total, 6) for c in schemes},
              "units": {u.key(): {"choice": u.choice, "scores": u.scores} for u in units}}
    if rank == 0:  # the recipe, then the record that the search is over (a kill between: the search reruns)
        write_bytes_atomic(recipe_path, text.encode())
        if keep:
            state.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(state / "search.json", json.dumps({"recipe_text": text, "report": report}).encode())
    dist.barrier()
    logger.info("--target-bits %g: %.4f bits per weight reached; %s; recipe %s", cfg.target_bits, reached,
                ", ".join(f"{c} {100 * n / total:.1f}% of weights" for c, n in counts.items()), recipe_path)
    p.search_report = report
    return recipe_path


def search_score(cfg, targets) -> str:
    """``--search-score auto``: ``fisher`` where every block is differentiable, ``mse`` with routed
    experts (their expert-parallel forward has no backward)."""
    if cfg.search_score != "auto":
        return cfg.search_score
    return "mse" if any(targets.experts) else "fisher"


def score_solver(algo) -> dict | None:
    """How a unit is quantized for its score: GPTQ's settings for a GPTQ-family job (the error the job
    will leave; plain GPTQ for GPTAQ), None (round-to-nearest) for the others."""
    if not isinstance(algo, GPTQConfig):
        return None
    return {f.name: getattr(algo, f.name) for f in dataclasses.fields(GPTQConfig)}


def _start(p):
    """Block 0's inputs for this rank's windows, the steps every rank runs and the dummy batch."""
    inputs = capture_block0(p.model, p.windows()[p.rank::p.world], p.device, dtype=p.compute_dtype)
    steps = math.ceil(math.ceil(p.cfg.nsamples / p.world) / CALIB_BATCH)
    return inputs, steps, inputs[0]


def _scored_block(p, b, schemes, inputs, steps, dummy, state, grads=None) -> tuple[list[Unit], list]:
    """Block ``b``'s units scored (its weights filled by the caller), their scores kept in ``state``."""
    block = p.targets.blocks[b][1]
    units, outs = _score_block(block, p.targets.linears[b], p.targets.experts[b], schemes, inputs, steps, dummy,
                               p.autocast, grads, score_solver(p.cfg.algo))
    if p.rank == 0 and state is not None:
        state.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(state / f"block-{b:05d}.json", json.dumps([u.__dict__ for u in units]).encode())
    p.run.fault_point("search", b)
    logger.info("--target-bits: block %d/%d scored (%s)", b + 1, len(p.targets.blocks),
                ", ".join(f"{u.key().rsplit('.', 1)[-1]}: " + "/".join(f"{s:.3g}" for s in u.scores.values())
                          for u in units))
    return units, outs


@contextlib.contextmanager
def _filled(p, b: int):
    """Block ``b``'s weights filled for the duration, then freed and the C heap's free pages given back to
    the OS (as after a quantized block)."""
    names = p.weights.block_names(b)
    p.weights.fill(names)
    try:
        yield
    finally:
        p.weights.free(names)
    p.trim()


def _mse_pass(p, schemes, scored: dict, state) -> list[Unit]:
    """Blocks in order on the full-precision chain; each unit's score is the block output's mean
    squared error with it quantized."""
    inputs, steps, dummy = _start(p)
    units: list[Unit] = []
    for b, (prefix, block) in enumerate(p.targets.blocks):
        with _filled(p, b):
            if b in scored:
                block_units = [Unit(**u) for u in scored[b]]
                outs = block_forward(block, inputs, steps, dummy, autocast=p.autocast)
            else:
                block_units, outs = _scored_block(p, b, schemes, inputs, steps, dummy, state)
        units += block_units
        inputs = [(y, kw) for y, (_, kw) in zip(outs, inputs)]
        dummy = inputs[0]
    return units


def _fisher_pass(p, schemes, scored: dict, state) -> list[Unit]:
    """The loss's view: the full-precision chain forward (each block's inputs kept on disk, this
    rank's own), the next-token cross entropy's gradient at the last block's outputs, then the blocks
    from the last to the first: the gradient carried back through each (``block_grads``) and each
    unit's score the block output's change with it quantized, weighted by the gradient there:
    ``sum (g * (y_q - y))^2`` (the diagonal Fisher's estimate of the loss's rise)."""
    n_blocks = len(p.targets.blocks)
    inputs, steps, dummy = _start(p)
    kws = [kw for _, kw in inputs]
    store = p.run.state.root / SEARCH_DIR / f"inputs-rank{p.rank:05d}"
    store.mkdir(parents=True, exist_ok=True)
    for b, (_, block) in enumerate(p.targets.blocks):  # the chain forward, each block's inputs kept
        _save_inputs(store / f"block-{b:05d}.safetensors", [h for h, _ in inputs])
        with _filled(p, b):
            outs = block_forward(block, inputs, steps, dummy, autocast=p.autocast)
        inputs = [(y, kw) for y, kw in zip(outs, kws)]
        dummy = inputs[0]
    total = torch.tensor([sum(h.shape[0] for h, _ in inputs) * (p.cfg.seqlen - 1)], dtype=torch.float64)
    dist.all_reduce(total)
    logger.info("--target-bits: the full-precision chain's inputs kept for %d blocks; the loss's gradient at the "
                "logits next", n_blocks)
    grads = head_grads(p.model, [h for h, _ in inputs], p.windows()[p.rank::p.world], float(total),
                       dtype=p.compute_dtype)
    per_block: dict[int, list[Unit]] = {}
    for b in reversed(range(n_blocks)):
        block = p.targets.blocks[b][1]
        inputs = [(h, kw) for h, kw in zip(_load_inputs(store / f"block-{b:05d}.safetensors", p.device), kws)]
        dummy = inputs[0]
        with _filled(p, b):
            if b in scored:
                per_block[b] = [Unit(**u) for u in scored[b]]
            else:
                per_block[b], _ = _scored_block(p, b, schemes, inputs, steps, dummy, state, grads)
            grads = block_grads(block, inputs, grads, steps, dummy, autocast=p.autocast) if b else None
        (store / f"block-{b:05d}.safetensors").unlink()
    shutil.rmtree(store, ignore_errors=True)
    return [u for b in range(n_blocks) for u in per_block[b]]


def _save_inputs(path: Path, hidden: list[torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({str(i): h.contiguous() for i, h in enumerate(hidden)}, str(path))


def _load_inputs(path: Path, device) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    got = load_file(str(path), device=str(device))
    return [got[str(i)] for i in range(len(got))]


def recipe_text(units: list[Unit], cfg, reached: float) -> str:
    """The recipe: the candidate holding most weights by default, one rule per Linear (or experts
    module) that got another."""
    counts: dict[str, int] = {}
    for u in units:
        counts[u.choice] = counts.get(u.choice, 0) + u.params
    default = max(counts, key=lambda c: counts[c]) if counts else cfg.candidates[0]
    lines = [f"# written by sq --target-bits {cfg.target_bits:g} --candidates {','.join(cfg.candidates)}:",
             f"# {reached:.4f} stored bits per weight over the quantized Linears; edit and rerun with --recipe",
             f"default: {default}", f"group_size: {cfg.group_size}", "rules:"]
    rules = [(n, u.choice) for u in units if u.choice != default for n in u.names]
    for name, choice in rules:
        lines += [f"  - match: '^{re.escape(name)}$'", f"    scheme: {choice}"]
    if not rules:
        lines[-1] = "rules: []"
    return "\n".join(lines) + "\n"
