"""Every zoo type in generated configurations (``sq.testing.zoo.variant``: layer pattern, shared experts, head
size, tied embeddings, dtype), each through GPTQ W4A16 at 2 ranks (``--ep 2`` for MoE) and model-free RTN
W4A16 at 1 rank, each output proven by ``check_output``; prints one row per variant and the failures.

    .venv/bin/python bench/zoo_variants.py [--types llama qwen3_moe ...] [--seeds 1 2 3] [--json FILE]

``tests/test_zoo_variants.py`` runs a small seeded sample of these (``SQ_ZOO_SEED`` picks another); this runs
them all (about 15 s per variant on 2 cores: the whole zoo at one seed is ~20 min).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sq.testing.zoo import ZOO, build_zoo, check_output, variant

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(nproc: int, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    return subprocess.run([*launch, "-m", "sq.ptq", *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def _cell(res: subprocess.CompletedProcess, src: Path, out: Path) -> tuple[str, str]:
    if res.returncode != 0:
        err = [ln.removeprefix("sq: error: ") for ln in res.stderr.splitlines() if "sq: error:" in ln]
        tail = res.stderr.strip().splitlines()[-1:] or [""]
        return ("refused", err[0][:240]) if err else ("FAILS", tail[0][:240])
    try:
        check_output(src, out)
    except AssertionError as e:
        return "WRONG", str(e).splitlines()[-1][:240]
    return "ok", ""


def run_variant(root: Path, model_type: str, seed: int) -> dict:
    v = variant(model_type, seed)
    entry = ZOO[model_type]
    src = build_zoo(root / v.id, model_type, variant=v)
    common = ["--model", str(src), "--scheme", "W4A16", "--group-size", "8"]
    cells = {}
    for mode, nproc, args in (
            ("gptq-2", 2, ["--algo", "gptq", "--nsamples", "4", "--seqlen", "32", *(["--ep", "2"] if entry.moe else []),
                           *(["--allow-unquantized-experts"] if entry.allow_carried(False) else [])]),
            ("model-free", 1, ["--algo", "rtn", "--model-free",
                               *(["--allow-unquantized-experts"] if entry.allow_carried(True) else [])])):
        out = root / f"{v.id}-{mode}"
        t0 = time.perf_counter()
        cells[mode] = (*_cell(_run(nproc, [*common, "--output", str(out), *args]), src, out),
                       round(time.perf_counter() - t0, 1))
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    return {"id": v.id, "family": entry.family, "variant": v.describe(), "dropped": list(v.dropped), "cells": cells}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="*", default=list(ZOO))
    p.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3])
    p.add_argument("--json", default=None, help="also write every row to this file (JSON lines)")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sq-zoo-variants-") as tmp:
        for t in a.types:
            for s in a.seeds:
                try:
                    row = run_variant(Path(tmp), t, s)
                except Exception as e:  # noqa: BLE001 - a variant that does not build is a row, not the end
                    row = {"id": f"{t}-s{s}", "family": ZOO[t].family, "variant": "", "dropped": [],
                           "cells": {"build": ("FAILS", f"{type(e).__name__}: {e}"[:240], 0)}}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print("\n| variant | GPTQ 2 ranks | model-free RTN |\n|---|---|---|")
    for r in rows:
        c = r["cells"]
        print(f"| {r['variant'] or r['id']} | " + " | ".join(f"{c[m][0]} {c[m][1]}".strip() if m in c else "-"
                                                           for m in ("gptq-2", "model-free")) + " |")
    bad = [r for r in rows if any(c[0] != "ok" for c in r["cells"].values())]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} variants pass")


if __name__ == "__main__":
    main()
