"""Process memory from /proc (Linux): current and peak RSS, private vs file-backed.

``ru_maxrss`` survives ``execve`` (a spawned rank inherits its parent's peak), so peaks come
from ``VmHWM``, which belongs to this address space and can be reset through ``clear_refs``.
safetensors maps files: their pages count in RSS as file-backed (shared page cache), so the
breakdown reports ``RssAnon`` (private) and ``RssFile`` separately.
"""

from __future__ import annotations


def _status() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def rss_bytes() -> int:
    return _status().get("VmRSS", 0)


def peak_rss_bytes() -> int:
    return _status().get("VmHWM", 0)


def rss_breakdown() -> dict[str, int]:
    s = _status()
    return {"rss": s.get("VmRSS", 0), "anon": s.get("RssAnon", 0), "file": s.get("RssFile", 0),
            "peak": s.get("VmHWM", 0)}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakPhases:
    """A run's peak RSS and each phase's: ``start(phase)`` folds the peak since the last reset into the phase
    that just ended and resets ``VmHWM``, so the next phase measures its own; it returns whether the reset was
    permitted (where it is not, every phase sees the process's peak so far)."""

    def __init__(self):
        self.peak = 0
        self.phases: dict[str, int] = {}

    def fold(self, phase: str) -> int:
        peak = peak_rss_bytes()
        self.peak = max(self.peak, peak)
        self.phases[phase] = max(self.phases.get(phase, 0), peak)
        return peak

    def start(self, ended: str) -> bool:
        self.fold(ended)
        return reset_peak_rss()


def io_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (page-cache hits are free)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 32 << 20
HEAP_TRIM_THRESHOLD = 64 << 20


def tune_heap(mmap_threshold: int = HEAP_MMAP_THRESHOLD, trim_threshold: int = HEAP_TRIM_THRESHOLD) -> bool:
    """Set glibc's heap policy for a quantization run: buffers above ``mmap_threshold`` are mapped
    (returned to the OS on free), smaller ones come from the heap, which shrinks itself once
    ``trim_threshold`` is free at its top; :func:`trim_heap` after each block returns the rest, so
    the private RSS stays flat in depth.  No-op (False) where glibc's ``mallopt`` is unavailable.

    Why not map everything above 64 KiB: every freed activation or gradient then goes back to the
    OS and the next step faults its pages in again -- SignRound on 2 ranks spends 41 of 136
    CPU-seconds in the kernel that way (6 s with these values) and runs 1.5x slower; the
    calibration forwards of every algorithm pay the same per batch.  Why not glibc's dynamic
    threshold: it only ever rises, so 2-32 MiB buffers fragment a heap that never shrinks by
    itself (~40 MiB per GPTQ block at hidden 1024, tests/test_ptq_memory.py), which the per-block
    trim undoes.  The price: freed buffers wait on the heap for the next step, so a SignRound
    rank's peak RSS on SmolLM2 is 1.24 GB instead of 0.75 GB (flat across blocks).  A user who sets glibc's
    own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` keeps that policy (False here);
    ``MALLOC_MMAP_THRESHOLD_=65536`` selects the leaner, slower policy.
    """
    import os

    if _libc() is None or any(v in os.environ for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(_LIBC.mallopt(_M_TRIM_THRESHOLD, trim_threshold))


# oneDNN's primitive cache and PyTorch's ideep cache above it each keep a compiled CPU kernel per
# matmul shape: 1024 entries by default, ~0.3-0.6 MiB each for a bf16 matmul.  A MoE calibration
# forward multiplies each expert by a different number of tokens, so on CPU nearly every expert
# call is a new shape and both caches fill to ~0.7 GiB per process (measured: 600 distinct bf16
# shapes, 1024 x 384: +390 MiB of private RSS at the defaults, +21 MiB at 16 entries each, same
# speed).  Fixed-shape (dense) forwards hit a small cache just as well.  0 is not safe: torch
# 2.13 segfaults with LRU_CACHE_CAPACITY=0.
CPU_KERNEL_CACHE_ENTRIES = 32
_KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_cpu_kernel_caches(entries: int = CPU_KERNEL_CACHE_ENTRIES, environ=None) -> dict[str, str]:
    """Cap the CPU matmul kernel caches at ``entries`` each, unless the user set them.

    Both caches read their variable when first used, so this must run before the process's first
    CPU matmul (the command lines call it first thing; inside a framework that already ran one it
    changes nothing).  Returns the values in effect.  No effect on CUDA.
    """
    import os

    environ = os.environ if environ is None else environ
    for var in _KERNEL_CACHE_VARS:
        environ.setdefault(var, str(max(1, int(entries))))
    return {var: environ[var] for var in _KERNEL_CACHE_VARS}


_LIBC = None


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``); False elsewhere.

    A block's many short-lived buffers of a few MB (per-expert Hessians, GPTQ temporaries) sit
    under the mmap threshold, so they come from the heap, and a freed heap is not returned to the
    OS by itself: without this the private RSS of a long MoE run creeps up block after block.
    The pipeline calls it through ``HeapTrim`` at each block's end.
    """
    if _libc() is None:
        return False
    return bool(_LIBC.malloc_trim(0))


# HeapTrim: at most this many blocks between trims, and at most this much private RSS growth
HEAP_TRIM_EVERY = 4
HEAP_KEEP = 256 << 20


class HeapTrim:
    """``trim_heap`` at a block's end, every ``every`` blocks, or sooner once the private RSS
    (``RssAnon``) has risen more than ``keep`` bytes above its level after the last trim.

    The next block allocates about what this one freed, and every page handed back is faulted in
    again then: trimming after every block cost GPTQ on SmolLM2 at 2 ranks 2.2 of its 8.2 system
    CPU-seconds and ~1 s of wall time per rank.  Not trimming at all lets a fragmenting heap creep
    up block after block (tests/test_ptq_memory.py: +70-110 MiB from 4 to 8 layers).  Between the
    two, the creep is bounded by ``every`` blocks' worth and by ``keep``: flat in depth."""

    def __init__(self, every: int = HEAP_TRIM_EVERY, keep: int = HEAP_KEEP):
        self.every, self.keep = every, keep
        self.since = 0
        self.base = rss_breakdown()["anon"]

    def __call__(self) -> bool:
        self.since += 1
        if self.since < self.every and rss_breakdown()["anon"] - self.base <= self.keep:
            return False
        trimmed = trim_heap()
        self.since, self.base = 0, rss_breakdown()["anon"]
        return trimmed


def _libc():
    """glibc through ctypes (cached), or None where it (or ``malloc_trim`` / ``mallopt``) is missing."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
            _LIBC.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC or None
