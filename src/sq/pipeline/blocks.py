"""The per-block pipeline: every rank quantizes the rows it holds, one decoder block at a time.

    claim the output folder (refusals first; nothing mutated before) -> agree on the restart point
    block-0 inputs from this rank's calibration samples (or the cached chain)
    for each block b:
        fill       materialize b's shards (DCP box reads)
        check      NaN/Inf weights refused by name (or skipped), the same on every rank
        reduce     cross-row statistics a format reads (NVFP4 global absmax, FP8 tensor/block absmax)
        observe    static activation / KV cache scales, where the job writes them: one forward on the
                   block's full-precision weights, all-reduced (sq.quant.activations)
        capture    the full-precision outputs, where the algorithm tunes against them
        calibrate  the algorithm's statistics from the block's calibration forward (collectives)
        solve      the algorithm on this rank's rows / experts -> data; dequantized rows written back
        propagate  forward again with quantized weights -> b+1's inputs (the quantized chain)
        write      rows gathered to a round-robin writer (or written by the rank that solved them
                   whole: GPTQ), compressed, one shard per rank; b freed;
                   in a background thread, one block behind: the shard, the chain cache, b recorded
                   in the manifest (in that order)
    rank 0: root tensors, carried keys, config, side files, report, merged index (last)

It knows no algorithm by name: the handler (``sq.quant.algorithms``) is found by the config's
type, and the pipeline reads only its ``calibrated`` / ``fp_chain`` facts and calls its hooks.
Fill/free and gathers to the writer live here; the folder, resume bookkeeping and fault points are
``sq.run``'s, shared with model-free.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from sq.anatomy import carried_experts, expert_params
from sq.dist import rank_device
from sq.errors import SqError
from sq.export import writer
from sq.files import REPORT_PNG, sha256_bytes, shard_name
from sq.formats import specs
from sq.formats.compressed import compress_weight
from sq.load.fill import local_box
from sq.memory import HeapTrim, PeakPhases, peak_rss_bytes, rss_breakdown, trim_heap
from sq.parallel.collectives import dim0_counts, full_tensor, gather_rows
from sq.parallel.fsdp import main_dtype
from sq.quant import rtn
from sq.quant.activations import ActivationObservation, kv_cache_args
from sq.quant.attention import attention_shape, use_sdpa
from sq.quant.algorithms import make_algorithm
from sq.quant.work import BlockWork, Solved
from sq.quant.experts import (SlotStats, experts_report, export_experts, export_slots, is_ep_param, segment_rows, slot_rows,
                               take_solved, unquantized_experts_report)
from sq.quant.forward import CALIB_BATCH, block_forward, capture_block0
from sq.quant.gptq import use_bf16_products
from sq.quant.recipe import Assigner, scheme_tag
from sq.report import block_progress, summary_lines, write_report_png
from sq.probe import (Choice, attention_backward_choice, attention_chunk_choice, calib_dtype_choice,
                      hessian_products_choice, machine)
from sq.pipeline.checks import job_problems
from sq.pipeline.targets import Targets, check_finite, config_groups, plan_targets, restore_nonfinite
from sq.run import Run, signature, versions
from sq.pipeline.search import apply_search
from sq.pipeline.rotation import Rotation
from sq.quant.served import ServedActivations
from sq.quant.smooth import smooth_block
from sq.pipeline.disk import written_bytes
from sq.pipeline.preflight import disk_preflight, memory_preflight, time_preflight

logger = logging.getLogger(__name__)

__all__ = ["run_pipeline"]


def _signature(cfg, calibrated: bool, assigner: Assigner, targets: Targets, weights, data: dict, world: int) -> dict:
    """The run's signature (``sq.run.signature``): calibration settings and the dataset only for an
    algorithm that reads calibration data."""
    return signature(source=weights.identity(), args=cfg.signature_args(calibrated=calibrated),
                     algorithm=cfg.algo.signature(), schemes=assigner.to_dict(), assignment=targets.assignment,
                     world=world, blocks=[p for p, _ in targets.blocks], **({"dataset": data} if calibrated else {}))


@dataclass
class _Stats:
    layers: dict[str, dict] = field(default_factory=dict)
    blocks: list[dict] = field(default_factory=list)
    experts_rtn: list[str] = field(default_factory=list)  # experts no calibration token reached (quantized with RTN)
    expert_tokens: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)  # (routed, calibrated) each
    per_block: dict[str, dict] = field(default_factory=dict)  # the algorithm's block reports, by block prefix


class _Pipeline:
    """One job's run over its blocks; the methods are the pipeline's stages."""

    def __init__(self, cfg, model: nn.Module, weights, assigner: Assigner, data: dict,
                 windows: Callable[[], torch.Tensor], parallelize, t_start: float):
        self.cfg, self.model, self.weights, self.assigner, self.data = cfg, model, weights, assigner, data
        self.windows, self.parallelize, self.t_start = windows, parallelize, t_start
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = rank_device()
        self.out = Path(cfg.output)
        self.run = Run(self.out, bookkeeping=cfg.bookkeeping, fault=cfg.fault)
        self.algo = make_algorithm(cfg.algo)
        # calibration data: for the algorithm, or to observe static activation / KV cache scales (then
        # one observed forward per block, before the solve: sq.quant.activations)
        self.calibrated = cfg.needs_data(assigner)
        self.observing = cfg.observes(assigner)
        self.targets = plan_targets(model, assigner, weights, self.world)
        # forwards compute in compute_dtype (None: as the model computes; the API's models keep their
        # own FSDP2 mixed precision), chosen in claim(); weights and checkpoint tensors stay in weight_dtype
        self.weight_dtype = main_dtype(self.targets.blocks[0][1]) if self.targets.blocks else None
        self.choice: Choice | None = None
        self.hessian: dict = {}  # GPTQ's Hessian products: how and why (the report's speed.hessian)
        self.stats = _Stats()
        self._raw_nonfinite: list[tuple[torch.Tensor, torch.Tensor]] = []  # --skip-nonfinite: (weight, stored values)
        self.inputs, self.fp_inputs, self.steps, self.dummy = [], [], 0, None
        self.search_report: dict | None = None  # --target-bits (sq.pipeline.search), when it ran in this process
        # --rotate (sq.pipeline.rotation): fused into each block right after it is filled
        self.rotation = Rotation(model, cfg.rotate, cfg.seed, self.device, cfg.rotate_block) if cfg.rotate else None
        # the preflights' predictions (claim): disk (with the free space measured), memory, time
        self.disk, self.memory, self.time = {}, {}, {}
        self.peaks = PeakPhases()  # the peak RSS before the blocks, in each block, at the end
        # the C heap's free pages back to the OS: after every block where blocks allocate little besides
        # their shards, every few blocks where calibration forwards churn activations (sq.memory)
        self.trim = HeapTrim() if self.calibrated else HeapTrim(every=1)

    # ---- before anything is mutated
    def claim(self) -> bool:
        """Refusals, then the output folder; False when the folder is already complete."""
        cfg = self.cfg
        problems = job_problems(cfg, self.model, self.assigner, self.algo, self.targets, world=self.world,
                                in_memory=self.weights.in_memory, weight_dtype=self.weight_dtype,
                                calibrated=self.calibrated, src=getattr(self.weights, "src", None))
        # the choices an earlier run in this folder recorded (its signature's args): one read, one collective
        args = ((self.run.recorded_signature() or {}).get("args") or {}
                if self.calibrated and cfg.resume != "never" else {})
        if self.calibrated and self.parallelize is not None:
            self.choice = self._calib_dtype(args)
        sig = _signature(cfg, self.calibrated, self.assigner, self.targets, self.weights, self.data, self.world)
        if self.calibrated:  # what the forwards actually compute in, resolved
            c = self.choice
            sig["args"].update(calib_dtype=c.name if c else "model", attn_chunk=(c.attn_chunk if c else None) or 0,
                               attn_backward=c.attn_backward if c else "sdpa")
        if self.calibrated and self.algo.sweeps:  # GPTQ's family: its Hessians' products, resolved
            bf16, why = self._hessian_products(args)
            sig["args"]["hessian_products"] = "bf16" if bf16 else "float32"
            self.hessian = {"products": "bf16" if bf16 else "float32", **why} if why else {}
            use_bf16_products(bf16)  # this job's Hessians (and the time preflight's measure of them)
        if cfg.preflight and not problems:  # a job refused already is not sized (its schemes may not apply)
            for check, part in ((memory_preflight, "memory"), (disk_preflight, "disk")):
                found, facts = check(self)
                problems += found
                setattr(self, part, facts)
            self.time = time_preflight(self) if not problems else {}
        tokens = self.windows() if self.calibrated else None
        return self.run.claim(sig, cfg.resume, problems, config=self.weights.config,
                              tokens=None if tokens is None else sha256_bytes(tokens.contiguous().cpu().numpy().tobytes()))

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.choice.dtype if self.choice is not None else None

    @property
    def autocast(self) -> torch.dtype | None:
        return self.choice.autocast if self.choice is not None else None

    def _calib_dtype(self, args: dict) -> Choice:
        """``--calib-dtype`` and the attention's query chunks: as given, as this folder's run recorded them
        (``args``), or measured (``sq.probe``)."""
        recorded = args.get("calib_dtype") if self.cfg.calib_dtype == "auto" else None
        choice = calib_dtype_choice(self.cfg.calib_dtype, self.targets.linear_shapes(3), self.weight_dtype,
                                    self.device, recorded=recorded if recorded in ("float32", "model", "mixed") else None,
                                    half=self.algo.half_forwards)
        chunk, shape = args.get("attn_chunk"), (*attention_shape(self.model), self.cfg.seqlen,
                                                  choice.autocast or choice.dtype or self.weight_dtype or torch.float32)
        choice.attn_chunk, choice.attn = attention_chunk_choice(*shape, self.device,
                                                                recorded=chunk if isinstance(chunk, int) else None)
        if self.algo.half_forwards == "mixed":  # its gradients flow through the forwards (SignRound's steps)
            choice.attn_backward, choice.attn_bwd = attention_backward_choice(*shape, self.device, choice.attn_chunk,
                                                                              recorded=args.get("attn_backward"))
        return choice

    def _hessian_products(self, args: dict) -> tuple[bool, dict]:
        """GPTQ's Hessian products of bf16 inputs: as bf16 operands or float32 (``sq.probe``), or as recorded."""
        return hessian_products_choice([i for i, _ in self.targets.linear_shapes()], self.compute_dtype
                                       or self.weight_dtype, self.device,
                                       recorded={"bf16": True, "float32": False}.get(args.get("hessian_products")))

    def restart_point(self) -> int:
        """The largest block every rank can restart from; keeps the manifests' blocks before it."""
        start = self.run.restart(len(self.targets.blocks), need_chain=self.calibrated)
        self._drop_skipped()
        return start

    def _drop_skipped(self) -> None:
        """Linears an earlier run of this job left unquantized for NaN/Inf (written raw in their block)."""
        for b, ls in enumerate(self.targets.linears):
            self.targets.linears[b] = [l for l in ls if l.name not in self.run.skipped]

    def calibration_inputs(self, start: int) -> None:
        """This rank's samples ``rank::world`` -> block-0 inputs, or both chains from the cache."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.inputs = capture_block0(self.model, self.windows()[self.rank::self.world], self.device,
                                     dtype=self.compute_dtype)
        self.steps = math.ceil(math.ceil(cfg.nsamples / self.world) / CALIB_BATCH)
        self.fp_inputs = self.inputs
        if start:  # both chains from the cache, never rebuilt approximately
            q_chain, fp_chain = self.run.state.read_chain(start)
            if q_chain and q_chain[0].dtype != self.inputs[0][0].dtype:  # the same on every rank
                raise SqError(f"{self.out}: the cached calibration chain is {q_chain[0].dtype}, this run's forwards "
                              f"compute in {self.inputs[0][0].dtype} (the model's mixed precision changed); "
                              "rerun as before, or pass --resume never")
            self.inputs = [(h, kw) for h, (_, kw) in zip(q_chain, self.inputs, strict=True)]
            if self.algo.fp_chain:
                self.fp_inputs = [(h, kw) for h, (_, kw) in zip(fp_chain, self.fp_inputs, strict=True)]
        self.dummy = self.inputs[0]

    # ---- one block
    def block(self, b: int) -> None:
        peaks = self.peaks.start("blocks" if self.peaks.phases else "before_blocks")  # each block's own peak
        t0 = time.perf_counter()
        prefix, block = self.targets.blocks[b]
        phase: dict[str, float] = {}
        names = self.weights.block_names(b)
        self.weights.fill(names)
        phase["fill"] = time.perf_counter() - t0
        bad = self._check_finite(b)
        if self.rotation is not None:  # before anything reads the block's weights
            t = time.perf_counter()
            self.rotation.block(b, prefix, block, bad)
            phase["rotate"] = time.perf_counter() - t
        if self.cfg.smooth is not None:  # before anything reads the block's weights or observes its inputs
            t = time.perf_counter()
            smooth_block(block, self.inputs, self.steps, self.dummy, self.cfg.smooth, self.device, self.autocast)
            phase["smooth"] = time.perf_counter() - t
        work = BlockWork(b, prefix, block, self.targets.linears[b], self.targets.experts[b], self.inputs,
                         self.fp_inputs, self.steps, self.dummy, self.device, self.rank, self.world,
                         self.cfg.nsamples, self.cfg.seed, self.cfg.calibrate_all_experts,
                         weight_dtype=self.weight_dtype, autocast=self.autocast,
                         served_activations=self.cfg.served_activations)
        self._reduce(work)
        t = time.perf_counter()
        observed_out = None
        if self.observing:  # static activation / KV scales, on the block's full-precision weights
            work.acts, observed_out = self._observe_activations(work)
            phase["observe"] = time.perf_counter() - t
            t = time.perf_counter()
        if (observed_out is None and self.calibrated and not self.algo.calibrated
                and b + 1 < len(self.targets.blocks)):
            # data read for --smooth alone (RTN, a scheme with dynamic activations: nothing observed): the next
            # block's inputs are this block's full-precision outputs, as RTN's observed forward gives them
            observed_out = block_forward(block, self.inputs, self.steps, self.dummy, autocast=self.autocast)
        if self.algo.fp_chain and not self.algo.pairs_chains:  # the full-precision outputs: the algorithm's targets
            work.fp_out = block_forward(block, self.fp_inputs, self.steps, self.dummy, autocast=self.autocast)
        if self.algo.calibrated:
            self.algo.observe(work)
            self.run.fault_point("calib", b)
            phase["calibrate"] = time.perf_counter() - t
        t = time.perf_counter()
        self.run.fault_point("stop", b)
        results, expert_q = self._solve(work)
        phase["solve"] = time.perf_counter() - t
        self._layer_errors(work, results)
        t = time.perf_counter()
        if self.calibrated and b + 1 < len(self.targets.blocks):
            self._propagate(work, observed_out)
            phase["forward"] = time.perf_counter() - t
        restore_nonfinite(self._raw_nonfinite)
        t = time.perf_counter()
        wait = self._write(work, names, results, expert_q, bad)
        phase["write"] = time.perf_counter() - t - wait
        phase["write_wait"] = wait
        report = self.algo.block_report(work)
        if report is not None:
            self.stats.per_block[prefix] = report
            logger.info("block %d/%d %s", b + 1, len(self.targets.blocks),
                        " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in report.items()))
        total = time.perf_counter() - t0
        self.stats.blocks.append({"block": b, "seconds": round(total, 3),
                                  **{k: round(v, 3) for k, v in phase.items()},
                                  "rss_anon_after": rss_breakdown()["anon"],
                                  **({"peak_rss": peak_rss_bytes()} if peaks else {})})
        logger.debug("block %d/%d done in %.2fs %s", b + 1, len(self.targets.blocks), total,
                     " ".join(f"{k}={v:.2f}" for k, v in phase.items()))
        self.progress.step(b, total)

    def _check_finite(self, b: int) -> list[str]:
        bad, self._raw_nonfinite = check_finite(self.targets, b, self.device, self.weights, self.cfg.skip_nonfinite,
                                                self.calibrated)
        return bad

    def _reduce(self, work: BlockWork) -> None:
        """Statistics a format reads across a weight's rows (NVFP4's global absmax, FP8's per-tensor or
        per-block absmax), all-reduced over the ranks holding its rows before anyone solves, and
        combined over fused partners (q/k/v, gate/up), which an engine loads as one weight."""
        rtn.reduce_linear_stats(work)
        for eprefix, ex, scheme in work.experts:
            reds = specs.required_reductions(scheme)
            if not reds:
                continue
            # whole-tensor / 2-D block scales (FP8, FP8_BLOCK): one set per checkpoint tensor -- gate,
            # up and down of each expert apart (a block must not straddle gate and up); a global scale
            # only (NVFP4): one per expert and param, gate and up sharing it (vLLM fuses them)
            per_slot = not rtn.scales_follow_rows(scheme)
            slots = slot_rows(export_slots(eprefix, ex, self.weights.expert_pieces)) if per_slot else {}
            for pname in expert_params(ex):
                p = ex._parameters[pname]
                local, off = local_box(p)  # [n_local, rows_local, in]: rows [r0, r0 + rows_local) of each expert
                r0 = off[1]
                per_expert = []
                for i in range(local.shape[0]):
                    segs = slots[off[0] + i, pname] if per_slot else [(0, p.shape[1])]
                    entry = []
                    for lo, hi in segs:
                        rows, at = segment_rows(local[i], r0, lo, hi)
                        entry.append(SlotStats(lo, hi, rtn.local_stats(rows, scheme, row_offset=at, rows=hi - lo)))
                    per_expert.append(entry)
                every = [seg.stats for entry in per_expert for seg in entry]
                if every and is_ep_param(p) and p.device_mesh.size(0) > 1:  # an expert's rows are split over dp
                    for r in reds:  # one collective per statistic: every slot's flattened together
                        flat = torch.cat([st[r.stat].reshape(-1) for st in every])
                        dist.all_reduce(flat, op=r.reduce_op, group=p.device_mesh.get_group(0))
                        for st, part in zip(every, flat.split([st[r.stat].numel() for st in every])):
                            st[r.stat].copy_(part.view_as(st[r.stat]))
                work.expert_stats[(eprefix, pname)] = per_expert

    def _observe_activations(self, work: BlockWork):
        """One forward of the block (full-precision weights, this rank's inputs) with the static
        activation and KV cache observers on; the statistics reduced over every rank's tokens.
        Returns the checkpoint tensors and the forward's outputs."""
        obs = ActivationObservation(self.model, work, self.cfg.kv_cache, self.device)
        try:
            outs = block_forward(work.block, self.inputs, self.steps, self.dummy, counters=obs.counters)
        finally:
            obs.remove()
        obs.reduce()
        # the scales in the model's dtype, as a forward in it computes them (llm-compressor's)
        return obs.scales(self.weight_dtype or self.inputs[0][0].dtype), outs

    def _solve(self, work: BlockWork):
        """This rank's rows of every target -> data; the dequantized rows go back into the shard."""
        results: dict[str, tuple[Solved, list[float]]] = {}
        compare = self.algo.calibrated  # a data-driven algorithm's report shows RTN's error beside its own
        h_cast: dict[tuple, torch.Tensor] = {}
        dtype = rtn.err_dtype(work.inputs)
        locals_ = [local_box(lin.module.weight)[0] for lin in work.linears]
        items = [(lin, local.detach().clone()) for lin, local in zip(work.linears, locals_)]
        for (lin, w), local, s in zip(items, locals_, self.algo.solve_linears(work, items)):
            terms = s.terms if s.terms is not None else rtn.report_terms(
                w, s.deq, s.H, lin.scheme, work.linear_stats.get(lin.name), work.row_offset.get(lin.name, 0), compare,
                h_cast, dtype)
            local.copy_(s.deq)
            results[lin.name] = (s, terms)
        expert_q = {}
        for eprefix, ex, scheme in work.experts:
            expert_q[eprefix] = {}
            for pname in expert_params(ex):
                local, off = local_box(ex._parameters[pname])
                expert_q[eprefix][pname] = take_solved(
                    self.algo.solve_experts(work, eprefix, ex, pname, local, off[0], scheme), local)
        self.algo.release(work)
        return results, expert_q

    def _layer_errors(self, work: BlockWork, results) -> None:
        """Per-layer relative errors: the per-rank terms summed over ranks; expert RTN fallbacks counted."""
        if work.linears:
            terms = torch.tensor([results[l.name][1] for l in work.linears], dtype=torch.float64)
            dist.all_reduce(terms)
            for l, row in zip(work.linears, terms.tolist()):
                # (max: a report's number must never stop the job, whatever a rounding did)
                entry = {"rel_err": math.sqrt(max(row[0], 0.0) / row[1]) if row[1] > 0 else 0.0,
                         "metric": self.algo.error_metric, "scheme": scheme_tag(l.scheme)}
                if len(row) > 2:
                    entry["rtn_rel_err"] = math.sqrt(max(row[2], 0.0) / row[3]) if row[3] > 0 else 0.0
                self.stats.layers[l.name] = entry
        if work.experts:
            every = [None] * self.world
            dist.all_gather_object(every, (self.algo.fallback_experts(work), self.algo.expert_tokens(work)))
            self.stats.experts_rtn += sorted(set().union(*(f for f, _ in every)))  # dp replicas name the same experts
            for _, tokens in every:
                for eprefix, per in tokens.items():
                    self.stats.expert_tokens.setdefault(eprefix, {}).update(per)

    def _propagate(self, work: BlockWork, observed_out=None) -> None:
        """The next block's inputs: the quantized chain of a data-driven algorithm (and the fp chain
        where it keeps it); RTN's observed forward's outputs (the full-precision chain, as
        llm-compressor calibrates activations for round-to-nearest); the algorithm's own
        (AWQ's full-precision chain) where it computed them."""
        outs = self.algo.next_inputs(work)
        if outs is None and not self.algo.calibrated:
            outs = observed_out
        elif outs is None:
            with ServedActivations(work.linears if work.served_activations else [], work.acts.absmax):
                outs = block_forward(work.block, self.inputs, self.steps, self.dummy, autocast=self.autocast)
        self.inputs = [(y, kw) for y, (_, kw) in zip(outs, self.inputs)]
        if self.algo.fp_chain:
            self.fp_inputs = [(y, kw) for y, (_, kw) in zip(work.fp_out, self.fp_inputs)]
        self.dummy = self.inputs[0]

    def _write(self, work: BlockWork, names, results, expert_q, bad) -> float:
        """Gather each Linear's rows on its writer and compress; rank 0 writes the rest whole; then the
        shard, the chain cache and the manifest are written in the background (``Run.write_block``) while
        the next block computes.  Returns the seconds spent waiting for the previous block's files."""
        b, rank = work.index, self.rank
        tensors: dict[str, torch.Tensor] = {}
        for lin in work.linears:
            s = results[lin.name][0]
            out_f, in_f = lin.module.out_features, lin.module.in_features
            dst = lin.owner if s.writer is None else s.writer
            if s.writer is not None:  # solved whole on its writer: nothing to gather
                fq, fs, fz = s.whole if rank == dst else (None, None, None)
            else:
                rows = dim0_counts(out_f, self.world)
                fq = gather_rows(s.q, rows, dst)
                fs, fz = s.scale, s.zero_point  # whole on every rank unless scales follow rows
                if rtn.scales_follow_rows(lin.scheme):
                    fs = gather_rows(s.scale, rows, dst)
                    fz = gather_rows(s.zero_point, rows, dst) if s.zero_point is not None else None
            if rank == dst:
                for rel, v in compress_weight((fq, fs, fz), lin.scheme, (out_f, in_f), global_scale=s.global_scale,
                                              activation_scales=work.acts.linears.get(lin.name)).items():
                    tensors[lin.ckpt_prefix + rel] = v
        for (eprefix, ex, scheme) in work.experts:
            tensors.update(export_experts(eprefix, ex, expert_q[eprefix], self.weights.expert_pieces, scheme,
                                           acts=work.acts.experts))
        if rank == 0:  # KV cache scales: per attention layer, the same on every rank
            for attn, scales in work.acts.kv.items():
                tensors.update({self._ckpt_module(attn) + k: v for k, v in scales.items()})
        if rank == 0 and self.rotation is not None:  # online rotations' matrices (R4), beside their Linears
            tensors.update({self._ckpt_module(f"{work.prefix}.{n}") + rel: v
                            for n, rel, v in self.rotation.online_tensors(work.block, self.weight_dtype)})
        skip = {f"{l.name}.weight" for l in work.linears} | {f"{p}.{f}" for p, ex, _ in work.experts
                                                             for f in expert_params(ex)}
        params = dict(self.model.named_parameters())
        for n in names:
            if n in skip:
                continue
            t_ = full_tensor(params[n] if n in params else self.model.get_buffer(n))
            if rank == 0:
                tensors.update(self.weights.ckpt_tensors(n, t_.detach()))
        chain = fp_chain = None
        if self.calibrated and b + 1 < len(self.targets.blocks):  # the next block's inputs (new tensors)
            chain = [h for h, _ in self.inputs]
            fp_chain = [h for h, _ in self.fp_inputs] if self.algo.fp_chain else None
        wait = self.run.write_block(b, tensors, bad, chain, fp_chain)
        self.weights.free(names)
        self.trim()
        return wait

    def _ckpt_module(self, name: str) -> str:
        """The checkpoint prefix of module ``name`` (``model.layers.0.self_attn.``), read off one of
        its parameters' checkpoint names."""
        module = self.model.get_submodule(name)
        for rel, _ in module.named_parameters():
            ck = self.weights.ckpt_name(f"{name}.{rel}")
            if ck.endswith(rel):
                return ck.removesuffix(rel)
        return f"{name}."

    # ---- after the blocks
    def finish(self, start: int) -> dict:
        """Root tensors, then rank 0's final stage that every rank waits for."""
        rank, weights = self.rank, self.weights
        trim_heap()  # the blocks' freed buffers back to the system: the end's peak is the root's, not theirs
        self.peaks.start("blocks" if self.peaks.phases else "before_blocks")
        for entry in self.stats.blocks:  # the background files' bookkeeping, by block
            entry["bookkeeping"] = round(self.run.book_s.get(entry["block"], 0.0), 3)
        params = dict(self.model.named_parameters())
        root = {}
        for n in weights.root_names:  # whole, under the checkpoint's own names (a tied alias has no key)
            t = full_tensor(params[n] if n in params else self.model.get_buffer(n))
            if rank == 0:
                root.update(weights.ckpt_tensors(n, t.detach()))
        if self.rotation is not None:  # a tied lm_head untied (collective; rank 0 writes root)
            root.update(self.rotation.root_tensors())
        if rank == 0:
            self.run.fragments.update(writer.write_tensors(self.out, shard_name(0, None), root))
            self.run.fragments.update(weights.write_extras(self.out))
        self.peaks.fold("final")  # (rank 0's final stage -- config, report, index -- allocates little)
        mine = {"rank": rank, "peak_rss_bytes": self.peaks.peak, "peak_rss_phases": self.peaks.phases,
                "peak_gpu_bytes": _peak_gpu(self.device),
                **({"predicted_peak_bytes": self.memory["predicted_peak_rank0_bytes" if rank == 0 else
                                                        "predicted_peak_bytes"], "base_rss_bytes": self.memory["base"]}
                   if self.memory else {}),
                **({"read_bytes": weights.bytes_read, "predicted_read_bytes": (self.time.get("predicted_read_bytes")
                                                                               or [None] * self.world)[rank]}
                   if getattr(weights, "bytes_read", None) is not None else {}),
                "machine": machine(), "blocks": self.stats.blocks}
        all_frags, _, all_mine = self.run.gather(mine)

        def final() -> dict:  # rank 0: config, side files, report and (last) the index
            report = self._report(all_mine, start)
            unquantized = sorted({*self.targets.unquantized, *self.run.skipped})
            config = weights.config if self.rotation is None else self.rotation.config(weights.config)
            transforms = None if self.rotation is None else self.rotation.transform_config(self._ckpt_module)
            self.run.write_final(config, config_groups(self.targets, weights), unquantized, report,
                                 all_frags, lambda: weights.write_side_files(self.out),
                                 kv_cache=kv_cache_args(self.cfg.kv_cache), before_index=lambda: _summary(report, self.out),
                                 transforms=transforms)
            return report

        return self.run.final(final)

    def _report(self, all_mine: list, start: int) -> dict:
        cfg, weights = self.cfg, self.weights
        report = {
            "args": cfg.to_dict(),
            "source": weights.describe(),
            "scheme": self.assigner.default.to_dict() if self.assigner.default is not None else None,
            "recipe": self.assigner.to_dict() if cfg.recipe or self.search_report else None,
            "assignment": self.targets.assignment,
            "world_size": self.world,
            "versions": versions(),
            "ignored_linears": self.targets.unquantized,
            "carried_over": weights.carried,
            "seconds": round(time.perf_counter() - self.t_start, 3),
            "ranks": all_mine,
            "layers": self.stats.layers,
            "experts_rtn_fallback": len(self.stats.experts_rtn),
            **({"experts": experts_report(self.stats.expert_tokens, self.stats.experts_rtn,
                                         cfg.calibrate_all_experts)} if self.stats.expert_tokens else {}),
            "resumed_from_block": start,
            "skipped_nonfinite": self.run.skipped,  # left unquantized: NaN/Inf weights (--skip-nonfinite)
            # routed experts written in full precision (--allow-unquantized-experts; refused without it)
            "unquantized_experts": unquantized_experts_report(carried_experts(self.model)),
        }
        if self.choice is not None or self.hessian:
            report["speed"] = {**(self.choice.to_dict() if self.choice is not None else {}),
                               **({"hessian": self.hessian} if self.hessian else {})}
        if self.stats.per_block:
            report[cfg.algo.name] = self.stats.per_block
        if self.search_report:  # --target-bits: every unit's scores and choice
            report["search"] = self.search_report
        if self.rotation is not None:
            report["rotation"] = self.rotation.report
        if self.memory:  # the preflight's prediction beside each rank's measured peak
            report["memory"] = self.memory
        if self.time:  # the predicted seconds (by phase, by block), the bytes each rank reads, the rates that priced them
            report["time"] = self.time
        if self.disk:  # the preflight's prediction beside what is in the folder now (report and index to come)
            report["disk"] = {**self.disk, "written_output_bytes": written_bytes(self.out)}
        return report


@torch.no_grad()
def run_pipeline(cfg, model: nn.Module, weights, assigner: Assigner, data: dict, windows, parallelize,
                 t_start: float) -> dict:
    """The job, whatever the weights' source (a checkpoint, or a model in memory): refusals,
    output folder, blocks, final stage.  Returns the report on rank 0, ``{}`` elsewhere."""
    p = _Pipeline(cfg, model, weights, assigner, data, windows, parallelize, t_start)
    if not p.claim():
        return {"complete": True}
    with p.run.log_file():
        return _run_blocks(p)


def _run_blocks(p: _Pipeline) -> dict:
    """Restart point, calibration inputs, every block left, the final stage."""
    model, weights, parallelize = p.model, p.weights, p.parallelize
    n_blocks = len(p.targets.blocks)
    logger.info("quantizing %s -> %s on %d rank(s): %d Linears, %d expert groups", weights.describe(), p.out,
                p.world, sum(len(ls) for ls in p.targets.linears), sum(len(es) for es in p.targets.experts))
    use_sdpa(model, *((p.choice.attn_chunk, p.choice.attn_backward) if p.choice is not None else (None,)))
    start = p.restart_point()
    if parallelize is not None:
        parallelize(p.compute_dtype)
    weights.fill(weights.root_names)
    if p.rotation is not None:  # the probe, then R1 on the root (proven) before block 0's inputs are captured
        p.rotation.start(p.compute_dtype)
    if p.cfg.target_bits is not None:
        apply_search(p)
    if p.calibrated and start < n_blocks:
        p.calibration_inputs(start)
    p.progress = block_progress(n_blocks, start, bar=p.rank == 0)
    try:
        for b in range(start, n_blocks):
            p.block(b)
    finally:  # the last block's files (a failure there raises here)
        p.run.files.close()
    p.progress.close()
    return p.finish(start)


def _summary(report: dict, out: Path) -> None:
    """The report's summary on the log, and its picture."""
    for line in summary_lines(report):
        logger.info("%s", line)
    picture = write_report_png(report, out / REPORT_PNG)
    if picture is not None:
        logger.info("report picture: %s", picture)


def _peak_gpu(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
