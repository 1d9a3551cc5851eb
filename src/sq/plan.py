"""``python -m sq.plan``: what a ``sq.ptq`` job will need, predicted before launching it.

Takes sq.ptq's own arguments plus the launch (``--nproc-per-node``, ``--nnodes``, ``--device``), reads
config.json, the index and the safetensors headers (the model is built on the meta device, as every rank
of the job builds it), and prints the job's preflights: each rank's peak memory by part
(``sq.pipeline.footprint``) against the node's memory (this machine's available memory, or
``--host-memory`` / ``--gpu-memory`` for another), and the disk (``sq.pipeline.disk``): the checkpoint, the
resume state, the free space where ``--output`` lives; the checkpoint bytes each rank reads and the seconds the
job takes by phase (``sq.pipeline.timing``: this machine's rates from short probes, or another machine's as
stated with ``--tflops`` and the bandwidths).  No process group, no weight read.  Before predicting, the job's
own refusals (``sq.pipeline.checks``, the functions ``sq.ptq`` calls): a job ``sq.ptq`` refuses at once,
``sq.plan`` refuses with the same ``sq: error:`` lines (the calibration corpus is read for that).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from sq.pipeline.disk import SLACK, GiB, disk_need, disk_problems

__all__ = ["build_parser", "plan_job", "main"]

DESCRIPTION = """\
Predict what a sq.ptq job needs before launching it. Takes sq.ptq's own arguments (prefix
the job's command line with python -m sq.plan) and the launch, reads only config.json, the index
and the safetensors headers (and, for a calibrated job, the tokenizer and the corpus), refuses what
sq.ptq refuses at once (the same checks, the same messages), and prints each rank's peak memory by
part against the node's memory, the disk the checkpoint and the resume state will take and the free
space where --output lives, the bytes each rank reads and the time the job takes by phase (this
machine's speeds, measured by short probes; or a GPU's, stated with --tflops and the bandwidths);
exits 2 with the job's own refusals when it would not fit."""


def _positive(unit: str):
    """argparse ``type`` of a size or a speed: a finite number above 0 (NaN, 0, a negative or an infinite
    one would price nothing, or everything)."""
    import argparse

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number of {unit} above 0, got {text!r}")
        return value

    return parse


