"""Model-free throughput (issue 19): ``sq.ptq --model-free`` against ``cat`` and llm-compressor.

    .venv/bin/python bench/modelfree.py                      # the 30.5 GB MoE of bench/scale.py ("big")
    .venv/bin/python bench/modelfree.py --layers 3           # a smaller one: 3 layers, ~1.9 GB
    .venv/bin/python bench/modelfree.py --layers 3 --base 9fddb7f --repeat 2 --no-llmc
                                                  # also sq at a git revision (A/B), 2 interleaved rounds
    .venv/bin/python bench/modelfree.py --layers 3 --inline --repeat 3 --no-llmc
                                                  # the overlap alone: sq vs sq without its I/O threads

One invocation runs back to back, each after the checkpoint's pages are evicted from the page cache
(``POSIX_FADV_DONTNEED`` per file, no root needed; what stays resident is checked with ``fincore``):

1. ``cat`` of every checkpoint file to /dev/null: the disk's sequential read speed, the floor;
2. ``torchrun --nproc-per-node N -m sq.ptq --model-free --algo rtn --scheme S`` (``OMP_NUM_THREADS=1``);
3. with ``--base REV``: the same command on that revision's source tree (a git worktree under
   ``bench/_work/``, as ``bench/ab.py`` makes them), e.g. the commit before reads and writes overlapped;
4. with ``--inline``: the same sq with the read-ahead and writer threads replaced by in-line calls
   (``--inline-worker``, monkeypatched in the bench only): what the overlap alone is worth;
5. if ``bench/_work/venv-llmc/bin/python`` exists: llm-compressor's ``model_free_ptq`` on the same
   checkpoint and scheme in that venv (``device="cpu"``, ``max_workers=N``, one torch thread per
   worker, routers / embeddings / ``lm_head`` ignored as sq leaves them), then an ``fsync`` of its
   files (it does not sync; sq's time includes its own fsyncs), timed apart.

Throughput is checkpoint bytes / wall seconds (sq's includes ``torchrun`` starting its ranks; the
record also keeps sq's own seconds from its report, and every job's CPU seconds).  Prints GB/s of
each, sq/cat (target >= 0.8) and sq/llm-compressor; appends one JSON line to
``bench/_work/modelfree/results.jsonl``.  Outputs are deleted after each job (the checkpoint is kept:
it is cached).  Checkpoints are built (or reused) by ``bench/scale.py``'s builder under
``bench/_work/scale/`` (~2 GB files: a 3-layer one is a single file, which llm-compressor, one job per
file, cannot spread over its workers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
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


def inline_worker(argv: list[str]) -> None:
    """``sq.ptq`` with model-free's read-ahead and writer threads replaced by in-line calls: each
    unit read when it is quantized, each layer written and recorded before the next is read."""
    import sq.modelfree as mf
    from sq.cli import exit_process
    from sq.ptq import main as ptq_main

    class InlineReads:
        def __init__(self, reader, units, depth=0):
            self.reader, self.units = reader, iter(units)

        def get(self):
            return self.reader.fetch_unit(next(self.units))

        def close(self):
            pass

    class InlineWrites:
        def __init__(self, write):
            self.write = write

        def submit(self, *item):
            self.write(*item)

        def close(self, check=True):
            pass

    mf._ReadAhead, mf._LayerWriter = InlineReads, InlineWrites
    exit_process(ptq_main(argv))


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
    """``cmd`` after evicting ``ckpt`` from the page cache: wall and CPU seconds (of the job and its
    children), exit code, the log's tail on failure."""
    loadbench.evict(ckpt)
    cached = loadbench.cached_bytes(ckpt)
    print(f"== {label}: {' '.join(str(c).replace(str(REPO) + '/', '') for c in cmd)}\n"
          f"   page cache after eviction: {cached} bytes; load average {os.getloadavg()[0]:.1f}; "
          f"log {log.relative_to(REPO)}", flush=True)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as lf:
        rc = subprocess.run(cmd, env={**os.environ, **ENV, **(env or {})}, cwd=REPO, stderr=lf,
                            stdout=subprocess.DEVNULL if cmd[0] == "cat" else lf).returncode
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    rec = dict(label=label, rc=rc, wall_s=round(wall, 2), cpu_s=round(cpu, 1), page_cache_after_evict=cached,
               loadavg_before=os.getloadavg()[0])
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
    ap.add_argument("--inline", action="store_true", help="also sq without its read-ahead and writer threads")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every job, interleaved; medians reported")
    ap.add_argument("--no-llmc", action="store_true", help="skip llm-compressor even if its venv exists")
    args = ap.parse_args()

    name, ckpt = checkpoint(args)
    nbytes = sum(p.stat().st_size for p in _files(ckpt))
    free = shutil.disk_usage(REPO).free
    if free < 0.7 * nbytes + 5 * GB:  # one output at a time (FP8: about half the bf16 bytes)
        raise SystemExit(f"{free / GB:.1f} GB free: not enough for an output of {ckpt} ({nbytes / GB:.1f} GB)")
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"checkpoint {ckpt.relative_to(REPO)}: {nbytes / GB:.2f} GB in {len(_files(ckpt))} files", flush=True)

    sq_args = ["--model", str(ckpt), "--model-free", "--algo", "rtn", "--scheme", args.scheme]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                "-m", "sq.ptq"]
    jobs = [("cat", ["cat", *map(str, _files(ckpt))], None, None),
            ("sq", [*torchrun, *sq_args], {"PYTHONPATH": str(REPO / "src")}, WORK / "out-sq")]
    if args.base:
        tree = ab.worktree(args.base)
        jobs.append((f"sq@{args.base}", [*torchrun, *sq_args], {"PYTHONPATH": str(tree / "src")},
                     WORK / "out-sq-base"))
    if args.inline:
        jobs.append(("sq-inline", [*torchrun[:-2], str(Path(__file__).resolve()), "--inline-worker", *sq_args],
                     {"PYTHONPATH": str(REPO / "src")}, WORK / "out-sq-inline"))
    if LLMC_PY.is_file() and not args.no_llmc:
        jobs.append(("llm-compressor", [str(LLMC_PY), "-c", LLMC_SCRIPT, str(ckpt)], {}, WORK / "out-llmc"))

    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeat):
        for label, cmd, env, out in jobs:
            if out is not None:
                shutil.rmtree(out, ignore_errors=True)
                cmd = [*cmd, "--output", str(out)] if label.startswith("sq") else \
                    [*cmd, str(out), args.scheme, str(args.nproc)]
            rec = timed(label, cmd, ckpt, WORK / f"log-{label.replace('@', '-')}.txt", env)
            if out is not None and out.is_dir():
                if label == "llm-compressor":
                    rec["fsync_s"] = round(fsync_tree(out), 2)
                if (out / "sq_report.json").is_file():  # sq's own time: from its start to the index, no launcher
                    rec["sq_seconds"] = json.loads((out / "sq_report.json").read_text())["seconds"]
                rec["output_bytes"] = _dir_bytes(out)
                shutil.rmtree(out, ignore_errors=True)
            rec["seconds"] = round(rec["wall_s"] + rec.get("fsync_s", 0.0), 2)
            runs.setdefault(label, []).append(rec)
            print(f"   {rec['seconds']:.1f} s" + (f" (llm-compressor {rec['wall_s']:.1f} + fsync {rec['fsync_s']:.1f})"
                                                 if "fsync_s" in rec else "")
                  + (f", sq's own {rec['sq_seconds']:.1f} s" if "sq_seconds" in rec else "")
                  + f", CPU {rec['cpu_s']:.0f} s", flush=True)

    summary = {}
    for label, recs in runs.items():
        ok = [r["seconds"] for r in recs if r["rc"] == 0]
        med = statistics.median(ok) if ok else None
        summary[label] = dict(seconds=round(med, 2) if ok else None, runs=len(recs), failed=len(recs) - len(ok),
                              gb_per_s=round(nbytes / GB / med, 3) if ok else None)
        own = [r["sq_seconds"] for r in recs if r["rc"] == 0 and "sq_seconds" in r]
        if own:
            summary[label]["sq_seconds"] = round(statistics.median(own), 2)

    def ratio(a: str, b: str) -> float | None:
        ra, rb = summary.get(a, {}).get("gb_per_s"), summary.get(b, {}).get("gb_per_s")
        return round(ra / rb, 3) if ra and rb else None

    ratios = {"sq/cat": ratio("sq", "cat"), "sq/llm-compressor": ratio("sq", "llm-compressor")}
    if args.base:
        ratios[f"sq/sq@{args.base}"] = ratio("sq", f"sq@{args.base}")
    if args.inline:
        ratios["sq/sq-inline"] = ratio("sq", "sq-inline")
    print(f"\n{nbytes / GB:.2f} GB, {args.nproc} ranks / workers, {args.scheme}, medians of {args.repeat}\n"
          "| job | seconds | GB/s | sq's own seconds |\n|---|---|---|---|")
    for label, sm in summary.items():
        print(f"| {label} | {sm['seconds'] if sm['seconds'] is not None else 'failed'} | {sm['gb_per_s']} "
              f"| {sm.get('sq_seconds', '')} |")
    print("\n" + ", ".join(f"{k} = {v}x" for k, v in ratios.items() if v is not None)
          + ("  (target sq/cat >= 0.8)" if ratios["sq/cat"] is not None else ""))
    line = dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), ckpt=name, ckpt_bytes=nbytes,
                ckpt_files=len(_files(ckpt)), scheme=args.scheme, nproc=args.nproc, base=args.base,
                repeat=args.repeat, summary=summary, ratios=ratios, jobs=runs, loadavg=os.getloadavg(),
                cpus=os.cpu_count(),
                commit=subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                                      text=True).stdout.strip())
    with open(RESULTS, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"recorded in {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--inline-worker"]:
        inline_worker(sys.argv[2:])
    else:
        main()
