"""sq and its peers back to back, one table (issue 20).

    .venv/bin/python bench/peers.py [--steps gptq,signround,load,eval] [--nsamples 32] [--seqlen 512]
        [--iters 10] [--batch-size 8] [--eval-windows 40] [--skip-setup] [--table] [--setup]

Every step runs on ``demo:smollm2`` (``sq.resolve.resolve_model``), W4A16 symmetric, group 64, with the
same calibration tokens on both sides: the first ``nsamples x seqlen`` tokens of sq's
``builtin:pydoc`` as consecutive windows. The driver tokenizes them once with sq's own functions
(``sq.calib.data``: ``load_tokenizer``, ``tokenize_corpus``, ``calibration_windows``, as ``sq.ptq``
does) into ``_work/peers/windows-NxL.json`` (its sha256 goes into every record) and hands that file
to the peers, so their Python, transformers and tokenizer versions cannot change the tokens.

1. ``gptq``: sq at 2 ranks x 1 thread (``OMP_NUM_THREADS=1 torch.distributed.run --nproc-per-node 2
   -m sq.ptq --algo gptq ...``) vs llm-compressor 0.14 in one process (this file re-run inside
   ``bench/_work/venv-llmc`` with ``--llmc-worker``: ``oneshot`` with ``GPTQModifier(config_groups=
   {"group_0": W4A16 preset, group_size 64}, ignore=["lm_head"])``, ``shuffle_calibration_samples=
   False``, then ``save_pretrained(save_compressed=True)``), torch's default threads (2 here).
2. ``signround``: sq ``--algo signround --iters S --batch-size B`` at 2 ranks vs auto-round 0.16
   (``--ar-worker`` inside ``bench/_work/venv-autoround``): ``AutoRound(model, tok, bits=4,
   group_size=64, sym=True, iters=S, batch_size=B, nsamples=N, seqlen=L, dataset=<the windows>)``
   then ``quantize_and_save(format="llm_compressor")``: a compressed-tensors ``pack-quantized``
   checkpoint that the same evaluator loads (needs ``compressed-tensors`` in that venv: the setup
   here adds it).
3. ``load``: ``bench/load.py`` as a subprocess, loaders sq_ep1, hf_fsdp2, sq_ep2, hf_fsdp2_ep2 on
   both layouts, ``--repeat 1`` (cold page cache, as it does); wall (load + touch) and peak RSS
   rise per rank / checkpoint size from its results file.
4. ``eval``: ``bench/peers/eval_preset.py`` (fp32, last ``--eval-windows`` windows of 512 pydoc
   tokens) on every quantized output of these settings found under ``_work/peers`` and the source.

Wall time of a side = the whole command (start-up, load, calibration, save); the peers' own
quantization call (``oneshot`` / ``quantize_and_save``) is also recorded as ``core_s``. Each record
also holds the 1-minute load average before and after (the machine is shared). Records are
appended to ``_work/peers/results.jsonl``; the table at the end (``--table`` prints it alone) pairs
the latest records of the current settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "_work" / "peers"
RESULTS = WORK / "results.jsonl"
LLMC_PY = ROOT / "bench" / "_work" / "venv-llmc" / "bin" / "python"
AR_PY = ROOT / "bench" / "_work" / "venv-autoround" / "bin" / "python"
MODEL = "demo:smollm2"
GROUP = 64
STEPS = ("gptq", "signround", "load", "eval")
TARGETS = {"gptq": 0.5, "signround": 1.0, "load": 1.0}
LOAD_RSS_TARGET = 0.55
LOAD_PAIRS = (("sq_ep1", "hf_fsdp2"), ("sq_ep2", "hf_fsdp2_ep2"))
LOAD_LAYOUTS = ("per_expert", "fused")


# ----------------------------------------------------------------------------- peer workers
# These run inside the peer venvs: standard library, torch and the peer only (no sq).


def _windows(path: str) -> tuple[list[list[int]], int, int]:
    d = json.loads(Path(path).read_text())
    return d["windows"], d["nsamples"], d["seqlen"]


def llmc_worker(args) -> int:
    """Inside venv-llmc: GPTQ W4A16 g64 on the given windows, saved compressed."""
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the sequential pipeline pins its cached batches, which torch refuses without an accelerator;
    # on a CPU-only machine the pinning is skipped (it changes no value)
    if not torch.cuda.is_available():
        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    windows, n, seqlen = _windows(args.windows)
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights = scheme.weights.model_copy(update={"group_size": GROUP})
    dtype = "auto" if args.peer_dtype == "auto" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map="cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seqlen for _ in windows]})
    t = time.perf_counter()
    oneshot(model=model, tokenizer=tok, dataset=ds,
            recipe=[GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])],
            num_calibration_samples=n, max_seq_length=seqlen, shuffle_calibration_samples=False)
    core = time.perf_counter() - t
    t = time.perf_counter()
    model.save_pretrained(args.out, save_compressed=True)
    tok.save_pretrained(args.out)
    save = time.perf_counter() - t
    info = {"core_s": round(core, 2), "save_s": round(save, 2), "threads": torch.get_num_threads(),
            "model_dtype": str(model.dtype), "versions": {
                "torch": torch.__version__, "llmcompressor": llmcompressor.__version__,
                "compressed_tensors": compressed_tensors.__version__, "transformers": transformers.__version__}}
    (Path(args.out) / "peer_run.json").write_text(json.dumps(info) + "\n")
    return 0


def ar_worker(args) -> int:
    """Inside venv-autoround: SignRound W4 g64 sym on the given windows, saved as compressed-tensors."""
    import auto_round
    import torch
    import transformers
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows, n, seqlen = _windows(args.windows)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto", device_map="cpu")
    tok = AutoTokenizer.from_pretrained(args.model)
    # pre-tokenized samples, one [1, seqlen] window each, in order (auto-round's calib() takes a list
    # of dicts as the dataloader and keeps the first nsamples of them)
    data = [{"input_ids": torch.tensor([w], dtype=torch.long),
             "attention_mask": torch.ones(1, seqlen, dtype=torch.long)} for w in windows]
    t = time.perf_counter()
    ar = AutoRound(model, tokenizer=tok, bits=4, group_size=GROUP, sym=True, iters=args.iters,
                   batch_size=args.batch_size, nsamples=n, seqlen=seqlen, dataset=data, device_map="cpu")
    ar.quantize_and_save(args.out, format="llm_compressor")
    core = time.perf_counter() - t
    # auto-round writes into OUT/<model name>-w4g64/: move the checkpoint up so OUT is the checkpoint
    out = Path(args.out)
    if not (out / "config.json").is_file():
        sub = [d for d in out.iterdir() if (d / "config.json").is_file()]
        if len(sub) != 1:
            raise SystemExit(f"auto-round's checkpoint not found under {out}: {sorted(out.iterdir())}")
        for f in sub[0].iterdir():
            f.rename(out / f.name)
        sub[0].rmdir()
    ctx = getattr(ar, "model_context", None)
    info = {"core_s": round(core, 2), "threads": torch.get_num_threads(),
            "amp": getattr(ctx, "amp", None), "amp_dtype": str(getattr(ctx, "amp_dtype", None)),
            "torch_compile": getattr(ar, "enable_torch_compile", None),
            "versions": {"torch": torch.__version__, "auto_round": auto_round.__version__,
                         "transformers": transformers.__version__}}
    try:
        import compressed_tensors

        info["versions"]["compressed_tensors"] = compressed_tensors.__version__
    except ImportError:
        pass
    (Path(args.out) / "peer_run.json").write_text(json.dumps(info) + "\n")
    return 0


# ----------------------------------------------------------------------------- driver helpers


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _git() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return "?"


def _record(rec: dict) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    rec = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": _git(), **rec}
    with open(RESULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def _run(cmd: list[str], log: Path, env: dict | None = None, drop: tuple[str, ...] = (), timeout=None) -> dict:
    """Run ``cmd`` from the repo root, output to ``log``; wall seconds and load average around it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {k: v for k, v in os.environ.items() if k not in drop}
    full_env.update(env or {})
    before = _loadavg()
    print(f"$ {' '.join((f'{k}={v} ' for k, v in (env or {}).items()))}{' '.join(cmd)}\n  log: {log}", flush=True)
    t = time.perf_counter()
    with open(log, "w") as lf:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=full_env, stdout=lf, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t
    out = {"cmd": cmd, "env": env or {}, "rc": rc, "wall_s": round(wall, 2), "loadavg_before": before,
           "loadavg_after": _loadavg(), "log": str(log.relative_to(ROOT))}
    if rc != 0:
        tail = log.read_text(errors="replace")[-2500:]
        print(f"  FAILED ({rc}) after {wall:.0f} s; log tail:\n{tail}", flush=True)
    else:
        print(f"  done in {wall:.1f} s (load avg {before[0]} -> {out['loadavg_after'][0]})", flush=True)
    return out


