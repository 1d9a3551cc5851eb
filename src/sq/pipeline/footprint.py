"""The memory a job's ranks need, predicted before any weight is read (``sq.ptq``'s preflight, ``python -m sq.plan``).

A rank's peak is counted in parts, each from the model on the meta device and the job's arguments:

    base         the process as it stands at the preflight (interpreter, torch, the model on meta,
                 the tokenizer and corpus, the process group): measured, not modelled
    root         this rank's shard of the parameters outside the decoder blocks (embeddings, final
                 norm, lm_head), resident for the whole run
    block        the block in flight: this rank's shard of it, the copy FSDP2 gathers for its
                 forwards (in the compute dtype; under ``--ep`` only this rank's experts), the copy
                 of this rank's rows a solve works on and what it returns; the previous block's
                 files, written in the background meanwhile (tensors, and their serialized bytes)
    chain        the calibration chain: this rank's tokens x hidden in the compute dtype: inputs,
                 outputs and the copy the resume cache serializes (each twice with a full-precision
                 chain)
    activations  one calibration forward's intermediate tensors (``CALIB_BATCH`` samples)
    algorithm    what the algorithm holds through the block (``Algorithm.memory``: GPTQ's float64
                 Hessians, AWQ's cached inputs) and what its solve allocates (GPTQ's factorization
                 and sweep, SignRound's tuning loop), which never coexists with a forward's
                 activations: the block's peak is the larger of the two phases
    heap         freed buffers the C heap keeps between blocks (``sq.memory.tune_heap``): a calibrated
                 job trims it every few blocks or once it holds ``HEAP_KEEP`` more (``sq.memory.HeapTrim``),
                 others after every block, down to glibc's trim threshold; so up to the smaller of that and
                 the block's buffers small enough to come from the heap (under ``HEAP_MMAP_THRESHOLD``)
                 waits there when the next block peaks

    final        the end: the root tensors gathered whole (every rank), kept and serialized for the
                 root shard file (rank 0)

and the peak is ``base + root + max(the largest block's phase, final)``.  On a GPU the parts after ``base`` are device
memory, and the host side is counted apart: the block's files and the chain cache serialized in host memory by the
background writer while the next block's shard is staged there, and rank 0's root and carried tensors at the end
(``predicted_host_peak_bytes``; no GPU has measured it yet).  The preflight
refuses a job whose ranks on one node would need more than the node has available
(``MemAvailable``, a cgroup's limit) or a GPU more than it has free, naming the knobs that shrink
each part; the report keeps the prediction beside each rank's measured peak
(``sq_report.json`` ``memory``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from sq.anatomy import expert_params, experts_modules, partner_groups
from sq.memory import HEAP_KEEP, HEAP_MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD
from sq.pipeline.disk import block_output_bytes, size
from sq.quant.attention import attention_shape
from sq.quant.forward import ACT_HIDDEN, ACT_WIDE, CALIB_BATCH

__all__ = ["BlockShape", "MemoryFacts", "predict_memory", "predict_ranks", "memory_problems", "available_host_bytes", "Buffers",
           "carried_bytes", "fitting_layout", "with_layout", "fit_memory"]


def _bytes(dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype or torch.float32).element_size()


Buffers = list[tuple[int, int]]  # (bytes of one buffer, how many)


def _sum(buffers: Buffers) -> int:
    return sum(n * k for n, k in buffers)


def _small(buffers: Buffers) -> int:
    """The bytes in buffers the C heap serves (and keeps when freed); larger ones are mapped and unmapped."""
    return sum(n * k for n, k in buffers if n < HEAP_MMAP_THRESHOLD)


@dataclass(frozen=True)
class BlockShape:
    """One decoder block's sizes, from the model on meta."""

    params: tuple[tuple[int, bool], ...]  # each parameter's elements, and whether it is in an experts module
    linears: tuple[tuple[int, int], ...]  # each quantized Linear's (in, out)
    accumulators: tuple[tuple[int, int], ...]  # each distinct input the quantized Linears read (fused partners share
    # one): its width and the rows of the Linears reading it
    experts_modules: tuple[tuple[int, int, int], ...]  # each quantized experts module's (experts, hidden, intermediate)
    widest: int  # the widest activation per token (the largest Linear or expert width)

    @property
    def dense(self) -> int:
        return sum(n for n, e in self.params if not e)

    @property
    def experts(self) -> int:
        return sum(n for n, e in self.params if e)


