"""Every collective on tensor rows that sq runs: one module, so algorithms see local tensors.

A rank holds a *row shard* of a tensor: FSDP2 gives it dim-0 rows (``dim0_counts``), EP gives it
rows of its experts (dim 1 of ``[E_local, rows, cols]`` within the dp group), a calibration
forward holds its own tokens.  The helpers here turn shards into whole tensors and back:

=============================  =============================================  ======================
helper                         result                                         used by
=============================  =============================================  ======================
``dim0_counts(n, world)``      every rank's dim-0 shard size under FSDP2      SignRound, the writer
``row_counts(n, group)``       every rank's size, when only the rank knows    token gathers
``gather_rows(t, counts, d)``  the whole tensor on rank ``d``, None elsewhere  the writer, GPTQ
``scatter_rows(ts, ...)``      back: each rank its rows of tensors held by one  GPTQ's solvers
``all_gather_rows(t, ...)``    the whole tensor on every rank                 EP forward, experts
``all_gather_rows_autograd``   the same, differentiable (sum of grads back)   SignRound
``full_tensor(t)``             a DTensor's whole tensor, a plain tensor as is the writer
=============================  =============================================  ======================

Two rules hold for all of them:

- **Any dtype.**  Tensors travel as their bytes (``uint8``), so int8/int32 packed weights,
  float8 and bfloat16 cross gloo, which has no float8 (and no reduction is ever needed).
- **Uneven shards, one collective.**  Shards are padded to the largest count, gathered with one
  equal-size collective (what NCCL requires) and cut back, so a rank with 0 rows is fine.

The results are bit-identical to the unsharded tensor: bytes are copied, never converted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["all_gather_rows", "all_gather_rows_autograd", "dim0_counts", "full_tensor", "gather_rows",
           "row_counts", "scatter_rows"]


def dim0_counts(n: int, world: int) -> list[int]:
    """Sizes of FSDP2's dim-0 shards of ``n`` rows over ``world`` ranks.

    FSDP2 splits with ``torch.chunk``: ``ceil(n / world)`` rows each, the last ones shorter or
    empty (``n=7, world=3 -> [3, 3, 1]``; ``n=2, world=3 -> [1, 1, 0]``).
    """
    counts = [len(c) for c in torch.arange(n).chunk(world)]
    return counts + [0] * (world - len(counts))


def row_counts(n: int, group=None, device: torch.device | str = "cpu") -> list[int]:
    """Every rank's ``n`` (its number of rows), in group-rank order: one small all-gather.

    For shards whose sizes only their owner knows (a calibration batch's tokens).  ``device``
    must suit the backend (a CUDA device under NCCL).
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [int(c) for c in every]


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor: a DTensor's ``full_tensor()`` (a collective), any other tensor as it is.  A DTensor with
    no elements (a zero-width Linear's weight) is its empty global shape, no collective (every rank knows it)."""
    if not isinstance(t, DTensor):
        return t
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
    return t.full_tensor()


# ---------------------------------------------------------------- bytes on the wire


def _as_bytes(t: Tensor) -> Tensor:
    """``t [*shape]`` -> ``[*shape, itemsize]`` uint8 (a view of a contiguous copy): any dtype, any ndim."""
    return t.contiguous().unsqueeze(-1).view(torch.uint8)


def _from_bytes(b: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`_as_bytes`: ``[*shape, itemsize]`` uint8 -> ``[*shape]`` of ``dtype``."""
    return b.contiguous().view(dtype).squeeze(-1)


def _padded(b: Tensor, dim: int, pad: int) -> Tensor:
    """``b`` with ``dim`` zero-padded to ``pad`` (``b`` itself if it is already that long)."""
    if b.shape[dim] == pad:
        return b
    shape = list(b.shape)
    shape[dim] = pad
    buf = b.new_zeros(shape)
    buf.narrow(dim, 0, b.shape[dim]).copy_(b)
    return buf


def _check_count(t: Tensor, counts: Sequence[int], dim: int, group) -> None:
    rank = dist.get_rank(group)
    if len(counts) != dist.get_world_size(group) or t.shape[dim] != counts[rank]:
        raise ValueError(f"rank {rank} holds {t.shape[dim]} rows on dim {dim}, counts say {list(counts)}")


# ---------------------------------------------------------------- gathers


def gather_rows(t: Tensor, counts: Sequence[int], dst: int, group=None) -> Tensor | None:
    """Gather dim-0 shards onto one rank: the whole tensor on ``dst``, None on every other rank.

    ``t [counts[rank], *row]`` (any dtype; 0 rows is fine) -> ``[sum(counts), *row]`` on ``dst``,
    which is a global rank (as ``torch.distributed.gather``'s).  The writer of a tensor uses it:
    only that rank ever holds the whole tensor.
    """
    _check_count(t, counts, 0, group)
    rank, world = dist.get_rank(), dist.get_world_size(group)
    buf = _padded(_as_bytes(t), 0, max(counts))  # [pad, *row, itemsize]
    parts = [torch.empty_like(buf) for _ in range(world)] if rank == dst else None
    dist.gather(buf, parts, dst=dst, group=group)
    if rank != dst:
        return None
    return _from_bytes(torch.cat([p[:n] for p, n in zip(parts, counts)]), t.dtype)


def scatter_rows(ts: Sequence[Tensor] | None, counts: Sequence[Sequence[int]], src: int,
                 specs: Sequence[tuple[torch.dtype, tuple[int, ...]]], group=None,
                 device: torch.device | str = "cpu") -> list[Tensor]:
    """The inverse of :func:`gather_rows` for several tensors in one collective: ``src`` holds whole
    tensors ``ts[k] [sum(counts[k]), *specs[k][1]]`` of dtype ``specs[k][0]`` (the other ranks pass
    None); every rank gets its own rows ``[counts[k][rank], *specs[k][1]]`` of each, new tensors.

    Every rank must know the specs (dtype and row shape of each tensor): the bytes of rank r's rows
    of every tensor travel as one padded buffer.  ``src`` is a global rank, as ``gather_rows``'s
    ``dst``; ``device``: where the buffers live on ranks that hold no tensor (the backend's device).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    itemsize = [torch.empty((), dtype=dt).element_size() for dt, _ in specs]
    row_bytes = [sz * math.prod(shape) for sz, (_, shape) in zip(itemsize, specs)]
    if len(counts) != len(specs) or any(len(c) != world for c in counts):
        raise ValueError(f"scatter_rows: {len(specs)} specs, counts {[list(c) for c in counts]} for {world} ranks")
    per_rank = [sum(c[r] * rb for c, rb in zip(counts, row_bytes)) for r in range(world)]
    pad = max(per_rank)
    if ts is not None:
        device = ts[0].device if ts else device
    recv = torch.empty(pad, dtype=torch.uint8, device=device)
    parts = None
    if rank == src:
        if ts is None or len(ts) != len(specs):
            raise ValueError("scatter_rows: the source rank must pass one tensor per spec")
        parts = []
        starts = [0] * len(ts)
        for r in range(world):
            buf = torch.zeros(pad, dtype=torch.uint8, device=device)
            at = 0
            for k, t in enumerate(ts):
                n = counts[k][r]
                b = _as_bytes(t[starts[k]:starts[k] + n]).reshape(-1)
                buf[at:at + b.numel()].copy_(b)
                at += b.numel()
                starts[k] += n
            parts.append(buf)
    dist.scatter(recv, parts, src=src, group=group)
    out, at = [], 0
    for c, rb, (dt, shape), sz in zip(counts, row_bytes, specs, itemsize):
        n = c[rank] * rb
        out.append(_from_bytes(recv[at:at + n].clone().view(c[rank], *shape, sz), dt))  # own, aligned storage
        at += n
    return out


def all_gather_rows(t: Tensor, counts: Sequence[int] | None = None, *, dim: int = 0, group=None) -> Tensor:
    """All-gather uneven shards along ``dim``: every rank gets the whole tensor, shards in rank order.

    ``t [..., counts[rank], ...]`` (``counts[rank]`` at ``dim``; any dtype, 0 rows is fine) ->
    ``[..., sum(counts), ...]``.  ``counts`` (one per rank of ``group``) are exchanged first when
    not given (:func:`row_counts`).  A group of one returns ``t`` itself.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return t
    dim = dim % t.ndim
    if counts is None:
        counts = row_counts(t.shape[dim], group, t.device)
    _check_count(t, counts, dim, group)
    buf = _padded(_as_bytes(t), dim, max(counts))  # [..., pad, ..., itemsize]
    parts = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(parts, buf, group=group)
    return _from_bytes(torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, counts)], dim=dim), t.dtype)


class _AllGatherRows(torch.autograd.Function):
    """Forward: :func:`all_gather_rows` on dim 0.  Backward: the gradient of the whole tensor,
    summed over ranks (every rank's loss used every rank's rows), cut to this rank's rows."""

    @staticmethod
    def forward(ctx, local: Tensor, counts: Sequence[int], group) -> Tensor:
        rank = dist.get_rank(group)
        ctx.lo = sum(counts[:rank])
        ctx.hi = ctx.lo + counts[rank]
        ctx.group = group
        if len(counts) == 1:
            return local
        return all_gather_rows(local, counts, group=group)  # [sum(counts), ...]

    @staticmethod
    def backward(ctx, grad: Tensor):
        if dist.get_world_size(ctx.group) > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)  # the sum of every rank's gradient of the whole
        return grad[ctx.lo:ctx.hi], None, None


def all_gather_rows_autograd(local: Tensor, counts: Sequence[int], group=None) -> Tensor:
    """Differentiable all-gather of dim-0 shards: ``local [counts[rank], ...]`` -> ``[sum(counts), ...]``.

    Each rank runs the whole tensor in its own forward (its own data), so the gradient of its
    shard is the sum over ranks of the whole gradient's rows ``[lo, hi)`` of that shard: the
    backward all-reduces the gradient (in its dtype) and keeps this rank's rows.  Every rank of
    ``group`` must call it, in the same order, forward and backward.
    """
    return _AllGatherRows.apply(local, list(counts), group)
