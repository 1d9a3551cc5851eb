"""Model-free quantization of a planned checkpoint: each unit quantized with round-to-nearest by the model
path's own functions, row-split Linears reduced and gathered, and the run driven through ``sq.run``
(``sq.modelfree``)."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load

from sq.agree import agree, argument_facts, verified_identity
from sq.dist import uses_nccl
from sq.errors import SqError
from sq.export import writer
from sq.files import CARRIED_NAME, safetensors_bytes, shard_name
from sq.formats.compressed import compress_weight
from sq.formats.specs import required_reductions
from sq.load import fp8, mxfp4
from sq.load.meta import config_problems, model_type_problems, tokenizer_problems
from sq.load.source import scan_checkpoint
from sq.memory import PeakPhases, rss_bytes, trim_heap
from sq.modelfree.footprint import PARTS, predicted_time, preflight
from sq.pipeline.disk import written_bytes
from sq.modelfree.plan import (
    EXPERT_KEY,
    Plan,
    TensorSlot,
    Unit,
    classify,
    config_groups,
    dtype_of,
    READ_AHEAD,
    my_rows,
    split_by_bytes,
)
from sq.modelfree.reader import ReadAhead, Reader
from sq.quant import rtn
from sq.quant.experts import unquantized_experts_problems, unquantized_experts_report
from sq.quant.rtn import rtn_codes
from sq.report import block_progress, unquantized_experts_lines
from sq.run import Run, raise_all, signature

logger = logging.getLogger(__name__)

def _rtn(w: torch.Tensor, scheme, stats, row_offset: int = 0) -> dict:
    """``rtn_rows``'s codes and scales of rows ``w`` (``rtn_codes``: the same calls), without the
    dequantized copy the model path writes back into its model and this path never reads (for
    FP8_BLOCK it is most of the time)."""
    qp, q = rtn_codes(w, scheme, stats, row_offset)
    return {"q": q, "scale": qp.scale, "zero_point": qp.zero_point, "global_scale": qp.global_scale}


def _compress(parts: dict, scheme, shape) -> dict:
    return compress_weight((parts["q"], parts["scale"], parts["zero_point"]), scheme, tuple(shape),
                           global_scale=parts["global_scale"])


def _nonfinite_problem(key: str, dense: bool) -> str:
    return (f"{key} holds NaN or Inf values: its scales would be NaN. Fix the checkpoint"
            + (", or pass --skip-nonfinite to leave such Linears unquantized" if dense else
               "; --skip-nonfinite leaves dense Linears only: leave these experts out with --ignore"))


def _share_global(slots: list[TensorSlot], stats: list) -> None:
    """One global scale per fused weight (the model path's rule): slots with the same ``share`` take
    the max of their ``global_absmax`` (slots left out, e.g. for NaN, have ``None`` stats)."""
    for share in {s.share for s in slots}:
        members = [st for s, st in zip(slots, stats) if s.share == share and st and "global_absmax" in st]
        if len(members) > 1:
            shared = torch.stack([st["global_absmax"] for st in members]).amax(0)
            for st in members:
                st["global_absmax"] = shared.clone()


def _quantize_unit(unit: Unit, fetched: list, reader: Reader,
                   skip_nonfinite: bool) -> tuple[dict, list[str], list[str]]:
    """The unit's output tensors (from its ``fetch_unit``), the Linears left unquantized for NaN/Inf, and refusals."""
    if unit.scheme is None:
        out = {}
        for s, f in zip(unit.slots, fetched):
            if s.box is not None:  # a piece of a tensor written whole: into its box
                shape, offsets, lengths, stack_dim = s.box
                piece = reader.convert(s.key, f)
                whole = out.setdefault(s.out_prefix, torch.empty(shape, dtype=piece.dtype))
                box = whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
                box.copy_(piece.unsqueeze(stack_dim) if stack_dim is not None else piece)
            elif s.cols is None:
                out[s.key] = reader.convert(s.key, f)
            else:  # one expert's [in, out] columns, written as the [out, in] weight transformers loads
                out[s.out_prefix + "weight"] = reader.convert(s.key, f, expert=True)[:, s.cols[0]:s.cols[1]].T.contiguous()
        return out, [], []
    ws = [reader.convert(s.key, f, s.lo, expert=s.e is not None) for s, f in zip(unit.slots, fetched)]
    del fetched
    bad = [i for i, w in enumerate(ws) if not rtn.all_finite(w)]
    out, skipped = {}, []
    if bad:
        dense = unit.slots[0].e is None and not EXPERT_KEY.match(unit.slots[0].key)
        if not (skip_nonfinite and dense):
            return {}, [], [_nonfinite_problem(unit.slots[i].key, dense) for i in bad]
        for i in bad:  # left as they are, listed in ignore; their partners share a scale without them
            out[unit.slots[i].key] = ws[i]
            skipped.append(unit.slots[i].out_prefix.removesuffix("."))
        keep = [i for i in range(len(ws)) if i not in bad]
        unit = Unit(unit.block, [unit.slots[i] for i in keep], unit.scheme, unit.name)
        ws = [ws[i] for i in keep]
    stats = [rtn.local_stats(w, unit.scheme) or None for w in ws]
    _share_global(unit.slots, stats)
    for s, w, st in zip(unit.slots, ws, stats):
        for rel, v in _compress(_rtn(w, unit.scheme, st), unit.scheme, w.shape).items():
            out[s.out_prefix + rel] = v
    return out, skipped, []


def _reduced_stats(units: list[Unit], parts: list[Unit], reader: Reader) -> tuple[list[list], list[list[bool]]]:
    """Every row-split slot's cross-row statistics (NVFP4's global absmax, FP8_BLOCK's block absmax)
    and whether it holds NaN/Inf, over all ranks' rows: ONE all_reduce (max; a min statistic travels
    negated) of everything at once.  float64 holds every float32 statistic exactly."""
    chunks, where = [], []  # where: (unit, slot, stat, op, shape, dtype) per chunk after each flag
    ahead = ReadAhead(reader, parts)
    try:
        for ui, (u, part) in enumerate(zip(units, parts)):
            for si, (s, f) in enumerate(zip(part.slots, ahead.get())):
                w = reader.convert(s.key, f, s.lo)
                chunks.append(torch.tensor([0.0 if rtn.all_finite(w) else 1.0], dtype=torch.float64))
                for red in required_reductions(u.scheme):
                    t = red.local(w, row_offset=s.lo, rows=reader.source.tensors[s.key].shape[0])
                    where.append((ui, si, red.stat, red.op, t.shape, t.dtype))
                    chunks.append(t.to(torch.float64).flatten() * (-1.0 if red.op == "min" else 1.0))
                del w
    finally:
        ahead.close()
    flat = torch.cat(chunks)
    if uses_nccl():
        flat = flat.cuda()
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    flat = flat.cpu()
    stats = [[{} for _ in u.slots] for u in units]
    bad = [[False] * len(u.slots) for u in units]
    at, w_i = 0, 0
    for ui, u in enumerate(units):
        for si in range(len(u.slots)):
            bad[ui][si] = bool(flat[at] > 0)
            at += 1
            while w_i < len(where) and where[w_i][:2] == (ui, si):
                _, _, stat, op, shape, dtype = where[w_i]
                n = math.prod(shape)
                stats[ui][si][stat] = (flat[at:at + n] * (-1.0 if op == "min" else 1.0)).reshape(shape).to(dtype)
                at, w_i = at + n, w_i + 1
    return stats, bad


def _split_pass(units: list[Unit], owners: list[int], reader: Reader, skip_nonfinite: bool) -> dict[int, tuple]:
    """Row-split Linears (``split_by_bytes``): every rank reads and quantizes its rows of each, with the
    statistics that span rows reduced over all ranks, and the unit's owner gathers the codes and
    scales, compresses the whole tensor and writes it with its layer.  Returns the owner's output,
    ``{layer: (tensors, Linears left unquantized for NaN/Inf)}``.

    It runs before the first layer, on every rank alike (the same units from the same plan), so its
    collectives -- one all_reduce, then one gather per unit -- never wait for a rank that has left;
    the main loop keeps none.  A rank reads its rows twice (statistics, then codes) rather than
    holding them across the all_reduce: memory stays one unit's rows, plus the owner's compressed
    outputs until their layers are written.  The codes equal the whole tensor's: each row's scales
    see the same reduced statistics (``rtn.quantize`` with the row offset), as on the model path's
    row shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = lambda key: reader.source.tensors[key].shape[0]  # noqa: E731
    parts = [my_rows(u, rank, world, rows) for u in units]
    stats, bad = _reduced_stats(units, parts, reader)
    refused = [_nonfinite_problem(s.key, True) for u, b in zip(units, bad) for s, x in zip(u.slots, b) if x]
    if refused and not skip_nonfinite:
        raise SqError(refused)  # every rank holds the same reduced flags: all refuse together
    ready: dict[int, tuple[dict, list]] = {}
    ahead = ReadAhead(reader, parts)
    try:
        for ui, (u, part, owner) in enumerate(zip(units, parts, owners)):
            st = [None if b else (x or None) for x, b in zip(stats[ui], bad[ui])]
            _share_global(u.slots, st)
            mine = {}  # "slot.part" -> this rank's rows of it (codes, row scales; the rows themselves for NaN/Inf)
            for si, (s, f) in enumerate(zip(part.slots, ahead.get())):
                if s.hi > s.lo:
                    w = reader.convert(s.key, f, s.lo)
                    res = {"w": w} if bad[ui][si] else _rtn(w, u.scheme, st[si], row_offset=s.lo)
                    mine.update({f"{si}.{k}": v for k, v in res.items() if v is not None})
            # as safetensors bytes: exact for every dtype (pickled float8 tensors do not load back)
            got = [None] * world if rank == owner else None
            dist.gather_object(safetensors_bytes(mine), got, dst=owner)
            del mine
            if rank == owner:
                pieces = [st_load(g) for g in got]
                tensors, skipped = ready.setdefault(u.block, ({}, []))
                for si, s in enumerate(u.slots):
                    by_rank = [{k.partition(".")[2]: v for k, v in p.items() if k.startswith(f"{si}.")} for p in pieces]
                    tensors.update(_assemble(s, u.scheme, [r for r in by_rank if r],
                                             reader.source.tensors[s.key].shape, skipped))
            del got
    finally:
        ahead.close()
    return ready


def _assemble(slot: TensorSlot, scheme, pieces: list[dict], shape, skipped: list[str]) -> dict:
    """One row-split weight's output from every rank's rows, in rank (= row) order."""
    if "w" in pieces[0]:  # NaN/Inf with --skip-nonfinite: kept as it is, listed in ignore
        skipped.append(slot.out_prefix.removesuffix("."))
        return {slot.key: torch.cat([p["w"] for p in pieces])}
    rows = rtn.scales_follow_rows(scheme)  # else every rank computed the whole scale (2-D blocks)
    whole = {"q": torch.cat([p["q"] for p in pieces]), "global_scale": pieces[0].get("global_scale")}
    for k in ("scale", "zero_point"):
        whole[k] = None if k not in pieces[0] else torch.cat([p[k] for p in pieces]) if rows else pieces[0][k]
    return {slot.out_prefix + rel: v for rel, v in _compress(whole, scheme, shape).items()}


def data_free_problems(cfg, assigner, why: str) -> list[str]:
    """Refusals of a job model-free quantization cannot run: anything that needs calibration data."""
    reason = cfg.data_reason(assigner)
    if reason is None:
        return []
    return [f"{why}: model-free quantization reads no calibration data, but {reason} needs it; use --algo rtn with "
            "a data-free scheme (W4A16, W8A16, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, MXFP4A16, ...), or drop "
            "--model-free so the model is built"]


def wanted(cfg, model_free: bool) -> bool:
    """Whether ``sq.ptq`` takes the model-free path: on request, or when transformers cannot build
    the architecture (unknown ``model_type``; remote code not allowed) and the job is data-free.
    Call on every rank (a hub id is resolved, rank 0 downloading)."""
    if model_free:
        return True
    from sq.load.source import read_config
    from sq.resolve import resolve_model_dist

    try:
        src = resolve_model_dist(cfg.model)
        raw = read_config(src)
        assigner = cfg.assigner()
    except SqError:
        return False  # the model path names the problem
    model_type = raw.get("model_type")
    # an architecture transformers does not know, or code the user did not allow; a config without a
    # (string) model_type is broken, not new: the model path names it
    unbuildable = isinstance(model_type, str) and model_type != "" and (
        bool(model_type_problems(raw, Path(src), trust_remote_code=cfg.trust_remote_code))
        or (bool(raw.get("auto_map")) and not cfg.trust_remote_code))
    if unbuildable and cfg.data_reason(assigner) is None and not cfg.rotate and not cfg.problems():
        logger.info("transformers cannot build %s (model_type %r); quantizing it model-free", src, model_type)
        return True
    return False


def _prepare(cfg, world: int):
    """Every refusal, identical on every rank, before anything is written: (plan, reader, source, assigner).
    ``world``: the job's ranks (``sq.plan`` states them)."""
    from sq.pipeline.targets import ep_problems
    from sq.resolve import resolve_model_dist

    problems = list(cfg.problems())
    # nothing is expert-parallel here, but an --ep the model path would refuse is a typo: refused the same way
    problems += ep_problems(cfg.ep, world)
    assigner = None
    try:
        assigner = cfg.assigner()
    except SqError as e:
        problems += e.problems
    if assigner is not None:
        problems += data_free_problems(cfg, assigner, "--model-free")
    if cfg.rotate:
        problems.append(f"--rotate {','.join(cfg.rotate)}: a rotation is proven on the model's own blocks, which "
                        "model-free quantization never builds; drop --model-free (or --rotate)")
    raise_all(problems, "argument checks")
    src = Path(resolve_model_dist(cfg.model))
    source = scan_checkpoint(src)
    problems = list(source.problems)
    layout = None
    if not problems:
        problems += config_problems(source.config, src, trust_remote_code=True)  # no model code runs here
        problems += tokenizer_problems(src, trust_remote_code=cfg.trust_remote_code)  # copied: the user's word
        layout, fp8_problems = fp8.detect_fp8(source)
        problems += fp8_problems
        if mxfp4.is_mxfp4(source.config):  # read by the model path only: one line, whatever else is wrong
            problems.append(f"{src / 'config.json'}: the source is MXFP4 (quant_method 'mxfp4': gpt-oss' "
                            "*_blocks / *_scales experts); model-free quantization does not read it: run without "
                            "--model-free (the model path dequantizes each rank's experts while reading them)")
        else:
            problems += mxfp4.detect_mxfp4(source)[1]  # blocks / scales without an MXFP4 config
    plan = None
    if not problems:
        plan, more = classify(source, assigner, layout.scale_keys if layout is not None else set())
        problems += more
        if not plan.assignment:
            problems.append("nothing to quantize: every Linear is ignored or assigned no scheme")
        # classify asked the assigner about every tensor it may quantize, by checkpoint and model name
        problems += assigner.unmatched_problems(plan.unquantized, allow=cfg.allow_unmatched)
        problems += unquantized_experts_problems(plan.carried_experts, cfg.allow_unquantized_experts)
    problems += writer.output_path_problems(cfg.output, src)
    raise_all(problems, "checkpoint checks")
    return plan, Reader(source, layout, dtype_of(source.config)), source, assigner


def _signature(cfg, plan: Plan, source, assigner, world: int, split: list[str]) -> dict:
    """What a resumed run must share; ``row_split`` (the row-split Linear groups, which decide who
    writes what) only when there are any, so a run without splits has the signature it has without them."""
    return {"mode": "model-free", **signature(
        source=verified_identity(source, cfg.verify_source), args=cfg.signature_args(calibrated=False),
        algorithm=cfg.algo.signature(), schemes=assigner.to_dict(), assignment=plan.assignment, world=world,
        blocks=plan.blocks, **({"row_split": split} if split else {}))}


@torch.no_grad()
def quantize_checkpoint(cfg) -> dict:
    """``sq.ptq --model-free``: a checkpoint folder in, a compressed-tensors checkpoint out, no model
    built.  Runs inside an initialized process group; the report on rank 0, ``{}`` elsewhere."""
    t_start = time.perf_counter()
    agree(argument_facts(cfg), "arguments")  # before any collective the arguments decide
    plan, reader, source, assigner = _prepare(cfg, dist.get_world_size())
    try:
        return _run(cfg, plan, reader, source, assigner, t_start)
    finally:
        reader.close()


def _run(cfg, plan: Plan, reader: Reader, source, assigner, t_start: float) -> dict:
    world = dist.get_world_size()
    split_at = os.environ.get("SQ_MODELFREE_SPLIT_BYTES")  # tests only: force row splits of small Linears
    owner, split = split_by_bytes(plan.units, world, int(split_at) if split_at else None)
    problems, predicted = [], {}
    if cfg.preflight:  # memory and disk against this node (a refusal), then the time (a prediction)
        problems, predicted = _predictions(cfg, plan, reader, source, owner, split, world,
                                           time.perf_counter() - t_start, rank=dist.get_rank())
        trim_heap()  # the probes' buffers go back before the first layer
    sig = _signature(cfg, plan, source, assigner, world, [plan.units[i].name for i in split])
    run = Run(cfg.output, bookkeeping=cfg.bookkeeping, fault=cfg.fault)
    if not run.claim(sig, cfg.resume, problems, config=source.config):
        return {"complete": True}
    with run.log_file():
        return _run_layers(cfg, run, plan, reader, source, owner, split, t_start, predicted)


def _predictions(cfg, plan: Plan, reader: Reader, source, owner: list[int], split: list[int], world: int,
                 seconds: float, rates=None, **where) -> tuple[list[str], dict]:
    """The job's memory and disk checks (``preflight``: the refusals; ``where``: its rank and node) and its
    reads and seconds (``predicted_time``; ``seconds``: those before the first layer), as ``sq.ptq`` and
    ``sq.plan`` both make them: ``(problems, {"memory", "disk", "time"})``."""
    problems, memory, disk = preflight(plan, reader, owner, split, world, base=rss_bytes(), out=Path(cfg.output),
                                       **where)
    root = sum(source.tensors[k].nbytes for k in (*plan.root, *plan.carried))
    timing = predicted_time(plan, owner, split, world, root, source.root, Path(cfg.output), seconds,
                            fp8=reader.layout is not None, rates=rates)
    return problems, {"memory": memory, "disk": disk, "time": timing}


def _run_layers(cfg, run: Run, plan: Plan, reader: Reader, source, owner: list[int], split: list[int],
                t_start: float, predicted: dict) -> dict:
    """Restart point, the row-split pass, this rank's units layer by layer, the final stage."""
    rank, world = run.rank, run.world
    n = len(plan.blocks)
    start = run.restart(n, need_chain=False)
    split_set = set(split)
    mine = [u for i, (u, r) in enumerate(zip(plan.units, owner)) if r == rank and i not in split_set]
    problems: list[str] = []
    logger.info("model-free: %s -> %s on %d rank(s): %d units, this rank %d (%.1f MB)%s, from layer %d",
                source.root, run.out, world, len(plan.units), len(mine), sum(u.nbytes for u in mine) / 1e6,
                f" and its rows of {len(split)} row-split Linear groups "
                f"({sum(plan.units[i].nbytes for i in split) / world / 1e6:.1f} MB)" if split else "", start)
    peaks = PeakPhases()  # the peak RSS before the layers, in the split pass, in the layers, at the end
    peaks.start("before_layers")
    todo_split = [i for i in split if plan.units[i].block >= start]  # the same list on every rank
    ready = _split_pass([plan.units[i] for i in todo_split], [owner[i] for i in todo_split], reader,
                        cfg.skip_nonfinite) if todo_split else {}
    if todo_split:
        peaks.start("split")
    progress = block_progress(n, start, bar=rank == 0)
    todo = sorted((u for u in mine if u.block >= start), key=lambda u: u.block)
    ahead = ReadAhead(reader, todo, READ_AHEAD)
    try:
        i = 0
        for b in range(start, n):
            t_block = time.perf_counter()
            run.fault_point("stop", b)
            tensors, bad = ready.pop(b, ({}, []))
            while i < len(todo) and todo[i].block == b:
                t, sk, pr = _quantize_unit(todo[i], ahead.get(), reader, cfg.skip_nonfinite)
                tensors.update(t)
                bad += sk
                problems += pr
                i += 1
            if problems:
                break
            run.write_block(b, tensors, bad)
            del tensors
            trim_heap()
            progress.step(b, time.perf_counter() - t_block)
        run.files.close()  # every submitted layer recorded; the writer's error, if any, raised here
    finally:
        ahead.close()
        run.files.close(check=False)
    progress.close()
    peaks.start("layers")
    every = [None] * world
    dist.all_gather_object(every, problems)  # every rank meets here, done or refused
    problems = [p for ps in every for p in ps]
    if problems:
        raise SqError(problems)
    return _finish(cfg, run, plan, reader, source, start, t_start, predicted, peaks)


def _finish(cfg, run: Run, plan: Plan, reader: Reader, source, start: int, t_start: float, predicted: dict,
            peaks: PeakPhases) -> dict:
    """Rank 0: root and carried tensors, config, side files, report, the index last; every rank learns how it went."""
    out = run.out
    root, read = [], reader.bytes_read  # (the layers' reads: what predicted_read_bytes counts)
    if run.rank == 0:  # before the ranks meet, so that rank 0's peak counts them
        # one tensor at a time (write_streamed): a root of embeddings and an MTP layer are gigabytes at scale
        root.append(writer.write_streamed(out, shard_name(0, None), reader.specs(plan.root), reader.weight))
        root.append(writer.write_streamed(out, CARRIED_NAME, reader.specs(plan.carried, cast=False),
                                          lambda k: reader.weight(k, cast=False)))
    peaks.fold("final")
    memory, timing = predicted.get("memory") or {}, predicted.get("time") or {}
    mine = {"rank": run.rank, "peak_rss_bytes": peaks.peak, "peak_rss_phases": peaks.phases,
            **({"predicted_peak_bytes": memory["predicted_peak_rank0_bytes" if run.rank == 0 else "predicted_peak_bytes"],
                "base_rss_bytes": memory["base"]} if memory else {}),
            "read_bytes": read,
            "predicted_read_bytes": (timing.get("predicted_read_bytes") or [None] * run.world)[run.rank]}
    all_frags, all_skipped, ranks = run.gather(mine)

    def final() -> dict:  # rank 0
        frags = list(all_frags) + root
        skip = sorted({s for ss in all_skipped for s in ss})
        report = {"mode": "model-free", "args": cfg.to_dict(), "source": str(source.root),
                  "assignment": plan.assignment, "world_size": run.world, "ignored_linears": sorted(plan.unquantized),
                  "carried_over": plan.carried, "skipped_nonfinite": skip,
                  "unquantized_experts": unquantized_experts_report(plan.carried_experts), "resumed_from_block": start,
                  "seconds": round(time.perf_counter() - t_start, 3), "ranks": ranks,
                  **{k: v for k, v in predicted.items() if v}}
        if predicted.get("disk"):  # beside what is in the folder now (report and index to come)
            report["disk"] = {**predicted["disk"], "written_output_bytes": written_bytes(out)}
        run.write_final(source.config, config_groups(plan, set(skip)), sorted({*plan.unquantized, *skip}), report,
                        frags, lambda: writer.copy_side_files(source.root, out))
        for line in unquantized_experts_lines(report):
            logger.warning("%s", line.strip())
        return report

    return run.final(final)


def plan_model_free(cfg, *, nproc_per_node: int, nnodes: int, available: int | None, where: str | None, rates,
                    started: float) -> tuple[dict, list[str]]:
    """``python -m sq.plan --model-free``: the job's plan and placement as every rank makes them
    (``quantize_checkpoint``), its memory and disk checks, and its reads and seconds (``rates``: stated; None:
    this machine's)."""
    world = nproc_per_node * nnodes
    plan, reader, source, _ = _prepare(cfg, world)
    from sq.pipeline.checks import output_problems

    raise_all(output_problems(cfg.output, cfg.resume), "output folder checks")
    try:
        owner, split = split_by_bytes(plan.units, world)
        problems, p = _predictions(cfg, plan, reader, source, owner, split, world, started, rates=rates, rank=0,
                                   local_world=nproc_per_node, started=False, available=available, where=where)
    finally:
        reader.close()
    out = {"model": str(source.root), "mode": "model-free", "algo": cfg.algo.name,
           "quantized_linears": sum(u.scheme is not None for u in plan.units), "units": len(plan.units),
           "row_split": len(split), "blocks": len(plan.blocks), "world": world, "nproc_per_node": nproc_per_node,
           **p["disk"], "memory": {**p["memory"], "parts": list(PARTS)}, "time": p["time"] or None,
           "fits": not problems}
    return out, problems