@dataclass(frozen=True)
class MemoryFacts:
    """What an algorithm's own part reads (``Algorithm.memory``)."""

    block: BlockShape
    samples: int  # this rank's calibration samples (0: the job reads no data)
    seqlen: int
    hidden: int
    compute_bytes: int  # bytes per element of the forwards' dtype
    weight_bytes: int
    world: int
    ep: int
    calibrate_all_experts: bool
    rank: int = 0
    heads: int = 0  # the attention's query heads
    # the query chunks sq's attention backward may run at where a step's gradients flow through the attention
    # (SignRound on CPU: the job's probed chunk, or every one the probe may choose; none: SDPA's backward)
    hand_chunks: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        """This rank's calibration tokens."""
        return self.samples * self.seqlen

    @property
    def steps(self) -> int:
        """Calibration forwards per pass over this rank's samples."""
        return math.ceil(self.samples / CALIB_BATCH)

    @property
    def step_tokens(self) -> int:
        """The tokens of one calibration forward."""
        return min(self.samples, CALIB_BATCH) * self.seqlen

    @property
    def chain(self) -> Buffers:
        """One copy of this rank's calibration chain (a block's inputs or outputs), one buffer per forward."""
        return [(self.step_tokens * self.hidden * self.compute_bytes, self.steps)] if self.samples else []

    def owned_experts(self, n: int) -> int:
        return math.ceil(n / self.ep)


def block_shape(block: nn.Module, linears, experts) -> BlockShape:
    """``linears`` / ``experts``: the block's quantization targets (``sq.pipeline.targets``)."""
    in_experts = {id(p) for _, ex in experts_modules(block) for p in ex.parameters()}
    params = tuple((p.numel(), id(p) in in_experts) for p in block.parameters())
    shapes = {lin.name: (lin.module.in_features, lin.module.out_features) for lin in linears}
    accumulators = tuple((shapes[g[0]][0], sum(shapes[n][1] for n in g)) for g in partner_groups(list(shapes)))
    ex_shapes = []
    for ex in experts:
        gu, down = (ex.module._parameters[n] for n in expert_params(ex.module))
        ex_shapes.append((int(down.shape[0]), int(gu.shape[-1]), int(down.shape[-1])))
    widest = max([max(s) for s in shapes.values()] + [2 * s[2] for s in ex_shapes] + [1])
    return BlockShape(params, tuple(shapes.values()), accumulators, tuple(ex_shapes), widest)


def _block_buffers(shape: BlockShape, f: MemoryFacts, resident: bool) -> tuple[Buffers, Buffers, Buffers]:
    """The block in flight, by phase: (held throughout: this rank's shard of each parameter, unless resident;
    the forwards': FSDP2's all-gather of the unit in the compute dtype, one flat buffer -- under --ep the experts
    stay out of it: each rank runs its own experts, cast where the compute dtype differs, their rows gathered
    where dp splits them --; the solve's: each Linear's rows a solve copies and what it returns (codes and
    dequantized rows), the owned experts' stacked codes)."""
    wb, cb, world, ep = f.weight_bytes, f.compute_bytes, f.world, f.ep
    held: Buffers = [] if resident else [(math.ceil(n / world) * wb, 1) for n, _ in shape.params]
    experts = shape.experts
    fwd: Buffers = [((shape.dense + (experts if ep == 1 else 0)) * cb, 1)]
    if ep > 1 and experts and (world > ep or cb != wb):
        fwd.append((math.ceil(experts / ep) * cb, 1))
    solve: Buffers = [(math.ceil(o / world) * i * (2 * wb + 1), 1) for i, o in shape.linears]
    if experts:  # solved one expert at a time into stacks of codes (one byte an element) kept to the write
        solve.append((math.ceil(experts / world), 1))
    return held, fwd, solve


def _early_solve(shape: BlockShape, f: MemoryFacts) -> Buffers:
    """The solve's block buffers before any weight is solved (an algorithm's ``"dense"`` stage): the copies of
    this rank's rows the solve reads."""
    return [(math.ceil(o / f.world) * i * f.weight_bytes, 1) for i, o in shape.linears]


