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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sq.files import default_cache_dir, write_bytes_atomic

logger = logging.getLogger(__name__)

__all__ = ["Choice", "calib_dtype_choice", "machine", "time_linears"]

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

    @property
    def name(self) -> str:
        return "mixed" if self.autocast is not None else str(self.dtype or "model").removeprefix("torch.")

    def to_dict(self) -> dict:
        out = {"calib_dtype": self.name, "why": self.why, "seconds": self.seconds}
        if self.autocast is not None:
            out["autocast"] = str(self.autocast).removeprefix("torch.")
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
    key = json.dumps({"shapes": sorted(shapes), "dtype": str(dtype), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "machine": _processor(),
                      "node": platform.node(), "device": str(device.type), "tokens": PROBE_TOKENS})
    return default_cache_dir(os.environ) / "probes" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


def _read_cache(path) -> list[float] | None:
    try:
        cached = json.loads(path.read_text())
        return [float(cached[k]) for k in ("half", "float32")]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(path, secs: list[float]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, json.dumps(dict(zip(("half", "float32"), secs))).encode())
    except OSError as e:  # a read-only cache: measured again next time, same choice rule
        logger.debug("probe cache not written (%s)", e)


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
    path = _cache_file(shapes, model_dtype, device)
    secs = _read_cache(path)
    cached = secs is not None
    if secs is None:
        secs = [time_linears(shapes, d, device) for d in (model_dtype, torch.float32)]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:  # every rank's times averaged: one choice everywhere
        t = torch.tensor(secs, dtype=torch.float64)
        dist.all_reduce(t)
        secs = (t / world).tolist()
    if not cached and (not dist.is_initialized() or dist.get_rank() == 0):
        _write_cache(path, secs)  # the agreed times: a later job on this machine makes this same choice
    t_half, t_full = secs
    choice = take(half if t_half * MARGIN < t_full else "float32", "probe")
    choice.seconds = {str(model_dtype).removeprefix("torch."): round(t_half, 6), "float32": round(t_full, 6)}
    logger.info("--calib-dtype auto: %s (a probe of %d Linear shapes x %d tokens: %s %.1f ms, float32 %.1f ms%s)",
                choice.name if choice.name != "model" else str(model_dtype).removeprefix("torch."), len(shapes),
                PROBE_TOKENS, str(model_dtype).removeprefix("torch."), t_half * 1e3, t_full * 1e3,
                ", cached" if cached else "")
    return choice
