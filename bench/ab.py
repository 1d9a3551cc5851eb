"""A/B: the same ``sq.ptq`` command on two source trees (a git revision vs the working tree).

    .venv/bin/python bench/ab.py --base 558c3e2 -- --model demo:smollm2 --algo gptq --group-size 64 \
        --nsamples 32 --seqlen 512
    .venv/bin/python bench/ab.py --base 558c3e2 --nproc 2 --repeat 2 -- ...   # interleaved repetitions

The base revision is checked out once into ``bench/_work/ab-<rev>`` (a git worktree); each side
runs as its own ``torchrun`` job with ``PYTHONPATH`` pointing at its ``src/`` and one thread per
rank, alternating A, B, A, B so that machine load hits both alike.  Prints wall times (median),
their ratio, and whether the two outputs are tensor-for-tensor identical (names, dtypes, values).
A refactor that must not change results shows ``identical: yes`` and a ratio near 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "_work"


def worktree(rev: str) -> Path:
    path = WORK / f"ab-{rev}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev], check=True,
                       capture_output=True)
    return path


def run(src: Path, out: Path, nproc: int, args: list[str]) -> float:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "sq.ptq", "--output", str(out), *args]
    t = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t
    if res.returncode:
        raise SystemExit(f"{src}: exit {res.returncode}\n{res.stderr[-3000:]}")
    return took


def identical(a: Path, b: Path) -> tuple[bool, list[str]]:
    import torch
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
        return out

    ta, tb = tensors(a), tensors(b)
    diff = sorted(set(ta) ^ set(tb)) + [k for k in ta if k in tb and not (ta[k].dtype == tb[k].dtype
                                                                        and torch.equal(ta[k], tb[k]))]
    return not diff, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision for side A")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then sq.ptq arguments (without --output)")
    a = p.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    sides = {"A": worktree(a.base) / "src", "B": ROOT / "src"}
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(a.repeat):
        for side, src in sides.items():
            times[side].append(run(src, WORK / f"ab-out-{side}", a.nproc, args))
            print(f"run {i + 1} {side}: {times[side][-1]:.1f} s", flush=True)
    same, diff = identical(WORK / "ab-out-A", WORK / "ab-out-B")
    ta, tb = statistics.median(times["A"]), statistics.median(times["B"])
    print(f"A ({a.base}): {ta:.1f} s   B (working tree): {tb:.1f} s   B/A: {tb / ta:.3f}")
    print("identical: " + ("yes" if same else f"NO ({len(diff)} tensors differ, e.g. {diff[:3]})"))


if __name__ == "__main__":
    main()
