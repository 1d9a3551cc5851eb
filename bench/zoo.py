"""The support matrix: every zoo model_type through GPTQ W4A16 at 1 rank, at 2 ranks (--ep 2 for MoE) and
model-free RTN W4A16, each output proven by ``sq.testing.zoo.check_output`` (or the refusal's first
line); writes the table of docs/models.md below its ``<!-- matrix -->`` line.

    .venv/bin/python bench/zoo.py [--types llama gpt_oss ...] [--out docs/models.md]

The 1-rank runs share one interpreter (``sq.testing.zoo_one_rank``, as ``tests/test_zoo.py`` runs them);
each 2-rank run is a torchrun launch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sq.testing.zoo import ZOO, build_zoo, check_output

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _note(lines: list[str]) -> str:
    """The first 'carried unquantized' log line, without its module count."""
    if not lines:
        return ""
    return re.sub(r" \(\d+ module\(s\), e\.g\. [^)]*\)", "", lines[0].split("] ", 1)[-1])[:200]


def _one_rank(root: Path, types: list[str]) -> dict[tuple[str, str], tuple[str, str]]:
    res = subprocess.run([sys.executable, "-m", "sq.testing.zoo_one_rank", str(root), *types], capture_output=True,
                         text=True, timeout=3600, env=ENV)
    cells = {}
    for line in res.stdout.splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if r["rc"] == 0 and isinstance(r.get("check"), dict):
            cell = ("ok", _note(r["carried"]))
        elif r["rc"] == 0:
            cell = ("WRONG", str(r.get("check")).splitlines()[-1][:200])
        elif r["errors"]:
            cell = ("refused", r["errors"][0].removeprefix("sq: error: ")[:200])
        else:
            cell = ("FAILS", (r.get("traceback") or "").strip().splitlines()[-1:][0][:200] if r.get("traceback") else "")
        cells[r["type"], r["mode"]] = cell
    return cells


def _two_ranks(src: Path, out: Path, moe: bool, allow_carried: bool = False) -> tuple[str, str]:
    args = ["--model", str(src), "--output", str(out), "--scheme", "W4A16", "--group-size", "8", "--algo", "gptq",
            "--nsamples", "4", "--seqlen", "32", *(["--ep", "2"] if moe else []),
            *(["--allow-unquantized-experts"] if allow_carried else [])]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "sq.ptq", *args], capture_output=True, text=True, timeout=600, env=ENV)
    if res.returncode != 0:
        err = [ln.removeprefix("sq: error: ") for ln in res.stderr.splitlines() if "sq: error:" in ln]
        return "refused" if err else "FAILS", (err[0] if err else res.stderr.strip().splitlines()[-1])[:200]
    try:
        check_output(src, out)
    except AssertionError as e:
        return "WRONG", str(e).splitlines()[-1][:200]
    return "ok", _note([ln for ln in res.stderr.splitlines() if "carried unquantized" in ln])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="*", default=list(ZOO))
    p.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sq-zoo-") as tmp:
        root = Path(tmp)
        for t in a.types:
            build_zoo(root / t, t)
        one = _one_rank(root, a.types)
        for t in a.types:
            two = _two_ranks(root / t, root / f"{t}-gptq-2", ZOO[t].moe, ZOO[t].allow_carried(False))
            shutil.rmtree(root / f"{t}-gptq-2", ignore_errors=True)
            cells = [one.get((t, "gptq"), ("FAILS", "no result")), two, one.get((t, "model-free"), ("FAILS", "no result"))]
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
