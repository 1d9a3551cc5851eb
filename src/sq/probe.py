"""Speed choices measured on the machine that runs the job, never read off a CPU model or flag list.

    choice = calib_dtype_choice(shapes, model_dtype, device)   # every rank, before the output is claimed

``--calib-dtype auto`` on CPU: the calibration forwards compute in the model's half dtype only where
this machine multiplies it faster than float32 (AMX, AVX512-BF16: yes; AVX2 alone: about half float32's
speed), else in float32 (which is also the more precise).  An algorithm whose gradients flow through the
forwards (SignRound: ``half_forwards = "mixed"``) takes ``mixed`` instead of the model's dtype: weights and
the residual stream stay float32 and ``torch.autocast`` runs the matmuls and attention in the half dtype
(the half dtype's speed, float32's perplexity: docs/benchmarks.md).  A probe times the job's own Linear shapes in
both dtypes (well under a second); every rank's times are averaged with one all-reduce, so every rank makes
the same choice.  The times are kept per machine and shape in the sq cache
(``$SQ_CACHE_DIR/probes``), so later jobs on the machine -- and a test suite's many jobs -- choose the
same way without measuring again (delete the folder to measure again); a resumed run takes the choice
its signature recorded.  On GPU the model's dtype is kept without a probe.

The same way, each timed at the job's shapes, averaged over ranks, cached, recorded for resume: the causal
attention's query chunk and, where gradients flow, its backward (``sq.quant.attention``), and GPTQ's Hessian
products of bf16 inputs, bf16 operands or float32 (``sq.quant.gptq.use_bf16_products``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sq.files import default_cache_dir, write_bytes_atomic
from sq.quant.attention import causal_chunks
from sq.quant.gptq import bf16_operand_products, bf16_products_available, sym_products

logger = logging.getLogger(__name__)

__all__ = ["Choice", "attention_chunk_choice", "attention_chunks", "attention_probe_file", "calib_dtype_choice", "attention_backward_choice",
           "attention_backward_probe_file", "hessian_probe_file", "hessian_products_choice", "machine", "time_attention", "time_hessian", "time_linears"]

# CPU flags recorded beside a run's timings (docs/benchmarks.md names machines by them); never a rule
_RECORDED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16", "fma")

PROBE_TOKENS = 512  # rows of the probe's activations (a calibration forward's GEMMs are this wide or wider)
MAX_WIDTH = 2048  # a shape's sides are cut to this: the speed ratio is the same, the probe stays under ~1 s
REPEATS = 3  # the best of this many timed passes (after one untimed)
MARGIN = 1.10  # the half dtype must be this much faster than float32 to give up float32's precision


@dataclass
class Choice:
    """What the calibration forwards compute in, and why: ``dtype`` None means the model's own."""

    dtype: torch.dtype | None
    why: str  # "flag", "gpu", "float32 model", "probe", "recorded"
    seconds: dict[str, float] = field(default_factory=dict)  # averaged over ranks, by dtype name
    # mixed: the half dtype torch.autocast runs the block's matmuls and attention in (dtype is float32)
    autocast: torch.dtype | None = None
    # causal attention in query chunks of this many (sq.quant.attention), or one call; the probe's record
    attn_chunk: int | None = None
    attn: dict = field(default_factory=dict)
    # the chunks' backward where gradients flow (SignRound): SDPA's or sq's (sq.quant.attention); the probe's record
    attn_backward: str = "sdpa"
    attn_bwd: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "mixed" if self.autocast is not None else str(self.dtype or "model").removeprefix("torch.")

    def to_dict(self) -> dict:
        out = {"calib_dtype": self.name, "why": self.why, "seconds": self.seconds}
        if self.autocast is not None:
            out["autocast"] = str(self.autocast).removeprefix("torch.")
        if self.attn:
            out["attention"] = {"chunk": self.attn_chunk, **self.attn}
        if self.attn_bwd:
            out["attention_backward"] = {"backward": self.attn_backward, **self.attn_bwd}
        return out