def _count(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def build_parser():
    from sq.ptq import build_parser as ptq_parser

    p = ptq_parser()
    p.prog = "python -m sq.plan"
    p.description = DESCRIPTION
    p.add_argument("--json", action="store_true", help="print the plan as one JSON line (for schedulers)")
    p.add_argument("--nproc-per-node", type=_count, default=1, metavar="N",
                   help="ranks per node, as torchrun's (default 1)")
    p.add_argument("--nnodes", type=_count, default=1, metavar="K", help="nodes, as torchrun's (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the ranks compute: cpu (host memory) or cuda (one GPU per rank; default cpu)")
    p.add_argument("--host-memory", type=_positive("GiB"), default=None, metavar="GIB",
                   help="the memory a node has for the job (default: this machine's available memory)")
    p.add_argument("--gpu-memory", type=_positive("GiB"), default=None, metavar="GIB",
                   help="--device cuda: each GPU's memory (default: this machine's first GPU's free memory)")
    p.add_argument("--tflops", type=_positive("TFLOP/s"), default=None, metavar="T",
                   help="time on another machine: one rank's matmul TFLOP/s in the compute dtype (with the bandwidths "
                        "below; default: this machine's, measured)")
    p.add_argument("--mem-bandwidth", type=_positive("GB/s"), default=2000.0, metavar="GB/S",
                   help="with --tflops: one rank's memory bandwidth (default 2000, an H100's order)")
    p.add_argument("--read-bandwidth", type=_positive("GB/s"), default=2.0, metavar="GB/S",
                   help="with --tflops: one rank's checkpoint read and write bandwidth (default 2)")
    p.add_argument("--link-bandwidth", type=_positive("GB/s"), default=100.0, metavar="GB/S",
                   help="with --tflops: a collective's bandwidth per rank (default 100, NVLink's order)")
    return p


def plan_job(cfg, *, nproc_per_node: int = 1, nnodes: int = 1, device: str = "cpu", host_memory: float | None = None,
             gpu_memory: float | None = None, rates=None, t0: float | None = None,
             model_free: bool = False) -> tuple[dict, list[str]]:
    """The predictions ``sq.ptq`` makes at start, without a process group or any weight read: each rank's memory
    (``sq.pipeline.footprint``; this process's own memory stands for a rank's base) and the job's disk (which
    does not depend on the ranks: each writes its share into the one output folder).  ``host_memory`` /
    ``gpu_memory`` (GiB): a node's / a GPU's memory where the job will run (default: this machine's).  ``rates``
    (``sq.pipeline.timing.Rates``): the speeds that price the time (None: this machine's, probed; a GPU's must be
    stated); ``t0``: when this process started (``time.perf_counter``), standing for a rank's start."""
    from sq.errors import SqError
    from sq.load.loader import plan_load
    from sq.load.meta import build_skeleton
    from sq.memory import rss_bytes
    from sq.parallel.fsdp import main_dtype
    from sq.pipeline.footprint import carried_bytes, fit_memory, fitting_layout, memory_problems, predict_memory, with_layout
    from sq.pipeline.job import auto_ep
    from sq.pipeline.preflight import job_times, machine_rates
    from sq.pipeline.targets import plan_targets
    from sq.pipeline.weights import CheckpointWeights
    from sq.probe import attention_chunks
    from sq.quant.algorithms import make_algorithm
    from sq.resolve import resolve_model

    import dataclasses

    from sq import modelfree
    from sq.calib.data import read_corpus
    from sq.pipeline.checks import argument_checks, calibration_data, job_problems, output_problems
    from sq.run import raise_all

    if nproc_per_node < 1 or nnodes < 1:
        raise SqError(f"--nproc-per-node and --nnodes must be >= 1, got {nproc_per_node} and {nnodes}")
    raise_all(launch_problems(device=device, host_memory=host_memory, gpu_memory=gpu_memory), "launch checks")

    if not isinstance(resolve_model(cfg.model), Path):  # (before anything could download it)
        raise SqError(f"sq.plan reads a local checkpoint folder or demo:NAME; {cfg.model!r} is not one "
                      "(download it first: sq.ptq does, on rank 0)")
    if modelfree.wanted(cfg, model_free):  # as sq.ptq decides it (asked for, or an architecture transformers lacks)
        if device != "cpu":
            raise SqError("--model-free quantizes on the CPU; plan it without --device cuda")
        from sq.modelfree.quantize import plan_model_free

        return plan_model_free(cfg, nproc_per_node=nproc_per_node, nnodes=nnodes,
                               available=None if host_memory is None else int(host_memory * GiB),
                               where=None if host_memory is None else "--host-memory", rates=rates,
                               started=time.perf_counter() - (t0 if t0 is not None else time.perf_counter()))
    world = nproc_per_node * nnodes
    # the job's own refusals, by the functions the job calls (sq.pipeline.checks), in the job's order
    assigner = argument_checks(cfg)
    src = resolve_model(cfg.model)
    model = build_skeleton(src, trust_remote_code=cfg.trust_remote_code)
    load = plan_load(model, src, trust_remote_code=cfg.trust_remote_code)
    algo = make_algorithm(cfg.algo)
    if cfg.ep is None:
        cfg = dataclasses.replace(cfg, ep=auto_ep(model, world, algo))
    ep = cfg.ep
    calibration_data(cfg, src, model, assigner, read=read_corpus)  # a corpus too short is refused
    targets = plan_targets(model, assigner, CheckpointWeights(model, load, src, torch.device("cpu")), world)
    weight_dtype = main_dtype(targets.blocks[0][1]) if targets.blocks else None
    calibrated = cfg.needs_data(assigner)
    raise_all(job_problems(cfg, model, assigner, algo, targets, world=world, in_memory=False,
                           weight_dtype=weight_dtype, calibrated=calibrated, src=src)
              + output_problems(Path(cfg.output), cfg.resume), "model and output checks")
    # the calibration dtype: as the job chooses it (sq.probe: measured on a CPU, with the threads torchrun gives each
    # of a node's ranks; the same cache), the model's on a GPU
    threads = torch.get_num_threads()
    if device == "cpu" and nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        chain_dtype, gemm_dtype = _calib_dtype(cfg, targets, algo, weight_dtype, device, calibrated)
        if rates is None and device == "cpu":  # this machine's
            rates = machine_rates(model, targets, algo, calibrated=calibrated, nsamples=cfg.nsamples, seqlen=cfg.seqlen,
                                  world=world, ep=ep, dtype=gemm_dtype, weight_dtype=weight_dtype,
                                  device=torch.device("cpu"), src=src, out_dir=Path(cfg.output).parent,
                                  local_world=nproc_per_node)
    finally:
        torch.set_num_threads(threads)
    need = disk_need(cfg, model, targets, weight_dtype, src, calibrated=calibrated, chain_dtype=chain_dtype,
                     fp_chain=algo.fp_chain)
    problems, facts = disk_problems(Path(cfg.output), need["predicted_output_bytes"] + need["predicted_state_bytes"])
    kw = dict(base=rss_bytes(), nsamples=cfg.nsamples, seqlen=cfg.seqlen, calibrated=calibrated,
              compute_dtype=chain_dtype, weight_dtype=weight_dtype, calibrate_all_experts=cfg.calibrate_all_experts,
              device=device, bookkeeping=cfg.bookkeeping, carried=carried_bytes(load, weight_dtype, largest=True),
              # sq's attention backward at any query chunk its probe may choose (SignRound on CPU)
              hand_chunks=attention_chunks(cfg.seqlen) if device == "cpu" and calibrated
              and algo.half_forwards == "mixed" else ())
    memory = predict_memory(model, targets, algo, world=world, ep=ep, **kw)
    stated = gpu_memory if device == "cuda" else host_memory

    def check(pred):
        return memory_problems(
            pred, local_world=nproc_per_node, started=False, available=None if stated is None else int(stated * GiB),
            where=None if stated is None else f"--{'gpu' if device == 'cuda' else 'host'}-memory",
            host_available=None if host_memory is None else int(host_memory * GiB),
            host_where=None if host_memory is None else "--host-memory")

    mem_problems, mem_facts = check(memory)
    mem_problems, memory, fit = fit_memory(mem_problems, memory, lambda **more: predict_memory(
        model, targets, algo, world=world, ep=ep, **kw, **more), lambda pred: check(pred)[0], cfg.fit_memory)
    if fit is not None:
        mem_problems, mem_facts = check(memory)
        mem_facts["fit"] = fit
    if mem_problems:  # name the layout that fits (more nodes like this one; the per-rank share shrinks)
        def at(w):
            e = auto_ep(model, w, algo)
            return predict_memory(model, plan_targets(model, assigner, CheckpointWeights(
                model, load, src, torch.device("cpu")), w), algo, world=w, ep=e, **kw), e

        fits = fitting_layout(at, world=world, local_world=nproc_per_node, check=lambda pred: check(pred)[0])
        mem_problems = [with_layout(mem_problems[0], fits or "no layout of up to 1024 ranks fits"), *mem_problems[1:]]
    timing = None
    if rates is not None:
        timing = job_times(model, targets, algo, rates=rates, world=world, ep=ep, plan=load, nsamples=cfg.nsamples,
                           seqlen=cfg.seqlen, calibrated=calibrated, compute_dtype=chain_dtype,
                           weight_dtype=weight_dtype, calibrate_all_experts=cfg.calibrate_all_experts,
                           started=time.perf_counter() - (t0 if t0 is not None else time.perf_counter()))
    quantized = sum(len(ls) for ls in targets.linears)
    plan = {"model": str(src), "algo": cfg.algo.name, "quantized_linears": quantized,
            "experts_modules": sum(len(es) for es in targets.experts), "blocks": len(targets.blocks),
            "world": world, "nproc_per_node": nproc_per_node, "ep": ep,
            "chain_dtype": str(chain_dtype).removeprefix("torch."), **need, **facts,
            "memory": {**memory, **mem_facts}, "time": timing, "fits": not problems and not mem_problems}
    return plan, mem_problems + problems


def launch_problems(*, device: str, host_memory: float | None, gpu_memory: float | None) -> list[str]:
    """The launch flags against each other and this machine: a GPU's memory is stated for a GPU job only, and
    one is stated where this machine has no GPU to measure (else the plan would price an unknown memory)."""
    out = []
    if gpu_memory is not None and device != "cuda":
        out.append("--gpu-memory is each GPU's memory, for --device cuda; a CPU job's ranks use host memory: "
                   "state it with --host-memory GIB (or plan with --device cuda)")
    if device == "cuda" and gpu_memory is None and not torch.cuda.is_available():
        out.append("--device cuda: this machine has no GPU to measure; state each GPU's memory with --gpu-memory GIB "
                   "(and its speeds with --tflops and the bandwidths for the time)")
    return out


def _calib_dtype(cfg, targets, algo, weight_dtype, device: str, calibrated: bool):
    """(the chain's dtype, the forwards' matmul dtype) as the job will choose them (``sq.probe``)."""
    from sq.probe import calib_dtype_choice

    if not calibrated or weight_dtype is None:
        return torch.float32, torch.float32
    choice = calib_dtype_choice(cfg.calib_dtype, targets.linear_shapes(3), weight_dtype, torch.device(device),
                                half=algo.half_forwards)
    chain = choice.dtype or weight_dtype
    return chain, choice.autocast or chain


def _nonfinite(value, path: str = "") -> list[str]:
    """The keys (dotted) of ``value``'s floats that are NaN or infinite."""
    import math

    if isinstance(value, float):
        return [] if math.isfinite(value) else [path or "value"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nonfinite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _nonfinite(v, f"{path}[{i}]")]
    return []


def _print(plan: dict) -> None:
    from sq.pipeline.footprint import PARTS

    free, m = plan.get("free_bytes"), plan["memory"]
    unit = "GPU" if m["device"] == "cuda" else "host"
    avail = m.get("available_bytes")
    free_mode = plan.get("mode") == "model-free"
    lines = [
        f"sq.plan: {plan['model']} -- model-free: {plan['quantized_linears']} of {plan['units']} units quantized over "
        f"{plan['blocks']} layers ({plan['row_split']} row-split), --algo {plan['algo']}, {plan['world']} rank(s) "
        f"({plan['nproc_per_node']} per node)" if free_mode else
        f"sq.plan: {plan['model']} -- {plan['quantized_linears']} Linears and {plan['experts_modules']} experts modules "
        f"quantized over {plan['blocks']} blocks, --algo {plan['algo']}, {plan['world']} rank(s) "
        f"({plan['nproc_per_node']} per node), --ep {plan['ep']}",
        f"memory per rank ({unit}{'; base is host memory' if unit == 'GPU' else ''}):",
        f"  base           {m['base'] / GiB:9.3f} GiB  (a rank's process before it loads: this one's, measured)",
        *(f"  {k:<14} {m[k] / GiB:9.3f} GiB" for k in m.get("parts", PARTS)),
        f"  final          {m['final'] / GiB:9.3f} GiB  (" + ("rank 0's root and carried tensors at the end)" if free_mode
                                                           else "the root gathered whole at the end; rank 0 holds more)"),
        f"  peak           {m['predicted_peak_bytes'] / GiB:9.3f} GiB  (rank 0: {m['predicted_peak_rank0_bytes'] / GiB:.3f} GiB)",
        f"  {'one GPU' if unit == 'GPU' else 'one node'} needs {m['need_bytes'] / GiB:7.3f} GiB, "
        + (f"has {avail / GiB:.3f} GiB ({m['where']})" if avail is not None else "its memory unknown (--gpu-memory)"),
        *([f"  host side      {m['host_block'] / GiB:9.3f} GiB  (a block's files and chain cache serialized, its shard "
           f"staged; rank 0 at the end: {m['host_final'] / GiB:.3f} GiB)",
           f"  host peak      {m['predicted_host_peak_bytes'] / GiB:9.3f} GiB  (rank 0: "
           f"{m['predicted_host_peak_rank0_bytes'] / GiB:.3f} GiB); one node needs {m['host_need_bytes'] / GiB:.3f} GiB, "
           + (f"has {m['host_available_bytes'] / GiB:.3f} GiB ({m['host_where']})" if m.get("host_available_bytes")
              is not None else "its memory unknown")] if unit == "GPU" else []),
        "disk:",
        f"  checkpoint     {plan['predicted_output_bytes'] / GiB:9.3f} GiB",
        f"  resume state   {plan['predicted_state_bytes'] / GiB:9.3f} GiB  (chain files at their peak, "
        f"{plan.get('chain_dtype', 'none')})",
        f"  disk needed    {plan['need_bytes'] * SLACK / GiB:9.3f} GiB  (with {SLACK - 1:.0%} for the index, report "
        "and logs)",
        f"  free there     {free / GiB:9.3f} GiB" if free is not None else f"  free there     unknown ({plan['error']})",
    ]
    t = plan.get("time")
    if t and free_mode:
        reads = t["predicted_read_bytes"]
        lines += [f"time ({'stated rates' if t['rates']['source'] == 'stated' else 'this machine, probed'}; the ranks "
                  "meet only at the end):",
                  *(f"  rank {r:<9} {v:9.1f} s" for r, v in enumerate(t["ranks_seconds"])),
                  f"  total          {t['predicted_seconds']:9.1f} s  ({t['predicted_seconds'] / 3600:.2f} h)",
                  f"  read per rank  {max(reads) / GiB:9.3f} GiB  (the largest; {sum(reads) / GiB:.3f} GiB over the ranks)"]
    elif t:
        reads = t.get("predicted_read_bytes") or [0]
        lines += [f"time ({'stated rates' if t['rates']['source'] == 'stated' else 'this machine, probed'}; each block "
                  "phase as its slowest rank):",
                  f"  start          {t['start_seconds']:9.1f} s  (a rank's start and the root's fill)",
                  *(f"  {k:<14} {v:9.1f} s" for k, v in t["phases"].items() if v),
                  f"  final          {t['final_seconds']:9.1f} s",
                  f"  total          {t['predicted_seconds']:9.1f} s  ({t['predicted_seconds'] / 3600:.2f} h)",
                  f"  read per rank  {max(reads) / GiB:9.3f} GiB  (the largest; {sum(reads) / GiB:.3f} GiB over the ranks)",
                  f"  collectives    {t['collectives_per_block']:9.1f} per block  "
                  f"({t['collective_bytes_per_block'] / 2**20:.1f} MiB per rank and block)"]
    else:
        lines.append("time             not predicted (a GPU's speeds are stated: --tflops and the bandwidths)")
    lines.append(f"verdict          {'fits' if plan['fits'] else 'does not fit'}")
    print("\n".join(lines))


def main(argv=None) -> int:
    from sq.cli import run_cli
    from sq.errors import SqError
    from sq.ptq import config_from

    t0 = time.perf_counter()

    def body():
        import json

        from sq.pipeline.timing import stated_rates

        a = build_parser().parse_args(argv)
        rates = None if a.tflops is None else stated_rates(tflops=a.tflops, mem_gbs=a.mem_bandwidth,
                                                           read_gbs=a.read_bandwidth, link_gbs=a.link_bandwidth)
        plan, problems = plan_job(config_from(a), nproc_per_node=a.nproc_per_node, nnodes=a.nnodes, device=a.device,
                                  host_memory=a.host_memory, gpu_memory=a.gpu_memory, rates=rates, t0=t0,
                                  model_free=a.model_free)
        odd = _nonfinite(plan)
        if odd:  # stated speeds at the edge of what a float holds: say so instead of printing inf / NaN
            raise SqError(f"the plan's {', '.join(odd[:3])} came out non-finite: the stated --tflops / "
                          "--mem-bandwidth / --read-bandwidth / --link-bandwidth / memory are beyond what it can "
                          "price; state a real machine's")
        print(json.dumps(plan, allow_nan=False)) if a.json else _print(plan)  # strict JSON: no NaN / Infinity
        if problems:
            raise SqError(problems)

    return run_cli(body)


if __name__ == "__main__":
    from sq.cli import exit_process

    exit_process(main())
