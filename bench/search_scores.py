"""Which score makes ``--target-bits``' best allocation: one process, every score variant at once (issue 37).

    .venv/bin/python bench/search_scores.py [--nsamples 32] [--seqlen 512] [--bits 4.5] [--out bench/_work/search_scores]

On the demo model (one process, the whole model in memory, bf16 forwards as ``--calib-dtype auto``
chose here), every unit (the Linears reading one input) under W4A16 and W8A16 g64 by RTN alone,
its block's output change ``d`` scored five ways:

- ``mse``: ``sum d^2`` (``--search-score mse``);
- ``fisher_data_diag``: ``sum (g * d)^2``, ``g`` the gradient of the next-token loss on the data's tokens
  (``--search-score fisher``);
- ``fisher_data_dot``: ``sum_t (g_t . d_t)^2``, the per-token rank-one Fisher, not its diagonal;
- ``fisher_model_diag`` / ``fisher_model_dot``: the same with labels drawn from the model's own next-token
  distribution (the true Fisher, i.e. the Gauss-Newton of the KL to the full-precision model, in
  expectation), one draw per token (seeded).

Each variant's allocation is written as a recipe ``OUT/<variant>.yaml`` (``sq.pipeline.search.allocate``,
``recipe_text``), to quantize with ``sq.ptq --recipe`` and evaluate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("mse", "fisher_data_diag", "fisher_data_dot", "fisher_model_diag", "fisher_model_dot")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--bits", type=float, default=4.5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "_work" / "search_scores"))
    ap.add_argument("--quantizer", choices=("rtn", "gptq"), default="rtn",
                    help="how a unit is quantized for its score: RTN, or GPTQ against the unit's Hessian on the "
                         "full-precision chain (the algorithm the job then runs)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)

    from transformers import AutoModelForCausalLM

    from sq.calib.data import BUILTIN_PYDOC, calibration_windows, load_tokenizer, read_corpus, tokenize_corpus
    from sq.formats.schemes import get_scheme
    from sq.pipeline.search import Unit, _bits, allocate, recipe_text
    from sq.quant import rtn
    from sq.quant.gptq import GPTQ, GPTQConfig

    actorder = GPTQConfig().actorder
    from sq.quant.forward import InputLeaders, block_forward, block_grads, capture_block0, head_grads
    from sq.resolve import resolve_model

    src = resolve_model("demo:smollm2")
    tok = load_tokenizer(src)
    windows = calibration_windows(tokenize_corpus(tok, read_corpus(BUILTIN_PYDOC).text(tok)), args.nsamples, args.seqlen)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    layers = model.model.layers
    schemes = {c: get_scheme(c, group_size=64) for c in ("W4A16", "W8A16")}
    inputs = capture_block0(model, windows, "cpu")
    steps = len(inputs)
    chain = [inputs]
    for layer in layers:
        ys = block_forward(layer, chain[-1], steps, chain[-1][0])
        chain.append([(y, kw) for y, (_, kw) in zip(ys, chain[-1])])
    total = windows.shape[0] * (windows.shape[1] - 1)
    finals = [h for h, _ in chain[-1]]
    g_data = head_grads(model, finals, windows, total)
    # labels drawn from the model's own distribution: the same head, each token's label sampled
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logits = torch.cat([model(input_ids=windows[i:i + 8], use_cache=False).logits.float()
                            for i in range(0, windows.shape[0], 8)])
    drawn = torch.multinomial(torch.softmax(logits[:, :-1].reshape(-1, logits.shape[-1]), -1), 1, generator=gen)
    sampled = windows.clone()
    sampled[:, 1:] = drawn.reshape(windows.shape[0], -1)
    del logits
    g_model = head_grads(model, finals, sampled, total)

    units: dict[str, list[Unit]] = {v: [] for v in VARIANTS}
    for b in reversed(range(len(layers))):
        block, ins = layers[b], chain[b]
        ref = block_forward(block, ins, steps, ins[0])
        leaders = InputLeaders()
        lins = [(n, m) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
        hooks = [m.register_forward_hook(lambda mod, a, o, n=n: (leaders.of(n, a[0]), None)[1]) for n, m in lins]
        block_forward(block, ins[:1], 1, ins[0])
        for h in hooks:
            h.remove()
        hess = {}
        if args.quantizer == "gptq":
            def see(mod, a, o, n):
                hess.setdefault(n, GPTQ(mod.in_features)).add_batch(a[0])
            hooks = [m.register_forward_hook(lambda mod, a, o, n=n: see(mod, a, o, n)) for n, m in lins]
            block_forward(block, ins, steps, ins[0])
            for h in hooks:
                h.remove()
        groups: dict[str, list] = {}
        for n, m in lins:
            groups.setdefault(leaders.lead.get(n, n), []).append((n, m))
        leaders.release()
        for group in groups.values():
            scores = {v: {} for v in VARIANTS}
            for c, sc in schemes.items():
                saved = [(m, m.weight.data.clone()) for _, m in group]
                for n, m in group:
                    m.weight.data.copy_(rtn.rtn_rows(m.weight.data, sc).deq if args.quantizer == "rtn" else
                                        hess[n].quantize(m.weight.data, sc, name=n, actorder=actorder).weight)
                got = block_forward(block, ins, steps, ins[0])
                for m, w in saved:
                    m.weight.data.copy_(w)
                acc = dict.fromkeys(VARIANTS, 0.0)
                for i, (a, r) in enumerate(zip(got, ref)):
                    d = a.double() - r.double()
                    acc["mse"] += float(d.square().sum())
                    for kind, gs in (("data", g_data), ("model", g_model)):
                        g = gs[i].double()
                        acc[f"fisher_{kind}_diag"] += float((g * d).square().sum())
                        acc[f"fisher_{kind}_dot"] += float((g * d).sum(-1).square().sum())
                for v in VARIANTS:
                    scores[v][c] = acc[v]
            names = [f"model.layers.{b}.{n}" for n, _ in group]
            shapes = [[m.out_features, m.in_features] for _, m in group]
            for v in VARIANTS:
                units[v].append(Unit(names, shapes, scores[v]))
        print(f"block {b} scored", flush=True)
        if b:
            g_data = block_grads(block, ins, g_data, steps, ins[0])
            g_model = block_grads(block, ins, g_model, steps, ins[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = SimpleNamespace(target_bits=args.bits, candidates=tuple(schemes), group_size=64)

    def cost(u, c):
        return sum(_bits(schemes[c], o, i, torch.bfloat16) for o, i in u.shapes)

    summary = {}
    for v in VARIANTS:
        us = list(reversed(units[v]))
        reached = allocate(us, cost, args.bits)
        (out / f"{v}-{args.quantizer}-{args.bits:g}.yaml").write_text(recipe_text(us, cfg, reached))
        summary[v] = {"reached": reached, "w8": sorted(u.key() for u in us if u.choice == "W8A16")}
    (out / f"summary-{args.quantizer}-{args.bits:g}.json").write_text(json.dumps(summary, indent=1))
    for v, s in summary.items():
        print(v, round(s["reached"], 4), [k.split(".")[2] + "." + k.split(".")[-1] for k in s["w8"]])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