def time_linears(shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                 tokens: int = PROBE_TOKENS, repeats: int = REPEATS) -> float:
    """Seconds for one pass of ``tokens`` rows through a Linear of each ``(in, out)`` shape, then what a
    block does beside its matmuls -- an activation times a gate on each output, and causal attention
    over the tokens in heads of 64 -- in ``dtype`` (the best of ``repeats`` passes after an untimed one)."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(min(i, MAX_WIDTH), min(o, MAX_WIDTH)) for i, o in shapes]
    pairs = [(torch.randn(tokens, i, generator=g, device=device).to(dtype),
              torch.randn(o, i, generator=g, device=device).to(dtype)) for i, o in shapes]
    width = max(i for i, _ in shapes)
    q = torch.randn(1, max(1, width // 64), tokens, 64, generator=g, device=device).to(dtype)
    F = torch.nn.functional
    best = float("inf")
    for r in range(repeats + 1):
        t = time.perf_counter()
        for x, w in pairs:
            y = F.linear(x, w)
            F.silu(y) * y
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r:
            best = min(best, time.perf_counter() - t)
    return best


def machine() -> dict:
    """What this rank runs on, for the report beside its timings: the CPU's model and core count, the
    matrix-relevant ISA flags, torch's CPU capability, the GPU's name.  Recorded only: no choice reads it."""
    try:
        with open("/proc/cpuinfo") as f:  # the first processor's entries are every processor's
            first = f.read(1 << 16).split("\n\n", 1)[0]
    except OSError:
        first = ""
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    out: dict = {"cpu": info.get("model name") or _processor(), "cores": os.cpu_count(),
                 "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if "flags" in info:
        have = set(info["flags"].split())
        out["flags"] = [f for f in _RECORDED_FLAGS if f in have]
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def _processor() -> str:
    return platform.processor() or platform.machine()


def _cache_file(shapes, dtype: torch.dtype, device: torch.device):
    return _probe_path({"shapes": sorted(shapes), "dtype": str(dtype), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "machine": _processor(),
                        "node": platform.node(), "device": str(device.type), "tokens": PROBE_TOKENS})


def _probe_path(key: dict):
    """``$SQ_CACHE_DIR/probes/<sha256 of the key's JSON, 24 hex>.json``: one file per machine and shape."""
    text = json.dumps(key)
    return default_cache_dir(os.environ) / "probes" / (hashlib.sha256(text.encode()).hexdigest()[:24] + ".json")


def _read_cache(path, keys=("half", "float32")) -> list[float] | None:
    try:
        cached = json.loads(path.read_text())
        return [float(cached[k]) for k in keys]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(path, secs: list[float], keys=("half", "float32")) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, json.dumps(dict(zip(keys, secs))).encode())
    except OSError as e:  # a read-only cache: measured again next time, same choice rule
        logger.debug("probe cache not written (%s)", e)


def _agreed(path, keys, measure) -> tuple[list[float], bool]:
    """Seconds by ``keys``: from the cache at ``path`` or ``measure()``d; averaged over every rank (one
    all-reduce: every rank then chooses the same), then cached.  Collective: call on every rank."""
    secs = _read_cache(path, keys)
    cached = secs is not None
    if secs is None:
        secs = measure()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        t = torch.tensor(secs, dtype=torch.float64)
        dist.all_reduce(t)
        secs = (t / world).tolist()
    if not cached and (not dist.is_initialized() or dist.get_rank() == 0):
        _write_cache(path, secs, keys)  # the agreed times: a later job on this machine makes this same choice
    return secs, cached


