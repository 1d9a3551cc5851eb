"""sq.parallel.collectives on real gloo ranks: every gather (and the scatter back) against the unsharded
tensor, bit for bit.

Uneven shards (7 rows over 3 ranks, a rank with 0 rows, hand-picked counts), dtypes gloo cannot
reduce or does not know (float8, packed int32, bfloat16 with NaN payloads: the tensors are random
bytes), dim 0 and dim 1, a subgroup, and the autograd gather's summed-gradient backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from sq.parallel.collectives import (all_gather_rows, all_gather_rows_autograd, dim0_counts, full_tensor,
                                     gather_rows, row_counts, scatter_rows)

DTYPES = (torch.int32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.int64, torch.bool)


def test_dim0_counts_are_fsdp2_chunks():
    assert dim0_counts(7, 3) == [3, 3, 1]
    assert dim0_counts(2, 3) == [1, 1, 0]
    assert dim0_counts(6, 4) == [2, 2, 2, 0]
    assert dim0_counts(0, 2) == [0, 0]
    assert dim0_counts(5, 1) == [5]
    for n, world in ((7, 3), (9, 4), (1, 2)):
        assert dim0_counts(n, world) == [len(c) for c in torch.arange(n).chunk(world)] + \
            [0] * (world - len(torch.arange(n).chunk(world)))


def _random(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaNs, infinities, any bit pattern), the same on every rank."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed)).bool()
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, item), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).squeeze(-1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().unsqueeze(-1).view(torch.uint8), b.contiguous().unsqueeze(-1).view(torch.uint8))


def _cases(world: int) -> list[list[int]]:
    """Row counts per rank: FSDP2's splits (an empty tail rank among them) and hand-picked ones."""
    cases = [dim0_counts(7, world), dim0_counts(max(world - 1, 1), world), dim0_counts(0, world)]
    cases.append([0] + [r + 2 for r in range(world - 1)])  # rank 0 empty
    cases.append([5] * world)  # even: no padding
    return cases


def _shard(full: torch.Tensor, counts: list[int], rank: int, dim: int = 0) -> torch.Tensor:
    lo = sum(counts[:rank])
    return full.narrow(dim, lo, counts[rank]).clone()


def _check_gathers(rank: int, world: int) -> None:
    seed = 0
    for counts in _cases(world):
        assert row_counts(counts[rank]) == counts
        for dtype in DTYPES:
            seed += 1
            # dim 0: [sum(counts), 6]; 1-D [sum(counts)]
            for row in ((6,), ()):
                full = _random((sum(counts), *row), dtype, seed)
                local = _shard(full, counts, rank)
                assert _same(all_gather_rows(local, counts), full), (counts, dtype, row)
                assert _same(all_gather_rows(local), full), (counts, dtype, row)  # counts exchanged
                for dst in range(world):
                    got = gather_rows(local, counts, dst)
                    if rank == dst:
                        assert got is not None and _same(got, full), (counts, dtype, row, dst)
                    else:
                        assert got is None
            # dim 1: experts [E_local=2, rows, 5] with rows sharded (EP's dp gather)
            full = _random((2, sum(counts), 5), dtype, seed + 1000)
            local = _shard(full, counts, rank, dim=1)
            assert _same(all_gather_rows(local, counts, dim=1), full), (counts, dtype, "dim 1")
            assert _same(all_gather_rows(local, dim=1), full), (counts, dtype, "dim 1")
            assert _same(all_gather_rows(local, dim=-2), full), (counts, dtype, "dim -2")
    # a rank whose counts disagree with its tensor refuses before any collective (no hang)
    with pytest.raises(ValueError, match="counts say"):
        all_gather_rows(torch.zeros(3, 2), [2] * world) if world > 1 else gather_rows(torch.zeros(3, 2), [2], 0)
    with pytest.raises(ValueError, match="counts say"):
        gather_rows(torch.zeros(3, 2), [2] * world, 0)
    assert full_tensor(local) is local