def _venv_ok(py: Path, module: str) -> bool:
    return py.is_file() and subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode == 0


def ensure_venvs(which: tuple[str, ...], skip: bool) -> None:
    """Both peer venvs (their setup scripts), plus compressed-tensors in auto-round's for its export."""
    need = {"llmc": (LLMC_PY, "llmcompressor", "setup_llmc.sh"),
            "autoround": (AR_PY, "auto_round", "setup_autoround.sh")}
    for name in which:
        py, module, script = need[name]
        if not _venv_ok(py, module):
            if skip:
                sys.exit(f"peers: {py} cannot import {module}; run bench/peers/{script} (or drop --skip-setup)")
            subprocess.run(["bash", str(ROOT / "bench" / "peers" / script)], check=True)
        if name == "autoround" and not _venv_ok(py, "compressed_tensors"):
            # auto-round's format="llm_compressor" export imports compressed-tensors (an optional
            # dependency it does not install); the version sq's evaluator loads with, torch pinned
            if skip:
                sys.exit(f"peers: {py} lacks compressed-tensors (auto-round's llm_compressor export needs it); "
                         "drop --skip-setup or pip install it there")
            pins = ROOT / "bench" / "_work" / "autoround-constraints.txt"
            if not pins.is_file():
                pins.write_text("torch==2.13.0\n")
            subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(pins), "compressed-tensors==0.20.1"],
                           check=True)


