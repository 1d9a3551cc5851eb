"""The time a job's ranks take, predicted before any weight is read (``sq.ptq``'s preflight, ``python -m sq.plan``).

Each block's phases are counted as work from the model on meta and the job's arguments, then priced by this
machine's speeds (:class:`Rates`), measured by short probes at start (or stated for another machine):

    fill         the bytes each rank reads from the checkpoint (:func:`read_bytes`: exactly what its reader will
                 ask the files for), a fixed cost per fill and per tensor
    calibrate    the algorithm's calibration (``Algorithm.cost``): GPTQ's forward with its Hessian accumulation,
                 AWQ's grid search (a forward of the mapped layers per grid point), SignRound's tuning steps
    solve        the algorithm's solve: GPTQ's factorizations and column sweeps (Python-bound: a measured cost
                 per column, and per column and row), the rows gathered to their solver; RTN's elementwise passes
    forward      the quantized block on this rank's tokens, for the next block's inputs
    write        the rank's share of the block's output: gathered to its writer, packed, handed to the background
                 writer (which writes it, and the resume state, while the next block computes)

Each block's phase takes as long as its slowest rank (the ranks meet in the phase's collectives).  A forward is
priced as its matmuls (``gemm``: FLOP/s in the compute dtype), its attention (``attention``), its activations'
elementwise passes (``mem``), its small ops (``op``: seconds each) and, on more than one rank, FSDP2's gathers
(``link``, ``collective``); GPTQ by timing GPTQ's own code on the job's scheme (``hessian``, ``factor``,
``column``, ``cell``); the disk by reading the checkpoint and writing durably beside the output.  The compute
probes run on every rank at the same time, as the ranks will compute, on the job's own widths (about a
second), and are kept per machine in the sq cache (``$SQ_CACHE_DIR/rates``) as ``sq.probe``'s are; the disk's
are measured every time.  What the probes do not see -- a forward's elementwise passes and small ops, a
fill's and a write's fixed costs, a collective's rendezvous -- are constants fitted on this project's CPU runs
(below), in units of the measured rates, so they scale with the machine.

Measured against predicted: ``bench/footprint.py`` and docs/benchmarks.md ("Time: predicted and measured").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass

import torch

from sq.anatomy import config_size
from sq.files import default_cache_dir, write_bytes_atomic
from sq.pipeline.footprint import MemoryFacts, block_shape
from sq.quant.forward import ACT_HIDDEN, ACT_WIDE
from sq.quant.gptq import bf16_products
from sq.quant.work import Cost

logger = logging.getLogger(__name__)

__all__ = ["Rates", "Forwards", "CostFacts", "probe_rates", "stated_rates", "predict_times", "read_bytes", "PHASES"]

PHASES = ("fill", "calibrate", "solve", "forward", "write")

# fitted on this project's CPU runs (docs/benchmarks.md): the elementwise passes a forward makes over its
# activations (norms, rotary, residuals, the gate's product, casts), the small ops of one decoder block's
# forward call (and of each expert it routes to), the ops of a fill, a write stage and a checkpoint tensor
ACT_PASSES = 6
OPS_PER_CALL = 120
OPS_PER_EXPERT = 2000  # per expert and forward call: routing, gathers and the grouped matmul's set-up (fitted)
OPS_PER_FILL = 15000
OPS_PER_PIECE_READ = 1200  # a checkpoint tensor's box: DCP's planning and the read into its shard
FP8_DEQUANT_BYTES = 60  # an FP8 element dequantized while read (a table gather, its block's scale broadcast, the casts), in bytes moved
OPS_PER_TENSOR_WRITE = 350  # an output tensor packed, named and handed to the writer
OPS_PER_WRITE = 20000  # a block's write stage: gathers of its small tensors, the background writer's hand-off
WRITE_PASSES = 8  # elementwise passes packing a rank's share of the codes and scales
OPS_PER_COLLECTIVE = 1000  # a collective between the ranks of one host (gloo): its rendezvous, in small ops
LINK_SHARE = 4  # a collective's bytes move this much slower than one local socket's (gloo's copies, busy cores)
FILES_PER_BLOCK = 1  # a rank's shard file of the block (the resume state is written in the background)
OPS_START = 150000  # between the preflight and block 0: the output claimed, the model sharded, block 0's inputs
OPS_FINAL = 300000  # the final stage: the index, the report and its picture


@dataclass(frozen=True)
class Rates:
    """A machine's speeds, per rank (each rank's share of the machine when its ranks compute at once), one per
    field of ``Cost``: FLOP/s, units/s or bytes/s, and seconds per op, column, sweep cell and file."""

    gemm: float
    attention: float
    experts: float  # FLOP/s of the experts' matmuls (a few rows each: the tokens routed to one expert)
    gemm32: float
    gemm64: float
    hessian: float  # tokens x width^2 per second
    factor: float  # width^3 per second
    solve: float  # seconds (a factorization's fixed cost)
    column: float  # seconds
    cell: float  # seconds
    mem: float
    op: float  # seconds
    read: float
    write: float
    file: float  # seconds
    link: float
    collective: float  # seconds
    source: str = "probe"  # "probe", "cached", "stated"

    def seconds(self, c: Cost) -> float:
        return (c.gemm / self.gemm + c.attention / self.attention + c.experts / self.experts + c.gemm32 / self.gemm32 + c.gemm64 / self.gemm64
                + c.hessian / self.hessian + c.factor / self.factor + c.solves * self.solve + c.columns * self.column
                + c.cells * self.cell + c.mem / self.mem + c.ops * self.op + c.read / self.read + c.write / self.write
                + c.files * self.file + c.link / self.link + c.collectives * self.collective)

    def to_dict(self) -> dict:
        return {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class Forwards:
    """One pass of this rank's calibration tokens through a block (``CALIB_BATCH`` samples per call), as work:
    ``routed`` with each token at its experts (the propagate forward), ``calibrating`` with every expert on
    every token where the job calibrates all experts (GPTQ's, AWQ's observe)."""

    routed: Cost
    calibrating: Cost
    calls: int  # forward calls per pass

    def samples(self, n: int, per_pass: int) -> Cost:
        """A routed pass over ``n`` of the ``per_pass`` samples (SignRound's batches)."""
        return self.routed * (n / max(per_pass, 1))


@dataclass(frozen=True)
class CostFacts(MemoryFacts):
    """``MemoryFacts`` and what pricing the block needs beyond them."""

    fwd: Forwards | None = None
    top_k: int = 1  # experts per token


def top_k_of(config) -> int:
    """Experts per token, from a model config (1 where it names none)."""
    for k in ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k"):
        v = getattr(config, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1


def _attention_width(config, hidden: int) -> int:
    heads, dim = config_size(config, "num_attention_heads"), config_size(config, "head_dim")
    if heads is not None and dim is not None:
        return heads * dim
    return hidden


def forwards(shape, facts: MemoryFacts, *, top_k: int, attn_width: int, n_modules: int, units: int = 1) -> Forwards:
    """A pass of this rank's tokens through a block of ``shape``: the dense parameters' matmuls, causal attention
    over ``seqlen``, ``ACT_PASSES`` elementwise passes over the activations a forward holds, and the small ops of
    each call; experts: each token at ``top_k`` of them (routed) or at every one (calibrating)."""
    t, s, cb, calls = facts.tokens, facts.seqlen, facts.compute_bytes, facts.steps
    acts = t * (ACT_HIDDEN * facts.hidden + ACT_WIDE * shape.widest) * cb * ACT_PASSES
    gathered = (shape.dense + (shape.experts if facts.ep == 1 else 0)) * cb
    base = Cost(gemm=2 * t * shape.dense, attention=2 * t * s * attn_width, mem=acts,
                ops=calls * (OPS_PER_CALL + 2 * n_modules))
    if facts.world > 1:  # FSDP2 gathers the block's units for each call
        base = base + Cost(link=calls * gathered, collectives=calls * units)
    routed = calibrating = base
    for n, h, i in shape.experts_modules:
        per_token = 2 * 3 * h * i
        if facts.ep > 1:  # every --ep rank's tokens gathered (hidden states, routes, weights), outputs all-reduced
            exchange = Cost(link=3 * t * facts.ep * h * cb, collectives=calls * 4)
            routed, calibrating = routed + exchange, calibrating + exchange
        routed = routed + Cost(experts=t * top_k * per_token, ops=calls * OPS_PER_EXPERT * n)
        calibrating = calibrating + Cost(gemm=t * n * per_token, ops=calls * OPS_PER_EXPERT * n)  # every token: wide
    return Forwards(routed, calibrating if facts.calibrate_all_experts else routed, calls)


def predict_times(model, targets, algo, *, ranks, rates: Rates, world: int, ep: int, nsamples: int, seqlen: int,
                  calibrated: bool, compute_dtype: torch.dtype | None, weight_dtype: torch.dtype | None,
                  reads: dict[int, dict] | None = None, calibrate_all_experts: bool = True) -> dict:
    """The job's predicted seconds, by phase and block: each block's phase as long as the slowest of ``ranks``
    takes (the ranks meet in the phase's collectives); and the collectives a rank joins per block (FSDP2's
    gathers, GPTQ's Hessian all-reduces and its gathers to each stack's solver, the writers' gathers), and their
    bytes, averaged over the blocks.  ``reads[r]``: what rank ``r`` reads (:func:`read_bytes`;
    None: the weights are in memory)."""
    from sq.pipeline.disk import block_output_bytes

    ranks = list(ranks)
    wb = torch.empty((), dtype=weight_dtype or torch.float32).element_size()
    cb = torch.empty((), dtype=compute_dtype or weight_dtype or torch.float32).element_size()
    config = getattr(model, "config", None)
    hidden = int(model.get_input_embeddings().weight.shape[-1])
    top_k, attn = top_k_of(config), _attention_width(config, hidden)
    samples = math.ceil(nsamples / world) if calibrated else 0
    total, blocks, collectives = dict.fromkeys(PHASES, 0.0), [], [0.0, 0.0]
    cache: dict = {}
    for b, (prefix, blk) in enumerate(targets.blocks):
        shape = block_shape(blk, targets.linears[b], targets.experts[b])
        n_modules = sum(1 for _ in blk.modules())
        written = math.ceil(block_output_bytes(targets, b, weight_dtype) / world)
        key = (shape, n_modules, written, tuple(id(l.scheme) for l in targets.linears[b]))
        if key not in cache:
            base = MemoryFacts(shape, samples, seqlen, hidden, cb, wb, world, ep, calibrate_all_experts)
            fwd = (forwards(shape, base, top_k=top_k, attn_width=attn, n_modules=n_modules,
                            units=1 + len(shape.experts_modules)) if samples else None)
            facts = CostFacts(**{f.name: getattr(base, f.name) for f in dataclasses.fields(MemoryFacts)},
                              fwd=fwd, top_k=top_k)
            phases: dict[str, float] = {}
            comm = [0.0, 0.0]  # the block's collectives and their bytes, the most any rank joins
            for r in ranks:
                work = algo.cost(dataclasses.replace(facts, rank=r))
                if fwd is not None and "forward" not in work:  # the quantized block, for the next one's inputs
                    work["forward"] = fwd.routed
                for k, w in work.items():
                    phases[k] = max(phases.get(k, 0.0), rates.seconds(w))
                comm = max(comm, [sum(w.collectives for w in work.values()), sum(w.link for w in work.values())])
            elems = sum(i * o for i, o in shape.linears) + sum(n * 3 * h * i for n, h, i in shape.experts_modules)
            # gathered: the small tensors (norms, routers) whole; each Linear's codes and scales onto its writer, unless
            # solved whole there (GPTQ on more than one rank)
            gathers = len(shape.params) - len(shape.linears) - 2 * len(shape.experts_modules)
            gathers += 0 if algo.sweeps else 3 * len(shape.linears)
            # this rank's share of the output tensors: codes, scales and zero points or shape of each Linear and of each
            # expert's three projections
            tensors = (3 * len(shape.linears) + 9 * sum(n for n, _, _ in shape.experts_modules)) / world
            phases["write"] = rates.seconds(Cost(write=written, files=FILES_PER_BLOCK, mem=WRITE_PASSES * 4 * elems / world,
                                                 ops=OPS_PER_WRITE + OPS_PER_TENSOR_WRITE * tensors,
                                                 collectives=max(gathers, 0) if world > 1 else 0))
            comm[0] += max(gathers, 0) if world > 1 else 0
            cache[key] = phases, comm
        phases, comm = dict(cache[key][0]), cache[key][1]
        collectives[0] += comm[0]
        collectives[1] += comm[1]
        if reads is not None:
            phases["fill"] = max(rates.seconds(Cost(read=reads[r]["blocks"][b], mem=FP8_DEQUANT_BYTES * reads[r]["fp8"][b],
                                                    ops=OPS_PER_FILL + OPS_PER_PIECE_READ * reads[r]["pieces"][b]))
                                 for r in ranks)
        if b + 1 == len(targets.blocks):
            phases.pop("forward", None)
        for k, v in phases.items():
            total[k] = total.get(k, 0.0) + v
        blocks.append(round(sum(phases.values()), 4))
    n = max(len(blocks), 1)
    return {"phases": {k: round(v, 3) for k, v in total.items()}, "blocks": blocks,
            "blocks_seconds": round(sum(blocks), 3), "collectives_per_block": round(collectives[0] / n, 1),
            "collective_bytes_per_block": int(collectives[1] / n)}


# ---- rates


PROBE_TOKENS = 512
MAX_WIDTH = 1024  # the probes' widths are cut to this (a GEMM's rate hardly changes past it; the probe stays small)
PROBE_BYTES = 8 << 20
SWEEP_COLS = 1024


def _best(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gemm_rate(shapes, dtype: torch.dtype, device: torch.device) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    tokens = PROBE_TOKENS
    pairs = [(torch.randn(tokens, i, generator=g, device=device).to(dtype),
              torch.randn(o, i, generator=g, device=device).to(dtype)) for i, o in shapes]

    def run():
        for x, w in pairs:
            torch.nn.functional.linear(x, w)
        _sync(device)

    return sum(2 * tokens * i * o for i, o in shapes) / _best(run)


def _experts_rate(rows: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> float:
    """The experts' gate/up matmul as the model runs it: ``torch.nn.functional.grouped_mm`` over 16 experts of
    ``rows`` tokens each where torch has it (transformers' grouped experts path), else one matmul per expert."""
    n, rows = 16, max(1, min(rows, PROBE_TOKENS))
    hidden, inter = min(hidden, MAX_WIDTH), min(inter, MAX_WIDTH)
    x = torch.randn(n * rows, hidden, device=device).to(dtype)
    w = torch.randn(n, hidden, 2 * inter, device=device).to(dtype)
    offs = torch.arange(rows, n * rows + 1, rows, device=device, dtype=torch.int32)
    grouped = getattr(torch.nn.functional, "grouped_mm", None)

    def run():
        if grouped is not None:
            grouped(x, w, offs=offs)
        else:
            for e in range(n):
                x[e * rows:(e + 1) * rows] @ w[e]
        _sync(device)

    try:
        return 2 * n * rows * hidden * 2 * inter / _best(run)
    except (RuntimeError, TypeError):  # no grouped kernel for this dtype or device: the loop
        grouped = None
        return 2 * n * rows * hidden * 2 * inter / _best(run)


def _attention_rate(heads: int, seqlen: int, dtype: torch.dtype, device: torch.device) -> float:
    q = torch.randn(1, heads, seqlen, 64, device=device).to(dtype)

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        _sync(device)

    return 2 * seqlen * seqlen * heads * 64 / _best(run)


def _mem_rate(device: torch.device) -> float:
    x = torch.ones(PROBE_BYTES // 4, device=device)
    y = torch.empty_like(x)

    def run():
        torch.mul(x, 1.5, out=y)
        _sync(device)

    return 2 * PROBE_BYTES / _best(run)


def _op_seconds(device: torch.device) -> float:
    a, b = torch.ones(1024, device=device), torch.ones(1024, device=device)
    c = torch.empty_like(a)

    def run():
        for _ in range(200):
            torch.div(a, b, out=c)
        _sync(device)

    return _best(run) / 200


def _gptq_rates(device: torch.device, scheme, width: int, seqlen: int, dtype: torch.dtype,
                weight_dtype: torch.dtype) -> dict[str, float]:
    """GPTQ's own code on the job's scheme: a calibration batch's Hessian accumulation at ``width`` (the
    job's narrowest Hessian) and ``seqlen``; the factorization at two widths (its cubic and fixed costs); the
    sweep of ``SWEEP_COLS`` columns at 64 and 1024 rows (a column's fixed cost, and its cost per row)."""
    from sq.quant.gptq import GPTQ

    g = torch.Generator().manual_seed(0)
    n = min(width, MAX_WIDTH)
    acc = GPTQ(n, device=device)
    x = torch.randn(2, seqlen, n, generator=g).to(device=device, dtype=dtype)
    out = {"hessian": 2 * seqlen * n * n / _best(lambda: (acc.add_batch(x), _sync(device)), repeats=2)}
    factor = {}
    for cols in (256, 1024):
        gq = GPTQ(cols, device=device)
        gq.add_batch(torch.randn(1, 4 * cols, cols, generator=g).to(device))
        row = torch.randn(1, cols, generator=g).to(device=device, dtype=weight_dtype)
        sweep = _best(lambda: gq.quantize(row.clone(), scheme, name="probe"), repeats=2)  # prepared once: sweep only

        def prepared():
            gq._prepared = None
            gq.quantize(row.clone(), scheme, name="probe")

        factor[cols] = max(_best(prepared, repeats=2) - sweep, 1e-6)
        if cols == SWEEP_COLS:
            sweeps = {1: sweep}
            w = torch.randn(1024, cols, generator=g).to(device=device, dtype=weight_dtype)
            sweeps[1024] = _best(lambda: gq.quantize(w.clone(), scheme, name="probe"), repeats=2)
    out["factor"] = (1024**3 - 256**3) / max(factor[1024] - factor[256], 1e-6)
    out["solve"] = max(factor[256] - 256**3 / out["factor"], 0.0)
    out["cell"] = max((sweeps[1024] - sweeps[1]) / (SWEEP_COLS * 1023), 0.0)
    out["column"] = max(sweeps[1] / SWEEP_COLS - out["cell"], 1e-7)
    return out


def _link_rate() -> float:
    """Bytes/s through a local socket (gloo's path between the ranks of one host)."""
    import socket
    import threading

    a, b = socket.socketpair()
    data = bytes(PROBE_BYTES // 2)
    try:
        sender = threading.Thread(target=a.sendall, args=(data,))
        t = time.perf_counter()
        sender.start()
        left = len(data)
        while left:
            left -= len(b.recv(min(left, 1 << 20)))
        sender.join()
        return len(data) / max(time.perf_counter() - t, 1e-6)
    finally:
        a.close()
        b.close()


def _read_rate(src) -> float:
    """Bytes/s reading the checkpoint: from the page cache where the whole checkpoint fits in the memory this
    machine has available (a job re-reading it finds it there), else from the disk -- the middle ``PROBE_BYTES``
    of its largest file, dropped from the cache first (``posix_fadvise``), then read."""
    from sq.pipeline.footprint import available_host_bytes

    files = sorted(src.glob("*.safetensors"), key=lambda p: -p.stat().st_size) if src is not None else []
    if not files:
        return 2e9
    total = sum(f.stat().st_size for f in files)
    fits = total < (available_host_bytes()[0] or 0)
    with open(files[0], "rb", buffering=0) as f:
        at = max(0, files[0].stat().st_size // 2 - PROBE_BYTES // 2) // 4096 * 4096
        if not fits and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), at, PROBE_BYTES, os.POSIX_FADV_DONTNEED)
        for _ in range(1 if not fits else 2):  # (where it fits: the second read, from the cache)
            t = time.perf_counter()
            n = len(os.pread(f.fileno(), PROBE_BYTES, at))
            dt = time.perf_counter() - t
    return max(n, 1 << 20) / max(dt, 1e-6)


def _io_rates(src, out_dir) -> dict[str, float]:
    """Reading the checkpoint (:func:`_read_rate`), writing ``PROBE_BYTES`` beside the output folder durably, and
    one small file durably (fsync and the folder's)."""
    out = {"read": 2e9, "write": 1e9, "file": 0.005}
    try:
        out["read"] = _read_rate(src)
        where = out_dir if out_dir is not None and out_dir.is_dir() else None
        for name, data in (("file", b"x" * 4096), ("write", os.urandom(1 << 20) * (PROBE_BYTES >> 21))):
            with tempfile.NamedTemporaryFile(dir=where) as f:
                t = time.perf_counter()
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                fd = os.open(os.path.dirname(f.name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                dt = max(time.perf_counter() - t, 1e-6)
            out[name] = dt if name == "file" else len(data) / max(dt - out["file"], dt / 2)
    except OSError as e:
        logger.debug("io probe: %s", e)
    return out


def probe_rates(*, shapes, heads: int, seqlen: int, compute_dtype: torch.dtype, device: torch.device, scheme=None,
                hessian_width: int = 0, weight_dtype: torch.dtype = torch.float32, experts: tuple[int, int, int] | None = None,
                src=None, out_dir=None, local_world: int = 1) -> Rates:
    """This machine's rates on the job's widths, from the cache where this machine measured them before.
    ``shapes``: the block's Linear ``(in, out)`` shapes; ``scheme``: the GPTQ sweep's (None: no sweep) and
    ``hessian_width`` its narrowest Hessian; ``local_world``: the ranks probing at once (part of the cache key).
    The disk's rates are measured every time (the page cache's state is the job's, not the machine's)."""
    shapes = sorted({(min(i, MAX_WIDTH), min(o, MAX_WIDTH)) for i, o in shapes}, key=lambda s: s[0] * s[1])[-3:]
    shapes = shapes or [(1024, 1024)]
    key = json.dumps({"shapes": shapes, "heads": heads, "seqlen": seqlen, "dtype": str(compute_dtype),
                      "scheme": None if scheme is None else [scheme.name, scheme.strategy], "hessian_width": hessian_width,
                      "weight_dtype": str(weight_dtype), "experts": experts,
                      "torch": torch.__version__, "threads": torch.get_num_threads(), "local_world": local_world,
                      "machine": platform.processor() or platform.machine(), "node": platform.node(),
                      "device": device.type, "bf16_products": bf16_products(), "v": 6}, sort_keys=True, default=str)
    path = default_cache_dir(os.environ) / "rates" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
    try:
        compute = {k: float(v) for k, v in json.loads(path.read_text()).items()}
        source = "cached"
    except (OSError, ValueError, AttributeError, TypeError):
        t0 = time.perf_counter()
        compute = {"gemm": _gemm_rate(shapes, compute_dtype, device),
                   "attention": _attention_rate(max(1, min(heads, 32)), min(seqlen, 2048), compute_dtype, device),
                   "gemm32": _gemm_rate(shapes, torch.float32, device),
                   "experts": _experts_rate(*experts, compute_dtype, device) if experts else 0.0,
                   "gemm64": _gemm_rate(shapes[-1:], torch.float64, device),
                   "mem": _mem_rate(device), "op": _op_seconds(device),
                   "link": _link_rate() / LINK_SHARE if device.type == "cpu" else 50e9}
        if scheme is not None:
            compute.update(_gptq_rates(device, scheme, hessian_width or SWEEP_COLS, seqlen, compute_dtype, weight_dtype))
        compute["experts"] = compute["experts"] or compute["gemm"]
        source = "probe"
        logger.info("timing probe: %.2f s (rates kept in %s)", time.perf_counter() - t0, path.parent)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, json.dumps(compute).encode())
        except OSError as e:
            logger.debug("rates cache not written (%s)", e)
    # no sweep in this job: its rates are never used (a FLOP-rate stand-in keeps the arithmetic defined)
    for k, v in (("hessian", compute["gemm32"]), ("factor", compute["gemm64"]), ("solve", 0.0), ("column", 0.0),
                 ("cell", 0.0)):
        compute.setdefault(k, v)
    return Rates(**compute, **_io_rates(src, out_dir), collective=OPS_PER_COLLECTIVE * compute["op"], source=source)


def stated_rates(*, tflops: float, mem_gbs: float, read_gbs: float, link_gbs: float, op_us: float = 8.0) -> Rates:
    """Another machine's rates, as stated (``sq.plan --tflops ...``), per rank (one GPU): the forwards at
    ``tflops``, float32 at a quarter of it, float64 and factorizations at a sixteenth; a sweep column as a
    dozen kernel launches of ``op_us`` each."""
    t = tflops * 1e12
    return Rates(gemm=t, attention=t / 2, experts=t / 2, gemm32=t / 4, gemm64=t / 16, hessian=t / 8, factor=t / 64, solve=op_us * 1e-4,
                 column=12 * op_us * 1e-6, cell=4 / (mem_gbs * 1e9), mem=mem_gbs * 1e9, op=op_us * 1e-6,
                 read=read_gbs * 1e9, write=read_gbs * 1e9, file=0.005, link=link_gbs * 1e9, collective=5e-5,
                 source="stated")


# ---- bytes read


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """``torch.chunk``'s (DTensor ``Shard``'s) piece ``i`` of ``n`` over ``parts``: (start, length)."""
    c = math.ceil(n / parts) if n else 0
    lo = min(n, i * c)
    return lo, max(0, min(n, lo + c) - lo)


def read_bytes(model, plan, *, world: int, ep: int, ranks) -> dict[int, dict]:
    """The checkpoint bytes each of ``ranks`` reads (what its load asks the files for: ``SqStorageReader.
    bytes_read``), the checkpoint pieces it reads them from and the FP8 elements it dequantizes while reading:
    ``{"root": n, "root_pieces": k, "blocks": [n per block], "pieces": [k per block], "fp8": [e per block]}``.  Dense parameters are FSDP2's dim-0 chunks over the world, buffers whole;
    experts under ``--ep`` split by expert over the ep ranks and by row over dp (``sq.parallel.expert``);
    an FP8 weight's box reads the scale blocks it touches too."""
    from sq.anatomy import decoder_blocks, expert_params, experts_modules
    from sq.load.fp8 import scale_box

    expert_names = {f"{prefix}.{n}.{p}" for prefix, blk in decoder_blocks(model) for n, ex in experts_modules(blk)
                    for p in expert_params(ex)} if ep > 1 else set()
    buffers = {n for n, _ in model.named_buffers()}  # not sharded: every rank reads them whole
    dp = world // ep
    tensors = plan.source.tensors
    scales = plan.fp8.scales if plan.fp8 is not None else {}
    block = plan.fp8.block if plan.fp8 is not None else None

    def local(name: str, r: int) -> tuple[list[int], list[int]]:
        shape = list(plan.targets[name])
        off, lengths = [0] * len(shape), list(shape)
        if not shape or name in buffers:
            return off, lengths
        if name in expert_names:
            off[0], lengths[0] = _chunk(shape[0], ep, r % ep)
            if len(shape) > 1:
                off[1], lengths[1] = _chunk(shape[1], dp, r // ep)
        else:
            off[0], lengths[0] = _chunk(shape[0], world, r)
        return off, lengths

    def nbytes(name: str, r: int) -> tuple[int, int, int]:
        """(bytes, checkpoint pieces, FP8 elements dequantized) rank ``r`` reads for target ``name``."""
        lo, n = local(name, r)
        total = pieces = fp8 = 0
        for piece in plan.keymap.pieces.get(name, []):
            box_lo, box_n = [], []
            for d, (a, la, b, lb) in enumerate(zip(lo, n, piece.offsets, piece.lengths)):
                s, e = max(a, b), min(a + la, b + lb)
                if e <= s:
                    break
                if d != piece.stack_dim:
                    box_lo.append(s - b)
                    box_n.append(e - s)
            else:
                pieces += 1
                info = tensors.get(piece.ckpt_key)
                if info is None:  # made by a transform (MXFP4 pairs): counted at its dequantized size
                    total += math.prod(box_n) * 2
                    continue
                total += math.prod(box_n) * info.dtype.itemsize
                if piece.ckpt_key in scales and len(box_n) == 2:
                    total += math.prod(scale_box(box_lo, box_n, block)[1]) * tensors[scales[piece.ckpt_key]].dtype.itemsize
                    fp8 += math.prod(box_n)
        return total, pieces, fp8

    def summed(names, r: int) -> tuple[int, ...]:
        got = [nbytes(n, r) for n in names]
        return tuple(sum(g[i] for g in got) for i in range(3))

    out = {}
    for r in ranks:
        root, blocks = summed(plan.root_names, r), [summed(names, r) for names in plan.block_names]
        out[r] = {"root": root[0], "root_pieces": root[1], "blocks": [b[0] for b in blocks],
                  "pieces": [b[1] for b in blocks], "fp8": [b[2] for b in blocks]}
    return out
