"""What a model-free job needs, predicted once its units are placed and before anything is written: each rank's
peak memory, the disk the checkpoint takes, each rank's reads and the job's seconds (``sq.ptq --model-free``'s
preflight, ``python -m sq.plan --model-free``).

A rank's memory is counted in parts, from the plan (every unit's tensors as the headers give them) and the
placement (``sq.modelfree.plan.split_by_bytes``), in the order the rank works:

    base     the process at the preflight (interpreter, torch, the plan): measured, not modelled
    units    the unit being quantized -- its tensors as read, converted to the model's dtype (FP8 ones
             dequantized), RTN's float32 working copies of its largest tensor -- and the next ``READ_AHEAD``
             units the read-ahead thread has read
    layer    the layer's outputs so far (codes and scales; copied tensors converted) and the previous layer's,
             tensors and serialized bytes, in the background writer
    split    the row-split units' outputs their owner keeps until their layers are written, and the gather of
             a split unit's codes (the owner receives every rank's rows: pickled bytes, the tensors they load
             to, the whole codes, the compressed tensors)
    heap     freed buffers the C heap keeps within a layer (trimmed after each one), at most glibc's trim
             threshold
    final    rank 0 at the end: the root tensors read, converted and serialized for their file, then the
             carried ones (an MTP layer; FP8 dequantized)

and the peak is ``base + max(every point of the split pass and of each layer, final)``.  The checks against
the node's memory and the disk's free space are the model path's (``sq.pipeline.footprint.memory_problems``,
``sq.pipeline.disk.disk_problems``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from sq.memory import HEAP_MMAP_THRESHOLD, HEAP_TRIM_THRESHOLD
from sq.modelfree.plan import READ_AHEAD, Plan, Unit, my_rows
from sq.pipeline.disk import disk_problems, header_bytes, side_bytes, stored_bytes
from sq.pipeline.footprint import CARRIED_COPIES, memory_problems  # (rank 0 writes carried tensors as the model path does)

logger = logging.getLogger(__name__)

__all__ = ["preflight", "predicted_memory", "output_bytes", "predicted_time", "KNOBS", "PARTS"]

PARTS = ("units", "layer", "split", "heap")
KNOBS = {
    "units": "more ranks (each reads and quantizes only its own units; a dense Linear too large for one rank is "
             "split by rows over all of them)",
    "layer": "more ranks (a layer's units are spread over them)",
    "split": "more ranks (a row-split Linear's rows are spread over them; its owner gathers the codes)",
    "heap": "MALLOC_MMAP_THRESHOLD_=65536 in the job's environment (freed buffers go back to the system at once)",
}
RTN_COPIES = 3  # float32 copies RTN makes of the tensor it quantizes (the weight, scaled, rounded)
SEND_COPIES = 4  # a rank's rows of a split unit's codes: the codes, serialized, pickled, as a byte tensor to send
RECEIVE_COPIES = 4  # the whole codes on the unit's owner: the receive buffer, the unpickled bytes, loaded, joined


@dataclass(frozen=True)
class UnitBytes:
    """One unit's bytes at each step, on the rank that holds it (or its rows of a split one)."""

    raw: int  # as read (FP8 scale rows too)
    converted: int  # the converted copies (0 where the model's dtype is the stored one: a view)
    work: int  # RTN's float32 copies of its largest tensor (0 for copied tensors)
    out: int  # what it writes: codes and scales as the scheme stores them, copied tensors converted
    codes: int  # its codes before compression (a split unit's gather)


def _slot_shape(source, s) -> tuple[int, int]:
    """(rows, columns) of a slot: its rows of the tensor, or of expert ``e`` of a fused one."""
    shape = source.tensors[s.key].shape
    if s.e is not None:
        rows, cols = (s.hi if s.hi is not None else shape[1]) - s.lo, math.prod(shape[2:])
        return (rows, cols) if s.cols is None else (s.cols[1] - s.cols[0], rows)
    rows = (s.hi if s.hi is not None else (shape[0] if shape else 1)) - s.lo
    return rows, math.prod(shape[1:]) if len(shape) > 1 else 1


def unit_bytes(unit: Unit, reader) -> UnitBytes:
    """``unit``'s bytes (a split unit: pass this rank's rows, ``sq.modelfree.plan.my_rows``)."""
    source = reader.source
    raw = conv = out = codes = largest = 0
    code_size = unit.scheme.storage_dtype.itemsize if unit.scheme is not None else 0
    for s in unit.slots:
        info = source.tensors[s.key]
        rows, cols = _slot_shape(source, s)
        n = rows * cols
        raw += n * info.dtype.itemsize
        scaled = reader.layout is not None and s.key in reader.layout.scales and s.e is None
        size = reader.converted_itemsize(s.key, expert=s.e is not None)
        if scaled:  # its block scales' rows
            raw += math.ceil(rows / reader.layout.block[0]) * math.ceil(cols / reader.layout.block[1]) * 4
        if scaled or size != info.dtype.itemsize:
            conv += n * size
        if unit.scheme is None:
            out += n * size if s.box is None else 0
        else:
            out += sum(b for _, b in stored_bytes(unit.scheme, rows, cols, reader.dtype))
            codes += n * code_size
            largest = max(largest, n)
    if unit.scheme is None and any(s.box is not None for s in unit.slots):  # one merged tensor, written whole
        merged = {s.out_prefix: s.box[0] for s in unit.slots if s.box}
        out += sum(math.prod(shape) for shape in merged.values()) * reader.dtype.itemsize
    return UnitBytes(raw, conv, 4 * largest * RTN_COPIES, out, codes)