def predict_memory(model: nn.Module, targets, algo, *, rank: int | None = None, **job) -> dict:
    """Rank ``rank``'s predicted peak and its parts (bytes); None: the largest over the ranks.  ``job``: the
    keyword arguments of :func:`predict_ranks`."""
    ranks = [rank] if rank is not None else range(job["world"] if algo.rank_dependent_memory else 1)
    return max(predict_ranks(model, targets, algo, ranks=ranks, **job).values(),
               key=lambda m: m["predicted_peak_rank0_bytes"])


def predict_ranks(model: nn.Module, targets, algo, *, ranks, base: int, world: int, ep: int, nsamples: int,
                  seqlen: int, calibrated: bool, compute_dtype: torch.dtype | None, weight_dtype: torch.dtype | None,
                  calibrate_all_experts: bool = True, device: str = "cpu", resident: bool = False,
                  bookkeeping: bool = True, carried: int = 0, hand_chunks: tuple[int, ...] = (),
                  overlap: bool = True) -> dict[int, dict]:
    """Each of ``ranks``' predicted peak and its parts (bytes), by rank: what does not depend on the rank (the
    block, the chain, the activations) is counted once per distinct block, only the algorithm's part per rank.
    ``resident``: the weights are in memory already (the Python API's model), so in ``base``: no root or shard
    to fill.  ``carried``: the bytes of the largest checkpoint tensor the model has no slot for (an MTP layer's), in
    the model's dtype (FP8 ones dequantized): rank 0 writes them at the end, one at a time (:func:`carried_bytes`).
    ``hand_chunks``: ``MemoryFacts.hand_chunks``.  ``overlap``: the previous block's files are written while a
    block computes (False: ``--fit-memory``'s choice, written before it starts)."""
    ranks = list(ranks)
    wb, cb = _bytes(weight_dtype), _bytes(compute_dtype or weight_dtype)
    hidden = int(model.get_input_embeddings().weight.shape[-1])
    heads = attention_shape(model)[0]
    in_blocks = {id(p) for _, blk in targets.blocks for p in blk.parameters()}
    root_params = {id(p): p for p in model.parameters() if id(p) not in in_blocks}  # tied once
    root_full = sum(p.numel() for p in root_params.values()) * wb
    root = 0 if resident else math.ceil(root_full / world)
    samples = math.ceil(nsamples / world) if calibrated else 0
    worst, parts, seen = dict.fromkeys(ranks, -1), {r: {} for r in ranks}, set()
    host_block = 0
    for b, (prefix, blk) in enumerate(targets.blocks):
        shape = block_shape(blk, targets.linears[b], targets.experts[b])
        key = (shape, tuple(id(l.scheme) for l in targets.linears[b]), tuple(id(e.scheme) for e in targets.experts[b]),
               b > 0)  # (the first block has no previous one written beside it)
        if key in seen:  # repeated blocks: the same prediction
            continue
        seen.add(key)
        facts = MemoryFacts(shape, samples, seqlen, hidden, cb, wb, world, ep, calibrate_all_experts,
                            heads=heads, hand_chunks=hand_chunks)
        step = facts.step_tokens
        # the previous block's files, written in the background while this one computes: this rank's share of
        # its tensors, and the same serialized in memory (sq.export.writer.write_shard)
        written = math.ceil(block_output_bytes(targets, b - 1, weight_dtype) / world) if b and overlap else 0
        block, block_fwd, block_solve = _block_buffers(shape, facts, resident)
        block += [(written, 1), (written, 1)]
        if not calibrated:  # no calibration forward: what a forward gathers is counted beside the solve (measured)
            block, block_fwd = block + block_fwd, []
        # inputs and outputs, of the full-precision chain too where the algorithm keeps it, and the chain cache
        # the background writer serializes for a resume (sq.resume)
        copies = 2 + bool(bookkeeping)
        chain = facts.chain * (copies * (2 if algo.fp_chain else 1))
        acts = [(step * hidden * cb, ACT_HIDDEN), (step * shape.widest * cb, ACT_WIDE)] if step else []
        if device == "cuda":  # the host side: the block's files and chain cache moved to host memory and serialized
            # there (by the background writer, while the next block's shard is staged through host buffers)
            own = math.ceil(block_output_bytes(targets, b, weight_dtype) / world)
            host_block = max(host_block, 2 * own + (_sum(facts.chain) * (2 if algo.fp_chain else 1) * 2
                                                        if bookkeeping else 0)
                             + (0 if resident else math.ceil(_sum([(n, 1) for n, _ in shape.params]) * wb / world)))
        for r in ranks:
            rf = dataclasses.replace(facts, rank=r)
            held, solve = algo.memory(rf) if calibrated or not algo.calibrated else ([], [])
            fwd = algo.forward_memory(rf) if calibrated else []  # held through the forwards only
            # the solve's stages (an algorithm's own, else one: every result held): the largest, with the block's
            # buffers of that stage
            stages = algo.solve_stages(rf) if calibrated else []
            # experts under FSDP2 (--ep 1): their gathered copy's memory is not given back before the solve
            gathered = block_fwd if shape.experts and ep == 1 else []
            if not stages:  # an algorithm that does not say: the forward's and the solve's block buffers together
                stages, solving_all = [("end", solve)], block_solve + block_fwd
            else:
                solving_all = block_solve + gathered
            # (one rank solves every width in one call: the earlier widths' results are held by the last one's)
            by_stage = {"dense": (block_solve if world == 1 else _early_solve(shape, facts)) + gathered,
                        "end": solving_all}
            stage, solve = max(stages, key=lambda st: _sum(st[1]) + _sum(by_stage[st[0]]))
            solving = by_stage[stage]
            # freed small buffers the heap keeps (sq.pipeline.blocks: HeapTrim): a calibrated job trims every few
            # blocks, so up to HEAP_KEEP of the churn of the blocks before waits there (none before the first), the
            # larger phase's small buffers with the chain's and what is held; others trim after every block, where
            # glibc keeps up to its trim threshold
            small_f = _small(acts) + _small(fwd) + _small(block_fwd)
            small_s = _small(solve) + _small(solving)
            kept = 0 if not b else min(HEAP_KEEP if calibrated else HEAP_TRIM_THRESHOLD,
                                       max(small_f, small_s) + _small(chain) + _small(held))
            heap = {"forward": kept, "solve": kept}
            common = _sum(block) + _sum(chain) + _sum(held)
            whole = {"forward": common + _sum(block_fwd) + _sum(acts) + _sum(fwd) + heap["forward"],
                     "solve": common + _sum(solving) + _sum(solve) + heap["solve"]}
            # a calibration forward's transients and a solve's never coexist: the block's peak is the larger phase
            phase = "solve" if whole["solve"] > whole["forward"] else "forward"
            p = {"block": _sum(block) + _sum(solving if phase == "solve" else block_fwd), "chain": _sum(chain),
                 "activations": _sum(acts) if phase == "forward" else 0,
                 "algorithm": _sum(held) + (_sum(solve) if phase == "solve" else _sum(fwd)), "heap": heap[phase]}
            total = sum(p.values())
            if total > worst[r]:  # (each phase's whole beside it: the peak is the larger)
                worst[r], parts[r] = total, {**p, "phase": phase, "peak_block": prefix,
                                             "forward_bytes": whole["forward"], "solve_bytes": whole["solve"]}
    # the end: each root tensor all-gathered whole on every rank (the gather's output and its chunks), rank 0
    # keeping them all for the root shard file and serializing that file in memory; then the carried tensors read
    # (dequantized) and written one at a time beside the root it still holds
    final, final0 = 2 * root_full, max(3 * root_full, root_full + int(CARRIED_COPIES * carried))
    empty = {"phase": "forward", "peak_block": None, "block": 0, "chain": 0, "activations": 0, "algorithm": 0, "heap": 0}
    host = {}
    if device == "cuda":  # rank 0's root copied to host memory and serialized there, then the carried tensors read
        # there one at a time: the GPU holds the root alone
        host_final, final0 = max(2 * root_full, int(CARRIED_COPIES * carried)), 3 * root_full
        host = {"host_block": host_block, "host_final": host_final,
                "predicted_host_peak_bytes": base + max(host_block, 0),
                "predicted_host_peak_rank0_bytes": base + max(host_block, host_final)}
    return {r: {"device": device, "rank": r, "algorithm_knob": algo.memory_knob, "base": base, "root": root,
                **empty, **parts[r], "final": final,
                "predicted_peak_bytes": base + root + max(worst[r], 0, final),  # every rank but 0
                "predicted_peak_rank0_bytes": base + root + max(worst[r], 0, final0), **host}
            for r in ranks}