def _check_scatter(rank: int, world: int) -> None:
    """scatter_rows: several tensors of different dtypes, row shapes and counts from one rank, each
    rank its own rows bit for bit (odd byte sizes back to back: every piece lands aligned)."""
    cases = _cases(world)
    for src in range(world):
        specs = [(dt, row) for dt, row in zip(DTYPES, ((6,), (), (3, 2), (5,), (1,), (7,)))]
        counts = [cases[k % len(cases)] for k in range(len(specs))]
        fulls = [_random((sum(c), *row), dt, 50 + k) for k, (c, (dt, row)) in enumerate(zip(counts, specs))]
        got = scatter_rows(fulls if rank == src else None, counts, src, specs)
        assert len(got) == len(fulls)
        for k, (g, f, c) in enumerate(zip(got, fulls, counts)):
            assert _same(g, _shard(f, c, rank)), (src, k, c)
            assert g.untyped_storage().nbytes() >= g.numel() * g.element_size()
        # one tensor per rank (counts of ones): what every rank must receive whole, e.g. a global scale
        whole = _random((3,), torch.float32, 99)
        (one,) = scatter_rows([whole.unsqueeze(0).expand(world, 3)] if rank == src else None, [[1] * world], src,
                              [(torch.float32, (3,))])
        assert _same(one[0], whole)
    with pytest.raises(ValueError, match="specs"):
        scatter_rows(None, [[1] * (world + 1)], 0, [(torch.float32, ())])


def _check_subgroup(rank: int, world: int) -> None:
    """A group of the last two ranks (EP's dp/ep groups are subgroups); ``dst`` stays a global rank."""
    members = [world - 2, world - 1]
    group = dist.new_group(members)
    if rank not in members:
        return
    g = members.index(rank)
    counts = [3, 0]
    full = _random((3, 4), torch.float8_e4m3fn, 7)
    local = _shard(full, counts, g)
    assert row_counts(local.shape[0], group) == counts
    assert _same(all_gather_rows(local, counts, group=group), full)
    assert _same(all_gather_rows(local, group=group), full)
    got = gather_rows(local, counts, members[1], group=group)
    assert (got is None) == (rank != members[1]) and (got is None or _same(got, full))
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mine = _shard(w, counts, g).requires_grad_()
    out = all_gather_rows_autograd(mine, counts, group=group)
    assert torch.equal(out, w)
    (out * (g + 1)).sum().backward()
    assert torch.equal(mine.grad, torch.full_like(mine, 3.0))  # 1 + 2, summed within the group only


def _check_autograd(rank: int, world: int) -> None:
    """Forward = the whole tensor; the gradient of each rank's rows = the sum over ranks of that slice."""
    for counts in _cases(world):
        n = sum(counts)
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.arange(n * 4, dtype=dtype).reshape(n, 4)  # small integers: every sum is exact
            local = _shard(w, counts, rank).requires_grad_()
            out = all_gather_rows_autograd(local, counts)
            assert out.shape == (n, 4) and torch.equal(out, w), (counts, dtype)
            # each rank's own upstream gradient; the expected one is their sum, cut to this rank's rows
            grads = [torch.arange(n * 4, dtype=dtype).reshape(n, 4) % 5 + r for r in range(world)]
            (out * grads[rank]).sum().backward()
            expect = _shard(torch.stack(grads).sum(0), counts, rank)
            assert local.grad is not None and local.grad.dtype == dtype, (counts, dtype)
            assert torch.equal(local.grad, expect), (counts, dtype, local.grad, expect)


def _all(rank: int, world: int) -> None:
    _check_gathers(rank, world)
    _check_scatter(rank, world)
    _check_autograd(rank, world)
    if world >= 2:
        _check_subgroup(rank, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_collectives_match_the_unsharded_tensor(world):
    run_ranks(_all, world, timeout=300)