def windows_file(src: Path, nsamples: int, seqlen: int) -> tuple[Path, str]:
    """The calibration windows as sq.ptq builds them, written once as JSON; (path, sha256 of the tokens)."""
    path = WORK / f"windows-{nsamples}x{seqlen}.json"
    if not path.is_file():
        from sq.calib.data import BUILTIN_PYDOC, calibration_windows, load_tokenizer, read_corpus, tokenize_corpus

        tok = load_tokenizer(src)
        tokens = tokenize_corpus(tok, read_corpus(BUILTIN_PYDOC).text(tok))
        w = calibration_windows(tokens, nsamples, seqlen).tolist()
        WORK.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"nsamples": nsamples, "seqlen": seqlen, "corpus": BUILTIN_PYDOC,
                                    "model": str(src), "windows": w}))
    w = json.loads(path.read_text())["windows"]
    return path, hashlib.sha256(json.dumps(w).encode()).hexdigest()[:16]


def _settings(task: str, args) -> dict:
    s = {"model": MODEL, "scheme": "W4A16", "group_size": GROUP, "nsamples": args.nsamples, "seqlen": args.seqlen}
    if task == "signround":
        s.update(iters=args.iters, batch_size=args.batch_size)
    else:
        s.update(peer_dtype=args.peer_dtype)
    return s


def _outdir(task: str, side: str, args) -> Path:
    tag = f"{task}-n{args.nsamples}x{args.seqlen}"
    if task == "signround":
        tag += f"-i{args.iters}b{args.batch_size}"
    return WORK / tag / side


def _sq_cmd(src: Path, out: Path, task: str, args) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "sq.ptq",
           "--model", str(src), "--output", str(out), "--algo", task, "--scheme", "W4A16", "--group-size", str(GROUP),
           "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--resume", "never"]
    if task == "signround":
        cmd += ["--iters", str(args.iters), "--batch-size", str(args.batch_size)]
    return cmd