CARRIED_COPIES = 2  # the carried tensor being written: as read, dequantized (FP8), its float32 chunk


def carried_bytes(plan, dtype: torch.dtype | None, largest: bool = False) -> int:
    """The carried tensors (``plan.carried``: checkpoint keys with no slot in the model) at the model's dtype, as
    rank 0 writes them (FP8 weights dequantized), in all; ``largest``: the largest one (rank 0 holds one at a
    time: ``sq.export.writer.write_streamed``)."""
    if plan is None:
        return 0
    size = _bytes(dtype)
    each = [math.prod(plan.source.tensors[k].shape) * (size if plan.source.tensors[k].dtype.itemsize == 1 else
                                                       plan.source.tensors[k].dtype.itemsize)
            for k in plan.carried if k in plan.source.tensors]
    return max(each, default=0) if largest else sum(each)


def available_host_bytes() -> tuple[int | None, str]:
    """What this node can still give: ``MemAvailable``, or less where a cgroup (v2 or v1) limits the job."""
    avail, where = None, "MemAvailable"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_f).read().strip()
            usage = int(open(usage_f).read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < (1 << 60):
            left = int(limit) - usage
            if avail is None or left < avail:
                avail, where = left, f"the cgroup limit ({limit_f})"
        break
    return avail, where


def _local_world() -> int:
    try:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return 1


# what shrinks each part, for the refusal
KNOBS = {
    "root": "more ranks (the root is sharded over them)",
    "block": "more ranks, or --ep for an MoE (a block is sharded over the ranks, experts split by --ep)",
    "chain": "fewer --nsamples or a shorter --seqlen, more ranks (each holds its share of the samples), or "
             "--calib-dtype model (a half-precision chain)",
    "activations": "a shorter --seqlen",
    "heap": "MALLOC_MMAP_THRESHOLD_=65536 in the job's environment (freed buffers go back to the system at once)",
}
PARTS = ("root", "block", "chain", "activations", "algorithm", "heap")


def memory_problems(pred: dict, *, local_world: int | None = None, started: bool = True,
                    available: int | None = None, where: str | None = None, parts: tuple = PARTS,
                    knobs: dict = KNOBS, by: str = "sq.pipeline.footprint", host_available: int | None = None,
                    host_where: str | None = None) -> tuple[list[str], dict]:
    """Refusal when the ranks of one node (``LOCAL_WORLD_SIZE``) would need more host memory than the node has,
    or one GPU more than it has free; the numbers for the report.

    ``started``: the ranks are running (``sq.ptq``'s preflight), so each one's base is in use already and the
    node needs each rank's growth beyond it; else (``sq.plan``) the whole peaks.  ``available``: the bytes
    the node (a GPU, when the prediction is a GPU's) can give; None: this machine's, measured now."""
    local_world = local_world or _local_world()
    gpu = pred["device"] == "cuda"
    peak, peak0 = pred["predicted_peak_bytes"], pred["predicted_peak_rank0_bytes"]
    if gpu:  # the parts after base are device memory, one GPU per rank
        need = peak0 - pred["base"]
        if available is None and torch.cuda.is_available():
            available, where = torch.cuda.mem_get_info()[0], "the GPU's free memory"
        what = "one GPU"
    else:
        need, available, where = _node_need(peak, peak0, pred["base"], started, local_world, available, where)
        what = f"the {local_world} rank(s) of one node"
    where = where or "the stated memory"
    host_problems, host_facts = _host_side(pred, local_world, started, host_available, host_where) if gpu else ([], {})
    biggest = max(parts, key=lambda k: pred.get(k, 0))
    knob = pred["algorithm_knob"] if biggest == "algorithm" else knobs[biggest]
    facts = {"need_bytes": need, "available_bytes": available, "where": where, "local_ranks": local_world, **host_facts}
    if available is None or need <= available:
        return host_problems, facts
    listed = ", ".join(f"{k} {size(pred[k])}" for k in parts if pred.get(k))
    held = f" beyond the {size(pred['base'])} each holds now" if started and not gpu else ""
    return [f"{'GPU' if gpu else 'host'} memory: {what} would need about {size(need)}{held} (per rank: {listed}; "
            f"predicted by {by}), and {where} gives {size(available)}; the largest part is the "
            f"{biggest}: {knob}{NO_PREFLIGHT}"] + host_problems, facts


NO_PREFLIGHT = "; or pass --no-preflight to try anyway"


def with_layout(problem: str, fits: str | None) -> str:
    """A memory refusal with the layout that fits (``fitting_layout``) named before its last resort."""
    if not fits:
        return problem
    return problem.replace(NO_PREFLIGHT, f"; {fits}{NO_PREFLIGHT}") if NO_PREFLIGHT in problem else f"{problem}; {fits}"


FIT_MEMORY = "write each block's files before the next block starts"


def fit_memory(problems: list[str], pred: dict, predict, check, chosen: bool) -> tuple[list[str], dict, dict | None]:
    """``--fit-memory``: where ``pred`` does not fit (``problems``), the prediction without the previous block's
    files beside each block (``predict(overlap=False)``, the same output).  ``chosen``: the flag was given, so
    a prediction that fits is taken (returned with its problems, none, and what was chosen); else a refusal that
    names the flag.  Returns (problems, the prediction in force, the choice or None)."""
    if not problems:
        return problems, pred, None
    other = predict(overlap=False)
    if check(other):
        return problems, pred, None
    if chosen:
        return [], other, {"write_overlap": False, "why": f"{FIT_MEMORY}: predicted peak "
                                                          f"{size(other['predicted_peak_rank0_bytes'])} per rank, "
                                                          f"{size(pred['predicted_peak_rank0_bytes'])} otherwise"}
    return [with_layout(problems[0], f"--fit-memory makes it fit on these ranks ({FIT_MEMORY}: the same output, "
                                     f"predicted peak {size(other['predicted_peak_rank0_bytes'])} per rank)"),
            *problems[1:]], pred, None


def fitting_layout(predict, *, world: int, local_world: int, check, most: int = 1024) -> str | None:
    """The smallest layout of more nodes like this one (``local_world`` ranks each) whose ranks fit, as a sentence
    for a refusal; None if none up to ``most`` ranks does.  ``predict(world) -> (prediction, ep)`` for a world
    size; ``check(prediction) -> problems`` judges one (``memory_problems`` with the job's node)."""
    nodes = max(1, world // max(1, local_world))
    while (nodes := nodes * 2) * local_world <= most:
        pred, ep = predict(nodes * local_world)
        if not check(pred):
            return (f"it fits on {nodes} such nodes: --nnodes {nodes} --nproc-per-node {local_world} --ep {ep} "
                    f"(predicted peak {size(pred['predicted_peak_rank0_bytes'])} per rank)")
    return None


def _node_need(peak: int, peak0: int, base: int, started: bool, local_world: int, available: int | None,
               where: str | None) -> tuple[int, int | None, str | None]:
    """The host bytes one node's ranks need (rank 0's peak and the others'; ``started``: each base is in use
    already), and what the node has (``available``, else this machine's, measured now)."""
    held = base if started else 0
    if available is None:
        available, where = available_host_bytes()
    return (local_world - 1) * (peak - held) + (peak0 - held), available, where


def _host_side(pred: dict, local_world: int, started: bool, available: int | None,
               where: str | None) -> tuple[list[str], dict]:
    """A GPU job's host memory: each rank's process and what passes through host memory (the block's files and
    chain cache as they are serialized, a block's shard staged while it is read; rank 0's root and carried
    tensors at the end), the node holding its ranks."""
    need, available, where = _node_need(pred["predicted_host_peak_bytes"], pred["predicted_host_peak_rank0_bytes"],
                                        pred["base"], started, local_world, available, where)
    where = where or "the stated memory"
    facts = {"host_need_bytes": need, "host_available_bytes": available, "host_where": where}
    if available is None or need <= available:
        return [], facts
    return [f"host memory: the {local_world} rank(s) of one node would need about {size(need)} beside their GPUs "
            f"(per rank: block files and chain cache {size(pred['host_block'])}, rank 0's root and carried tensors "
            f"at the end {size(pred['host_final'])}; predicted by sq.pipeline.footprint), and {where} gives "
            f"{size(available)}: fewer ranks per node, or fewer --nsamples (a smaller chain cache); or pass "
            "--no-preflight to try anyway"], facts
