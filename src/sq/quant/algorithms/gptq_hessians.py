"""Where GPTQ's Hessians come from and where they go: the hooks that accumulate them in a block's calibration
forward (``Counting``), the plan of which rank solves each (``plan_owners`` from ``solve_cost``: the same on every
rank, from shapes alone), and what they and their solves hold (``hessian_bytes``, ``prepare_buffers``,
``sweep_buffers``, ``sweep_shapes``: ``sq.quant.algorithms.gptq``'s memory prediction).  docs/gptq.md."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from sq.errors import SqError
from sq.quant.forward import InputLeaders
from sq.quant.gptq import BATCH_ELEMS, GPTQ, hessian_dtype

__all__ = ["Counting", "plan_owners", "solve_cost", "hessian_bytes", "prepare_buffers", "sweep_buffers", "sweep_shapes"]


class Counting:
    """Forward hooks on Linears that feed GPTQ Hessians, switched off for dummy batches.

    Linears that read the very same input tensor (q/k/v, gate/up) share one accumulator
    (``InputLeaders``).

    ``paired`` (GPTAQ, ``sq.quant.forward.paired_forward``): while ``capturing``, a forward on the
    full-precision chain only keeps each Linear's input; the next forward, on the quantized chain's
    same tokens, accumulates ``H`` and the cross term from both.

    ``skip_last`` (a forward run only for these Hessians: ``block_forward(..., outputs=False)``): after the
    first batch, the last Linear the block calls (once) computes zeros instead of its product -- its
    Hessian is its input, and nothing the Hessians read comes after it (a dense block's down_proj: a
    quarter of its matmuls); ``last``: that Linear's name where an earlier block of the same kind showed
    it (``learned`` is what this block's first batch showed), so it computes zeros from the first batch.
    """

    def __init__(self, linears, device, paired: bool = False, skip_last: bool = False, last: str | None = None):
        self.on = True
        self.device = device
        self.paired = paired
        self.capturing = False
        self.fp_in: dict[str, torch.Tensor] = {}
        self.leaders = InputLeaders()
        self.gptq: dict[str, GPTQ] = {}
        self.modules = {l.name: l.module for l in linears}
        self.calls: list[str] | None = [] if skip_last and not paired else None  # the first batch's, in order
        self.skipped: torch.nn.Module | None = None
        self.learned: str | None = None
        self.handles = [l.module.register_forward_hook(self._hook(l.name)) for l in linears]
        if self.calls is not None and last is not None:
            self.calls = None
            self._skip(last)

    def _hook(self, name):
        def hook(module, args, output):
            x = args[0]
            if self.capturing:
                if self.paired:
                    self.fp_in[name] = x
                return
            if self.calls is not None and self.on:
                self.calls.append(name)
            lead = self.leaders.of(name, x)
            if lead == name and name not in self.gptq:
                self.gptq[name] = GPTQ(module.in_features, device=self.device)
            if self.on and lead == name:
                if self.paired and name not in self.fp_in:
                    raise SqError(f"{name}: not called in the block's forward on the full-precision chain, "
                                  "so GPTAQ has no inputs to pair with the quantized chain's")
                self.gptq[name].add_batch(x, self.fp_in[name] if self.paired else None)
        return hook

    def all_reduce(self) -> None:
        """Every rank's tokens in each accumulator on every rank (``H``, GPTAQ's cross term, the sample count), for
        a caller that solves every Linear's rows where they are (the bit-budget search's scoring)."""
        for g in self.gptq.values():
            n = torch.tensor([g.nsamples], dtype=torch.int64, device=self.device)
            dist.all_reduce(g.H)
            if g.cross is not None:
                dist.all_reduce(g.cross)
            dist.all_reduce(n)
            g.nsamples = int(n.item())

    def reduce_to_owners(self, world: int, rank: int) -> None:
        """Every rank's tokens in each accumulator (``H``, GPTAQ's cross term) on the one rank that solves it and
        nowhere else: a reduce, not an all-reduce, so a rank holds only the Hessians it owns after the forward
        (DeepSeek-V3's o_proj alone is 1 GiB) and sends each one once.  ``owner`` is ``owners``' plan from the
        shapes (the same on every rank; the accumulators in the same order everywhere); the sample counts are
        summed on every rank in one small all-reduce.  One rank: its own sums, nothing to combine."""
        gs = list(self.gptq.items())
        rows = dict.fromkeys(self.gptq, 0)
        for name, lead in self.leaders.lead.items():
            if lead in rows:
                rows[lead] += self.modules[name].out_features
        owners = plan_owners([solve_cost(g.in_features, rows[lead]) for lead, g in gs], world)
        for (_, g), o in zip(gs, owners):
            g.owner = o
        if world == 1 or not gs:
            return
        n = torch.tensor([g.nsamples for _, g in gs], dtype=torch.int64, device=self.device)
        dist.all_reduce(n)
        for (_, g), o, k in zip(gs, owners, n.tolist()):
            dist.reduce(g.H, dst=o)
            if g.cross is not None:
                dist.reduce(g.cross, dst=o)
            g.nsamples = k
            if rank != o:
                g.free()

    def release(self) -> None:
        """Drop the full-precision pass's inputs (a batch's are held until its quantized pass is done)."""
        self.fp_in.clear()

    def first_pass_done(self) -> None:
        """The first batch is through: the last Linear it called (once) computes zeros from now on."""
        calls, self.calls = self.calls, None
        if calls and calls.count(calls[-1]) == 1:
            self.learned = calls[-1]
            self._skip(calls[-1])

    def _skip(self, name: str) -> None:
        m = self.skipped = self.modules[name]
        m.forward = functools.partial(_zeros, m.out_features)  # (an instance attribute: remove() drops it)

    def get(self, name: str) -> GPTQ | None:
        return self.gptq.get(self.leaders.lead.get(name, ""))

    def remove(self):
        for h in self.handles:
            h.remove()
        if self.skipped is not None:
            del self.skipped.forward
            self.skipped = None
        self.leaders.release()


def _zeros(out_features: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A Linear's output shape, computed by nothing (``Counting.first_pass_done``)."""
    return x.new_zeros(*x.shape[:-1], out_features)


