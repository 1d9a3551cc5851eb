"""Scale benchmark (issue 7): sq.ptq on a checkpoint bigger than this machine's RAM, 2 ranks on CPU.

    /work/venv/bin/python bench/scale.py build                  # checkpoints (cached under bench/_work/scale/)
    /work/venv/bin/python bench/scale.py run --ckpt big --algo rtn
    /work/venv/bin/python bench/scale.py run --ckpt big --algo gptq --nsamples 8 --seqlen 128
    /work/venv/bin/python bench/scale.py plan --ckpt big        # planning time on one process (cProfile)
    /work/venv/bin/python bench/scale.py depth --algos rtn,gptq # peak RSS at 4, 8, 16, 32 layers
    /work/venv/bin/python bench/scale.py profile --ckpt depth-L8 --algo rtn   # cProfile of each rank
    /work/venv/bin/python bench/scale.py table                  # markdown tables + docs/img/memory-depth.png

Checkpoints are synthetic bf16 Qwen3-MoE checkpoints in the per-expert Hub layout, written one
~2 GB file at a time by ``bench/load.py``'s ``build_checkpoint`` (imported, not copied) from a
1-layer template made by ``sq.testing.checkpoints``:

- ``big``: 50 MoE layers x 256 experts top-8 (DeepSeek-V3's expert count), hidden 1024, expert
  intermediate 384, 16 heads / 4 KV heads, vocab 8192: 30.5 GB (28.4 GiB) on disk in 15 files,
  more than this machine's 24 GiB of RAM.
- ``depth-L{4,8,16,32}``: the same widths with 64 experts (156 MB per layer), for memory vs depth.

Every job is ``torchrun --standalone --nproc-per-node 2 -m sq.ptq ...`` with ``OMP_NUM_THREADS=1``,
started after the checkpoint's pages are evicted from the page cache (``POSIX_FADV_DONTNEED``,
checked with ``fincore``).  While it runs, the driver samples ``/proc/<pid>`` of both rank
processes every 0.5 s: ``VmHWM`` / ``VmRSS`` / ``RssAnon`` / ``RssFile`` (process memory; the page
cache is not in it), ``io`` ``read_bytes`` (what the rank fetched from the block device) and CPU
time, plus the machine's ``MemAvailable`` and load average.  It kills the job (its own process
group) if ``MemAvailable`` drops under 2 GiB or at ``--deadline``.  After the job it reads
``sq_report.json``: per-rank ``peak_rss_bytes`` and the per-block phases (fill = read,
calibrate / solve = quantize, forward, write, bookkeeping).  One JSON line per job goes to
``bench/_work/scale/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import load as loadbench  # noqa: E402  (bench/load.py: checkpoint builder, page-cache eviction)

REPO = HERE.parent
SCALE = HERE / "_work" / "scale"
RESULTS = SCALE / "results.jsonl"
PY = sys.executable
GB, GIB, MIB = 1e9, 2**30, 2**20
FILE_BYTES = 2e9  # ~2 GB per checkpoint file
MIN_FREE_DISK = 15e9
MIN_AVAILABLE = 2 * GIB

WIDTH = dict(
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2816,  # unused: every layer is sparse
    moe_intermediate_size=384,
    num_experts_per_tok=8,
    vocab_size=8192,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
CKPTS = {"big": dict(WIDTH, num_hidden_layers=50, num_experts=256)}
DEPTHS = (4, 8, 16, 32)
for _L in DEPTHS:
    CKPTS[f"depth-L{_L}"] = dict(WIDTH, num_hidden_layers=_L, num_experts=64)
# a few MB, to check the bench itself
CKPTS["smoke"] = dict(WIDTH, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=2, num_experts=8,
                      num_attention_heads=4, num_key_value_heads=2)


def est_bytes(size: dict) -> int:
    """bf16 bytes of a Qwen3-MoE checkpoint of this size (weights only)."""
    h, e, i, hd = size["hidden_size"], size["num_experts"], size["moe_intermediate_size"], size["head_dim"]
    attn = h * hd * (2 * size["num_attention_heads"] + 2 * size["num_key_value_heads"]) + 2 * hd
    layer = 3 * e * h * i + attn + e * h + 2 * h
    return 2 * (size["num_hidden_layers"] * layer + 2 * size["vocab_size"] * h + h)


def ckpt_dir(name: str) -> Path:
    size = CKPTS[name]
    tag = f"qwen3moe-per_expert-L{size['num_hidden_layers']}-E{size['num_experts']}-H{size['hidden_size']}"
    return SCALE / name / tag


def build(name: str) -> Path:
    """Build (or reuse) one checkpoint with bench/load.py's builder, under bench/_work/scale/NAME/."""
    size = CKPTS[name]
    out = ckpt_dir(name)
    if (out / ".bench-done").is_file():
        return out
    need = est_bytes(size)
    free = shutil.disk_usage(SCALE.parent if SCALE.exists() else HERE).free
    if free - need < MIN_FREE_DISK:
        raise SystemExit(f"{name}: needs {need / GB:.1f} GB, {free / GB:.1f} GB free; would leave under "
                         f"{MIN_FREE_DISK / GB:.0f} GB")
    shards = max(1, round(need / FILE_BYTES))
    loadbench.WORK = SCALE / name  # the builder caches its template and output under its WORK
    loadbench.WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"building {name}: ~{need / GB:.2f} GB in {shards} files", flush=True)
    path = loadbench.build_checkpoint("per_expert", size, shards)
    assert path == out, (path, out)
    meta = json.loads((out / ".bench-done").read_text())
    meta["build_s"] = time.perf_counter() - t0
    (out / ".bench-done").write_text(json.dumps(meta) + "\n")
    print(f"  {name}: {meta['total_bytes'] / GB:.2f} GB in {meta['files']} files, {meta['build_s']:.0f}s", flush=True)
    return out


