"""The support matrix: every zoo model_type through GPTQ W4A16 at 1 rank, at 2 ranks (--ep 2 for MoE) and
model-free RTN W4A16, each output proven by ``sq.testing.zoo.check_output`` (or the refusal's first
line); writes the table of docs/models.md below its ``<!-- matrix -->`` line.

    .venv/bin/python bench/zoo.py [--types llama gpt_oss ...] [--out docs/models.md]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
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
    """("ok" | "refused" | "FAILS" | "WRONG", a note: what was carried, or why not)."""
    if res.returncode != 0:
        err = [ln.removeprefix("sq: error: ") for ln in res.stderr.splitlines() if "sq: error:" in ln]
        return "refused" if err else "FAILS", (err[0] if err else res.stderr.strip().splitlines()[-1])[:200]
    try:
        check_output(src, out)
    except AssertionError as e:
        return "WRONG", str(e).splitlines()[-1][:160]
    carried = [ln.split("] ", 1)[-1] for ln in res.stderr.splitlines() if "carried unquantized" in ln]
    note = re.sub(r" \(\d+ module\(s\), e\.g\. [^)]*\)", "", carried[0])[:200] if carried else ""
    return "ok", note


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="*", default=list(ZOO))
    p.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sq-zoo-") as tmp:
        for t in a.types:
            src = build_zoo(Path(tmp) / t, t)
            base = ["--model", str(src), "--scheme", "W4A16", "--group-size", "8"]
            gptq = ["--algo", "gptq", "--nsamples", "4", "--seqlen", "32"]
            cells = []
            for name, args, nproc in (("gptq1", gptq, 1), ("gptq2", gptq + (["--ep", "2"] if ZOO[t].moe else []), 2),
                                      ("mf", ["--algo", "rtn", "--model-free"], 1)):
                out = Path(tmp) / f"{t}-{name}"
                cells.append(_cell(src, out, _run([*base, "--output", str(out), *args], nproc)))
                shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(src)
            rows.append((t, ZOO[t].family, cells))
            print(t, cells, flush=True)
    lines = ["| model_type | family | GPTQ, 1 rank | GPTQ, 2 ranks (`--ep 2` for MoE) | model-free RTN | notes |",
             "|---|---|---|---|---|---|"]
    for t, fam, cells in rows:
        notes = "; ".join(dict.fromkeys(n for _, n in cells if n))
        lines.append(f"| `{t}` | {fam} | " + " | ".join(c for c, _ in cells) + f" | {notes} |")
    doc = Path(a.out)
    head = doc.read_text().split("<!-- matrix -->")[0] if doc.exists() else "# Supported models\n\n"
    doc.write_text(head + "<!-- matrix -->\n" + "\n".join(lines) + "\n")
    print(f"wrote {doc}")


if __name__ == "__main__":
    main()
