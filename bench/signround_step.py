"""One SignRound tuning step of one demo:smollm2 block, timed (docs/benchmarks.md, "Where a SignRound step goes").

    .venv/bin/python bench/signround_step.py                      # mixed (the CPU default), chunks of 64
    .venv/bin/python bench/signround_step.py --backward sdpa      # the chunks' backward SDPA's (default: sq's)
    .venv/bin/python bench/signround_step.py --compile            # torch.compile of the block's forward
    .venv/bin/python bench/signround_step.py --no-float32-copy    # gathered bf16 weights straight to autocast
    .venv/bin/python bench/signround_step.py --profile            # torch.profiler's table of the step
    .venv/bin/python bench/signround_step.py --attention          # causal attention alone: SDPA's backward vs sq's

One thread, 4 windows x 512 tokens (a rank's share of batch 8 at 2 ranks), W4A16 g64 on the full-range grid,
every Linear of layer 5 tuned (``sq.quant.signround.tuned_qdq``), the loss an MSE against a fixed target.
Prints the median of 8 steps after 3 untimed ones: the quantize-dequantize, the forward, the backward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _block_step(args) -> None:
    from transformers import AutoModelForCausalLM

    from sq.demo import demo_path
    from sq.formats.schemes import get_scheme, with_int_grid
    from sq.quant.attention import use_sdpa
    from sq.quant.forward import autocast_to
    from sq.quant.signround import _Swapped, tuned_qdq

    model = AutoModelForCausalLM.from_pretrained(demo_path("demo:smollm2"), dtype=torch.float32)
    use_sdpa(model, args.chunk or None, args.backward)
    block = model.model.layers[5]
    for p in block.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 512, 576, generator=g) * 0.5
    target = torch.randn(4, 512, 576, generator=g)
    pos = torch.arange(512)[None]
    pe = model.model.rotary_emb(x, pos)
    scheme = with_int_grid(get_scheme("W4A16", 64), "full")
    lins = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    params = []
    for m in lins:
        w = m.weight.float()
        groups = (w.shape[0], w.shape[1] // 64)
        params.append((w, torch.zeros_like(w, requires_grad=True), torch.ones(groups, requires_grad=True),
                       torch.ones(groups, requires_grad=True)))

    def loss_of(blk, h):
        y = blk(h, position_embeddings=pe, attention_mask=None, position_ids=pos)
        return ((y[0] if isinstance(y, tuple) else y).float() - target).pow(2).mean()

    forward = torch.compile(loss_of, dynamic=False) if args.compile else loss_of

    def step():
        t0 = time.perf_counter()
        ws = []
        for m, (w, v, a, b) in zip(lins, params):
            q = tuned_qdq(w, v, a, b, scheme, dtype=torch.bfloat16).to(torch.bfloat16)
            ws.append((m, "weight", q if args.no_float32_copy else q.to(torch.float32)))
        t1 = time.perf_counter()
        with _Swapped(ws), autocast_to(torch.bfloat16, x.device):
            loss = forward(block, x)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        for _, v, a, b in params:
            v.grad = a.grad = b.grad = None
        return t1 - t0, t2 - t1, t3 - t2

    t = time.perf_counter()
    step()
    print(f"first step {time.perf_counter() - t:.1f} s (a compile happens here)")
    for _ in range(2):
        step()
    times = [step() for _ in range(8)]
    q, f, b = (statistics.median(t[i] for t in times) * 1e3 for i in range(3))
    print(f"qdq {q:.1f} ms, forward {f:.1f} ms, backward {b:.1f} ms")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(3):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def _attention(args) -> None:
    from sq.quant.attention import causal_chunks

    B, H, KV, T, D = 4, 9, 3, 512, 64  # SmolLM2's heads, one rank's 4 windows

    def inputs():
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(B, h, T, D, generator=g) * 1.5).to(torch.bfloat16).requires_grad_() for h in (H, KV, KV)]

    grad = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = [t.detach().double().requires_grad_() for t in inputs()]
    F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True).backward(grad.double())
    c = args.chunk or 64
    for name, fn in (("SDPA, one call", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                      enable_gqa=True)),
                     (f"SDPA, chunks of {c}", lambda q, k, v: causal_chunks(q, k, v, c)),
                     (f"sq's backward, chunks of {c}", lambda q, k, v: causal_chunks(q, k, v, c, backward="sq"))):
        times = []
        for r in range(5):
            q, k, v = inputs()
            t0 = time.perf_counter()
            o = fn(q, k, v)
            t1 = time.perf_counter()
            o.backward(grad)
            t2 = time.perf_counter()
            times.append((t1 - t0, t2 - t1))
        errs = [float((t.grad.double() - r.grad).norm() / r.grad.norm()) for t, r in zip((q, k, v), ref)]
        f, b = (min(t[i] for t in times[1:]) * 1e3 for i in range(2))
        print(f"{name}: forward {f:.1f} ms, backward {b:.1f} ms; gradients' relative error vs float64 "
              f"q {errs[0]:.1e}, k {errs[1]:.1e}, v {errs[2]:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=64, help="causal attention's query chunk (0: one call)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--no-float32-copy", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--backward", choices=("sdpa", "sq"), default="sq", help="the chunks' backward (sq.quant.attention)")
    ap.add_argument("--attention", action="store_true", help="time the attention alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _attention(args) if args.attention else _block_step(args)


if __name__ == "__main__":
    main()