# ----------------------------------------------------------------------------- /proc sampling


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[k] = int(parts[0]) * 1024
    return out


def _io(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = int(v)
    return out


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, rest = line.partition(":")
            out[k] = int(rest.split()[0]) * 1024
    return out


def _rank_pids(root: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers below ``root`` (RANK in their environment)."""
    import psutil

    out = {}
    try:
        kids = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return out
    for k in kids:
        try:
            env = k.environ()
        except psutil.Error:
            continue
        if "RANK" in env and "LOCAL_RANK" in env:
            out[int(env["RANK"])] = k.pid
    return out


class Monitor:
    """Per-rank peaks and last values from /proc, every ``period`` s (driver side)."""

    def __init__(self, root: int, period: float = 0.5):
        self.root, self.period = root, period
        self.ranks: dict[int, dict] = {}
        self.min_available = None
        self.load_max = 0.0
        self.timeline: list[tuple] = []  # (t, rank, rss, anon, file, read_bytes)
        self.t0 = time.perf_counter()
        self.pids: dict[int, int] = {}
        self._tl_last: dict[int, float] = {}

    def sample(self) -> None:
        t = time.perf_counter() - self.t0
        if len(self.pids) < 2:  # the workers appear a second or two after torchrun starts
            self.pids = _rank_pids(self.root)
        for rank, pid in self.pids.items():
            try:
                st, io, cpu = _status(pid), _io(pid), _cpu_s(pid)
            except (OSError, ValueError, IndexError):
                continue
            r = self.ranks.setdefault(rank, dict(pid=pid, hwm=0, rss=0, anon=0, file=0, sum=0, read_bytes=0,
                                                 write_bytes=0, cpu_s=0.0, first_t=t))
            r["hwm"] = max(r["hwm"], st.get("VmHWM", 0))
            r["rss"] = max(r["rss"], st.get("VmRSS", 0))
            r["anon"] = max(r["anon"], st.get("RssAnon", 0))
            r["file"] = max(r["file"], st.get("RssFile", 0))
            r["sum"] = max(r["sum"], st.get("RssAnon", 0) + st.get("RssFile", 0))
            r["read_bytes"], r["write_bytes"], r["cpu_s"], r["last_t"] = io["read_bytes"], io["write_bytes"], cpu, t
            if t - self._tl_last.get(rank, -1e9) >= 5:
                self._tl_last[rank] = t
                self.timeline.append((round(t, 1), rank, st.get("VmRSS", 0), st.get("RssAnon", 0),
                                      st.get("RssFile", 0), io["read_bytes"]))
        avail = _meminfo().get("MemAvailable", 0)
        self.min_available = avail if self.min_available is None else min(self.min_available, avail)
        self.load_max = max(self.load_max, os.getloadavg()[0])


# ----------------------------------------------------------------------------- one job


def _report_summary(out: Path) -> dict | None:
    p = out / "sq_report.json"
    if not p.is_file():
        return None
    rep = json.loads(p.read_text())
    ranks = []
    for r in sorted(rep["ranks"], key=lambda r: r["rank"]):
        phases: dict[str, float] = {}
        for b in r["blocks"]:
            for k, v in b.items():
                if k not in ("block", "rss_anon_after"):
                    phases[k] = phases.get(k, 0.0) + v
        ranks.append(dict(rank=r["rank"], peak_rss_bytes=r["peak_rss_bytes"], blocks=len(r["blocks"]),
                          phases={k: round(v, 2) for k, v in phases.items()},
                          block_seconds=[b["seconds"] for b in r["blocks"]],
                          rss_anon_after=[b.get("rss_anon_after") for b in r["blocks"]]))
    index = out / "model.safetensors.index.json"
    tail = None
    if index.is_file():  # report written -> summary, picture, index merge -> index (the last file)
        tail = index.stat().st_mtime - p.stat().st_mtime
    return dict(seconds=rep["seconds"], ranks=ranks, report_to_index_s=tail,
                before_blocks_s=round(rep["seconds"] - max(sum(x["block_seconds"]) for x in ranks), 2))


def run_job(name: str, algo: str, extra: list[str], *, deadline: float | None, timeout: float,
            label: str | None = None, worker: list[str] | None = None, keep_output: bool = False,
            env_extra: dict[str, str] | None = None) -> dict:
    """One ``torchrun -m sq.ptq`` job on checkpoint ``name``; returns (and appends) its record.

    ``env_extra`` (e.g. an allocator setting) is added to the job's environment and recorded.
    """
    ckpt = ckpt_dir(name)
    if not (ckpt / ".bench-done").is_file():
        raise SystemExit(f"{ckpt} is not built: run `bench/scale.py build --ckpts {name}`")
    meta = json.loads((ckpt / ".bench-done").read_text())
    label = label or f"{name}-{algo}"
    out = SCALE / "out" / label
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    loadbench.evict(ckpt)
    cached = loadbench.cached_bytes(ckpt)
    sq_args = ["--model", str(ckpt), "--output", str(out), "--algo", algo, "--scheme", "W4A16",
               "--group-size", "128", *extra]
    target = worker if worker is not None else ["-m", "sq.ptq"]
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *target, *sq_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", **(env_extra or {}))
    log = SCALE / f"log-{label}.txt"
    shown = " ".join(["OMP_NUM_THREADS=1", *[f"{k}={v}" for k, v in (env_extra or {}).items()], "torchrun --standalone --nproc-per-node=2", *target,
                      *[str(a).replace(str(REPO) + "/", "") for a in sq_args]])
    print(f"== {label}: {shown}\n   page cache after eviction: {cached} bytes; log {log}", flush=True)
    load_before = os.getloadavg()
    avail_before = _meminfo()["MemAvailable"]
    t0 = time.perf_counter()
    why = None
    with open(log, "w") as lf:
        p = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        mon = Monitor(p.pid)
        last_print = 0.0
        while p.poll() is None:
            mon.sample()
            el = time.perf_counter() - t0
            if mon.min_available is not None and mon.min_available < MIN_AVAILABLE:
                why = f"killed: MemAvailable {mon.min_available / GIB:.2f} GiB < 2 GiB"
            elif el > timeout:
                why = f"killed: timeout {timeout:.0f}s"
            elif deadline is not None and time.time() > deadline:
                why = "killed: deadline"
            if why:
                os.killpg(p.pid, signal.SIGTERM)  # the job's own process group (started above)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                break
            if el - last_print >= 60:
                last_print = el
                done = len(list(out.glob("model-rank00000-block*.safetensors")))
                print(f"   {el:.0f}s: rank-0 blocks written {done}; " + ", ".join(
                    f"r{r}: RSS peak {v['sum'] / GIB:.2f} GiB read {v['read_bytes'] / GB:.1f} GB"
                    for r, v in sorted(mon.ranks.items())) + f"; MemAvailable min {mon.min_available / GIB:.1f} GiB",
                    flush=True)
            time.sleep(mon.period)
        rc = p.wait()
    wall = time.perf_counter() - t0
    report = _report_summary(out)
    log_blocks = {}  # from the rank logs: what a killed job got done, block by block
    import re

    for lp in sorted((out / "sq_logs").glob("rank-*.log")):
        secs = [float(m.group(3)) for m in re.finditer(r"block (\d+)/(\d+) done in ([\d.]+)s", lp.read_text())]
        log_blocks[int(lp.stem.split("-")[1])] = secs
    if (out / "sq_logs").is_dir():
        kept = SCALE / "kept" / label
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(out / "sq_logs", kept / "sq_logs")
        for f in ("sq_report.json", "config.json"):
            if (out / f).is_file():
                shutil.copy(out / f, kept / f)
    blocks_done = {r: len(list(out.glob(f"model-rank{r:05d}-block*.safetensors"))) for r in range(2)}
    rec = dict(
        label=label, ckpt=name, algo=algo, extra=extra, env=env_extra or {}, cmd=shown, ckpt_bytes=meta["total_bytes"],
        ckpt_files=meta["files"], layers=CKPTS[name]["num_hidden_layers"], experts=CKPTS[name]["num_experts"],
        rc=rc, error=why, wall_s=round(wall, 1), page_cache_after_evict=cached, blocks_written=blocks_done,
        log_blocks=log_blocks,
        loadavg_before=load_before, loadavg_after=os.getloadavg(), loadavg_max=mon.load_max,
        mem_available_before=avail_before, mem_available_min=mon.min_available, ram_total=_meminfo()["MemTotal"],
        ranks={r: {k: v for k, v in d.items()} for r, d in sorted(mon.ranks.items())},
        timeline=mon.timeline, report=report, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip(),
    )
    if rc != 0 and not why:
        rec["error"] = "exit %s: %s" % (rc, " | ".join(log.read_text().splitlines()[-5:])[-600:])
    with open(RESULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    _print_job(rec)
    if not keep_output:
        shutil.rmtree(out, ignore_errors=True)  # outputs are GBs; the report is in the record
    return rec


def _print_job(rec: dict) -> None:
    print(f"   {rec['label']}: rc={rec['rc']} {rec['error'] or ''} wall {rec['wall_s']:.0f}s, "
          f"MemAvailable min {rec['mem_available_min'] / GIB:.1f} GiB, load max {rec['loadavg_max']:.1f}", flush=True)
    rep = rec.get("report") or {}
    for r, v in rec["ranks"].items():
        rr = next((x for x in rep.get("ranks", []) if str(x["rank"]) == str(r)), None)
        print(f"   rank {r}: VmHWM {v['hwm'] / GIB:.2f} GiB (report {rr['peak_rss_bytes'] / GIB:.2f})"
              if rr else f"   rank {r}: VmHWM {v['hwm'] / GIB:.2f} GiB", end="")
        print(f", anon/file peak {v['anon'] / GIB:.2f}/{v['file'] / GIB:.2f} GiB, read {v['read_bytes'] / GB:.2f} GB,"
              f" CPU {v['cpu_s']:.0f}s" + (f", phases {rr['phases']}" if rr else ""), flush=True)


# ----------------------------------------------------------------------------- planning, profiles


def plan(name: str, out_json: Path | None = None) -> dict:
    """Time sq's planning (one process, meta model): skeleton, header scan, key map, overlap check;
    then the overlap check alone: the old all-pairs one against sq's sweep, on the same pieces."""
    import cProfile
    import io as _io
    import pstats

    import sq.load.keymap as K
    from sq.load.loader import plan_load
    from sq.load.meta import build_skeleton
    from sq.load.source import scan_checkpoint

    ckpt = ckpt_dir(name)
    times: dict[str, float] = {}
    orig_check = K._check_pieces

    def timed_check(km, targets, tensors):
        t = time.perf_counter()
        orig_check(km, targets, tensors)
        times["_check_pieces"] = times.get("_check_pieces", 0.0) + time.perf_counter() - t

    K._check_pieces = timed_check
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    model = build_skeleton(ckpt)
    t1 = time.perf_counter()
    src = scan_checkpoint(ckpt)
    t2 = time.perf_counter()
    prof.enable()
    p = plan_load(model, src)
    prof.disable()
    t3 = time.perf_counter()
    K._check_pieces = orig_check
    times.update(build_skeleton=t1 - t0, scan_checkpoint=t2 - t1, plan_load=t3 - t2)
    n_pieces = sum(len(v) for v in p.keymap.pieces.values())
    biggest = max(len(v) for v in p.keymap.pieces.values())
    # the overlap check alone: the old all-pairs one against sq's sweep (same problems; shape checks are
    # only in sq's, and report nothing on a valid checkpoint)
    km = p.keymap
    km.problems = []
    t = time.perf_counter()
    check_pieces_pairwise(km, p.targets, src.tensors)
    t_pair = time.perf_counter() - t
    probs_pair = list(km.problems)
    km.problems = []
    t = time.perf_counter()
    orig_check(km, p.targets, src.tensors)
    t_sweep = time.perf_counter() - t
    same = probs_pair == km.problems
    # sensitivity: an injected overlap must be found by both
    tgt = next(t for t, v in km.pieces.items() if len(v) == biggest)
    bad = dict(km.pieces)
    bad[tgt] = list(km.pieces[tgt]) + [km.pieces[tgt][len(km.pieces[tgt]) // 2]]
    found = []
    for fn in (check_pieces_pairwise, orig_check):
        k2 = K.KeyMap(pieces=bad)
        fn(k2, p.targets, src.tensors)
        found.append(len(k2.problems))
    # what one block's read pays per file it touches: safetensors parses the whole JSON header again
    from safetensors import safe_open

    t = time.perf_counter()
    for f in src.files:
        with safe_open(str(src.path(f)), framework="pt") as h:
            h.keys()
    safe_open_ms = 1000 * (time.perf_counter() - t) / max(1, len(src.files))
    buf = _io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
    (SCALE / f"prof-plan-{name}.txt").write_text(buf.getvalue())
    rec = dict(label=f"plan-{name}", ckpt=name, keys=len(src.tensors), files=len(src.files), pieces=n_pieces,
               largest_target_pieces=biggest, times={k: round(v, 3) for k, v in times.items()},
               check_pairwise_s=round(t_pair, 3), check_sweep_s=round(t_sweep, 4), same_problems=same,
               injected_overlap_found=found, safe_open_ms_per_file=round(safe_open_ms, 2),
               keys_per_file=round(len(src.tensors) / max(1, len(src.files))), loadavg=os.getloadavg(),
               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    print(json.dumps(rec), flush=True)
    with open(out_json or RESULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def check_pieces_pairwise(km, targets, tensors) -> None:
    """The overlap check as it was before the sweep in ``sq.load.keymap._check_pieces`` (all pairs,
    O(n^2)); kept here as the timing and equality reference."""
    for t, ps in km.pieces.items():
        boxes = sorted(ps, key=lambda p: p.offsets)
        for a_i, a in enumerate(boxes):
            for b in boxes[a_i + 1:]:
                if all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in
                       zip(a.offsets, a.lengths, b.offsets, b.lengths)):
                    km.problems.append(f"{a.ckpt_key!r} and {b.ckpt_key!r} both fill the same part of {t!r}")


def ptq_worker(argv: list[str]) -> None:
    """A rank of ``sq.ptq`` with timers around the steps named below and, with SQ_BENCH_PROFILE set,
    cProfile (functions wrapped in place; sq's source is untouched)."""
    import cProfile
    import functools
    import io as _io
    import pstats

    import safetensors

    import sq.export.writer as W
    import sq.load.fill as F
    import sq.load.keymap as K
    import sq.load.loader as L
    import sq.pipeline.job as B
    import sq.pipeline.weights as QW
    from sq import ptq

    acc: dict[str, list] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def inner(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                x = acc.setdefault(name, [0, 0.0])
                x[0] += 1
                x[1] += time.perf_counter() - t
        return inner

    for mod, names in ((B, ["build_skeleton", "plan_load", "_capture_block0", "_quantize_experts", "_export_experts",
                            "_finish"]),
                       (L, ["scan_checkpoint", "build_keymap", "dcp_read", "_fresh_buffers", "_expand_to_modules",
                            "set_device"]),
                       (K, ["_check_pieces"]), (QW, ["fill", "free"]), (W, ["merge_index", "write_shard"]),
                       (safetensors, ["safe_open"])):
        for n in names:
            setattr(mod, n, timed(n if mod is not QW else f"weights.{n}", getattr(mod, n)))
    from sq.resume import RunState

    RunState.write_chain = timed("write_chain", RunState.write_chain)
    F.SqStorageReader.read_data = timed("read_data", F.SqStorageReader.read_data)
    prof = cProfile.Profile() if os.environ.get("SQ_BENCH_PROFILE") else None
    if prof:
        prof.enable()
    t0 = time.perf_counter()
    rc = ptq.main(argv)
    total = time.perf_counter() - t0
    rank = int(os.environ.get("RANK", 0))
    dest = Path(os.environ["SQ_BENCH_TIMERS"])
    if prof:
        prof.disable()
        buf = _io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(50)
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        dest.with_name(dest.stem + f"-r{rank}.prof.txt").write_text(buf.getvalue())
    with open(dest, "a") as f:
        f.write(json.dumps(dict(rank=rank, total_s=total, timers={k: [v[0], round(v[1], 3)] for k, v in acc.items()},
                                profiled=bool(prof))) + "\n")
    from sq.cli import exit_process

    exit_process(rc)


def profile_job(name: str, algo: str, extra: list[str], deadline, cprofile: bool) -> dict:
    label = f"{name}-{algo}-{'cprofile' if cprofile else 'timers'}"
    timers = SCALE / f"timers-{label}.jsonl"
    timers.unlink(missing_ok=True)
    os.environ["SQ_BENCH_TIMERS"] = str(timers)
    if cprofile:
        os.environ["SQ_BENCH_PROFILE"] = "1"
    try:
        rec = run_job(name, algo, extra, deadline=deadline, timeout=3600, label=label,
                      worker=[str(Path(__file__).resolve()), "--ptq-worker"])
    finally:
        os.environ.pop("SQ_BENCH_PROFILE", None)
    if timers.is_file():
        rows = [json.loads(x) for x in timers.read_text().splitlines()]
        for r in sorted(rows, key=lambda r: r["rank"]):
            print(f"   rank {r['rank']} timers (calls, s): " + ", ".join(
                f"{k} {v[0]} {v[1]:.2f}" for k, v in sorted(r["timers"].items(), key=lambda kv: -kv[1][1])))
        with open(RESULTS, "a") as f:
            f.write(json.dumps(dict(label=f"timers-{label}", ckpt=name, algo=algo, timers=rows)) + "\n")
    return rec


# ----------------------------------------------------------------------------- tables and plot


def _records() -> list[dict]:
    return [json.loads(x) for x in RESULTS.read_text().splitlines()] if RESULTS.exists() else []


def _latest(recs: list[dict], label: str) -> dict | None:
    m = [r for r in recs if r.get("label") == label]
    return m[-1] if m else None


def _phase_sum(rec: dict, rank: int, k: str) -> float | None:
    rep = rec.get("report")
    if not rep:
        return None
    return next((x["phases"].get(k) for x in rep["ranks"] if x["rank"] == rank), None)


def tables() -> str:
    recs = _records()
    lines = []
    runs = [r for r in recs if r.get("ckpt") == "big" and "ranks" in r and r.get("algo")]
    if runs:
        lines += ["| job | checkpoint | wall s (sq report s) | result | peak RSS / rank GiB: report VmHWM (sampled anon + file) | "
                  "disk read / rank GB (x its share) | CPU s / rank | MemAvailable min GiB | load avg 1 min: before / max |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            rep = r.get("report") or {}
            peaks, reads, cpu = [], [], []
            for k, v in sorted(r["ranks"].items()):
                rr = next((x for x in rep.get("ranks", []) if str(x["rank"]) == str(k)), None)
                peaks.append(f"r{k}: {(rr['peak_rss_bytes'] if rr else v['hwm']) / GIB:.2f} "
                             f"({v['anon'] / GIB:.2f} + {v['file'] / GIB:.2f})")
                reads.append(f"r{k}: {v['read_bytes'] / GB:.2f} ({v['read_bytes'] / (r['ckpt_bytes'] / 2):.2f})")
                cpu.append(f"{v['cpu_s']:.0f}")
            res = "ok" if r["rc"] == 0 else (r["error"] or f"rc {r['rc']}")
            if r["rc"] != 0:
                res += " after " + " / ".join(f"{v}" for _, v in sorted(r["blocks_written"].items())) + \
                    f" of {r['layers']} blocks written (rank 0 / 1)"
            lines.append(f"| {r['label']} (`{' '.join(r['extra']) or 'defaults'}`) | {r['ckpt_bytes'] / GB:.1f} GB = "
                         f"{r['ckpt_bytes'] / GIB:.1f} GiB, {r['layers']} layers x {r['experts']} experts | "
                         f"{r['wall_s']:.0f} ({format(rep['seconds'], '.0f') if rep else '-'}) | {res} | {'; '.join(peaks)} | {'; '.join(reads)} | {' / '.join(cpu)} | "
                         f"{r['mem_available_min'] / GIB:.1f} | {r['loadavg_before'][0]:.1f} / {r['loadavg_max']:.1f} |")
        lines += ["", "| job | rank | before first block | fill (read) | calibrate | solve | forward | write | "
                  "bookkeeping | blocks total | report -> index |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            rep = r.get("report")
            if not rep:
                continue
            for x in rep["ranks"]:
                ph = x["phases"]
                lines.append(f"| {r['label']} | {x['rank']} | {rep['before_blocks_s']:.1f} | " + " | ".join(
                    f"{ph.get(k, 0):.1f}" for k in ("fill", "calibrate", "solve", "forward", "write", "bookkeeping"))
                    + f" | {ph.get('seconds', 0):.1f} | {rep['report_to_index_s'] or 0:.1f} |")
        lines += ["", "Private memory over the run (RssAnon MiB, sampled, at 20 / 40 / 60 / 80 / 100 % of each "
                  "rank's lifetime):", ""]
        for r in runs:
            lines.append(f"- {r['label']}: " + "; ".join(
                f"r{k}: " + " / ".join(f"{a / MIB:.0f}" for a in growth(r, int(k))) for k in sorted(r["ranks"])))
    dep = _depth_records(recs)
    if dep:
        lines += ["", depth_table(dep)]
    pl = [r for r in recs if str(r.get("label", "")).startswith("plan-")]
    if pl:
        lines += ["", "| checkpoint | keys | pieces (largest target) | build_skeleton s | scan headers s | plan_load s | "
                  "of which _check_pieces s | _check_pieces alone s | check, sort-and-sweep prototype s | same problems | "
                  "injected overlap found | safe_open (header parse) ms / file |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pl:
            t = r["times"]
            lines.append(f"| {r['ckpt']} | {r['keys']} | {r['pieces']} ({r['largest_target_pieces']}) | "
                         f"{t['build_skeleton']:.2f} | {t['scan_checkpoint']:.2f} | {t['plan_load']:.2f} | "
                         f"{t.get('_check_pieces', 0):.2f} | {r['check_pairwise_s']:.2f} | {r['check_sweep_s']:.3f} | "
                         f"{r['same_problems']} | {r['injected_overlap_found']} | {r.get('safe_open_ms_per_file', '')} |")
    return "\n".join(lines)


def _depth_records(recs: list[dict]) -> list[dict]:
    """Plain depth jobs (not the profiled ones)."""
    return [r for r in recs if str(r.get("ckpt", "")).startswith("depth-") and "ranks" in r
            and r.get("label") == f"{r['ckpt']}-{r['algo']}"]


def growth(rec: dict, rank: int) -> list[int]:
    """RssAnon of ``rank`` at 20, 40, 60, 80, 100 % of its sampled lifetime (timeline every ~5 s)."""
    tl = [x for x in rec.get("timeline", []) if int(x[1]) == rank]
    if not tl:
        return []
    t0, t1 = tl[0][0], tl[-1][0]
    out = []
    for f in (0.2, 0.4, 0.6, 0.8, 1.0):
        t = t0 + f * (t1 - t0)
        out.append(min(tl, key=lambda x: abs(x[0] - t))[3])
    return out


def _depth_points(dep: list[dict]) -> dict:
    pts: dict[str, dict[int, list[int]]] = {}
    for r in dep:
        if r["rc"] != 0 or not r.get("report"):
            continue
        pts.setdefault(r["algo"], {})[r["layers"]] = [x["peak_rss_bytes"] for x in r["report"]["ranks"]]
    return pts


def depth_table(dep: list[dict]) -> str:
    rows = ["| algo | layers | checkpoint GB | peak RSS / rank MiB (report VmHWM): r0, r1 | vs 4 layers | "
            "sampled anon + file peak MiB, r0 / r1 | disk read / rank GB | wall s | load avg max |",
            "|---|---|---|---|---|---|---|---|---|"]
    last = {}
    for r in dep:
        last[(r["algo"], r["layers"])] = r
    base = {}
    for (algo, layers), r in sorted(last.items()):
        if r["rc"] != 0 or not r.get("report"):
            rows.append(f"| {algo} | {layers} | {r['ckpt_bytes'] / GB:.2f} | failed: {r['error']} | | | | | |")
            continue
        peaks = [x["peak_rss_bytes"] for x in r["report"]["ranks"]]
        base.setdefault(algo, peaks)
        rel = ", ".join(f"{p / b - 1:+.1%}" for p, b in zip(peaks, base[algo]))
        samp = " / ".join(f"{v['anon'] / MIB:.0f} + {v['file'] / MIB:.0f}" for _, v in sorted(r["ranks"].items()))
        reads = " / ".join(f"{v['read_bytes'] / GB:.2f}" for _, v in sorted(r["ranks"].items()))
        rows.append(f"| {algo} | {layers} | {r['ckpt_bytes'] / GB:.2f} | {', '.join(f'{p / MIB:.0f}' for p in peaks)} | "
                    f"{rel} | {samp} | {reads} | {r['wall_s']:.0f} | {r['loadavg_max']:.1f} |")
    return "\n".join(rows)


def plot(dest: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dep = _depth_records(_records())
    pts = _depth_points(dep)
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    share = {}
    for r in dep:
        share[r["layers"]] = r["ckpt_bytes"] / 2 / MIB
    for algo, d in sorted(pts.items()):
        xs = sorted(d)
        for rank in (0, 1):
            ax.plot(xs, [d[x][rank] / MIB for x in xs], marker="o", ls="-" if rank == 0 else "--",
                    label=f"{algo}, rank {rank}")
    xs = sorted(share)
    ax.plot(xs, [share[x] for x in xs], color="grey", ls=":", marker=".", label="checkpoint / 2 (a rank's share)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("decoder layers (same widths: 64 experts, hidden 1024)")
    ax.set_ylabel("peak RSS per rank, MiB (VmHWM)")
    ax.set_title("sq.ptq, 2 ranks: peak memory per rank vs depth")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    dest.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, dpi=100)
    return dest


# ----------------------------------------------------------------------------- CLI


def _deadline(s: str | None) -> float | None:
    """HH:MM (UTC, today) -> epoch seconds."""
    if not s:
        return None
    import calendar

    hh, mm = (int(x) for x in s.split(":"))
    now = time.gmtime()
    return calendar.timegm((now.tm_year, now.tm_mon, now.tm_mday, hh, mm, 0, 0, 0, 0))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ptq-worker":
        ptq_worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["build", "run", "plan", "depth", "profile", "table"])
    ap.add_argument("--ckpts", default="big," + ",".join(f"depth-L{x}" for x in DEPTHS), help="for build")
    ap.add_argument("--ckpt", default="big")
    ap.add_argument("--algo", default="rtn")
    ap.add_argument("--algos", default="rtn,gptq", help="for depth")
    ap.add_argument("--layers", default=",".join(map(str, DEPTHS)), help="for depth")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--deadline", default=None, help="HH:MM UTC: kill a running job then")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--cprofile", action="store_true", help="profile: cProfile each rank (else timers only)")
    ap.add_argument("--keep-output", action="store_true")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="for run/depth: add to the job's environment (recorded); e.g. an allocator setting")
    ap.add_argument("--sq-args", default="", help="for run/depth: more sq.ptq arguments, e.g. '--ep 2'")
    ap.add_argument("--tag", default="", help="for run/depth: label suffix, keeping these runs out of the main tables")
    args = ap.parse_args()
    SCALE.mkdir(parents=True, exist_ok=True)
    dl = _deadline(args.deadline)
    calib = ["--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen)]
    more = args.sq_args.split()
    env_extra = dict(kv.split("=", 1) for kv in args.env)
    tag = f"-{args.tag}" if args.tag else ""

    if args.cmd == "build":
        for name in args.ckpts.split(","):
            build(name)
            loadbench.evict(ckpt_dir(name))
    elif args.cmd == "run":
        run_job(args.ckpt, args.algo, (calib if args.algo == "gptq" else []) + more, deadline=dl, timeout=args.timeout,
                keep_output=args.keep_output, env_extra=env_extra, label=f"{args.ckpt}-{args.algo}{tag}")
    elif args.cmd == "plan":
        plan(args.ckpt)
    elif args.cmd == "depth":
        for algo in args.algos.split(","):
            for L in (int(x) for x in args.layers.split(",")):
                name = f"depth-L{L}"
                build(name)
                run_job(name, algo, (calib if algo == "gptq" else []) + more, deadline=dl, timeout=args.timeout,
                        env_extra=env_extra, label=f"{name}-{algo}{tag}")
    elif args.cmd == "profile":
        profile_job(args.ckpt, args.algo, calib if args.algo == "gptq" else [], dl, args.cprofile)
    elif args.cmd == "table":
        print(tables())
        p = plot(REPO / "docs" / "img" / "memory-depth.png")
        print(f"\nplot: {p}")


if __name__ == "__main__":
    main()