def _small(unit: UnitBytes) -> int:
    """The bytes of a unit's buffers the C heap serves (and keeps, fragmented, when they are freed)."""
    return sum(b for b in (unit.raw, unit.converted, unit.work // RTN_COPIES, unit.out) if b < HEAP_MMAP_THRESHOLD)


def _peak_of(unit: UnitBytes) -> int:
    """A unit's peak while it is quantized: as read beside its converted copies, then the converted tensors
    (or the read ones, where no copy was made) beside RTN's working copies and its outputs."""
    held = unit.converted or unit.raw
    return max(unit.raw + unit.converted, held + unit.work + unit.out)


def predicted_memory(plan: Plan, reader, owner: list[int], split: list[int], world: int, *, base: int,
                     read_ahead: int, ranks=None) -> dict[int, dict]:
    """Each rank's predicted peak and its parts (bytes), by rank (``ranks``: all by default), as the model path's
    (``sq.pipeline.footprint.predict_ranks``) so that the same check refuses it."""
    rows = lambda key: reader.source.tensors[key].shape[0]  # noqa: E731
    split_set = set(split)
    whole = [unit_bytes(u, reader) for u in plan.units]
    out = {}
    for r in (range(world) if ranks is None else ranks):
        best, parts = 0, {k: 0 for k in PARTS}
        # the split pass: this rank's rows of each split unit, the owner's gather; the owner keeps the outputs
        ready, churn = [0] * len(plan.blocks), 0
        mine = [unit_bytes(my_rows(plan.units[i], r, world, rows), reader) for i in split]
        for k, i in enumerate(split):
            u = plan.units[i]
            # this rank's rows' codes serialized and pickled for the gather; the owner's receive buffer, the
            # objects unpickled, the tensors loaded from them and joined, then compressed
            gather = SEND_COPIES * mine[k].codes + (RECEIVE_COPIES * whole[i].codes + whole[i].out if owner[i] == r else 0)
            churn += _small(mine[k])  # (no trim before the first layer's end)
            p = {"units": _peak_of(mine[k]) + sum(m.raw for m in mine[k + 1:k + 1 + read_ahead]),
                 "split": sum(ready) + gather, "heap": min(HEAP_TRIM_THRESHOLD, churn)}
            if sum(p.values()) > best:
                best, parts = sum(p.values()), {**parts, **p, "phase": "split"}
            if owner[i] == r:
                ready[u.block] += whole[i].out
        # the layers, in order: read ahead, the unit in flight, the layer's outputs and the previous layer's files
        todo = sorted((i for i, o in enumerate(owner) if o == r and i not in split_set), key=lambda i: plan.units[i].block)
        done = prev = 0
        layer = None
        for k, i in enumerate(todo):
            u = plan.units[i]
            if u.block != layer:
                if layer is not None:
                    prev, done, churn = done + ready[layer], 0, 0
                    ready[layer] = 0
                layer = u.block
            ahead = sum(whole[j].raw for j in todo[k + 1:k + 1 + read_ahead])
            work = _peak_of(whole[i])
            # the heap is trimmed after every layer; within one, what its units freed stays up to the trim threshold
            churn += _small(whole[i])
            p = {"units": work + ahead, "layer": done + ready[layer] + 2 * prev, "split": sum(ready) - ready[layer],
                 "heap": min(HEAP_TRIM_THRESHOLD, churn)}
            if sum(p.values()) > best:
                best, parts = sum(p.values()), {**p, "phase": f"layer {u.block}"}
            done += whole[i].out
        out[r] = {"device": "cpu", "rank": r, "base": base, **parts, "peak_part": best}
    final0 = _final_bytes(plan, reader)
    final0 += min(HEAP_TRIM_THRESHOLD, final0)  # (its reads and conversions churn the heap as a layer's do)
    for r, m in out.items():
        m["final"] = final0 if r == 0 else 0
        m["predicted_peak_bytes"] = base + m.pop("peak_part")
        m["predicted_peak_rank0_bytes"] = max(m["predicted_peak_bytes"], base + final0)
        m.setdefault("phase", "none")
    return out


def preflight(plan: Plan, reader, owner: list[int], split: list[int], world: int, *, base: int, out: Path,
              rank: int, read_ahead: int | None = None, local_world: int | None = None, started: bool = True,
              available: int | None = None, where: str | None = None) -> tuple[list[str], dict, dict]:
    """The memory and disk checks (``sq.ptq --model-free`` on every rank, ``sq.plan --model-free``): the refusals,
    ``rank``'s predicted memory with the node's numbers, and the disk's."""
    every = predicted_memory(plan, reader, owner, split, world, base=base,
                             read_ahead=READ_AHEAD if read_ahead is None else read_ahead)
    worst = max(every.values(), key=lambda m: m["predicted_peak_rank0_bytes"])
    problems, facts = memory_problems(worst, local_world=local_world, started=started, available=available,
                                      where=where, parts=PARTS, knobs=KNOBS, by="sq.modelfree.footprint")
    need = output_bytes(plan, reader, reader.source.root)
    found, disk = disk_problems(out, need)
    return problems + found, {**every[rank], **facts}, {"predicted_output_bytes": need, "predicted_state_bytes": 0, **disk}


def _final_bytes(plan: Plan, reader) -> int:
    """Rank 0's end: the root tensors, then the carried ones (kept in their dtype, FP8 weights dequantized), each
    written as it is read (``sq.export.writer.write_streamed``): the largest one as read beside its converted
    copy."""
    tensors = reader.source.tensors
    root = max((tensors[k].nbytes + math.prod(tensors[k].shape) * reader.converted_itemsize(k) for k in plan.root),
               default=0)
    carried = max((math.prod(tensors[k].shape) * (reader.dtype.itemsize if tensors[k].dtype.itemsize == 1 else
                                                  tensors[k].dtype.itemsize) for k in plan.carried), default=0)
    return max(root, CARRIED_COPIES * carried)


def output_bytes(plan: Plan, reader, src: Path | None) -> int:
    """The checkpoint's bytes: each unit's outputs with their header entries, the root and carried tensors as
    read (converted), and the side files copied beside them."""
    total = 0
    for u in plan.units:
        total += unit_bytes(u, reader).out + sum(header_bytes(s.out_prefix or s.key) * 3 for s in u.slots)
    tensors = reader.source.tensors
    total += sum(math.prod(tensors[k].shape) * reader.converted_itemsize(k) + header_bytes(k) for k in plan.root)
    total += sum(tensors[k].nbytes * (2 if tensors[k].dtype.itemsize == 1 else 1) + header_bytes(k) for k in plan.carried)
    return total + side_bytes(src)


def predicted_time(plan: Plan, owner: list[int], split: list[int], world: int, root: int, src: Path, out: Path,
                   started: float, fp8: bool = False, rates=None) -> dict:
    """Each rank's checkpoint reads and the job's seconds, before anything is written, at this machine's rates
    (``sq.pipeline.timing``): a rank reads its units whole and its rows of each row-split unit (the reads
    ``predicted_read_bytes`` counts: an FP8 source's scale rows besides, within 1%), the read-ahead
    thread overlapping the reads with RTN's passes over them; each layer's file written durably; the slowest rank
    sets the time (they meet only at the end), then rank 0's root and carried tensors (``root`` bytes); ``fp8``:
    the source's weights are FP8, dequantized as they are converted (at most one byte an element); ``rates``:
    stated speeds (``sq.pipeline.timing.stated_rates``), else this machine's, probed."""
    from sq.pipeline.timing import FP8_DEQUANT_BYTES, OPS_FINAL, OPS_PER_PIECE_READ, OPS_PER_WRITE, Cost, probe_rates
    from sq.quant.algorithms.base import RTN_OPS, RTN_PASSES

    try:
        if rates is None:  # this machine's
            rates = probe_rates(shapes=[], heads=1, seqlen=1, compute_dtype=torch.float32, device=torch.device("cpu"),
                                src=src, out_dir=out.parent)
    except Exception as e:  # noqa: BLE001 - a prediction never stops a job
        logger.warning("time not predicted: %s: %s", type(e).__name__, e)
        return {}
    split_set = set(split)
    reads, compute, written = [0] * world, [Cost() for _ in range(world)], [0.0] * world
    for i, u in enumerate(plan.units):
        mine = range(world) if i in split_set else [owner[i]]
        for r in mine:
            nbytes = u.nbytes / len(mine)
            reads[r] += int(nbytes)
            bits = u.scheme.num_bits / 16 if u.scheme is not None else 1.0
            compute[r] = compute[r] + Cost(mem=(2 * RTN_PASSES * nbytes if u.scheme is not None else 2 * nbytes)
                                           + (FP8_DEQUANT_BYTES * nbytes if fp8 else 0),
                                           ops=(RTN_OPS + OPS_PER_PIECE_READ) * len(u.slots))
            written[r] += bits * nbytes
    blocks = len(plan.blocks)
    per_rank = [max(rates.seconds(Cost(read=reads[r])), rates.seconds(compute[r]))
                + rates.seconds(Cost(write=written[r], files=blocks, ops=OPS_PER_WRITE * blocks)) for r in range(world)]
    final = rates.seconds(Cost(read=root, write=root, files=3, ops=OPS_FINAL, mem=FP8_DEQUANT_BYTES * root if fp8 else 0))
    return {"predicted_seconds": round(started + max(per_rank) + final, 3),
            "ranks_seconds": [round(x, 3) for x in per_rank], "predicted_read_bytes": reads, "rates": rates.to_dict()}
