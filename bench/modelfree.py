"""Model-free throughput (issue 19): ``sq.ptq --model-free`` against ``cat`` and llm-compressor.

    .venv/bin/python bench/modelfree.py                      # the 30.5 GB MoE of bench/scale.py ("big")
    .venv/bin/python bench/modelfree.py --layers 3           # a smaller one: 3 layers, ~1.9 GB
    .venv/bin/python bench/modelfree.py --layers 3 --base 9fddb7f   # also sq at a git revision (A/B)

One invocation runs back to back, each after the checkpoint's pages are evicted from the page cache
(``POSIX_FADV_DONTNEED`` per file, no root needed; what stays resident is checked with ``fincore``):

1. ``cat`` of every checkpoint file to /dev/null: the disk's sequential read speed, the floor;
2. ``torchrun --nproc-per-node N -m sq.ptq --model-free --algo rtn --scheme S`` (``OMP_NUM_THREADS=1``);
3. with ``--base REV``: the same command on that revision's source tree (a git worktree under
   ``bench/_work/``, as ``bench/ab.py`` makes them), e.g. the commit before reads and writes overlapped;
4. if ``bench/_work/venv-llmc/bin/python`` exists: llm-compressor's ``model_free_ptq`` on the same
   checkpoint and scheme in that venv (``device="cpu"``, ``max_workers=N``, one torch thread per
   worker, routers / embeddings / ``lm_head`` ignored as sq leaves them), then an ``fsync`` of its
   files (it does not sync; sq's time includes its own fsyncs), timed apart.

Throughput is checkpoint bytes / wall seconds.  Prints GB/s of each, sq/cat (target >= 0.8) and
sq/llm-compressor; appends one JSON line to ``bench/_work/modelfree/results.jsonl``.  Outputs are
deleted after each job (the checkpoint is kept: it is cached).  Checkpoints are built (or reused)
by ``bench/scale.py``'s builder under ``bench/_work/scale/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ab  # noqa: E402  (bench/ab.py: a git revision's worktree)
import load as loadbench  # noqa: E402  (bench/load.py: page-cache eviction and residency)
import scale  # noqa: E402  (bench/scale.py: the synthetic MoE checkpoints)

REPO = HERE.parent
WORK = HERE / "_work" / "modelfree"
RESULTS = WORK / "results.jsonl"
LLMC_PY = HERE / "_work" / "venv-llmc" / "bin" / "python"
GB = 1e9
ENV = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
           TRANSFORMERS_VERBOSITY="error")

LLMC_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    torch.set_num_threads(1)
    from llmcompressor import model_free_ptq
    ckpt, out, scheme, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    model_free_ptq(ckpt, out, scheme=scheme, device="cpu", max_workers=workers,
                   ignore=["lm_head", "re:.*embed_tokens$", "re:.*mlp[.]gate$"])
""")


def checkpoint(args) -> tuple[str, Path]:
    """``bench/scale.py``'s ``big`` (default) or the same widths with ``--layers`` / ``--experts``."""
    if args.layers is None:
        name = "big"
    else:
        name = f"mf-L{args.layers}-E{args.experts}"
        scale.CKPTS[name] = dict(scale.WIDTH, num_hidden_layers=args.layers, num_experts=args.experts)
    return name, scale.build(name)