def calib_dtype_choice(setting: str, shapes: list[tuple[int, int]], model_dtype: torch.dtype | None,
                       device: torch.device, recorded: str | None = None, half: str = "model") -> Choice:
    """The dtype the calibration forwards compute in (collective for ``auto`` on CPU: call on every rank).

    ``setting``: ``--calib-dtype`` (``float32``, ``model``, ``mixed``, ``auto``); ``shapes``: the job's
    Linear ``(in, out)`` shapes to probe; ``recorded``: the choice an unfinished or finished run of this
    job recorded (``auto`` takes it, so a resumed run computes as the run it continues); ``half``: what
    ``auto`` takes where the half dtype wins, ``model`` or ``mixed`` (the algorithm's ``half_forwards``)."""
    halved = model_dtype is not None and model_dtype.is_floating_point and model_dtype.itemsize < 4

    def take(word: str, why: str) -> Choice:
        if word == "mixed":  # a float32 model has no half dtype to autocast to: it computes as it is
            return Choice(torch.float32, why, autocast=model_dtype) if halved else Choice(None, "float32 model")
        return Choice(None if word == "model" else getattr(torch, word), why)

    if setting != "auto":
        return take(setting, "flag")
    if recorded is not None:
        return take(recorded, "recorded")
    if device.type != "cpu":
        return take(half, "gpu")
    if not halved or not shapes:
        return Choice(None, "float32 model")
    (t_half, t_full), cached = _agreed(_cache_file(shapes, model_dtype, device), ("half", "float32"),
                                       lambda: [time_linears(shapes, d, device) for d in (model_dtype, torch.float32)])
    choice = take(half if t_half * MARGIN < t_full else "float32", "probe")
    choice.seconds = {str(model_dtype).removeprefix("torch."): round(t_half, 6), "float32": round(t_full, 6)}
    logger.info("--calib-dtype auto: %s (a probe of %d Linear shapes x %d tokens: %s %.1f ms, float32 %.1f ms%s)",
                choice.name if choice.name != "model" else str(model_dtype).removeprefix("torch."), len(shapes),
                PROBE_TOKENS, str(model_dtype).removeprefix("torch."), t_half * 1e3, t_full * 1e3,
                ", cached" if cached else "")
    return choice


# query chunks the attention probe tries (sq.quant.attention); a chunk is tried where 4 of them fit
ATTN_CHUNKS = (32, 64, 128, 256)
ATTN_PROBE_HEADS = 4  # heads in the probe's attention: the time per head is what is compared
ATTN_PROBE_TOKENS = 1024  # a longer window is probed at this length (longer ones gain more from chunks)