def quant_step(task: str, src: Path, args) -> None:
    """sq then the peer on the same windows; one record per side (ppl comes from the eval step)."""
    wpath, wsha = windows_file(src, args.nsamples, args.seqlen)
    settings = _settings(task, args)
    peer = {"gptq": "llmc", "signround": "autoround"}[task]
    logs = WORK / "logs"
    sides = [s for s in ("sq", peer) if s not in args.skip]
    for side in sides:
        out = _outdir(task, side, args)
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex[:12]
        log = logs / f"{task}-{side}-{run_id}.log"
        if side == "sq":
            res = _run(_sq_cmd(src, out, task, args), log, env={"OMP_NUM_THREADS": "1"}, timeout=args.timeout)
            info = {}
            rep = out / "sq_report.json"
            if res["rc"] == 0 and rep.is_file():
                r = json.loads(rep.read_text())
                info = {"core_s": r.get("seconds"), "world_size": r.get("world_size"),
                        "peak_rss_bytes": [x.get("peak_rss_bytes") for x in r.get("ranks", [])]}
        else:
            worker = "--llmc-worker" if side == "llmc" else "--ar-worker"
            py = LLMC_PY if side == "llmc" else AR_PY
            cmd = [str(py), str(Path(__file__).resolve()), worker, "--model", str(src), "--out", str(out),
                   "--windows", str(wpath), "--iters", str(args.iters), "--batch-size", str(args.batch_size),
                   "--peer-dtype", args.peer_dtype]
            # the peer's own thread count: torch's default (all cores), whatever the caller's environment says
            res = _run(cmd, log, drop=("OMP_NUM_THREADS", "MKL_NUM_THREADS"), timeout=args.timeout)
            pr = out / "peer_run.json"
            info = json.loads(pr.read_text()) if res["rc"] == 0 and pr.is_file() else {}
        if res["rc"] == 0:
            (out / "peers_run_id").write_text(run_id + "\n")
        rec = _record({"kind": "quant", "task": task, "side": side, "run_id": run_id, "settings": settings,
                       "windows": str(wpath.relative_to(ROOT)), "windows_sha256": wsha,
                       "output": str(out.relative_to(ROOT)), **res, **info})
        if res["rc"] != 0:
            print(f"peers: {task}/{side} failed; recorded, going on", flush=True)
        elif side != "sq":
            print(f"  {side}: core {rec.get('core_s')} s of {rec['wall_s']} s, {rec.get('threads')} threads",
                  flush=True)


def eval_step(src: Path, args) -> None:
    """eval_preset.py on every output of the current settings (each once per run id) and on the source."""
    done = {(r.get("run_id"), r.get("nwindows")) for r in _read() if r.get("kind") == "eval"}
    targets: list[tuple[str, str, Path, str]] = [("source", "source", src, "source")]
    for task, sides in (("gptq", ("sq", "llmc")), ("signround", ("sq", "autoround"))):
        for side in sides:
            out = _outdir(task, side, args)
            rid = out / "peers_run_id"
            if rid.is_file():
                targets.append((task, side, out, rid.read_text().strip()))
    for task, side, path, run_id in targets:
        if (run_id, args.eval_windows) in done:
            print(f"eval {task}/{side}: already evaluated (run {run_id})", flush=True)
            continue
        cmd = [sys.executable, "bench/peers/eval_preset.py", "--model", str(path), "--nwindows", str(args.eval_windows)]
        log = WORK / "logs" / f"eval-{task}-{side}-{run_id}.log"
        res = _run(cmd, log, timeout=args.timeout)
        ppl, detail = None, {}
        if res["rc"] == 0:
            lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
            detail = json.loads(lines[-1]) if lines else {}
            ppl = detail.get("ppl")
            print(f"  {task}/{side}: perplexity {ppl}", flush=True)
        _record({"kind": "eval", "task": task, "side": side, "run_id": run_id, "nwindows": args.eval_windows,
                 "output": str(path), "ppl": ppl, "eval": detail, **res})


def load_step(args) -> None:
    """bench/load.py for the sq / transformers pairs on both layouts, 1 repetition, summarized per pair."""
    run_id = uuid.uuid4().hex[:12]
    out = WORK / f"load-{run_id}.jsonl"
    loaders = [lo for pair in LOAD_PAIRS for lo in pair]
    cmd = [sys.executable, "bench/load.py", "--layouts", ",".join(LOAD_LAYOUTS), "--loaders", ",".join(loaders),
           "--repeat", "1", "--results", str(out)]
    # load.py rewrites bench/_work/results.md (its own table): keep the previous one, move this run's here
    md = ROOT / "bench" / "_work" / "results.md"
    saved = md.read_bytes() if md.is_file() else None
    try:
        res = _run(cmd, WORK / "logs" / f"load-{run_id}.log", timeout=args.timeout)
    finally:
        if md.is_file() and md.read_bytes() != saved:
            shutil.move(str(md), str(WORK / f"load-{run_id}.md"))
        if saved is not None:
            md.write_bytes(saved)
    load_records(out, run_id, res)


