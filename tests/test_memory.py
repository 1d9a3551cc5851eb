"""Process-memory helpers: the CPU matmul kernel caches are bounded, so RSS does not grow per shape."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sq.memory import bound_cpu_kernel_caches

# Runs in a fresh interpreter: both caches read their variable at the first CPU matmul.
_PROBE = """
import sys, torch
from sq.memory import bound_cpu_kernel_caches, rss_breakdown
if sys.argv[1] == "bounded":
    bound_cpu_kernel_caches()
torch.set_num_threads(1)
w = torch.randn(384, 1024, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(7, 1024, dtype=torch.bfloat16), w)
before = rss_breakdown()["anon"]
for m in range(1, 301):  # a MoE calibration forward: every expert sees another token count
    torch.nn.functional.linear(torch.randn(m, 1024, dtype=torch.bfloat16), w)
print((rss_breakdown()["anon"] - before) / 2**20)
"""


def _growth_mib(mode: str) -> float:
    res = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return float(res.stdout.strip().splitlines()[-1])


def test_bf16_matmuls_of_many_shapes_do_not_grow_private_memory():
    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN: no CPU kernel cache to bound")
    default, bounded = _growth_mib("default"), _growth_mib("bounded")
    assert bounded < 60, f"bounded caches still grew {bounded:.0f} MiB (default: {default:.0f} MiB)"
    # measured (torch 2.13 CPU, avx512_bf16, 32 entries): default 212 MiB for 300 shapes, bounded 31 MiB.
    # On an AVX2-only CPU bf16 matmuls take a path without per-shape oneDNN primitives (measured:
    # default ~1 MiB), so there the probe has nothing to see.
    if "AVX512" in torch.backends.cpu.get_cpu_capability():
        assert default > 100, f"the probe went blind: default caches grew only {default:.0f} MiB"


def test_user_settings_win_and_zero_is_never_set():
    env = {"LRU_CACHE_CAPACITY": "256"}
    assert bound_cpu_kernel_caches(environ=env) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32",
                                                     "LRU_CACHE_CAPACITY": "256"}
    assert bound_cpu_kernel_caches(0, environ={}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1",
                                                       "LRU_CACHE_CAPACITY": "1"}


def test_command_lines_bound_the_caches_before_their_body_runs(monkeypatch):
    import os

    from sq.cli import run_cli

    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(var, raising=False)
    seen = {}
    assert run_cli(lambda: seen.update(os.environ)) == 0
    assert (seen["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], seen["LRU_CACHE_CAPACITY"]) == ("32", "32")


_FAULTS = r"""
import resource, sys, torch
from sq.memory import tune_heap
# "mapped": the user set glibc's MALLOC_MMAP_THRESHOLD_=65536 (sq's policy before 2026-12-03), kept
assert tune_heap() == (sys.argv[1] == "tuned")
def step():
    a = torch.ones(4 << 20)  # 16 MiB: an activation of a calibration batch
    del a
for _ in range(12):  # the heap grows to its working size (glibc: a few steps)
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def test_tuned_heap_reuses_freed_activations_without_faulting_them_in_again():
    """sq.ptq's heap policy (``tune_heap``): a freed 16 MiB buffer is served again from the heap, not
    mapped afresh and faulted in page by page on every calibration step (the 64 KiB mmap threshold
    sq used before cost SignRound a third of its CPU time in the kernel); a user's own glibc setting
    is left alone."""
    import os
    import subprocess
    import sys

    def faults(mode):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        if mode == "mapped":
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        r = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120,
                           env=env)
        assert r.returncode == 0, r.stderr
        return int(r.stdout.split()[-1])

    pages = 10 * (16 << 20) // 4096
    assert faults("mapped") > pages // 2  # the old policy: every step faults its 4096 pages in again
    assert faults("tuned") < pages // 20


_TRIM = r"""
import resource, torch
from sq.memory import HeapTrim, rss_breakdown, tune_heap
assert tune_heap()
keep = []
def block(mib):  # a block's buffers, 4 MiB each (under the mmap threshold: heap), one kept alive
    bufs = [torch.ones(1 << 20) for _ in range(mib // 4)]
    keep.append(bufs[len(bufs) // 2])  # a survivor in the middle: the heap's top cannot shrink
    del bufs
trim = HeapTrim(every=3, keep=256 << 20)
block(96)
held = trim()  # 1 of 3 blocks, under keep: the free pages are left for the next block
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block(96)
refault = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
held2 = trim()
block(96)
third = trim()  # every 3 blocks
block(512)
before = rss_breakdown()["anon"]
grown = trim()  # over keep: at once
print(held, held2, refault, third, grown, (before - rss_breakdown()["anon"]) >> 20)
"""


def test_block_end_trim_every_few_blocks_or_once_the_heap_grew():
    """The pipeline's per-block ``HeapTrim``: a block's free heap pages are left for the next block,
    which reuses them without faulting them in again, and handed back every few blocks, or at once
    when they add up to more than ``keep`` (RSS bounded, flat in depth)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    r = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    held, held2, refault, third, grown, released = r.stdout.split()
    assert (held, held2, third, grown) == ("False", "False", "True", "True"), r.stdout
    assert int(refault) < (96 << 20) // 4096 // 2, r.stdout  # reused (trimmed: ~all 24576 pages again)
    assert int(released) >= 256, r.stdout
