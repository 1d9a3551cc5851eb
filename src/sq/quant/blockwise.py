"""The block-by-block PTQ driver: every rank quantizes the rows it holds, one block at a time.

    skeleton (meta) -> plan -> FSDP2 -> fill root -> block-0 inputs (this rank's samples)
    for each block: fill -> (gptq) Hessians, all-reduced -> quantize local rows -> fake-quant
                    into the shard -> forward (next inputs) -> gather rows to a writer -> write -> free
    rank 0: root tensors, carried keys, config, tokenizer, report, merged index (last)

MoE experts (transformers' fused ``gate_up_proj`` / ``down_proj``) are quantized per expert by
the rank that holds them, with Hessians from every rank's tokens (``sq.quant.experts``).  The maths lives in ``sq.quant.rtn`` /
``sq.quant.gptq`` and the checkpoint form in ``sq.export.compressed``; this file is plumbing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from sq.calib.data import calibration_windows, load_tokenizer, read_corpus_dist, tokenize_corpus
from sq.hub import resolve_model_dist
from sq.dist import ParallelDims, all_ok, broadcast_object
from sq.errors import SqError
from sq.export import writer
from sq.export.compressed import compress_weight, quantization_config
from sq.load.fill import local_box
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton, decoder_blocks, experts_modules
from sq.memory import peak_rss_bytes, rss_breakdown, trim_heap
from sq.parallel.fsdp import apply_parallel
from sq.quant import rtn
from sq.quant.experts import (FUSED, ExpertCalibration, export_slots, gather_rows_bytes, is_ep_param,
                              local_experts)
from sq.quant.gptq import GPTQ, GPTQConfig
from sq.quant.recipe import Assigner, make_assigner, scheme_tag
from sq.quant.schemes import QuantScheme, check_group_size
from sq.quant.signround import SignRoundConfig, Slot, dim0_counts, tune_block, unsharded
from sq.quant.weights import CheckpointWeights
from sq.report import LOG_DIR, add_log_file, block_progress, remove_log_file, summary_lines, write_report_png
from sq.resume import (RUN_DIR, Fault, RunState, describe_diff, maybe_die, sha256_bytes, signature_diff,
                       signature_sha)

logger = logging.getLogger(__name__)

__all__ = ["PTQConfig", "quantize_model"]

ALGOS = ("rtn", "gptq", "signround")
CALIBRATED = ("gptq", "signround")  # algorithms that run calibration data through the blocks
CALIB_BATCH = 8  # samples per calibration forward


@dataclass(frozen=True)
class PTQConfig:
    """One quantization job; ``to_dict`` goes into the report (and later the resume signature)."""

    model: str
    output: str
    scheme: str = "W4A16"
    algo: str = "gptq"
    group_size: int = 128
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    dataset: str = "builtin:pydoc"
    ignore: tuple[str, ...] = ()
    recipe: str | None = None  # mixed-precision recipe file (sq.quant.recipe)
    timeout_s: float = 600.0
    ep: int = 1
    calibrate_all_experts: bool = True
    actorder: bool = True  # GPTQ static act-order (llm-compressor's default for group scales)
    iters: int = 200  # SignRound steps per block
    lr: float | None = None  # SignRound step size (None: 1 / iters, decaying linearly)
    batch_size: int = 8  # SignRound samples per step, over all ranks
    resume: str = "auto"  # auto | never | require
    skip_nonfinite: bool = False  # leave NaN/Inf Linears unquantized instead of refusing
    bookkeeping: bool = True  # benchmark-only switch: no manifests, chain cache or checksums
    fault: str | None = None  # test-only: SQ_FAULT=point:rank[:block] (sq.resume.FAULT_POINTS)

    def problems(self) -> list[str]:
        """Argument refusals (identical on every rank)."""
        out = []
        if self.resume not in ("auto", "never", "require"):
            out.append(f"--resume must be auto, never or require, got {self.resume!r}")
        if self.algo not in ALGOS:
            out.append(f"unknown --algo {self.algo!r}; choose one of {', '.join(ALGOS)}")
        for flag in ("nsamples", "seqlen", "ep"):
            v = getattr(self, flag)
            if v <= 0:
                out.append(f"--{flag} must be positive, got {v}")
        if not 0 < self.timeout_s < float("inf"):  # NaN fails too; the collective timeout is a timedelta
            out.append(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        if self.algo == "signround":
            out += self.signround.problems()
            if self.ep > 1:
                out.append("--algo signround runs with --ep 1 (experts tuned by the rank holding them under "
                           "FSDP2); expert-parallel tuning is not supported yet")
        for pat in self.ignore:
            try:
                re.compile(pat)
            except re.error as e:
                out.append(f"--ignore {pat!r} is not a valid regular expression: {e}")
        try:
            make_assigner(self.scheme, self.group_size, (), None)
        except SqError as e:
            out += e.problems
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ignore"] = list(self.ignore)
        return d

    @property
    def signround(self) -> SignRoundConfig:
        return SignRoundConfig(iters=self.iters, lr=self.lr, batch_size=self.batch_size)

    def signature_args(self) -> dict[str, Any]:
        """The arguments a resumed run must share (not where to write, how to launch, or faults)."""
        d = self.to_dict()
        # the recipe's content (rules and the resolved assignment) is in the signature, not its path
        # skip_nonfinite decides only what happens to a non-finite weight, which refuses the run
        # without it: a rerun that adds the flag continues the blocks already done
        for k in ("model", "output", "timeout_s", "resume", "bookkeeping", "fault", "recipe", "skip_nonfinite"):
            d.pop(k)
        if self.algo != "signround":
            for k in SignRoundConfig.__dataclass_fields__:
                d.pop(k)
        return d


class _StopForward(Exception):
    """Raised by the block-0 pre-hook once its inputs are captured."""


@dataclass
class _Linear:
    name: str  # model name of the module, e.g. model.layers.3.self_attn.q_proj
    module: nn.Linear
    ckpt_prefix: str  # checkpoint name minus "weight", e.g. model.layers.3.self_attn.q_proj.
    owner: int  # writer rank
    scheme: QuantScheme


@dataclass
class _Stats:
    layers: dict[str, dict] = field(default_factory=dict)
    blocks: list[dict] = field(default_factory=list)
    experts_rtn_fallback: int = 0  # experts no calibration token reached (quantized with RTN)
    tuning: dict[str, dict] = field(default_factory=dict)  # SignRound: block prefix -> first / best loss


def _full(t: torch.Tensor) -> torch.Tensor:
    """Whole tensor on every rank (collective for a DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _gather_rows(t: torch.Tensor | None, rows: list[int], dst: int, like_cols: int, dtype: torch.dtype):
    """Gather ``t [rows_r, cols]`` from every rank onto ``dst`` (as bytes: any dtype, gloo too)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    itemsize = torch.empty((), dtype=dtype).element_size()
    width = like_cols * itemsize
    pad = max(rows)
    buf = torch.zeros(pad, width, dtype=torch.uint8)
    if t is not None and t.shape[0]:
        buf[: t.shape[0]] = t.contiguous().view(torch.uint8).reshape(t.shape[0], width)
    parts = [torch.empty_like(buf) for _ in range(world)] if rank == dst else None
    dist.gather(buf, parts, dst=dst)
    if rank != dst:
        return None
    return torch.cat([p[:n] for p, n in zip(parts, rows)]).view(dtype).reshape(sum(rows), like_cols)


def _refusals(model, cfg: PTQConfig, assigner: Assigner) -> list[str]:
    """Model-dependent refusals (identical on every rank): group sizes per assigned scheme, EP split."""
    problems = []
    world = dist.get_world_size()
    if world % cfg.ep:
        problems.append(f"--ep {cfg.ep} does not divide the world size {world}")
    for prefix, block in decoder_blocks(model):
        for n, ex in experts_modules(block):
            e, hidden, inter = ex._parameters["down_proj"].shape
            scheme = assigner.assign(f"{prefix}.{n}")
            for pname, width in (("gate_up_proj", hidden), ("down_proj", inter)):
                try:
                    if scheme is not None:
                        check_group_size(f"{prefix}.{n}.{pname}", width, scheme)
                except SqError as err:
                    problems += err.problems
            if cfg.ep > 1 and e % cfg.ep:
                problems.append(f"{prefix}.{n}: {e} experts do not split evenly over --ep {cfg.ep}")
        for n, m in block.named_modules():
            scheme = assigner.assign(f"{prefix}.{n}") if isinstance(m, nn.Linear) else None
            if scheme is not None:
                try:
                    check_group_size(f"{prefix}.{n}", m.in_features, scheme)
                except SqError as e:
                    problems += e.problems
    if cfg.algo == "signround":
        for prefix, block in decoder_blocks(model):
            names = [f"{prefix}.{n}" for n, m in block.named_modules() if isinstance(m, nn.Linear)]
            names += [f"{prefix}.{n}" for n, _ in experts_modules(block)]
            floats = {scheme_tag(s) for s in map(assigner.assign, names) if s is not None and s.type != "int"}
            if floats:
                problems.append(f"--algo signround tunes integer weights; {prefix} is assigned "
                                f"{', '.join(sorted(floats))} (quantize float8 layers in another run, or with rtn/gptq)")
                break
    if cfg.algo in CALIBRATED and cfg.nsamples < dist.get_world_size():
        problems.append(f"--nsamples {cfg.nsamples} is smaller than the world size {dist.get_world_size()}: "
                        "every rank needs calibration samples")
    return problems


def _capture_block0(model, windows: torch.Tensor, device) -> list[tuple[torch.Tensor, dict]]:
    """Block-0 inputs (hidden states and the kwargs the decoder layer gets) for each local batch.

    The root FSDP unit is bypassed: its lazy init would insist every block is materialized.
    The inner model's own root parameters are swapped for full copies for the duration
    (collective), and a pre-hook on block 0 (ahead of FSDP's) stops the forward.
    """

    inner = model.get_submodule(decoder_blocks(model)[0][0].rsplit(".", 2)[0])
    block0 = decoder_blocks(model)[0][1]
    swapped = []
    for mname, mod in inner.named_modules():
        if mname.startswith("layers"):
            continue
        for leaf, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                swapped.append((mod, leaf, p))
                mod._parameters[leaf] = nn.Parameter(p.full_tensor(), requires_grad=False)
    captured = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "hidden_states")}
        kw["use_cache"] = False
        captured.append((hidden.detach(), kw))
        raise _StopForward

    handle = block0.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    try:
        with torch.no_grad():
            for i in range(0, windows.shape[0], CALIB_BATCH):
                try:
                    inner(input_ids=windows[i:i + CALIB_BATCH].to(device), use_cache=False)
                except _StopForward:
                    pass
    finally:
        handle.remove()
        for mod, leaf, p in swapped:
            mod._parameters[leaf] = p
    return captured


def _block_forward(block, inputs, steps: int, dummy, counters=()) -> list[torch.Tensor]:
    """Run every local batch through ``block``; pad with ``dummy`` so all ranks run ``steps`` forwards
    (FSDP2 all-gathers the block's weights in each).  ``counters`` stop counting on dummy batches."""
    outs = []
    with torch.no_grad():
        for i in range(steps):
            real = i < len(inputs)
            for c in counters:
                c.on = real
            hidden, kw = inputs[i] if real else dummy
            y = block(hidden, **kw)
            y = y[0] if isinstance(y, tuple) else y
            if real:
                outs.append(y.detach())
    return outs


class _Counting:
    """Forward hooks on Linears that feed GPTQ Hessians, switched off for dummy batches.

    Linears that read the very same input tensor (q/k/v, gate/up) share one accumulator: the
    first batch decides, with its inputs kept alive so no address can be reused meanwhile.
    """

    def __init__(self, linears: list[_Linear], device):
        self.on = True
        self.device = device
        self.leader: dict[str, str] = {}
        self.gptq: dict[str, GPTQ] = {}
        self._first: dict[tuple, tuple[str, torch.Tensor]] = {}
        self.handles = [l.module.register_forward_hook(self._hook(l.name)) for l in linears]

    def _hook(self, name):
        def hook(module, args, output):
            x = args[0]
            if name not in self.leader:
                key = (x.data_ptr(), tuple(x.shape), x.dtype)
                lead = self._first.setdefault(key, (name, x))[0]
                self.leader[name] = lead
                if lead == name:
                    self.gptq[name] = GPTQ(module.in_features, device=self.device)
            if self.on and self.leader[name] == name:
                self.gptq[name].add_batch(x)
        return hook

    def get(self, name: str) -> GPTQ | None:
        return self.gptq.get(self.leader.get(name, ""))

    def remove(self):
        for h in self.handles:
            h.remove()
        self._first.clear()


def _quantize_rows(w: torch.Tensor, scheme, gptq, name: str, actorder: bool = True):
    """(q, scale, zp, dequantized) for this rank's rows ``w [rows, in]``."""

    if gptq is not None and w.shape[0]:
        r = gptq.quantize(w, scheme, name=name, **GPTQConfig(actorder=actorder).to_dict())
        return r.q, r.scale, r.zero_point, r.weight.to(w.dtype)
    scale, zp = rtn.compute_qparams(w, scheme)
    q = rtn.quantize(w, scale, zp, scheme)
    return q, scale, zp, rtn.dequantize(q, scale, zp, scheme).to(w.dtype)


def _err_terms(w: torch.Tensor, deq: torch.Tensor, H: torch.Tensor | None) -> list[float]:
    """Numerator / denominator of the relative error (through H when given, else in weight space)."""
    w64, d64 = w.double(), (w.double() - deq.double())
    if H is None:
        return [float((d64 ** 2).sum()), float((w64 ** 2).sum())]
    return [float(((d64 @ H) * d64).sum()), float(((w64 @ H) * w64).sum())]


def _nonfinite(linears: list[_Linear], experts, device) -> list[str]:
    """The block's quantized weights holding NaN or Inf on any rank (collective; the same list on every rank)."""
    names = [l.name for l in linears] + [f"{e}.{p}" for e, _, _ in experts for p in FUSED]
    if not names:
        return []
    local = [local_box(l.module.weight)[0] for l in linears]
    local += [local_box(ex._parameters[p])[0] for _, ex, _ in experts for p in FUSED]
    flags = torch.tensor([not bool(torch.isfinite(t).all()) for t in local], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [n for n, f in zip(names, flags.tolist()) if f]


def _nonfinite_refusal(bad: list[str], linears: list[_Linear], weights, skip: bool) -> list[str]:
    """Refusals for non-finite weights ([] where ``--skip-nonfinite`` may leave them unquantized)."""
    dense = {l.name for l in linears}
    problems = []
    for n in bad:
        if n in dense and not skip:
            problems.append(f"{n}.weight (checkpoint key {weights.ckpt_name(n + '.weight')!r}) holds NaN or Inf "
                            "values: its scales would be NaN. Fix the checkpoint, or pass --skip-nonfinite to leave "
                            "such Linears unquantized")
        elif n not in dense:
            problems.append(f"{n} holds NaN or Inf values in some experts; --skip-nonfinite leaves dense Linears "
                            "only: fix the checkpoint, or leave these experts out with --ignore / a recipe")
    return problems


def _raise_enospc() -> None:
    raise OSError(28, "No space left on device (injected)")


def _signature(cfg: PTQConfig, assigner: Assigner, assignment: dict[str, str], weights, data: dict,
               world: int, block_prefixes: list[str]) -> dict:
    """Everything a resumed run must share with the run it continues, including the resolved
    module -> scheme assignment (two runs that differ only in bit allocation never match)."""
    return {
        "source": weights.identity(),
        "args": cfg.signature_args(),
        "schemes": assigner.to_dict(),
        "assignment": assignment,
        "gptq": GPTQConfig(actorder=cfg.actorder).to_dict(),
        "dataset": data,
        "world_size": world,
        "blocks": list(block_prefixes),
        "versions": _versions(),
    }


# Stacked expert solves: at most this many weight elements per sweep (64 MiB of float32 rows;
# a sweep holds a few copies of them).  Larger stacks amortize the per-column loop further.
_EXPERT_STACK_ELEMS = 1 << 24


def _quantize_experts(experts, calibs, algo: str, actorder: bool = True, slots: dict | None = None):
    """Quantize the local rows of every local expert; write the dequantized rows back.

    Returns ``{experts prefix: {param: (q, scale, zp) local [n_local, rows_local, ...]}}`` and
    the experts that fell back to RTN (no calibration token reached them).
    """
    out, fallback = {}, []
    by_module = {id(c.experts): c for c in calibs}
    for eprefix, ex, scheme in experts:
        calib = by_module.get(id(ex))
        out[eprefix] = {}
        for pname in FUSED:
            local, off = local_box(ex._parameters[pname])
            slot = (slots or {}).get(f"{eprefix}.{pname}")
            if slot is not None:  # SignRound: tuned per local expert already
                res = slot.result()
                if res is not None:
                    local.copy_(res[3])
                out[eprefix][pname] = res[:3] if res is not None else (None, None, None)
                continue
            qs, ss, zs = [], [], []
            g = calib.h_in[calib.mine.start] if calib is not None and calib.calibrate_all and len(calib.mine) else None
            if pname == "gate_up_proj" and g is not None and g.nsamples and local.shape[0] and local.shape[1]:
                # One Hessian for every expert (calibrate-all): GPTQ's rows are independent given
                # it, so the experts' rows are solved stacked, a few experts per sweep, instead of
                # one column loop per expert (same bits; see _EXPERT_STACK_ELEMS).
                n, rows, cols = local.shape
                per = max(1, _EXPERT_STACK_ELEMS // (rows * cols))
                for a in range(0, n, per):
                    b = min(n, a + per)
                    w = local[a:b].detach().reshape(-1, cols).clone()
                    name = f"{eprefix}.{off[0] + a}-{off[0] + b - 1}.{pname}"
                    q, scale, zp, deq = _quantize_rows(w, scheme, g, name, actorder)
                    local[a:b].copy_(deq.view(b - a, rows, cols))
                    qs += q.view(b - a, rows, -1).unbind(0)
                    ss += scale.view(b - a, rows, -1).unbind(0)
                    zs += zp.view(b - a, rows, -1).unbind(0) if zp is not None else [None] * (b - a)
                out[eprefix][pname] = (torch.stack(qs), torch.stack(ss), torch.stack(zs) if zs[0] is not None else None)
                continue
            for i in range(local.shape[0]):
                e = off[0] + i
                g = None
                if calib is not None:
                    g = (calib.h_in if pname == "gate_up_proj" else calib.h_mid)[e]
                    if g.nsamples == 0:
                        g = None
                        if pname == "gate_up_proj":
                            fallback.append(f"{eprefix}.{e}")
                w = local[i].detach().clone()
                q, scale, zp, deq = _quantize_rows(w, scheme, g, f"{eprefix}.{e}.{pname}", actorder)
                local[i].copy_(deq)
                qs.append(q), ss.append(scale), zs.append(zp)
            out[eprefix][pname] = (torch.stack(qs) if qs else None, torch.stack(ss) if ss else None,
                                   torch.stack(zs) if zs and zs[0] is not None else None)
        if calib is not None:
            for g in (*calib.h_in.values(), *calib.h_mid.values()):
                g.free()
    return out, fallback


def _signround_slots(linears: list[_Linear], experts, world: int) -> dict[str, Slot]:
    """This rank's dim-0 shard of every quantized weight of the block, as SignRound slots (same order everywhere)."""
    slots = {}
    for lin in linears:
        local, _ = local_box(lin.module.weight)
        slots[lin.name] = Slot(lin.name, lin.module, "weight", lin.scheme, local,
                               dim0_counts(lin.module.out_features, world))
    for eprefix, ex, scheme in experts:
        for pname in FUSED:
            p = ex._parameters[pname]
            local, _ = local_box(p)
            slots[f"{eprefix}.{pname}"] = Slot(f"{eprefix}.{pname}", ex, pname, scheme, local,
                                               dim0_counts(p.shape[0], world))
    return slots


def _export_experts(eprefix: str, ex: nn.Module, qdata: dict, pieces, scheme) -> dict[str, torch.Tensor]:
    """Compressed per-expert tensors under checkpoint-layout names, written by the rank holding them.

    Under EP with dp > 1 an expert's rows are spread over the dp group: they are gathered there
    and the dp rank ``e % dp`` writes the expert.
    """
    tensors = {}
    mine = local_experts(ex)
    p0 = ex._parameters["down_proj"]
    dp_rank, dp = (p0.device_mesh.get_local_rank(0), p0.device_mesh.size(0)) if is_ep_param(p0) else (0, 1)
    full = {}
    for pname in FUSED:
        p = ex._parameters[pname]
        q, scale, zp = qdata[pname]
        if q is None:
            continue
        full[pname] = tuple(gather_rows_bytes(t, p) if t is not None else None for t in (q, scale, zp))
    for slot in export_slots(eprefix, ex, pieces):
        if slot.expert not in mine or slot.expert % dp != dp_rank or slot.param not in full:
            continue
        q, scale, zp = full[slot.param]
        i = slot.expert - mine.start
        sl = slice(slot.lo, slot.hi)
        w = (q[i, sl], scale[i, sl], zp[i, sl] if zp is not None else None)
        for rel, v in compress_weight(w, scheme, tuple(w[0].shape)).items():
            tensors[slot.ckpt_prefix + rel] = v
    return tensors


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _raise_all(problems: list[str], what: str) -> None:
    """Every rank raises together (the same problems where they are the same), or none does."""
    all_ok(not problems, what)
    if problems:
        raise SqError(problems)


@torch.no_grad()
def quantize_model(cfg: PTQConfig) -> dict:
    """``sq.ptq``: a checkpoint folder in, a compressed-tensors checkpoint out.

    Runs inside an initialized process group; returns the report on rank 0, ``{}`` elsewhere.
    """
    t_start = time.perf_counter()
    world = dist.get_world_size()
    device = _device()
    _raise_all(cfg.problems(), "argument checks")
    assigner, problems = None, []
    try:
        assigner = make_assigner(cfg.scheme, cfg.group_size, cfg.ignore, cfg.recipe)
    except SqError as e:
        problems += e.problems
    _raise_all(problems, "recipe checks")

    src = resolve_model_dist(cfg.model)  # a hub id: rank 0 downloads, the others wait
    model = build_skeleton(src)
    plan = plan_load(model, src)
    weights = CheckpointWeights(model, plan, src, device)
    text = tokenizer = None
    if cfg.algo in CALIBRATED:  # rank 0 reads the dataset (a hub dataset downloads once); chat records need the tokenizer
        tokenizer = load_tokenizer(src, model, purpose=f"--algo {cfg.algo} tokenizes its calibration data with it",
                                   trust_remote_code=False)  # auto_map: refused by plan_load
        text = read_corpus_dist(cfg.dataset).text(tokenizer)

    # the windows are cut before the output folder is touched: a corpus too short for
    # --nsamples x --seqlen is refused like every other argument (every rank, same tokens)
    calib = calibration_windows(tokenize_corpus(tokenizer, text), cfg.nsamples, cfg.seqlen) if text is not None else None

    def windows() -> torch.Tensor:
        return calib

    data = {"spec": cfg.dataset, "sha256": sha256_bytes(text.encode()) if text is not None else None}
    return _run(cfg, model, weights, assigner, data, windows,
                parallelize=lambda: apply_parallel(model, ParallelDims(world, cfg.ep).build_mesh(device.type)),
                t_start=t_start)


def _output_verdict(out: Path, sig: dict, resume: str, state: RunState) -> dict:
    """What to do with ``--output`` (rank 0, read-only): ``{"action", "problems"}``.

    action: ``fresh`` (empty or new), ``resume`` (an unfinished run of the same signature),
    ``replace`` (remove what sq wrote there, keep anything else, start over), ``complete``
    (a finished output of the same signature).  Completion and resumption are decided from the
    stored signature, never from the mere presence of files.
    """
    def verdict(action, *problems):
        return {"action": action, "problems": list(problems)}

    again = "rerun with the same command, or pass --resume never to start over"
    try:
        unfinished = state.read_signature()
    except SqError as e:
        return verdict("replace") if resume == "never" else verdict("refuse", *e.problems)
    if unfinished is not None:
        if resume == "never":
            return verdict("replace")
        changed = signature_diff(unfinished, sig)
        if not changed:
            return verdict("resume")
        if not state.any_block_done():  # nothing worth keeping: a refused or failed start
            logger.info("%s holds an unfinished run with other settings that completed no block; starting over", out)
            return verdict("replace")
        return verdict("refuse", f"{out} holds an unfinished run with different settings ({describe_diff(changed)}); "
                                 f"{again}")
    if resume == "require":
        return verdict("refuse", f"--resume require: {out} holds no run to resume")
    finished = writer.finished_signature(out)
    if finished is not None:
        changed = signature_diff(finished, sig)
        if resume == "never":
            return verdict("replace")
        if not changed:
            return verdict("complete")
        return verdict("refuse", f"{out} holds a finished sq checkpoint made with different settings "
                                 f"({describe_diff(changed)}); choose another folder, or pass --resume never to replace it")
    problems = writer.output_dir_problems(out)  # anything but .sq-run/ there: never overwritten
    if problems:
        return verdict("refuse", *problems)
    if (out / RUN_DIR).is_dir() and any(p.name != "lock" for p in (out / RUN_DIR).iterdir()):
        return verdict("replace")  # a run folder that never got a signature (killed while starting)
    return verdict("fresh")


@torch.no_grad()
def _run(cfg: PTQConfig, model: nn.Module, weights, assigner: Assigner, data: dict, windows,
         parallelize, t_start: float) -> dict:
    """The job, whatever the weights' source: checks, output folder, blocks, final stage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    out = Path(cfg.output)
    fault = Fault.parse(cfg.fault)
    state = RunState(out, rank, enabled=cfg.bookkeeping)

    # ---- refusals: model, output folder; nothing mutated yet
    problems = _refusals(model, cfg, assigner)
    blocks = decoder_blocks(model)
    block_linears: list[list[_Linear]] = []
    k = 0
    for prefix, block in blocks:
        mine = []
        for n, m in block.named_modules():
            full = f"{prefix}.{n}"
            scheme = assigner.assign(full) if isinstance(m, nn.Linear) else None
            if scheme is not None:
                ck = weights.ckpt_name(f"{full}.weight")
                mine.append(_Linear(full, m, ck.removesuffix("weight"), k % world, scheme))
                k += 1
        block_linears.append(mine)
    block_experts = [[(f"{prefix}.{n}", ex, assigner.assign(f"{prefix}.{n}")) for n, ex in experts_modules(block)]
                     for prefix, block in blocks]
    block_experts = [[e for e in es if e[2] is not None] for es in block_experts]
    quantized = {l.name for ls in block_linears for l in ls}
    # every unquantized Linear by name, and the MoE routers (vLLM builds them as Linears)
    unquantized = sorted({n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in quantized}
                         | {n for n, m in model.named_modules() if type(m).__name__.endswith("Router")})
    assignment = {l.name: scheme_tag(l.scheme) for ls in block_linears for l in ls}
    assignment.update({p: scheme_tag(s) for es in block_experts for p, _, s in es})
    if not assignment:
        problems.append("nothing to quantize: every Linear is ignored or assigned no scheme")
    sig = _signature(cfg, assigner, assignment, weights, data, world, [p for p, _ in blocks])
    problems += writer.output_path_problems(out, getattr(weights, "src", None))
    _raise_all(problems, "model and output checks")
    # rank 0 alone reads the folder and decides; every rank raises the same problems or none does
    verdict = broadcast_object(_output_verdict(out, sig, cfg.resume, state) if rank == 0 else None)
    _raise_all(verdict["problems"], "output folder checks")
    if verdict["action"] == "complete":
        logger.info("%s is already complete (same model and settings); nothing to do", out)
        return {"complete": True}
    problems = []
    if rank == 0:
        try:
            state.take_lock()
            # under the lock, the folder must still be what the verdict was made from
            if _output_verdict(out, sig, cfg.resume, state) != verdict:
                raise SqError(f"{out} changed while this run was starting (another sq run?); run the command again")
            if verdict["action"] == "replace":
                removed = state.clear(writer.written_by_sq)
                logger.info("removed the previous run's files from %s: %s", out, ", ".join(removed) or "none")
            if verdict["action"] != "resume":
                state.write_signature(sig)
        except SqError as e:
            problems += e.problems
        except OSError as e:
            problems.append(f"cannot write to --output {out}: {e.strerror or e}")
    _raise_all(problems, "taking the output folder")
    log_file = add_log_file(out / LOG_DIR / f"rank-{rank:05d}.log")
    logger.info("quantizing %s -> %s on %d rank(s): %d Linears, %d expert groups", weights.describe(), out,
                world, len(quantized), sum(len(es) for es in block_experts))
    try:
        model.set_attn_implementation("sdpa")  # None mask == causal, no padding in calibration windows
    except Exception:  # noqa: BLE001 - older transformers: keep the default
        pass

    # ---- agree on the restart point: the largest block every rank can restart from
    state.load_manifest()
    points = [None] * world
    dist.all_gather_object(points, state.restart_points(need_chain=cfg.algo in CALIBRATED, n_blocks=len(blocks)))
    start = max(set.intersection(*(set(p) for p in points)))
    fragments: dict[str, str] = state.truncate(start)
    # Linears an earlier run of this job left unquantized for NaN/Inf (written raw in their block)
    skipped_nonfinite = [n for entry in state.manifest["blocks"] for n in entry.get("skipped_nonfinite", [])]
    for b, ls in enumerate(block_linears):
        block_linears[b] = [l for l in ls if l.name not in skipped_nonfinite]
    if start:
        logger.info("resuming at block %d of %d (blocks before it verified on every rank)", start, len(blocks))

    if parallelize is not None:
        parallelize()
    weights.fill(weights.root_names)

    # ---- calibration: this rank's samples rank::world -> block-0 inputs; SignRound also carries
    # the full-precision chain (its targets)
    inputs, fp_inputs, steps, dummy = [], [], 0, None
    signround = cfg.algo == "signround"
    if cfg.algo in CALIBRATED and start < len(blocks):
        torch.manual_seed(cfg.seed)
        inputs = _capture_block0(model, windows()[rank::world], device)
        steps = math.ceil(math.ceil(cfg.nsamples / world) / CALIB_BATCH)
        fp_inputs = inputs
        if start:  # both chains from the cache, never rebuilt approximately
            q_chain, fp_chain = state.read_chain(start)
            inputs = [(h, kw) for h, (_, kw) in zip(q_chain, inputs, strict=True)]
            if signround:
                fp_inputs = [(h, kw) for h, (_, kw) in zip(fp_chain, fp_inputs, strict=True)]
        dummy = inputs[0]

    stats = _Stats()
    progress = block_progress(len(blocks), start, bar=rank == 0)
    for b, ((prefix, block), linears, experts) in enumerate(zip(blocks, block_linears, block_experts)):
        if b < start:
            continue
        t0 = time.perf_counter()
        phase = {}
        names = weights.block_names(b)
        weights.fill(names)
        phase["fill"] = time.perf_counter() - t0
        bad = _nonfinite(linears, experts, device)
        if bad:  # every rank has the same list: they refuse together, or skip the same Linears
            refused = _nonfinite_refusal(bad, linears, weights, cfg.skip_nonfinite)
            if refused:
                raise SqError(refused)
            logger.warning("block %d: %s hold NaN/Inf values; left unquantized (--skip-nonfinite)", b, ", ".join(bad))
            linears = block_linears[b] = [l for l in linears if l.name not in bad]
            skipped_nonfinite += bad

        # Hessians: dense Linears summed over all ranks' tokens; experts at their owner
        counting, calibs = None, []
        if cfg.algo == "gptq":
            t = time.perf_counter()
            counting = _Counting(linears, device)
            calibs = [ExpertCalibration(ex, cfg.calibrate_all_experts, device) for _, ex, _ in experts]
            _block_forward(block, inputs, steps, dummy, counters=[counting, *calibs])
            maybe_die(fault, "calib", rank, b)
            counting.remove()
            for c in calibs:
                c.remove()
            for g in counting.gptq.values():
                n = torch.tensor([g.nsamples], dtype=torch.int64, device=device)
                dist.all_reduce(g.H)
                dist.all_reduce(n)
                g.nsamples = int(n.item())
            phase["calibrate"] = time.perf_counter() - t

        # SignRound: full-precision targets (and the next fp inputs), then tune this rank's rows / experts
        slots: dict[str, Slot] = {}
        if signround:
            t = time.perf_counter()
            fp_out = _block_forward(block, fp_inputs, steps, dummy)
            slots = _signround_slots(linears, experts, world)
            if slots and cfg.iters:
                with unsharded(block):
                    stats.tuning[prefix] = tune_block(block, list(slots.values()), inputs, fp_out, cfg.nsamples,
                                                      cfg.signround, cfg.seed, b)
            maybe_die(fault, "calib", rank, b)
            phase["tune"] = time.perf_counter() - t

        # quantize this rank's rows, write the dequantized rows back (the quantized chain)
        t = time.perf_counter()
        results = {}
        for lin in linears:
            local, _ = local_box(lin.module.weight)
            g = counting.get(lin.name) if counting else None
            w = local.detach().clone()
            if lin.name in slots:
                q, scale, zp, deq = slots[lin.name].result()
            else:
                q, scale, zp, deq = _quantize_rows(w, lin.scheme, g, lin.name, cfg.actorder)
            H = g.H if g is not None else None
            terms = _err_terms(w, deq, H)
            if g is not None or lin.name in slots:  # RTN on the same rows (and Hessian), for comparison
                terms += _err_terms(w, _quantize_rows(w, lin.scheme, None, lin.name)[3], H)
            local.copy_(deq)
            results[lin.name] = (q, scale, zp, terms)
        expert_q, fallback = _quantize_experts(experts, calibs, cfg.algo, cfg.actorder, slots)
        if counting:
            for g in counting.gptq.values():
                g.free()
        phase["solve"] = time.perf_counter() - t

        # layer errors: sum the per-rank terms
        if linears:
            terms = torch.tensor([results[l.name][3] for l in linears], dtype=torch.float64)
            dist.all_reduce(terms)
            for l, row in zip(linears, terms.tolist()):
                entry = {"rel_err": math.sqrt(row[0] / row[1]) if row[1] > 0 else 0.0,
                         "metric": "output (through H)" if cfg.algo == "gptq" else "weight",
                         "scheme": scheme_tag(l.scheme)}
                if len(row) > 2:
                    entry["rtn_rel_err"] = math.sqrt(row[2] / row[3]) if row[3] > 0 else 0.0
                stats.layers[l.name] = entry
        if experts:
            every = [None] * world
            dist.all_gather_object(every, fallback)
            stats.experts_rtn_fallback += len(set().union(*every))  # dp replicas name the same experts

        # the quantized chain: next block's inputs
        if cfg.algo in CALIBRATED and b + 1 < len(blocks):
            t = time.perf_counter()
            outs = _block_forward(block, inputs, steps, dummy)
            inputs = [(y, kw) for y, (_, kw) in zip(outs, inputs)]
            if signround:
                fp_inputs = [(y, kw) for y, (_, kw) in zip(fp_out, fp_inputs)]
            dummy = inputs[0]
            phase["forward"] = time.perf_counter() - t

        # gather each Linear's rows on its writer and compress; rank 0 writes the rest whole
        t = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        for lin in linears:
            q, scale, zp, _ = results[lin.name]
            out_f, in_f = lin.module.out_features, lin.module.in_features
            rows = dim0_counts(out_f, world)
            fq = _gather_rows(q, rows, lin.owner, in_f, q.dtype)
            fs = _gather_rows(scale, rows, lin.owner, scale.shape[1], scale.dtype)
            fz = _gather_rows(zp, rows, lin.owner, zp.shape[1], zp.dtype) if zp is not None else None
            if rank == lin.owner:
                for rel, v in compress_weight((fq, fs, fz), lin.scheme, (out_f, in_f)).items():
                    tensors[lin.ckpt_prefix + rel] = v
        for (eprefix, ex, scheme) in experts:
            tensors.update(_export_experts(eprefix, ex, expert_q[eprefix], weights.expert_pieces, scheme))
        skip = {f"{l.name}.weight" for l in linears} | {f"{p}.{f}" for p, _, _ in experts for f in FUSED}
        block_params = dict(model.named_parameters())
        for n in names:
            if n in skip:
                continue
            t_ = _full(block_params[n] if n in block_params else model.get_buffer(n))
            if rank == 0:
                tensors[weights.ckpt_name(n)] = t_.detach().clone()
        shard = writer.shard_name(rank, b)
        die = None
        if fault is not None and fault.hit("mid-shard-write", rank, b):
            die = lambda: maybe_die(fault, "mid-shard-write", rank, b)  # noqa: E731
        elif fault is not None and fault.hit("enospc", rank, b):
            die = _raise_enospc
        book = {}  # resume bookkeeping: checksum, chain cache, manifest (reported on its own)
        rec = writer.write_shard(out, shard, tensors, die_midway=die, checksum=cfg.bookkeeping, timings=book)
        maybe_die(fault, "after-shard-write", rank, b)
        if rec:
            fragments.update({k: shard for k in rec["tensors"]})
        t_book = time.perf_counter()
        if cfg.algo in CALIBRATED and b + 1 < len(blocks):
            state.write_chain(b + 1, [h for h, _ in inputs], [h for h, _ in fp_inputs] if signround else None)
        state.record_block(b, {shard: rec} if rec else {}, fault, skipped=bad)
        book_s = book.get("checksum", 0.0) + time.perf_counter() - t_book
        weights.free(names)
        del results, expert_q, tensors, counting, calibs
        trim_heap()
        phase["write"] = time.perf_counter() - t - book_s
        phase["bookkeeping"] = book_s
        total = time.perf_counter() - t0
        stats.blocks.append({"block": b, "seconds": round(total, 3),
                             **{k: round(v, 3) for k, v in phase.items()},
                             "rss_anon_after": rss_breakdown()["anon"]})
        if prefix in stats.tuning:
            logger.info("block %d/%d SignRound loss %.4g -> %.4g (start -> best of %d steps)", b + 1, len(blocks),
                        stats.tuning[prefix]["loss_first"], stats.tuning[prefix]["loss_best"], cfg.iters)
        logger.debug("block %d/%d done in %.2fs %s", b + 1, len(blocks), total,
                     " ".join(f"{k}={v:.2f}" for k, v in phase.items()))
        progress.step(b, total)
    progress.close()

    # ---- root tensors whole (keeping the checkpoint's own names; a tied alias has no key of its own)
    params = dict(model.named_parameters())
    root = {}
    for n in weights.root_names:
        t = _full(params[n] if n in params else model.get_buffer(n))
        if rank == 0:
            root[weights.ckpt_name(n)] = t.detach().clone()
    if rank == 0:
        fragments.update(writer.write_tensors(out, writer.shard_name(0, None), root))
        fragments.update(weights.write_extras(out))

    mine = {"rank": rank, "peak_rss_bytes": peak_rss_bytes(), "peak_gpu_bytes": _peak_gpu(device),
            "blocks": stats.blocks}
    all_frags = [None] * world
    all_mine = [None] * world
    dist.all_gather_object(all_frags, fragments)
    dist.all_gather_object(all_mine, mine)
    # rank 0 writes config, side files, report and (last) the index; every rank learns how that went,
    # so a failure there fails the whole job and no rank tears down while rank 0 still works
    report, err = {}, None
    if rank == 0:
        try:
            groups = _config_groups(block_linears, block_experts, weights)
            unquantized = sorted({*unquantized, *skipped_nonfinite})
            report = {
                "args": cfg.to_dict(),
                "source": weights.describe(),
                "scheme": assigner.default.to_dict() if assigner.default is not None else None,
                "recipe": assigner.to_dict() if cfg.recipe else None,
                "assignment": assignment,
                "world_size": world,
                "versions": _versions(),
                "ignored_linears": unquantized,
                "carried_over": weights.carried,
                "seconds": round(time.perf_counter() - t_start, 3),
                "ranks": all_mine,
                "layers": stats.layers,
                "experts_rtn_fallback": stats.experts_rtn_fallback,
                "resumed_from_block": start,
                "skipped_nonfinite": skipped_nonfinite,  # left unquantized: NaN/Inf weights (--skip-nonfinite)
            }
            if signround:
                report["signround"] = stats.tuning
            # what a rerun compares itself with to know the folder is complete (sq.resume.signed_json)
            report["run_signature"], report["run_signature_sha256"] = sig, signature_sha(sig)
            _finish(out, weights, groups, unquantized, report, all_frags, fault, state)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others heard of it
            err = e
    all_ok(err is None, "writing the config, report and index")
    remove_log_file(log_file)
    if err is not None:
        raise err
    return report


def _finish(out: Path, weights, groups, unquantized, report: dict, all_frags, fault, state) -> None:
    """Rank 0: config, side files, report, summary, picture; the merged index last."""
    config = weights.config
    config["quantization_config"] = quantization_config(groups, unquantized)
    writer.write_json(out / "config.json", config)
    report["side_files"] = weights.write_side_files(out)
    writer.write_json(out / "sq_report.json", report)
    for line in summary_lines(report):
        logger.info("%s", line)
    picture = write_report_png(report, out / "sq_report.png")
    if picture is not None:
        logger.info("report picture: %s", picture)
    writer.merge_index(out, all_frags, before_write=lambda: maybe_die(fault, "index-merge", 0))
    state.finish()  # the index and config exist: the run folder is no longer needed


def _config_groups(block_linears, block_experts, weights) -> dict:
    """``{scheme: targets}`` for ``quantization_config``: the largest group targets ``Linear``, the
    others their modules by exact name (compressed-tensors and vLLM prefer an exact name to a class)."""
    members: dict[QuantScheme, list[str]] = {}
    for ls in block_linears:
        for l in ls:
            members.setdefault(l.scheme, []).append(l.ckpt_prefix.removesuffix("."))
    for es in block_experts:
        for eprefix, ex, scheme in es:
            names = sorted({s.ckpt_prefix.removesuffix(".") for s in export_slots(eprefix, ex, weights.expert_pieces)})
            members.setdefault(scheme, []).extend(names)
    if len(members) <= 1:
        return {s: ["Linear"] for s in members}
    biggest = max(members, key=lambda s: len(members[s]))
    return {s: (["Linear"] if s == biggest else names) for s, names in members.items()}


def _versions() -> dict:
    import compressed_tensors
    import transformers

    import sq

    return {"sq": getattr(sq, "__version__", "dev"), "torch": torch.__version__,
            "transformers": transformers.__version__, "compressed_tensors": compressed_tensors.__version__}


def _peak_gpu(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
