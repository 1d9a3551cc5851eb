"""GPTQ's stacks solved whole, each by one rank (``GPTQAlgorithm._solve_owned``), on real gloo ranks.

Every rank holds its FSDP2 rows of each Linear; a stack's rows are gathered onto the rank the plan
names, solved there and scattered back.  Checked against the one-rank solve of the whole weight (the
bits must not change with the world size or the plan), for int and fp4 schemes, a Linear with fewer
rows than ranks, and an error on one solver, which every rank must raise (none left waiting).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from harness import run_ranks
from sq.errors import SqError
from sq.parallel.collectives import dim0_counts
from sq.quant.work import BlockWork
from sq.quant.algorithms.gptq import GPTQAlgorithm
from sq.quant.algorithms.gptq_hessians import plan_owners as _owners, solve_cost as _solve_cost
from sq.quant.gptq import GPTQ, GPTQConfig
from sq.formats.schemes import get_scheme

COLS = 64


def _hessian(seed: int, nan: bool = False) -> GPTQ:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, COLS, generator=g) * (torch.rand(COLS, generator=g) + 0.1)
    H = (x.T @ x).double()
    if nan:
        H[3, 5] = float("nan")
    return GPTQ.from_hessian(H, 256)


def _job(scheme: str, nan: bool = False):
    """Four Linears: q/k share one Hessian (one stack), o another, a 1-row Linear a third."""
    s = get_scheme(scheme, 16 if scheme.startswith("NVFP4") else 32)
    heights = {"q": 24, "k": 8, "o": 40, "tiny": 1}
    gens = {"q": 0, "k": 0, "o": 1, "tiny": 2}
    hs = {0: _hessian(10), 1: _hessian(11, nan=nan), 2: _hessian(12)}
    torch.manual_seed(5)
    lins = [SimpleNamespace(name=n, module=nn.Linear(COLS, h, bias=False, dtype=torch.bfloat16), scheme=s)
            for n, h in heights.items()]
    counting = SimpleNamespace(get=lambda name: hs[gens[name]])
    return lins, counting


def _solve(rank: int, world: int, scheme: str, nan: bool = False):
    lins, counting = _job(scheme, nan)
    work = BlockWork(0, "b", None, lins, [], [], [], 0, None, torch.device("cpu"), rank, world, 0, 0, False)
    work.state["counting"] = counting
    items = []
    for lin in lins:
        counts = dim0_counts(lin.module.out_features, world)
        lo = sum(counts[:rank])
        items.append((lin, lin.module.weight.detach()[lo:lo + counts[rank]].clone()))
    algo = GPTQAlgorithm(GPTQConfig(actorder=True))
    try:
        return algo.solve_linears(work, items)
    except SqError as e:
        return ("SqError", e.problems)


def _rows(t, counts, rank):
    lo = sum(counts[:rank])
    return t[lo:lo + counts[rank]]


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b))


def _compare(rank: int, world: int, scheme: str):
    """This rank's owned results against the one-rank solve of the whole weights, computed here
    too (world 1 runs no collective): every rank's dequantized rows, and the writer's whole codes,
    scales and global scale.  Returns the differences by name, each Linear's writer and the rows
    of every solve this rank ran (tensors stay in the rank)."""
    calls = []
    orig = GPTQ._setup  # every solve, alone or swept with others (quantize_together), is set up once

    def counted(self, p, *a, **k):
        calls.append(p.w.shape[0])
        return orig(self, p, *a, **k)

    GPTQ._setup = counted
    try:
        got = _solve(rank, world, scheme)
    finally:
        GPTQ._setup = orig
    one = _solve(0, 1, scheme)
    lins, _ = _job(scheme)
    bad, writers = [], []
    for lin, g, ref in zip(lins, got, one):
        counts = dim0_counts(lin.module.out_features, world)
        writers.append(g.writer)
        if not _same(g.deq, _rows(ref.deq, counts, rank)):
            bad.append(f"{lin.name} deq")
        if rank == g.writer:
            for k, (a, b) in enumerate(zip((*g.whole, g.global_scale), (ref.q, ref.scale, ref.zero_point,
                                                                          ref.global_scale))):
                if not _same(a, b):
                    bad.append(f"{lin.name} whole {k}")
        elif g.q is not None or g.whole is not None:
            bad.append(f"{lin.name}: codes away from the writer")
    return bad, writers, sorted(calls)


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "NVFP4A16"])
def test_owned_solves_equal_the_one_rank_solve(scheme):
    for world in (2, 3):
        every = run_ranks(_compare, world, scheme, timeout=120)
        assert [bad for bad, _, _ in every] == [[]] * world
        assert all(w == every[0][1] for _, w, _ in every)  # one plan on every rank
        assert every[0][1][0] == every[0][1][1]  # q and k: one stack, one writer
        # each stack solved once, whole (q + k: 32 rows, o: 40, tiny: 1), not once per rank over its rows
        assert sorted(n for _, _, calls in every for n in calls) == [1, 32, 40], every


def test_an_owner_failure_is_raised_on_every_rank():
    """o's Hessian holds a NaN: its solver refuses it, and every rank raises the same refusal
    (the rest would otherwise wait in the scatter for it)."""
    every = run_ranks(_solve, 2, "W4A16", True, timeout=120)
    for got in every:
        assert got[0] == "SqError" and any("o" in p and "non-finite" in p for p in got[1]), got


def test_owner_plan_largest_first_onto_the_least_loaded_rank():
    assert _owners([1.0, 5.0, 2.0, 2.0], 2) == [1, 0, 1, 1]  # 5 -> r0; 2 -> r1; 2 -> r1 (2 < 5); 1 -> r1
    assert _owners([3.0, 3.0], 4) == [0, 1]
    assert _owners([], 2) == []
    # the 1536-wide down projection outweighs a 576-wide stack of any height at SmolLM2's shapes
    assert _solve_cost(1536, 576) > _solve_cost(576, 3072) > _solve_cost(576, 576)
