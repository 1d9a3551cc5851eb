"""GPTQ's column sweep: weights solved one by one vs side by side in one sweep (``quantize_together``).

    .venv/bin/python bench/gptq_sweep.py [--repeats 5]

One torch thread, W4A16 g64, static act-order (GPTQ's default).  Cases: SmolLM2's three 576-wide stacks of a
block (q/k/v 960 rows, o 576, gate/up 3072: each its own Hessian, what a rank solving them holds) and the down
projections of a few MoE experts, each under its own Hessian (16 experts 1024 x 512, 32 experts 256 x 128).
Prints the best of ``--repeats`` wall times each way, after checking every result is bit for bit the same
both ways (codes, scales, dequantized rows, loss).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from sq.formats.schemes import get_scheme
from sq.probe import machine
from sq.quant.gptq import GPTQ, Problem, quantize_together

CASES = {
    "SmolLM2 block: q/k/v + o + gate/up (576 wide)": [(960, 576), (576, 576), (3072, 576)],
    "16 experts' down_proj, 1024 x 512": [(1024, 512)] * 16,
    "32 experts' down_proj, 256 x 128": [(256, 128)] * 32,
}


def _problems(shapes, scheme, g: torch.Generator) -> list[Problem]:
    out = []
    for k, (rows, cols) in enumerate(shapes):
        x = torch.randn(2048, cols, generator=g) @ (torch.randn(cols, cols, generator=g) / cols**0.5)
        acc = GPTQ(cols)
        acc.add_batch(x.view(4, 512, cols).to(torch.bfloat16))
        out.append(Problem(acc, (torch.randn(rows, cols, generator=g) * 0.05).to(torch.bfloat16), scheme, f"w{k}"))
    return out


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    scheme = get_scheme("W4A16", 64)
    g = torch.Generator().manual_seed(0)
    print(f"machine: {machine()} ({platform.machine()}), torch {torch.__version__}, 1 thread")
    print("| case | one sweep each, ms | one sweep together, ms | speed-up |\n|---|---:|---:|---:|")
    for name, shapes in CASES.items():
        probs = _problems(shapes, scheme, g)
        alone = [quantize_together([p], actorder=True)[0] for p in probs]
        together = quantize_together(probs, actorder=True)
        for a, b in zip(alone, together):
            if not (torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and torch.equal(a.weight, b.weight)
                    and a.loss == b.loss):
                raise SystemExit(f"{name}: the results differ")
        t1 = _best(lambda: [quantize_together([p], actorder=True) for p in probs], args.repeats)
        t2 = _best(lambda: quantize_together(probs, actorder=True), args.repeats)
        print(f"| {name} | {t1 * 1e3:.0f} | {t2 * 1e3:.0f} | {t1 / t2:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
