"""What an algorithm is to the pipeline: a config type, a handler class, and a registry.

The block pipeline (``sq.pipeline.blocks``) knows no algorithm by name.  Per decoder block it
calls the handler found for the job's config type (torchao's handler-per-config)::

    observe(work)                      statistics from the block's calibration forwards
                                       (collectives inside: every rank calls it)
    solve(work, linear, w)             this rank's rows of one dense Linear -> Solved
    solve_experts(work, experts, ...)  this rank's rows of every local expert of one projection
    release(work)                      drop the block's statistics

and reads its class facts: ``calibrated`` (it runs calibration data; the quantized chain is
carried between blocks), ``fp_chain`` (it also needs the full-precision block outputs as
targets; the pipeline computes them before ``observe``, unless ``pairs_chains``: then ``observe``
runs each batch on both chains and sets them) and ``error_metric`` (what the
report's per-layer error is measured through).

A config is a frozen dataclass: its fields are the algorithm's settings, written once with
their defaults and help.  The command line flags (``add_arguments``), the Python API's keyword
arguments (``algo_config``) and the resume signature (``AlgoConfig.signature``) all derive
from the fields, so an RTN run's signature holds nothing RTN does not read.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn as nn

from sq.errors import SqError
from sq.load.fill import local_box
from sq.quant import rtn
from sq.quant.rtn import rtn_rows
from sq.quant.work import BlockWork, Cost, Solved
from sq.quant.experts import local_experts, segment_rows
from sq.quant.settings import AlgoConfig

__all__ = ["Algorithm", "register", "algorithm_names", "config_type", "make_algorithm", "algo_config", "add_arguments",
           "config_from_namespace"]


class Algorithm:
    """Handler base: RTN's behaviour, which every other algorithm refines."""

    config_type: ClassVar[type[AlgoConfig]]
    calibrated: ClassVar[bool] = False
    fp_chain: ClassVar[bool] = False
    # observe runs each batch on both chains itself and sets work.fp_out (GPTAQ: its statistics pair
    # the two chains' inputs to each Linear); else the pipeline computes fp_out before observe
    pairs_chains: ClassVar[bool] = False
    error_metric: ClassVar[str] = "weight"
    expert_parallel: ClassVar[bool] = True  # runs with --ep > 1 (experts held by index, tokens moved to them)
    # what --calib-dtype auto may trade float32 for where the probe finds the model's half dtype faster:
    # "model" (the forwards in it) or "mixed" (float32 weights and residuals, autocast matmuls; sq.probe)
    half_forwards: ClassVar[str] = "model"
    # what shrinks ``memory``'s part, for the memory preflight's refusal
    memory_knob: ClassVar[str] = "--algo rtn holds nothing per block"
    rank_dependent_memory: ClassVar[bool] = False  # ``memory`` differs by rank (a plan predicts every rank)
    sweeps: bool = False  # it runs GPTQ's column sweep (the time prediction measures a column's cost)

    def __init__(self, config: AlgoConfig):
        self.config = config

    def refusals(self, model: nn.Module, assigner, world: int, ep: int) -> list[str]:
        """Refusals that depend on the model or the launch (identical on every rank)."""
        return self.ep_refusals(ep)

    def ep_refusals(self, ep: int) -> list[str]:
        if ep > 1 and not self.expert_parallel:
            return [f"--algo {self.config.name} runs with --ep 1 (it holds each block's experts under FSDP2 while "
                    "it tunes them); expert-parallel tuning is not supported yet"]
        return []

    def observe(self, work: BlockWork) -> None:
        """Run the block on the calibration batches and keep what ``solve`` needs (collective)."""

    def solve(self, work: BlockWork, linear, w: torch.Tensor) -> Solved:
        """This rank's rows ``w [rows, in]`` of ``linear`` (a copy; the pipeline writes ``deq`` back)."""
        return rtn_rows(w, linear.scheme, work.linear_stats.get(linear.name), work.row_offset.get(linear.name, 0))

    def solve_linears(self, work: BlockWork, items: list[tuple[Any, torch.Tensor]]) -> list[Solved]:
        """Every dense target of the block: ``items`` pairs each Linear with a copy of its local rows;
        one ``Solved`` each, in order.  An algorithm may solve several together (GPTQ stacks the
        Linears that share a Hessian); by default each is one ``solve``."""
        return [self.solve(work, lin, w) for lin, w in items]

    def solve_expert(self, work: BlockWork, eprefix: str, ex: nn.Module, pname: str, e: int, w: torch.Tensor,
                     scheme) -> Solved:
        """Expert ``e``'s local rows ``w [rows, in]`` of projection ``pname`` (rows ``[r0, r0 + rows)``
        of ``param[e]``: under EP with dp > 1 the dp group splits an expert's rows).

        A scheme with cross-row statistics has them in ``work.expert_stats`` as segments of ``param[e]``'s
        rows (``sq.quant.experts.SlotStats``): each checkpoint tensor (gate, up, down) for whole /
        2-D block scales, all rows for a global scale only.  Each segment's local rows are quantized
        with its own statistics at its own row offset -- exactly what that tensor quantized alone
        gives.  Scales that follow rows come back as rows; whole / block scales as one grid per
        segment, ``[n_segments, *grid]``, the same on every rank holding rows of the expert (a rank
        holding none of a segment's rows still computes its grid from the all-reduced statistics)."""
        segs = work.expert_stats.get((eprefix, pname))
        if not segs:
            return rtn_rows(w, scheme)
        segs = segs[e - local_experts(ex).start]
        r0 = local_box(ex._parameters[pname])[1][1]
        parts = []
        for seg in segs:
            rows, at = segment_rows(w, r0, seg.lo, seg.hi)
            parts.append(rtn_rows(rows, scheme, seg.stats, at))

        def cat(ts):
            return ts[0] if len(ts) == 1 else torch.cat(ts)

        join = cat if rtn.scales_follow_rows(scheme) else torch.stack
        zp = join([s.zero_point for s in parts]) if parts[0].zero_point is not None else None
        return Solved(cat([s.q for s in parts]), join([s.scale for s in parts]), zp, cat([s.deq for s in parts]),
                      global_scale=parts[0].global_scale)

    def solve_experts(self, work: BlockWork, eprefix: str, ex: nn.Module, pname: str, local: torch.Tensor,
                      first: int, scheme) -> Iterable[Solved]:
        """Every local expert of one fused projection ``local [n, rows, in]`` (experts ``first..``);
        one ``Solved`` per expert, in order, each taken (its rows written into ``local``, its codes
        stacked: ``sq.quant.experts.take_solved``) before the next is asked for, so a generator holds one
        expert's solve at a time.  Algorithms override it to solve experts together."""
        for i in range(local.shape[0]):
            yield self.solve_expert(work, eprefix, ex, pname, first + i, local[i].detach().clone(), scheme)

    def release(self, work: BlockWork) -> None:
        """Free the block's statistics."""

    def memory(self, facts) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The buffers this algorithm adds to a block beyond the pipeline's own (the block's shard and gathered
        copy, the solve's rows, two chains, a forward's activations), as ``(bytes, count)`` pairs (the heap
        keeps the small ones: ``sq.pipeline.footprint``): those held through the block's forwards, and those
        only its solve allocates (never beside a forward's activations).  ``facts``: ``MemoryFacts``.  RTN: its
        solve's float32 working copies (the weight, its scaled and its rounded values) of the largest weight it
        solves at once -- this rank's rows of a Linear, or one expert's projection."""
        b = facts.block
        largest = max([math.ceil(o / facts.world) * i for i, o in b.linears]
                      + [2 * i * h for _, h, i in b.experts_modules], default=0)
        return [], [(4 * largest, 3)] if largest else []

    def solve_stages(self, facts) -> list[tuple[str, list[tuple[int, int]]]]:
        """The solve's buffers by stage, where they differ (``"dense"``: before any weight is solved, so beside the
        solve's copies of the rows alone; ``"end"``: with every result held); [] : ``memory``'s solve, at the end."""
        return []

    def forward_memory(self, facts) -> list[tuple[int, int]]:
        """Buffers held through the block's calibration forwards only, beside their activations, and gone before
        the solve (GPTQ: the Hessians other ranks solve, reduced away after the forward)."""
        return []

    def cost(self, facts) -> dict[str, Cost]:
        """What this algorithm does to a block, by phase (``calibrate``, ``solve``, ``forward``), for the time
        prediction (``sq.pipeline.timing``).  ``facts``: ``sq.pipeline.timing.CostFacts`` (this rank's tokens,
        the block's shapes, one calibration pass's forward as ``facts.fwd``).  RTN: elementwise passes over
        this rank's rows of every target, and a few small ops per weight solved."""
        return {"solve": rtn_cost(facts)}

    def next_inputs(self, work: BlockWork) -> list | None:
        """The next block's inputs where the algorithm computed them (AWQ on the full-precision chain: its
        capture forward's outputs); None: the pipeline's propagate forward on the quantized block."""
        return None

    def fallback_experts(self, work: BlockWork) -> list[str]:
        """Experts this rank quantized with RTN because no calibration token reached them."""
        return []

    def expert_tokens(self, work: BlockWork) -> dict[str, dict[int, tuple[int, int]]]:
        """By experts module, each expert this rank calibrated: (tokens the router sent it, tokens its statistics
        saw), over every rank's tokens; {} for an algorithm that calibrates no expert."""
        return {}

    def block_report(self, work: BlockWork) -> dict | None:
        """What the report keeps about this block (None: nothing)."""
        return None


RTN_PASSES = 40  # elementwise passes of an RTN solve over a weight in float32 (range, scale, divide, round, clamp,
# back, the casts and copies between them; fitted)
RTN_OPS = 40  # small ops per weight (or expert) an RTN solve makes


def rtn_cost(facts, passes: int = RTN_PASSES) -> Cost:
    """RTN over this rank's rows of the block's targets (``passes`` float32 passes over each)."""
    b = facts.block
    elems = (sum(i * o for i, o in b.linears) + sum(n * 3 * h * i for n, h, i in b.experts_modules)) / facts.world
    weights = len(b.linears) + sum(2 * facts.owned_experts(n) for n, _, _ in b.experts_modules)
    return Cost(mem=4 * passes * elems, ops=RTN_OPS * weights)


_BY_NAME: dict[str, type[Algorithm]] = {}
_BY_CONFIG: dict[type[AlgoConfig], type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: ``cls`` handles ``cls.config_type`` (and ``--algo cls.config_type.name``)."""
    name = cls.config_type.name
    if not name or name in _BY_NAME:
        raise ValueError(f"algorithm name {name!r} is empty or registered twice")
    _BY_NAME[name] = cls
    _BY_CONFIG[cls.config_type] = cls
    return cls


def algorithm_names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def config_type(name: str) -> type[AlgoConfig]:
    if name not in _BY_NAME:
        raise SqError(f"unknown --algo {name!r}; choose one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name].config_type


def make_algorithm(config: AlgoConfig) -> Algorithm:
    """The handler for ``config``, found by its type."""
    try:
        return _BY_CONFIG[type(config)](config)
    except KeyError:
        raise SqError(f"no algorithm is registered for {type(config).__name__}") from None


def algo_config(name: str, **settings) -> AlgoConfig:
    """``name``'s config from keyword settings (None = the default); a setting the algorithm does
    not have is refused by name, with the ones it has."""
    cls = config_type(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(k for k, v in settings.items() if k not in fields and v is not None)
    if unknown:
        have = ", ".join(sorted(fields)) or "none"
        raise SqError(f"--algo {name} has no setting {', '.join(unknown)} (its settings: {have})")
    return _build(cls, {k: v for k, v in settings.items() if k in fields and v is not None}, flags=False)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of every registered config (a field two algorithms share is one flag);
    the default is None so a flag not given means the algorithm's own default."""
    seen: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for name, cls in _BY_NAME.items():
        for f in dataclasses.fields(cls.config_type):
            if "help" in f.metadata:
                seen.setdefault(f.name, []).append((name, f))
    for fname, owners in seen.items():
        f = owners[0][1]
        who = ", ".join(n for n, _ in owners)
        default = f.default if f.default is not dataclasses.MISSING else None
        choices = f.metadata.get("choices")
        if choices:
            shown = next((k for k, v in choices.items() if v == default), default)
            parser.add_argument(_flag(fname), dest=fname, default=None, choices=tuple(choices),
                                help=f"({who}) {f.metadata['help']} (default: {shown})")
        else:
            kind = _field_type(f)
            shown = "" if default is None else f" (default: {default})"
            parser.add_argument(_flag(fname), dest=fname, default=None, type=kind, metavar=kind.__name__.upper(),
                                help=f"({who}) {f.metadata['help']}{shown}")


def _field_type(f: dataclasses.Field):
    t = str(f.type)
    if "float" in t:
        return float
    if "int" in t:
        return int
    return str


def config_from_namespace(name: str, ns: argparse.Namespace) -> AlgoConfig:
    """``--algo name``'s config from parsed flags; a flag of another algorithm is refused."""
    cls = config_type(name)
    mine = {f.name: f for f in dataclasses.fields(cls)}
    settings, problems = {}, []
    for other, ocls in _BY_NAME.items():
        for f in dataclasses.fields(ocls.config_type):
            v = getattr(ns, f.name, None)
            if v is None or "help" not in f.metadata:
                continue
            if f.name not in mine:
                problems.append(f"{_flag(f.name)} is a setting of --algo {other}, not of --algo {name}")
                continue
            choices = f.metadata.get("choices")
            settings[f.name] = choices[v] if choices else v
    if problems:
        raise SqError(sorted(set(problems)))
    return _build(cls, settings, flags=True)


def _build(cls, settings: dict, *, flags: bool) -> AlgoConfig:
    """``cls(**settings)``; a value its checks refuse (``ValueError``) becomes an ``SqError`` naming the setting
    as the user spelled it: the flag (``--gptaq-alpha``) on the command line, the keyword in the Python API."""
    try:
        return cls(**settings)
    except (TypeError, ValueError) as e:
        text = str(e)
        if flags:
            for name in sorted(settings, key=len, reverse=True):
                if text.startswith(name):
                    text = _flag(name) + text[len(name):]
                    break
        raise SqError(f"--algo {cls.name}: {text}") from None
