"""GPTQ in the pipeline: Hessians from the block's calibration forward, each reduced to the rank that solves it
(``sq.quant.algorithms.gptq_hessians``); the Linears sharing a Hessian solved as one stack, each stack whole by
that rank, which writes it (experts: at their owner, over the rows it holds).  The maths: ``sq.quant.gptq``."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from sq.anatomy import decoder_blocks, is_experts_module
from sq.errors import SqError
from sq.parallel.collectives import dim0_counts, gather_rows, scatter_rows
from sq.quant.algorithms.base import Algorithm, register, rtn_cost
from sq.quant import rtn
from sq.quant.rtn import rtn_rows
from sq.quant.work import BlockWork, Cost, Solved
from sq.quant.experts import ExpertCalibration, local_experts
from sq.quant.forward import block_forward, paired_forward
from sq.quant.served import ServedActivations
from sq.formats import primitives
from sq.formats.specs import spec_for
from sq.quant.experts import whole_rows_stats
from sq.quant.algorithms.gptq_hessians import (Counting, hessian_bytes, plan_owners, prepare_buffers, solve_cost,
                                               sweep_buffers, sweep_shapes)
from sq.quant.gptq import GPTAQConfig, GPTQ, GPTQConfig, Problem, quantize_together
from sq.quant.recipe import scheme_tag

# Stacked expert solves: at most this many weight elements per sweep (64 MiB of float32 rows;
# a sweep holds a few copies of them).  Larger stacks amortize the per-column loop further.
EXPERT_STACK_ELEMS = 1 << 24
EXPERT_SOLVE_OPS = 2000  # an expert's solve beyond its sweep: its rows copied, statistics, results (time prediction)
# scheme strategies GPTQ solves: a row's scales depend on that row alone (NVFP4's global scale
# is the all-reduced statistic the pipeline's reduce stage hands over)


@register
class GPTQAlgorithm(Algorithm):
    config_type = GPTQConfig
    calibrated = True
    error_metric = "output (through H)"
    rank_dependent_memory = True  # each stack is solved by its owner
    sweeps = True
    memory_knob = ("GPTQ's float32 Hessians and its solve grow with the square of each Linear's input width: each "
                   "dense one is solved on one rank (more ranks spread them), an MoE's expert Hessians split by --ep "
                   "over more ranks; --algo rtn holds none")

    def __init__(self, config):
        super().__init__(config)
        self._last_linear: dict[tuple, str] = {}  # a kind of block -> the Linear its forward calls last (observe)

    def refusals(self, model, assigner, world: int, ep: int) -> list[str]:
        """GPTQ's column sweep quantizes each row against scales of that row: per-channel and per-group
        schemes (int, FP8 per channel, NVFP4 under its all-reduced global scale, MXFP4/MXFP8) are
        solved; per-tensor and 2-D block scales (FP8, FP8_BLOCK) are refused."""
        bad = set()
        for prefix, block in decoder_blocks(model):
            for n, m in block.named_modules():
                if isinstance(m, torch.nn.Linear) or is_experts_module(m):
                    s = assigner.assign(f"{prefix}.{n}")
                    if s is not None and not s.row_local:
                        bad.add((s.name, scheme_tag(s), s.strategy))
        return [f"--algo {self.config.name} solves per-channel and per-group schemes (integer, FP8 per channel, NVFP4, MXFP4, "
                f"MXFP8); scheme {n} ({t}) has {'per-tensor' if st == 'tensor' else '2-D block'} scales, which "
                "it does not support (use --algo rtn for it)" for n, t, st in sorted(bad)]

    def observe(self, work: BlockWork) -> None:
        """Dense Linears: Hessians summed over every rank's tokens; experts: at their owner."""
        # a block without experts: its calibration forward's outputs are never read (the next block's
        # inputs come from the quantized block), so its last Linear may skip its product; the blocks of
        # one kind (class and Linears) call theirs alike, so the first one of a kind shows it
        kind = (type(work.block), tuple(l.name[len(work.prefix):] for l in work.linears))
        last = self._last_linear.get(kind)
        counting = Counting(work.linears, work.device, paired=self.pairs_chains, skip_last=not work.experts,
                            last=None if last is None else work.prefix + last)
        calibs = [ExpertCalibration(ex, work.calibrate_all_experts, work.device, paired=self.pairs_chains)
                  for _, ex, _ in work.experts]
        # --served-activations: the quantized chain's inputs rounded as served (GPTAQ's fp pass is not)
        served = ServedActivations(work.linears if work.served_activations else [], work.acts.absmax,
                                   active=lambda: not counting.capturing)
        if self.pairs_chains:
            work.fp_out = paired_forward(work.block, work.fp_inputs, work.inputs, work.steps, work.dummy,
                                         counters=[counting, *calibs], autocast=work.autocast)
        else:
            block_forward(work.block, work.inputs, work.steps, work.dummy, counters=[counting, *calibs],
                          outputs=False)
        if counting.learned is not None:
            self._last_linear[kind] = counting.learned[len(work.prefix):]
        counting.remove()
        served.remove()
        for c in calibs:
            c.remove()
        counting.reduce_to_owners(work.world, work.rank)
        for g in counting.gptq.values():
            g.report_dtype = rtn.err_dtype(work.inputs)
        work.state["counting"] = counting
        work.state["calibs"] = {id(c.experts): c for c in calibs}

    def _owned(self, facts) -> list[int]:
        """Which of the block's accumulators (``facts.block.accumulators``) rank ``facts.rank`` solves: all on one
        rank, else ``plan_owners``' plan from the shapes (``Counting.reduce_to_owners`` makes the same)."""
        acc = facts.block.accumulators
        if facts.world == 1:
            return list(range(len(acc)))
        owners = plan_owners([solve_cost(n, rows) for n, rows in acc], facts.world)
        return [k for k, o in enumerate(owners) if o == facts.rank]

    def forward_memory(self, facts) -> list[tuple[int, int]]:
        """Every dense Hessian (and GPTAQ's cross term) as the forwards accumulate it on every rank; after the
        forward each is reduced to its owner and freed elsewhere (``memory``'s solve counts the owned ones)."""
        return [(hessian_bytes(n) * n * n, 2 if self.pairs_chains else 1) for n, _ in facts.block.accumulators]

    def solve_stages(self, facts) -> list[tuple[str, list[tuple[int, int]]]]:
        return self._phases(facts)[1]

    def memory(self, facts) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        held, stages = self._phases(facts)
        return held, max((bufs for _, bufs in stages), key=lambda bufs: sum(n * k for n, k in bufs), default=[])

    def _phases(self, facts) -> tuple[list[tuple[int, int]], list[tuple[str, list[tuple[int, int]]]]]:
        """Held: the float32 Hessians this rank solves (the dense ones it owns -- ``forward_memory`` has the
        others --, the experts' shared input Hessian under calibrate-all, else one per owned expert, and one
        down-projection Hessian per owned expert), GPTAQ's cross terms beside them (with one step's
        full-precision inputs to every Linear).  The solve, one width at a time (``_solve_owned``): the whole
        rows of that width's stacks gathered, and what it returns for them; the prepared factors of the stacks
        before the last, which is being factorized (its permuted copy, the factor written beside it and the
        half-size product and Schur complement of ``_lower_inverse_into``); the sweep's rows (float32, permuted,
        the copy, the codes, the dequantized rows).  Owned Hessians of widths solved earlier are freed by then
        (on one rank they and their factors stay to the block's end).  The experts' stacked solves likewise,
        after the dense ones."""
        b, cb, wb, pair = facts.block, facts.compute_bytes, facts.weight_bytes, 2 if self.pairs_chains else 1
        owned = [b.accumulators[k] for k in self._owned(facts)]
        hess: list[tuple[int, int]] = []
        for n, h, i in b.experts_modules:
            own = facts.owned_experts(n)
            hess += [(4 * h * h, 1 if facts.calibrate_all_experts else own), (4 * i * i, own)]
        held = [(n, k * pair) for n, k in hess]
        if self.pairs_chains:
            held += [(facts.step_tokens * n * cb, 1) for n, _ in b.accumulators]
        phases: list[tuple[str, list[tuple[int, int]]]] = []
        widths = list(dict.fromkeys(n for n, _ in owned))
        one = facts.world == 1  # one rank solves every stack in one call: nothing freed before the block's end
        done: list[tuple[int, int]] = []  # (one rank) the sums and prepared factors of the widths before
        for w_i, width in enumerate(widths):
            group = [(n, rows) for n, rows in owned if n == width]
            hb = hessian_bytes(width)
            # the sums not solved yet; this width's kept in the report's dtype once permuted (GPTQ._prepare)
            kept = hb if hb == 8 or self.pairs_chains else min(4, cb)
            base = done + [(hessian_bytes(n) * n * n, pair) for n, _ in owned if n in widths[w_i + 1:]] + [
                (kept * width * width, len(group) * pair)]
            if not one:  # the stacks' whole rows gathered, and what the solve returns for them
                base += [(n * rows * wb, 1) for n, rows in group] + [(n * rows * (wb + 1), 1) for n, rows in group]
            phases.append(("dense", base + prepare_buffers(width, len(group), hb)))
            phases.append(("dense", base + [(4 * width * width, len(group))] + sweep_buffers(sweep_shapes(group))))
            if one:
                done += [(kept * width * width, len(group) * pair), (4 * width * width, len(group))]
        for n, h, i in b.experts_modules:
            own = facts.owned_experts(n)
            down = min(max(EXPERT_STACK_ELEMS, i * h), own * i * h)
            for w, k, e in [(h, 1, min(max(EXPERT_STACK_ELEMS, 2 * i * h), own * 2 * i * h)), (i, down // (i * h), down)]:
                phases.append(("end", done + prepare_buffers(w, k, 4)))
                phases.append(("end", done + [(4 * w * w, k)] + sweep_buffers([(w, k, e)])))
        return held, phases

    def cost(self, facts) -> dict[str, Cost]:
        """Calibrate: the forward with every expert on every token, each sample's ``x^T x`` accumulated
        (``hessian``: tokens x width^2) and reduced to its owner; experts' Hessians in float32 over the tokens of the
        --ep group.  Solve: the stacks this rank owns (``plan_owners``; their rows gathered to it and scattered
        back), each a factorization (``width^3``) and a sweep of ``width`` columns over its rows; experts:
        gate_up stacked under one shared Hessian, down one sweep per expert, over this rank's rows of its
        experts."""
        b, t, world = facts.block, facts.tokens, facts.world
        cal = facts.fwd.calibrating if facts.fwd is not None else Cost()
        if self.pairs_chains and facts.fwd is not None:  # both chains, and the cross terms
            cal = cal * 2 + Cost(hessian=sum(t * n * n for n, _ in b.accumulators))
        elif facts.fwd is not None and b.linears and not b.experts_modules:
            n_in, n_out = b.linears[-1]  # the block's last Linear computes nothing here (Counting's skip_last)
            cal = cal + Cost(gemm=-2 * t * n_in * n_out)
        for n, _ in b.accumulators:  # each float32 sum reduced to its owner (one all-reduce of the counts)
            cal = cal + (Cost(hessian=t * n * n, link=hessian_bytes(n) * n * n, collectives=1) if world > 1
                         else Cost(hessian=t * n * n))
        if world > 1 and b.accumulators:
            cal = cal + Cost(collectives=1)
        solve = rtn_cost(facts, passes=2)  # the rows handed to the solve, the results written back
        stacks = list(b.accumulators)
        if world > 1:
            owners = plan_owners([solve_cost(n, rows) for n, rows in stacks], world)
            solve = solve + Cost(link=sum(2 * n * rows * facts.weight_bytes for n, rows in stacks) / world,
                                 collectives=len(b.linears) + len(stacks) + 1)  # gathers, scatters, the verdict
            stacks = [st for st, o in zip(stacks, owners) if o == facts.rank]
        for n, rows in stacks:  # (and the reported error through H: 2 rows n^2)
            solve = solve + Cost(factor=n**3, solves=1, cells=n * rows, gemm32=2 * rows * n * n)
        for n, k, _ in sweep_shapes(stacks):  # a sweep's column steps, and each further stack's error push in them
            solve = solve + Cost(columns=n, ops=n * (k - 1))  # (stacks of a block differ in height: not batched)
        for n_e, h, i in b.experts_modules:
            # --ep E: E/ep experts a rank, their rows split over dp = world/ep; --ep 1: FSDP2 splits the experts
            # themselves over the world, rows whole.  Its experts see the tokens of the ranks holding the others
            split = facts.ep if facts.ep > 1 else world
            own, dp = math.ceil(n_e / split), (world // facts.ep if facts.ep > 1 else 1)
            group = t * split  # the tokens every expert sees (calibrate-all: gathered from the other ranks)
            if world > 1:  # ExpertCalibration gathers every rank's hidden states and routes to the owners
                cal = cal + Cost(link=t * world * h * facts.compute_bytes, collectives=4 * facts.steps)
            routed = group * min(1.0, facts.top_k / n_e)
            up_rows, down_rows = math.ceil(2 * i / dp), math.ceil(h / dp)
            if facts.calibrate_all_experts:
                cal = cal + Cost(gemm32=2 * group * (h * h + own * i * i))
                per = max(1, EXPERT_STACK_ELEMS // (up_rows * h))
                solve = solve + Cost(factor=h**3, solves=1, columns=h * math.ceil(own / per), cells=h * own * up_rows,
                                     gemm32=2 * own * up_rows * h * h)
            else:
                cal = cal + Cost(gemm32=2 * routed * own * (h * h + i * i))
                # each its own Hessian, swept together (one height: one batched error push a column)
                ups = math.ceil(own / max(1, EXPERT_STACK_ELEMS // (up_rows * h)))
                solve = solve + Cost(factor=own * h**3, solves=own, columns=ups * h, cells=own * h * up_rows,
                                     gemm32=2 * own * up_rows * h * h)
            sweeps = math.ceil(own / max(1, EXPERT_STACK_ELEMS // (down_rows * i)))  # several experts a sweep
            solve = solve + Cost(factor=own * i**3, solves=own, columns=sweeps * i, cells=own * i * down_rows,
                                 gemm32=2 * own * down_rows * i * i, ops=2 * own * EXPERT_SOLVE_OPS)
        return {"calibrate": cal, "solve": solve}

    def _rows(self, g: GPTQ | None, w: torch.Tensor, scheme, name: str, stats=None, row_offset: int = 0) -> Solved:
        """``stats``: the weight's all-reduced cross-row statistics (a list: one per stacked weight)."""
        if g is None or not w.shape[0]:
            return rtn_rows(w, scheme, stats, row_offset)
        return _solved(g.quantize(w, scheme, name=name, stats=stats, **self.config.to_dict()), w.dtype, g.H)

    def solve(self, work: BlockWork, linear, w: torch.Tensor) -> Solved:
        g = work.state["counting"].get(linear.name)
        solved = self._rows(g, w, linear.scheme, linear.name, work.linear_stats.get(linear.name),
                            work.row_offset.get(linear.name, 0))
        solved.H = g.H if g is not None else None
        return solved

    def solve_linears(self, work: BlockWork, items) -> list[Solved]:
        """Linears that share a Hessian (q/k/v, gate/up) and a scheme are solved as one stack of rows:
        GPTQ's rows are independent given the Hessian, so this is each one's own solve (same bits,
        tests/test_quant_gptq.py) with one column loop instead of one per Linear.  On more than one
        rank each stack is solved whole by one rank (``_solve_owned``)."""
        counting = work.state["counting"]
        owned = work.world > 1
        out: list[Solved | None] = [None] * len(items)
        stacks: list[tuple[GPTQ, list[int]]] = []
        for i, (lin, w) in enumerate(items):
            g = counting.get(lin.name)
            # whether rows exist: the Linear's (the same on every rank) when ranks solve for each other
            if g is None or not (lin.module.out_features if owned else w.shape[0]):
                out[i] = self.solve(work, lin, w)
                continue
            for g2, idx in stacks:
                lin2, w2 = items[idx[0]]
                if g2 is g and lin2.scheme == lin.scheme and w2.dtype == w.dtype and _same_stats(
                        lin.scheme, work.linear_stats.get(lin2.name), work.linear_stats.get(lin.name)):
                    idx.append(i)
                    break
            else:
                stacks.append((g, [i]))
        if owned:
            return self._solve_owned(work, items, stacks, out)
        for (g, idx), solved in zip(stacks, self._solve_stacks(work, [(g, [items[i][0] for i in idx],
                                                                         [items[i][1] for i in idx]) for g, idx in stacks])):
            for i, s in zip(idx, solved):
                out[i] = s
        return out

    def _solve_stacks(self, work: BlockWork, stacks) -> list[list[Solved]]:
        """``stacks``: ``(g, lins, ws)``, the rows ``ws`` (one tensor per Linear of ``lins``, all under ``g``);
        one ``Solved`` per Linear.  Each stack is one problem of ``quantize_together``: one column sweep for
        the stacks of one width and scheme, each under its own Hessian."""
        problems = [Problem(g, ws[0] if len(ws) == 1 else torch.cat(ws), lins[0].scheme,
                            " + ".join(l.name for l in lins), work.linear_stats.get(lins[0].name))
                    for g, lins, ws in stacks]
        out = []
        for (g, lins, ws), r in zip(stacks, quantize_together(problems, **self.config.to_dict())):
            solved = _solved(r, ws[0].dtype, g.H)
            if len(lins) == 1:
                out.append([solved])
                continue
            heights = [w.shape[0] for w in ws]
            # own storage per Linear (safetensors refuses tensors that share memory in one file)
            parts = [[p.clone() for p in t.split(heights)] if t is not None else [None] * len(lins)
                     for t in (solved.q, solved.scale, solved.zero_point)] + [solved.deq.split(heights)]
            gs = solved.global_scale
            out.append([Solved(q, sc, z, d, H=g.H, global_scale=None if gs is None else gs.clone())
                        for q, sc, z, d in zip(*parts)])
        return out

    def _solve_owned(self, work: BlockWork, items, stacks, out) -> list[Solved]:
        """Each stack solved whole by one rank, instead of every stack by every rank over its rows.

        A solve's cost hardly depends on its rows: the damped inverse factor is ``in^3`` and the
        column loop is ``in`` Python-bound steps, both the same for 1 row or 3072.  Split by rows,
        every rank paid all of them (on SmolLM2, 3264 column steps and four factorizations per
        block and rank); split by stacks, each rank pays for its own (``owners``: largest first
        onto the least loaded rank, from shapes alone, so every rank computes the same plan).
        Every stack's rows are gathered onto its solver; one small all-reduce tells every rank
        whether a solver failed (then every rank raises its message); each solver scatters the
        dequantized rows back to the ranks holding them (the quantized chain) and writes the
        weights itself (``Solved.writer``), so its codes and scales never travel.  The rows of a
        stack are the ones a single rank would solve: the world-size-1 solve's bits."""
        rank, world = work.rank, work.world
        counts = {i: dim0_counts(items[i][0].module.out_features, world) for _, idx in stacks for i in idx}
        # where its Hessian was reduced to (Counting.reduce_to_owners); Hessians summed elsewhere: the same plan
        owners = [g.owner for g, _ in stacks]
        if None in owners:
            owners = plan_owners([solve_cost(g.in_features, sum(items[i][0].module.out_features for i in idx))
                              for g, idx in stacks], world)
        full = {}
        for (g, idx), o in zip(stacks, owners):
            for i in idx:
                full[i] = gather_rows(items[i][1], counts[i], o)
        mine: dict[int, Solved] = {}
        terms: dict[int, list[float]] = {}
        failure = None
        own = [(g, idx) for (g, idx), o in zip(stacks, owners) if o == rank]
        h_cast: dict = {}
        dtype = rtn.err_dtype(work.inputs)
        try:
            # one width at a time (its stacks share one column sweep): solved, measured, their Hessians freed
            for width in dict.fromkeys(g.in_features for g, _ in own):
                group = [(g, idx) for g, idx in own if g.in_features == width]
                for (g, idx), solved in zip(group, self._solve_stacks(
                        work, [(g, [items[i][0] for i in idx], [full[i] for i in idx]) for g, idx in group])):
                    mine.update(zip(idx, solved))
                    for i in idx:  # the report's terms over the whole weight, here where its Hessian is
                        lin = items[i][0]
                        terms[i] = rtn.report_terms(full[i], mine[i].deq, g.H, lin.scheme, work.linear_stats.get(lin.name),
                                                    0, True, h_cast, dtype)
                        full[i] = None
                h_cast.clear()
                for g, _ in group:
                    g.free()
        except Exception as e:  # every rank must learn of it, or the others wait in the scatter
            failure = e
        full.clear()
        failed = torch.tensor([failure is not None], dtype=torch.int32, device=work.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            every: list = [None] * world
            dist.all_gather_object(every, None if failure is None else _failure_text(failure))
            if failure is not None:
                raise failure
            raise SqError([f"rank {r} (solving GPTQ for the other ranks): {m}" for r, m in enumerate(every)
                           if m is not None])
        for (g, idx), o in zip(stacks, owners):
            specs = [(items[i][1].dtype, tuple(items[i][1].shape[1:])) for i in idx]
            got = scatter_rows([mine[i].deq for i in idx] if o == rank else None, [counts[i] for i in idx], o, specs,
                               device=work.device)
            for i, deq in zip(idx, got):
                s = mine.get(i)
                out[i] = Solved(None, None, None, deq, global_scale=None if s is None else s.global_scale,
                                writer=o, whole=None if s is None else (s.q, s.scale, s.zero_point),
                                terms=terms.get(i, [0.0] * 4))
        return out

    @staticmethod
    def _expert_stats(work, eprefix, ex, pname, e):
        """Expert ``e``'s all-reduced statistics of ``pname`` (None: none needed)."""
        stats = work.expert_stats.get((eprefix, pname))
        return whole_rows_stats(stats[e - local_experts(ex).start], f"{eprefix}.{e}.{pname}") if stats else None

    def _expert_hessian(self, work, eprefix, ex, pname, e) -> GPTQ | None:
        """Expert ``e``'s accumulator for ``pname``; None where it saw no token (RTN; a gate/up so
        solved is reported as a fallback)."""
        calib = work.state["calibs"].get(id(ex))
        g = (calib.h_in if pname != "down_proj" else calib.h_mid)[e] if calib is not None else None
        if g is not None and g.nsamples == 0:
            g = None
            if pname != "down_proj":  # the input side (gate_up_proj, or up_proj of up/down-only experts)
                work.state.setdefault("fallback", []).append(f"{eprefix}.{e}")
        return g

    def solve_expert(self, work, eprefix, ex, pname, e, w, scheme) -> Solved:
        return self._rows(self._expert_hessian(work, eprefix, ex, pname, e), w, scheme, f"{eprefix}.{e}.{pname}",
                          self._expert_stats(work, eprefix, ex, pname, e))

    def solve_experts(self, work, eprefix, ex, pname, local, first, scheme) -> Iterable[Solved]:
        calib = work.state["calibs"].get(id(ex))
        shared = calib.h_in[calib.mine.start] if calib is not None and calib.calibrate_all and len(calib.mine) else None
        if not (local.shape[0] and local.shape[1]):
            yield from super().solve_experts(work, eprefix, ex, pname, local, first, scheme)
            return
        if not (pname != "down_proj" and shared is not None and shared.nsamples):
            yield from self._solve_each(work, eprefix, ex, pname, local, first, scheme)
            return
        # One Hessian for every expert (calibrate-all): GPTQ's rows are independent given it, so
        # the experts' rows are solved stacked, a few experts per sweep, instead of one column
        # loop per expert (same bits; see EXPERT_STACK_ELEMS).  Each expert keeps its own
        # statistics (NVFP4: its own global scale).
        n, rows, cols = local.shape
        per = max(1, EXPERT_STACK_ELEMS // (rows * cols))
        for a in range(0, n, per):
            b = min(n, a + per)
            w = local[a:b].detach().reshape(-1, cols).clone()  # [(b - a) * rows, cols]
            stats = [self._expert_stats(work, eprefix, ex, pname, first + i) for i in range(a, b)]
            s = self._rows(shared, w, scheme, f"{eprefix}.{first + a}-{first + b - 1}.{pname}",
                           stats if any(st is not None for st in stats) else None)
            zs = s.zero_point.view(b - a, rows, -1).unbind(0) if s.zero_point is not None else [None] * (b - a)
            gs = s.global_scale.split(1) if s.global_scale is not None else [None] * (b - a)
            # (each stack's rows read before they are solved: the caller writes the solved ones back into ``local``)
            yield from [Solved(q, sc, z, d, global_scale=g)
                        for q, sc, z, d, g in zip(s.q.view(b - a, rows, -1).unbind(0),
                                                  s.scale.view(b - a, rows, -1).unbind(0), zs,
                                                  s.deq.view(b - a, rows, cols).unbind(0), gs)]
            del s

    def _solve_each(self, work, eprefix, ex, pname, local, first, scheme) -> Iterable[Solved]:
        """Experts each under its own Hessian (down projections; gate/up without calibrate-all): a few
        experts' rows side by side in one column sweep (``quantize_together``: each its own solve's
        bits), as many as ``EXPERT_STACK_ELEMS`` weight elements."""
        n, rows, cols = local.shape
        per = max(1, EXPERT_STACK_ELEMS // (rows * cols))
        for a in range(0, n, per):
            gs = {i: self._expert_hessian(work, eprefix, ex, pname, first + i) for i in range(a, min(n, a + per))}
            solve = [i for i, g in gs.items() if g is not None]
            results = dict(zip(solve, quantize_together(
                [Problem(gs[i], local[i].detach().clone(), scheme, f"{eprefix}.{first + i}.{pname}",
                         self._expert_stats(work, eprefix, ex, pname, first + i)) for i in solve],
                **self.config.to_dict())))
            for i in gs:  # (each expert's rows read before any is solved: the caller writes them back into ``local``)
                r = results.pop(i, None)
                yield (rtn_rows(local[i].detach().clone(), scheme, self._expert_stats(work, eprefix, ex, pname, first + i))
                       if r is None else _solved(r, local.dtype))

    def fallback_experts(self, work: BlockWork) -> list[str]:
        return work.state.get("fallback", [])

    def expert_tokens(self, work: BlockWork) -> dict[str, dict[int, tuple[int, int]]]:
        out = {}
        for eprefix, ex, _ in work.experts:
            calib = work.state["calibs"].get(id(ex))
            if calib is not None:
                out[eprefix] = {e: (calib.routed.get(e, 0), calib.h_mid[e].nsamples) for e in calib.mine
                                if e in calib.h_mid}
        return out

    def release(self, work: BlockWork) -> None:
        for g in work.state["counting"].gptq.values():
            g.free()
        for calib in work.state["calibs"].values():
            for g in (*calib.h_in.values(), *calib.h_mid.values()):
                g.free()


@register
class GPTAQAlgorithm(GPTQAlgorithm):
    """GPTAQ: GPTQ with each dense Linear fitted to the full-precision model's outputs.

    The full-precision chain is carried beside the quantized one (``fp_chain``; cached for resume
    like it); each calibration batch runs through the block on both (``paired_forward``), so every
    Linear's Hessian comes with the cross term ``sum (x_fp - x)^T x`` of the same tokens, all-reduced
    like the Hessian; the solve is GPTQ's after the correction up front (``sq.quant.gptq._asymmetric_map``).
    Experts too where every expert calibrates on every token (calibrate-all, the default): their
    shared input Hessian and each one's down-projection Hessian get the cross term of the same
    tokens (``ExpertCalibration.paired``).  With ``--no-calibrate-all-experts`` the two chains route
    tokens differently, there are no token pairs, and experts are solved as GPTQ solves them."""

    config_type = GPTAQConfig
    fp_chain = True
    pairs_chains = True


def _same_stats(scheme, a, b) -> bool:
    """Whether two Linears quantize under the same cross-row statistics of ``scheme`` (none for
    most; NVFP4's global absmax, which q/k/v and gate/up share), so their rows can be stacked."""
    need = primitives.cross_row_stats(spec_for(scheme))
    if not need:
        return True
    if not a or not b:
        return not a and not b
    return all(k in a and k in b and torch.equal(a[k], b[k]) for k in need)


def _solved(r, dtype: torch.dtype, H: torch.Tensor | None = None) -> Solved:
    """A ``GPTQResult`` as the pipeline takes it: the dequantized rows in the weight's ``dtype``."""
    return Solved(r.q, r.scale, r.zero_point, r.weight.to(dtype), H=H, global_scale=r.global_scale)


def _failure_text(e: BaseException) -> str:
    return "\n".join(e.problems) if isinstance(e, SqError) else f"{type(e).__name__}: {e}"


