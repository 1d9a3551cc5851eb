"""sq's ``--target-bits`` search beside auto-round 0.16's AutoScheme at the same budget (issue 37).

    .venv/bin/python bench/peers/autoscheme.py [--bits 4.5] [--nsamples 128] [--seqlen 512] [--gptq-nsamples 128]
        [--steps choose,gptq,eval]

Both choose between W4 g64 and W8 g64 (symmetric int, weights only) per Linear on the same calibration
windows (``bench/peers.py``'s ``windows_file``: sq's own tokenization of ``builtin:pydoc``):

1. ``choose``: this file re-run inside ``bench/_work/venv-autoround`` (``--worker``; AutoScheme reads a
   dataset by name or local file only, so the windows go as their decoded text, which auto-round tokenizes
   again with the same tokenizer): ``AutoRound(model,
   scheme=AutoScheme(avg_bits=B, options=[W4 g64, W8 g64], shared_layers=[q/k/v, gate/up]), iters=0)``
   -- AutoScheme's delta-loss choice, then round-to-nearest -- saved as compressed-tensors; its per-layer
   choice (``ar.layer_config``) written as an sq recipe (``autoscheme_recipe.yaml``: W4A16 by default, an
   exact-name rule per 8-bit Linear).
2. ``gptq``: sq GPTQ at 2 ranks with that recipe (``--recipe``; ``--gptq-nsamples`` x ``--seqlen`` tokens): AutoScheme's allocation under sq's
   quantizer, to set beside sq's own search + GPTQ (``bench/ptq.py --runs tb45_w2``).
3. ``eval``: ``bench/peers/eval_preset.py`` on both outputs (the standard benchmark's last 40 windows).

The stored bits per weight of each allocation are counted the same way (``sq.pipeline.search.effective_bits``
over the quantized Linears). Results: ``bench/_work/autoscheme/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "bench" / "_work" / "autoscheme"
AR_PY = ROOT / "bench" / "_work" / "venv-autoround" / "bin" / "python"
GROUP = 64


def worker(args) -> int:
    """Inside venv-autoround: AutoScheme's choice at ``--bits``, RTN, saved; the choice as an sq recipe."""
    from auto_round import AutoRound, AutoScheme
    from auto_round.schemes import QuantizationScheme
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = json.loads(Path(args.windows).read_text())
    windows, n, seqlen = d["windows"], d["nsamples"], d["seqlen"]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", device_map="cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    # AutoScheme takes a dataset by name or local file only: the windows' text, one sample each (auto-round
    # tokenizes it again, with the same tokenizer)
    data = Path(args.out).parent / f"windows-text-{n}x{seqlen}.json"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(json.dumps([tok.decode(w) for w in windows]))
    data = str(data)
    options = [QuantizationScheme(bits=4, group_size=GROUP, sym=True), QuantizationScheme(bits=8, group_size=GROUP, sym=True)]
    scheme = AutoScheme(avg_bits=args.bits, options=options, nsamples=n, seqlen=seqlen, batch_size=args.batch_size,
                        dataset=data, shared_layers=[["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]])
    t = time.perf_counter()
    ar = AutoRound(model, tokenizer=tok, scheme=scheme, iters=0, nsamples=n, seqlen=seqlen, dataset=data,
                   device_map="cpu")
    ar.quantize_and_save(args.out, format="llm_compressor")
    core = time.perf_counter() - t
    out = Path(args.out)
    if not (out / "config.json").is_file():  # auto-round writes into OUT/<name>-<scheme>/
        sub = [p for p in out.iterdir() if (p / "config.json").is_file()]
        for f in sub[0].iterdir():
            f.rename(out / f.name)
        sub[0].rmdir()
    bits = {name: int(cfg["bits"]) for name, cfg in ar.layer_config.items()
            if isinstance(cfg, dict) and cfg.get("bits") is not None and "lm_head" not in name}
    rules = "".join(f"  - match: '^{re.escape(name)}$'\n    scheme: W8A16\n" for name, b in sorted(bits.items()) if b == 8)
    (out / "autoscheme_recipe.yaml").write_text(f"# auto-round AutoScheme avg_bits={args.bits}: its 8-bit layers\n"
                                                f"default: W4A16\ngroup_size: {GROUP}\nrules:\n{rules or '  []'}")
    (out / "autoscheme_run.json").write_text(json.dumps({"core_s": round(core, 2), "layer_bits": bits}) + "\n")
    return 0


def _stored_bits(model_src: Path, recipe: Path) -> float:
    """The recipe's stored bits per weight over the model's quantized Linears (sq's count)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sq.pipeline.search import effective_bits
    from sq.quant.recipe import make_assigner

    assigner = make_assigner("W4A16", GROUP, (), str(recipe), "standard")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_src))
    bits = params = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name:
            scheme = assigner.assign(name)
            n = m.out_features * m.in_features
            bits += effective_bits(scheme, m.out_features, m.in_features) * n
            params += n
    return bits / params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--windows")
    ap.add_argument("--out")
    ap.add_argument("--bits", type=float, default=4.5)
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--gptq-nsamples", type=int, default=128, help="sq GPTQ's calibration (the standard benchmark's)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", default="choose,gptq,eval")
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(ROOT / "bench"))
    from peers import windows_file

    from sq.resolve import resolve_model

    src = resolve_model("demo:smollm2")
    windows, sha = windows_file(src, args.nsamples, args.seqlen)
    tag = f"b{args.bits:g}-n{args.nsamples}x{args.seqlen}"
    ar_out, sq_out = WORK / f"autoscheme-{tag}", WORK / f"sq-gptq-autoscheme-recipe-{tag}"
    results = WORK / "results.json"
    rec = json.loads(results.read_text()) if results.is_file() else {}
    steps = args.steps.split(",")
    WORK.mkdir(parents=True, exist_ok=True)
    if "choose" in steps:
        t = time.perf_counter()
        subprocess.run([str(AR_PY), __file__, "--worker", "--model", str(src), "--windows", str(windows), "--out",
                        str(ar_out), "--bits", str(args.bits), "--batch-size", str(args.batch_size)], check=True)
        rec[tag] = {"windows_sha256": sha, "autoscheme_wall_s": round(time.perf_counter() - t, 1),
                    "autoscheme_stored_bits": _stored_bits(src, ar_out / "autoscheme_recipe.yaml"),
                    **json.loads((ar_out / "autoscheme_run.json").read_text())}
    if "gptq" in steps:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                        "sq.ptq", "--model", str(src), "--output", str(sq_out), "--algo", "gptq", "--group-size",
                        str(GROUP), "--nsamples", str(args.gptq_nsamples), "--seqlen", str(args.seqlen), "--recipe",
                        str(ar_out / "autoscheme_recipe.yaml"), "--resume", "never"], check=True, env=env)
        rec[tag]["sq_gptq_wall_s"] = round(time.perf_counter() - t, 1)
    if "eval" in steps:
        for key, path in (("autoscheme_rtn_ppl", ar_out), ("sq_gptq_with_autoscheme_recipe_ppl", sq_out)):
            got = subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "eval_preset.py"), "--model",
                                  str(path), "--nwindows", "40"], check=True, capture_output=True, text=True).stdout
            rec[tag][key] = json.loads(got.strip().splitlines()[-1])["ppl"]
    results.write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec[tag], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
