"""FP8 block-scaled dequantization (reading DeepSeek-V3 / Kimi-K2 FP8 checkpoints): ``sq.load.fp8.dequantize_into``
against the plain way (torch's float8 -> float32 conversion, each element's block scale gathered, a cast), on
DeepSeek-V3's weight shapes, one thread, in the same run; both must give the same bits.

    .venv/bin/python bench/fp8_dequant.py
"""

from __future__ import annotations

import time

import torch

from sq.load.fp8 import dequantize_into
from sq.probe import machine

SHAPES = [(7168, 2048), (2048, 7168), (18432, 7168), (24576, 1536)]  # experts, shared, dense MLP, q_b_proj
BLOCK = (128, 128)


def plain(dest: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    nr, nc = weight.shape
    ri, ci = torch.arange(nr) // BLOCK[0], torch.arange(nc) // BLOCK[1]
    w = weight.to(torch.float32)
    w.mul_(scale[ri][:, ci])
    dest.copy_(w)


def main() -> None:
    torch.set_num_threads(1)
    m = machine()
    print(f"machine: {m.get('cpu')} ({', '.join(m.get('flags') or [])}), 1 thread")
    print("| weight | plain ns / element | sq ns / element | speed-up |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        w = (torch.randn(*shape, generator=g) * 0.1).to(torch.float8_e4m3fn)
        scale = torch.rand(shape[0] // BLOCK[0], shape[1] // BLOCK[1], generator=g) + 0.5
        a, b = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
        times = {}
        for name, run in (("plain", lambda: plain(a, w, scale)), ("sq", lambda: dequantize_into(b, w, scale, (0, 0), BLOCK))):
            run()
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t)
            times[name] = best * 1e9 / w.numel()
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), shape
        print(f"| {shape[0]} x {shape[1]} | {times['plain']:.2f} | {times['sq']:.2f} | {times['plain'] / times['sq']:.2f}x |")


if __name__ == "__main__":
    main()