def time_attention(heads: int, head_dim: int, tokens: int, dtype: torch.dtype, device: torch.device,
                   chunk: int | None, repeats: int = 2, backward: str | None = None) -> float:
    """Seconds for causal attention over ``tokens`` in ``heads`` heads of ``head_dim``: one call with
    ``is_causal``, or one per query chunk of ``chunk`` over the keys it can see (the best of ``repeats``
    passes after an untimed one); with ``backward`` (``"sdpa"`` or ``"sq"``: ``causal_chunks``'), forward
    and backward."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, tokens, head_dim, generator=g, device=device).to(dtype)
    if backward is not None:
        q.requires_grad_()
    best = float("inf")
    for r in range(repeats + 1):
        t = time.perf_counter()
        if chunk is None:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        elif backward is not None:
            with torch.enable_grad():
                causal_chunks(q, q, q, chunk, backward=backward).sum().backward()
        else:
            causal_chunks(q, q, q, chunk)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r:
            best = min(best, time.perf_counter() - t)
    return best


def attention_probe_file(heads: int, head_dim: int, tokens: int, dtype: torch.dtype, device: torch.device):
    """Where the attention probe's seconds for this shape are kept (``{"none": s, "<chunk>": s, ...}``):
    one per machine and shape, whatever the thread count, so every job of a shape here chooses alike."""
    return _probe_path({"attention": [min(heads, ATTN_PROBE_HEADS), head_dim, min(tokens, ATTN_PROBE_TOKENS)],
                        "dtype": str(dtype), "torch": torch.__version__, "machine": _processor(),
                        "node": platform.node(), "device": str(device.type)})


def attention_chunks(tokens: int) -> tuple[int, ...]:
    """The query chunks the attention probe chooses among for windows of ``tokens`` (at least four chunks)."""
    return tuple(c for c in ATTN_CHUNKS if 4 * c <= tokens)


def attention_chunk_choice(heads: int, head_dim: int, tokens: int, dtype: torch.dtype, device: torch.device,
                           recorded: int | None = None) -> tuple[int | None, dict]:
    """Query chunk for the calibration forwards' causal attention (``sq.quant.attention``), or None (one
    call); with the probe's seconds.  ``recorded``: the chunk a run of this job recorded (0: none), taken
    as it is.  Measured on CPU only (GPU kernels skip the masked blocks themselves); a chunk must beat one
    call by ``MARGIN``.  Collective where it measures: call on every rank."""
    if recorded is not None:
        return recorded or None, {"why": "recorded"}
    chunks = list(attention_chunks(tokens))
    if device.type != "cpu" or not chunks or heads < 1 or head_dim < 1:
        return None, {}
    n, h = min(tokens, ATTN_PROBE_TOKENS), min(heads, ATTN_PROBE_HEADS)
    keys = ["none", *map(str, chunks)]
    secs, cached = _agreed(attention_probe_file(heads, head_dim, tokens, dtype, device), keys,
                           lambda: [time_attention(h, head_dim, n, dtype, device, None if c == "none" else int(c))
                                    for c in keys])
    best = min(range(1, len(keys)), key=lambda i: secs[i])
    chunk = chunks[best - 1] if secs[best] * MARGIN < secs[0] else None
    logger.info("causal attention: %s (a probe of %d heads x %d tokens: %s%s)",
                f"in query chunks of {chunk}" if chunk else "one call", h, n,
                ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in zip(keys, secs)), ", cached" if cached else "")
    return chunk, {"why": "probe", "seconds": {k: round(t, 6) for k, t in zip(keys, secs)}}


HESSIAN_MARGIN = 1.05  # bf16 operands: the same exact products, only the sums' order differs from float32's


def time_hessian(widths: list[int], device: torch.device, bf16: bool, repeats: int = REPEATS) -> float:
    """Seconds for one sample's Hessian products (``sq.quant.gptq.sym_products``) of ``PROBE_TOKENS`` bf16
    values at each of ``widths`` (cut to ``MAX_WIDTH``), in float32 or as bf16 operands (the best of
    ``repeats`` passes after an untimed one)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(PROBE_TOKENS, min(n, MAX_WIDTH), generator=g).to(torch.bfloat16).to(device, torch.float32)
          for n in widths]
    hs = [torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=device) for x in xs]
    best = float("inf")
    with bf16_operand_products(bf16):
        for r in range(repeats + 1):
            t = time.perf_counter()
            for x, h in zip(xs, hs):
                sym_products(h, x)
            if r:
                best = min(best, time.perf_counter() - t)
    return best


def hessian_probe_file(widths: list[int], device: torch.device):
    """Where the Hessian probe's seconds for these widths are kept (``{"bf16": s, "float32": s}``)."""
    return _probe_path({"hessian": sorted({min(n, MAX_WIDTH) for n in widths}), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "machine": _processor(), "node": platform.node(),
                        "device": str(device.type), "tokens": PROBE_TOKENS})


