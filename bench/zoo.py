"""The support matrix: every zoo model_type through GPTQ at 2 ranks (--ep 2 for MoE) and model-free RTN,
each output proven by ``sq.testing.zoo.check_output``; writes docs/models.md.

    .venv/bin/python bench/zoo.py [--types llama gpt_oss ...] [--out docs/models.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sq.testing.zoo import ZOO, build_zoo, check_output

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    return subprocess.run(launch + ["-m", "sq.ptq", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _cell(src: Path, out: Path, res: subprocess.CompletedProcess) -> tuple[str, str]:
    if res.returncode != 0:
        err = [ln.removeprefix("sq: error: ") for ln in res.stderr.splitlines() if "sq: error:" in ln]
        return "refused" if err else "FAILS", (err[0] if err else res.stderr.strip().splitlines()[-1])[:160]
    try:
        got = check_output(src, out)
    except AssertionError as e:
        return "WRONG", str(e).splitlines()[-1][:160]
    carried = json.loads((out / "config.json").read_text())["quantization_config"].get("ignore", [])
    return "ok", f"{got['quantized']} quantized, {len(carried)} ignored"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="*", default=[t for t, e in ZOO.items() if e.family != "vlm"])
    p.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sq-zoo-") as tmp:
        for t in a.types:
            src = build_zoo(Path(tmp) / t, t)
            moe = ZOO[t].family == "moe"
            base = ["--model", str(src), "--scheme", "W4A16", "--group-size", "8"]
            g = Path(tmp) / f"{t}-gptq"
            gptq = _cell(src, g, _run([*base, "--output", str(g), "--algo", "gptq", "--nsamples", "4", "--seqlen",
                                       "32", *(["--ep", "2"] if moe else [])], 2))
            m = Path(tmp) / f"{t}-mf"
            mf = _cell(src, m, _run([*base, "--output", str(m), "--algo", "rtn", "--model-free"], 1))
            rows.append((t, ZOO[t].family, gptq, mf))
            print(t, gptq, mf, flush=True)
    lines = ["| model_type | family | GPTQ W4A16, 2 ranks" + (" (--ep 2 for MoE)" if True else "") +
             " | | model-free RTN W4A16 | |", "|---|---|---|---|---|---|"]
    lines += [f"| `{t}` | {fam} | {g[0]} | {g[1]} | {m[0]} | {m[1]} |" for t, fam, g, m in rows]
    doc = Path(a.out)
    head = doc.read_text().split("<!-- matrix -->")[0] if doc.exists() else "# Supported models\n\n"
    doc.write_text(head + "<!-- matrix -->\n" + "\n".join(lines) + "\n")
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