def hessian_bytes(width: int) -> int:
    """Bytes per element of a dense Hessian ``width`` wide (``sq.quant.gptq.hessian_dtype``)."""
    return torch.empty((), dtype=hessian_dtype(width)).element_size()


def prepare_buffers(width: int, k: int, hb: int) -> list[tuple[int, int]]:
    """The solve's Hessian-side buffers while the last of ``k`` Hessians ``width`` wide (``hb`` bytes an element)
    is prepared (``GPTQ._prepare``), beside the sums: the factors of the ``k - 1`` before it (float32), its
    permuted copy, the inverse factor written beside it and ``_lower_inverse_into``'s half-size product and
    Schur complement; a float64 Hessian's float32 copy and its flipped factor besides."""
    one = width * width
    bufs = [(4 * one, k - 1), (hb * one, 1), (4 * one, 1), (one, 2)]
    return bufs + ([(4 * one, 2)] if hb == 8 else [])


def sweep_buffers(sweeps) -> list[tuple[int, int]]:
    """A column sweep's rows (``sweeps``' ``(width, solves, elements)``, the largest): the float32 copy and its
    transposed, permuted copy (the sweep's buffer), the codes and their transposed copy, the dequantized rows in
    float32 and in the weight's dtype."""
    e = max((e for _, _, e in sweeps), default=0)
    return [(4 * e, 2), (2 * e, 2), (e, 1)] if e else []


def sweep_shapes(stacks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The column sweeps ``quantize_together`` makes of stacks ``(width, rows)`` (of one scheme): those of one
    width side by side, up to ``BATCH_ELEMS`` elements a sweep; ``(width, stacks, elements)`` each."""
    out: dict[int, list[list[int]]] = {}
    for n, rows in stacks:
        chunks = out.setdefault(n, [[0, 0]])
        if chunks[-1][0] and chunks[-1][1] + n * rows > BATCH_ELEMS:
            chunks.append([0, 0])
        chunks[-1][0] += 1
        chunks[-1][1] += n * rows
    return [(n, k, e) for n, chunks in out.items() for k, e in chunks]


def solve_cost(cols: int, rows: int) -> float:
    """A GPTQ solve's seconds on one CPU thread, roughly: the damped inverse factor (~cols^3), the
    column loop's Python-bound steps (~cols) and its updates (~rows * cols^2), fitted on SmolLM2's
    shapes (576 x 1536: 0.06 + 0.05 s; 3072 x 576: 0.003 + 0.02 + 0.02 s).  Only its ratios matter
    (``owners``)."""
    return 1.6e-11 * cols**3 + 3.3e-5 * cols + 2e-11 * rows * cols**2


def plan_owners(costs: list[float], world: int) -> list[int]:
    """A rank for each job: largest first onto the least loaded rank (the lowest on ties)."""
    load = [0.0] * world
    owners = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: -costs[k]):
        r = min(range(world), key=lambda r: load[r])
        owners[k] = r
        load[r] += costs[k]
    return owners
