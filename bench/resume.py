"""Cost of resume bookkeeping (checksums, manifests, chain cache, fsyncs) on the demo model.

    .venv/bin/python bench/resume.py [--algo gptq] [--repeats 3] [--nsamples 32]

Runs the same 2-rank job with and without the bookkeeping (``--no-bookkeeping``, a
benchmark-only switch), alternating, and prints the median job times and their ratio, and the
in-run share of the per-block ``bookkeeping`` phase (which the report times apart from the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(model: str, out: Path, algo: str, nsamples: int, bookkeeping: bool) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "sq.ptq",
           "--model", model, "--output", str(out), "--algo", algo, "--group-size", "64",
           "--nsamples", str(nsamples), "--seqlen", "512"]
    if not bookkeeping:
        cmd.append("--no-bookkeeping")
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    report = json.loads((out / "sq_report.json").read_text())
    shutil.rmtree(out)
    # in-run accounting: each rank's per-block 'bookkeeping' phase (checksums, chain cache, manifest)
    book = max(sum(b.get("bookkeeping", 0.0) for b in r["blocks"]) for r in report["ranks"])
    return wall, report["seconds"], book


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo:smollm2")
    p.add_argument("--algo", default="gptq")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    from sq.resolve import resolve_model

    model = str(resolve_model(a.model))
    times = {True: [], False: []}
    books = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for bk in (False, True):
                load = os.getloadavg()[0]
                wall, inner, book = run(model, Path(tmp) / f"o{i}{bk}", a.algo, a.nsamples, bk)
                times[bk].append(inner)
                if bk:
                    books.append(book / inner)
                print(f"run {i} bookkeeping={bk}: job {inner:.1f} s (wall {wall:.1f} s), bookkeeping phase "
                      f"{book:.2f} s, load average before {load:.1f}", flush=True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print("| algo | calibration | job s, bookkeeping off | on | ratio | bookkeeping phase / job (in-run) |")
    print(f"| {a.algo} | {a.nsamples} x 512 | {off:.1f} | {on:.1f} | {on / off:.3f} | "
          f"{statistics.median(books):.3f} |")


if __name__ == "__main__":
    main()