def load_records(out: Path, run_id: str, res: dict) -> None:
    """One record per (layout, sq loader / transformers loader) pair from load.py's results file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_load", ROOT / "bench" / "load.py")
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    results = [json.loads(ln) for ln in out.read_text().splitlines()] if out.is_file() else []
    summary = load.summarize(results) if results else {}
    for layout in LOAD_LAYOUTS:
        for sq_name, hf_name in LOAD_PAIRS:
            sides = {}
            for side, name in (("sq_side", sq_name), ("peer_side", hf_name)):
                m = summary.get((layout, name))
                if m is None or m.get("failed"):
                    sides[side] = {"failed": True, "error": (m or {}).get("error", "not run")}
                else:
                    sides[side] = {"wall_s": round(m["total"], 2), "load_s": round(m["load"], 2),
                                   "rss_rise_per_rank_bytes": int(m["peak"]), "ckpt_bytes": int(m["ckpt"]),
                                   "rss_rise_x_ckpt": round(m["peak"] / m["ckpt"], 4),
                                   "read_x_ckpt": round(m["read"] / m["ckpt"], 4), "cpu_s": round(m["cpu"], 2),
                                   "loadavg": m["loadavg"]}
            _record({"kind": "load", "task": "load", "layout": layout, "sq_name": sq_name, "peer_name": hf_name,
                     "run_id": run_id, "results": str(out.relative_to(ROOT)), **res, **sides})


# ----------------------------------------------------------------------------- table


def _read() -> list[dict]:
    if not RESULTS.is_file():
        return []
    return [json.loads(ln) for ln in RESULTS.read_text().splitlines() if ln.strip()]


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(args) -> str:
    recs = _read()
    evals = {}
    for r in recs:
        if r.get("kind") == "eval" and r.get("ppl") is not None and r.get("nwindows") == args.eval_windows:
            evals[r["run_id"] if r["task"] != "source" else "source"] = r
    rows = ["| task | sq (wall s, ppl) | peer (wall s [core s], ppl) | ratio sq/peer wall [vs core] | target | "
            "load avg before -> after (sq; peer) |", "|---|---|---|---|---|---|"]
    names = {"gptq": ("GPTQ", "llm-compressor 0.14 GPTQ", "llmc"),
             "signround": ("SignRound", "auto-round 0.16", "autoround")}
    for task in ("gptq", "signround"):
        s = _settings(task, args)
        last = {}
        for r in recs:
            if r.get("kind") == "quant" and r["task"] == task and r["settings"] == s and r.get("rc") == 0:
                last[r["side"]] = r
        sq, peer = last.get("sq"), last.get(names[task][2])
        if sq is None and peer is None:
            continue
        label = f"{names[task][0]} W4A16 g64, {s['nsamples']}x{s['seqlen']}"
        if task == "signround":
            label += f", {s['iters']} iters, batch {s['batch_size']}"
        label += f" (sq 2 ranks x 1 thread vs {names[task][1]})"

        def cell(r, core=False):
            if r is None:
                return "not run"
            ppl = evals.get(r["run_id"], {}).get("ppl")
            c = f" [{_f(r.get('core_s'))}]" if core else ""
            return f"{_f(r['wall_s'])}{c}, {_f(ppl, '{:.2f}')}"

        ratio, tgt = "-", f"<= {TARGETS[task]}"
        if sq and peer:
            q = sq["wall_s"] / peer["wall_s"]
            qc = sq["wall_s"] / peer["core_s"] if peer.get("core_s") else None
            ratio = f"{q:.2f} [{_f(qc, '{:.2f}')}]"
            tgt += " MET" if q <= TARGETS[task] else " MISSED"
        la = "; ".join(f"{r['loadavg_before'][0]} -> {r['loadavg_after'][0]}" if r else "-" for r in (sq, peer))
        rows.append(f"| {label} | {cell(sq)} | {cell(peer, True)} | {ratio} | {tgt} | {la} |")
    loads = [r for r in recs if r.get("kind") == "load"]
    if loads:
        last_id = loads[-1]["run_id"]
        for r in (r for r in loads if r["run_id"] == last_id):
            a, b = r["sq_side"], r["peer_side"]
            label = f"load {r['layout']}: {r['sq_name']} vs transformers {r['peer_name']} (cold cache, 1 rep)"

            def lcell(x):
                return "failed" if x.get("failed") else f"{_f(x['wall_s'])}, RSS rise/ckpt {x['rss_rise_x_ckpt']:.3f}"

            ratio, tgt = "-", f"<= {TARGETS['load']}, sq RSS/ckpt <= {LOAD_RSS_TARGET}"
            if not a.get("failed") and not b.get("failed"):
                q = a["wall_s"] / b["wall_s"]
                ratio = f"{q:.2f}"
                ok = q <= TARGETS["load"] and a["rss_rise_x_ckpt"] <= LOAD_RSS_TARGET
                tgt += " MET" if ok else " MISSED"
            la = "; ".join("-" if x.get("failed") else f"{x['loadavg']:.1f} at job start" for x in (a, b))
            rows.append(f"| {label} | {lcell(a)} | {lcell(b)} | {ratio} | {tgt} | {la} |")
    src = evals.get("source")
    foot = f"\nsource perplexity: {_f(src['ppl'], '{:.2f}') if src else '- (eval step not run)'}"
    foot += f" (eval_preset.py, fp32, last {args.eval_windows} windows of 512 pydoc tokens)"
    return "\n".join(rows) + "\n" + foot


# ----------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default=",".join(STEPS), help="comma list of gptq, signround, load, eval")
    p.add_argument("--nsamples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--iters", type=int, default=10, help="(signround) steps per block, both sides")
    p.add_argument("--batch-size", type=int, default=8, help="(signround) samples per step, both sides")
    p.add_argument("--eval-windows", type=int, default=40, help="evaluation windows of 512 tokens (standard: 40)")
    p.add_argument("--skip", default="", help="comma list of sides not to run: sq, llmc, autoround")
    p.add_argument("--peer-dtype", default="auto", choices=["auto", "float32"],
                   help="llm-compressor's model dtype (auto = the checkpoint's bf16, its default; float32 = like "
                        "sq's CPU calibration); auto-round always tunes in bf16 on CPU (its amp)")
    p.add_argument("--timeout", type=int, default=None, help="seconds per command (default: none)")
    p.add_argument("--table", action="store_true", help="print the table of the current settings from results only")
    p.add_argument("--setup", action="store_true", help="only ensure both peer venvs and exit")
    p.add_argument("--skip-setup", action="store_true", help="never create or change a peer venv; fail if missing")
    # worker modes (inside a peer venv)
    p.add_argument("--llmc-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ar-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--windows", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.llmc_worker:
        return llmc_worker(args)
    if args.ar_worker:
        return ar_worker(args)
    args.skip = {s for s in args.skip.split(",") if s}
    if args.table:
        print(table(args))
        return 0
    if args.setup:
        ensure_venvs(("llmc", "autoround"), skip=False)
        return 0
    steps = [s for s in args.steps.split(",") if s]
    bad = set(steps) - set(STEPS)
    if bad:
        p.error(f"unknown steps {sorted(bad)}; choose from {', '.join(STEPS)}")
    need = tuple(v for k, v in (("gptq", "llmc"), ("signround", "autoround")) if k in steps and v not in args.skip)
    if need:
        ensure_venvs(need, skip=args.skip_setup)

    from sq.resolve import resolve_model

    src = Path(resolve_model(MODEL))
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"model {MODEL} = {src}; results -> {RESULTS.relative_to(ROOT)}; load avg {_loadavg()}", flush=True)
    for step in STEPS:  # fixed order: quantizations back to back, then load, then the evaluations
        if step not in steps:
            continue
        print(f"\n== {step}", flush=True)
        if step in ("gptq", "signround"):
            quant_step(step, src, args)
        elif step == "load":
            load_step(args)
        else:
            eval_step(src, args)
    t = table(args)
    print("\n" + t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