def _files(ckpt: Path) -> list[Path]:
    return loadbench.safetensors_files(ckpt)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(label: str, cmd: list[str], ckpt: Path, log: Path, env: dict | None = None) -> dict:
    """``cmd`` after evicting ``ckpt`` from the page cache; wall time, exit code, the log's tail."""
    loadbench.evict(ckpt)
    cached = loadbench.cached_bytes(ckpt)
    print(f"== {label}: {' '.join(str(c).replace(str(REPO) + '/', '') for c in cmd)}\n"
          f"   page cache after eviction: {cached} bytes; log {log.relative_to(REPO)}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as lf:
        rc = subprocess.run(cmd, env={**os.environ, **ENV, **(env or {})}, cwd=REPO, stderr=lf,
                            stdout=subprocess.DEVNULL if cmd[0] == "cat" else lf).returncode
    wall = time.perf_counter() - t0
    rec = dict(label=label, rc=rc, wall_s=round(wall, 2), page_cache_after_evict=cached)
    if rc != 0:
        rec["error"] = " | ".join(log.read_text().splitlines()[-5:])[-800:]
        print(f"   FAILED (exit {rc}): {rec['error']}", flush=True)
    return rec


def fsync_tree(path: Path) -> float:
    t0 = time.perf_counter()
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, help="MoE layers (default: bench/scale.py's 'big', 50 layers, 30.5 GB)")
    ap.add_argument("--experts", type=int, default=256, help="experts per layer with --layers (default 256)")
    ap.add_argument("--scheme", default="FP8_BLOCK")
    ap.add_argument("--nproc", type=int, default=2, help="sq ranks and llm-compressor workers (default 2)")
    ap.add_argument("--base", help="also run sq at this git revision (A/B in the same invocation)")
    ap.add_argument("--no-llmc", action="store_true", help="skip llm-compressor even if its venv exists")
    args = ap.parse_args()

    name, ckpt = checkpoint(args)
    nbytes = sum(p.stat().st_size for p in _files(ckpt))
    free = shutil.disk_usage(REPO).free
    if free < 0.7 * nbytes + 5 * GB:  # one output at a time (FP8: about half the bf16 bytes)
        raise SystemExit(f"{free / GB:.1f} GB free: not enough for an output of {ckpt} ({nbytes / GB:.1f} GB)")
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"checkpoint {ckpt.relative_to(REPO)}: {nbytes / GB:.2f} GB in {len(_files(ckpt))} files", flush=True)

    jobs = [("cat", ["cat", *map(str, _files(ckpt))], None, None)]
    sq_args = ["--model", str(ckpt), "--model-free", "--algo", "rtn", "--scheme", args.scheme]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                "-m", "sq.ptq"]
    jobs.append(("sq", torchrun, {"PYTHONPATH": str(REPO / "src")}, WORK / "out-sq"))
    if args.base:
        tree = ab.worktree(args.base)
        jobs.append((f"sq@{args.base}", torchrun, {"PYTHONPATH": str(tree / "src")}, WORK / "out-sq-base"))
    if LLMC_PY.is_file() and not args.no_llmc:
        jobs.append(("llm-compressor", [str(LLMC_PY), "-c", LLMC_SCRIPT, str(ckpt)], {}, WORK / "out-llmc"))

    records = {}
    for label, cmd, env, out in jobs:
        if out is not None:
            shutil.rmtree(out, ignore_errors=True)
            if label.startswith("sq"):
                cmd = [*cmd, *sq_args, "--output", str(out)]
            else:
                cmd = [*cmd, str(out), args.scheme, str(args.nproc)]
        log = WORK / f"log-{label.replace('@', '-')}.txt"
        rec = timed(label, cmd, ckpt, log, env)
        if out is not None and out.is_dir():
            if label == "llm-compressor":
                rec["fsync_s"] = round(fsync_tree(out), 2)
            rec["output_bytes"] = _dir_bytes(out)
            shutil.rmtree(out, ignore_errors=True)
        total = rec["wall_s"] + rec.get("fsync_s", 0.0)
        rec["gb_per_s"] = round(nbytes / GB / total, 3) if rec["rc"] == 0 else None
        records[label] = rec
        print(f"   {rec['wall_s']:.1f} s" + (f" + fsync {rec['fsync_s']:.1f} s" if "fsync_s" in rec else "")
              + (f": {rec['gb_per_s']:.3f} GB/s" if rec["gb_per_s"] else ""), flush=True)

    def ratio(a: str, b: str) -> float | None:
        ra, rb = records.get(a), records.get(b)
        if ra and rb and ra["gb_per_s"] and rb["gb_per_s"]:
            return round(ra["gb_per_s"] / rb["gb_per_s"], 3)
        return None

    ratios = {"sq/cat": ratio("sq", "cat"), "sq/llm-compressor": ratio("sq", "llm-compressor")}
    if args.base:
        ratios[f"sq/sq@{args.base}"] = ratio("sq", f"sq@{args.base}")
    print("\n| job | wall s | GB/s |\n|---|---|---|")
    for label, rec in records.items():
        print(f"| {label} | {rec['wall_s'] + rec.get('fsync_s', 0.0):.1f} | {rec['gb_per_s'] or 'failed'} |")
    print("\n" + ", ".join(f"{k} = {v}x" for k, v in ratios.items() if v is not None)
          + ("  (target sq/cat >= 0.8)" if ratios["sq/cat"] is not None else ""))
    line = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), ckpt=name, ckpt_bytes=nbytes,
                ckpt_files=len(_files(ckpt)), scheme=args.scheme, nproc=args.nproc, base=args.base,
                jobs=records, ratios=ratios, loadavg=os.getloadavg(), cpus=os.cpu_count(),
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                      text=True).stdout.strip())
    with open(RESULTS, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"recorded in {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