def hessian_products_choice(widths: list[int], dtype: torch.dtype | None, device: torch.device,
                            recorded: bool | None = None) -> tuple[bool, dict]:
    """Whether GPTQ's Hessian products of the forwards' bf16 inputs run as bf16 operands with float32 sums
    (``sq.quant.gptq.use_bf16_products``) or in float32, with the probe's seconds.  Measured where both can
    run (CPU, bf16 inputs, a CPU and torch with the mode: on an AMX Xeon 2.4x faster, on an AMD EPYC with
    AVX512-BF16 1.13x at 1536 wide and equal at 576); the bf16 form must win by ``HESSIAN_MARGIN``.
    ``recorded``: a run of this job's choice, taken as it is.  Collective where it measures (the mode's
    absence counts as an infinitely slow time, so ranks on different CPUs agree): call on every rank."""
    if recorded is not None:
        on = recorded and bf16_products_available()
        if recorded and not on:
            logger.warning("the run being resumed took GPTQ's Hessian products as bf16 operands, which this CPU "
                           "or torch cannot: float32 here (the same products, sums in another order)")
        return on, {"why": "recorded"}
    widths = sorted(set(widths))[-3:]
    if device.type != "cpu" or dtype != torch.bfloat16 or not widths:
        return False, {}
    keys = ("bf16", "float32")
    secs, cached = _agreed(hessian_probe_file(widths, device), keys, lambda: [
        time_hessian(widths, device, True) if bf16_products_available() else float("inf"),
        time_hessian(widths, device, False)])
    on = secs[0] * HESSIAN_MARGIN < secs[1] and bf16_products_available()
    logger.info("GPTQ Hessian products: %s (a probe of %s wide x %d tokens: bf16 operands %s, float32 %.1f ms%s)",
                "bf16 operands, float32 sums" if on else "float32", "/".join(map(str, widths)), PROBE_TOKENS,
                f"{secs[0] * 1e3:.1f} ms" if math.isfinite(secs[0]) else "unavailable", secs[1] * 1e3,
                ", cached" if cached else "")
    return on, {"why": "probe", "seconds": {k: round(t, 6) if math.isfinite(t) else None for k, t in zip(keys, secs)}}


def attention_backward_probe_file(heads: int, head_dim: int, tokens: int, chunk: int, dtype: torch.dtype,
                                  device: torch.device):
    """Where the attention backward probe's seconds are kept (``{"sdpa": s, "sq": s}``), per machine and shape."""
    return _probe_path({"attention_backward": [min(heads, ATTN_PROBE_HEADS), head_dim, min(tokens, ATTN_PROBE_TOKENS),
                                               chunk], "dtype": str(dtype), "torch": torch.__version__,
                        "machine": _processor(), "node": platform.node(), "device": str(device.type)})


def attention_backward_choice(heads: int, head_dim: int, tokens: int, dtype: torch.dtype, device: torch.device,
                              chunk: int | None, recorded: str | None = None) -> tuple[str, dict]:
    """The backward of the chunked causal attention where gradients flow through the forwards (SignRound's
    steps): SDPA's (``"sdpa"``) or ``sq.quant.attention._CausalChunks``' (``"sq"``), with the probe's seconds.
    ``recorded``: a run of this job's, taken as it is.  Timed forward and backward at ``chunk`` on CPU; ``"sq"``
    must win by ``MARGIN`` (the two round differently).  Collective where it measures: call on every rank."""
    if recorded in ("sdpa", "sq"):
        return recorded, {"why": "recorded"}
    if device.type != "cpu" or not chunk:
        return "sdpa", {}
    n, h = min(tokens, ATTN_PROBE_TOKENS), min(heads, ATTN_PROBE_HEADS)
    keys = ("sdpa", "sq")
    secs, cached = _agreed(attention_backward_probe_file(heads, head_dim, tokens, chunk, dtype, device), keys,
                           lambda: [time_attention(h, head_dim, n, dtype, device, chunk, backward=b) for b in keys])
    backward = "sq" if secs[1] * MARGIN < secs[0] else "sdpa"
    logger.info("causal attention's backward: %s (a probe of %d heads x %d tokens in chunks of %d: SDPA's %.1f ms, "
                "sq's %.1f ms%s)", "sq's" if backward == "sq" else "SDPA's", h, n, chunk, secs[0] * 1e3, secs[1] * 1e3,
                ", cached" if cached else "")
    return backward, {"why": "probe", "seconds": {k: round(t, 6) for k, t in zip(keys, secs)}}
