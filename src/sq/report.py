"""What a run tells its user: progress over blocks, per-rank log files, the final summary, a picture.

- Progress: on rank 0, a tqdm bar over blocks (current block, last block time, ETA) when stderr is
  a terminal; otherwise (Slurm logs, CI) one log line per block with the ETA.
- Logs: every rank appends to ``OUT/sq_logs/rank-NNNNN.log`` (kept after the run, across resumes).
- Summary: wall time, peak memory per rank, the layers with the largest quantization error.
- ``sq_report.png`` beside ``sq_report.json``: per-layer relative error and per-block time by
  phase (matplotlib, optional: without it the picture is skipped with a note in the log).
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import torch.distributed as dist

from sq.dist import LOG_FORMAT, RankFilter

logger = logging.getLogger("sq.report")

FILE_ONLY = {"file_only": True}  # ``extra=`` for records the terminal already shows another way


def add_log_file(path: Path) -> logging.Handler:
    """Append the ``sq`` logger's records (this rank's, all levels it emits) to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(LOG_FORMAT)
    handler.addFilter(RankFilter(dist.get_rank() if dist.is_initialized() else 0, True))
    sq_logger = logging.getLogger("sq")
    if sq_logger.level == logging.NOTSET:  # a library caller that set nothing still gets INFO in the file
        sq_logger.setLevel(logging.INFO)
    sq_logger.addHandler(handler)
    return handler


def remove_log_file(handler: logging.Handler) -> None:
    logging.getLogger("sq").removeHandler(handler)
    handler.close()


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class BlockProgress:
    """One line per block in every rank's log (the terminal shows rank 0's); rank 0 on a terminal
    gets a tqdm bar instead of the lines there."""

    def __init__(self, total: int, start: int, bar: bool):
        self.total, self.done = total, start
        self.times: list[float] = []
        self.bar = None
        if bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="sq blocks", unit="block", dynamic_ncols=True)

    def step(self, block: int, seconds: float) -> None:
        self.done += 1
        self.times.append(seconds)
        recent = self.times[-5:]
        eta = (self.total - self.done) * sum(recent) / len(recent)
        line = f"block {block + 1}/{self.total} done in {seconds:.2f}s, ETA {_fmt_s(eta)}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"block {block + 1}: {seconds:.1f}s")
            self.bar.update(1)
            logger.info(line, extra=FILE_ONLY)
        else:
            logger.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def block_progress(total: int, start: int, bar: bool) -> BlockProgress:
    return BlockProgress(total, start, bar)


def summary_lines(report: dict, worst: int = 5) -> list[str]:
    """The end-of-run summary: time, peak memory per rank, the worst layers by error, routed experts left
    unquantized."""
    lines = [f"done in {_fmt_s(report['seconds'])} on {report['world_size']} rank(s)"
             + (f", resumed at block {report['resumed_from_block']}" if report.get("resumed_from_block") else "")]
    for r in report["ranks"]:
        gpu = f", GPU peak {r['peak_gpu_bytes'] / 2**30:.2f} GiB" if r.get("peak_gpu_bytes") else ""
        lines.append(f"  rank {r['rank']}: peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB{gpu}")
    layers = sorted(report["layers"].items(), key=lambda kv: -kv[1]["rel_err"])[:worst]
    if layers:
        metric = layers[0][1].get("metric", "")
        lines.append(f"  largest relative error ({metric}):")
        for name, e in layers:
            rtn = f" (RTN {e['rtn_rel_err']:.4f})" if "rtn_rel_err" in e else ""
            lines.append(f"    {e['rel_err']:.4f}{rtn}  {name}")
    ex = report.get("experts")
    if ex and ex.get("tokens"):  # the tokens the router sent each expert, fewest and most, and the policy
        routed = [n for t in ex["tokens"].values() for n in t["routed"]]
        lines.append(f"  experts: {len(routed)} in {len(ex['tokens'])} module(s), routed tokens {min(routed)}-"
                     f"{max(routed)} per expert; {ex['policy'].split(':')[0]}")
    if report.get("experts_rtn_fallback"):
        lines.append(f"  {report['experts_rtn_fallback']} expert(s) saw no calibration token (RTN): "
                     + ", ".join((ex or {}).get("rtn", [])[:8]) + (" ..." if len((ex or {}).get("rtn", [])) > 8 else ""))
    lines += unquantized_experts_lines(report)
    rot = report.get("rotation")
    if rot:  # --rotate: what was rotated and how closely each proof held
        errors = [b["error"] for b in rot["blocks"].values()] + ([rot["root"]["error"]] if "root" in rot else [])
        kinds = [f"r1 ({rot['r1']} {rot['hidden_size']})"] if rot.get("r1") else []
        kinds += [f"r2 ({kind} {d})" for d, kind in rot.get("r2", {}).items()]
        if rot.get("r4"):
            online = sum(b.get("online", 0) for b in rot["blocks"].values())
            kinds.append(f"r4 online on {online} down_proj (transform_config group {rot['r4']['group']}: vLLM "
                         "applies it, transformers does not)")
        size = f" in blocks of {rot['block']}" if rot.get("block") else ""
        lines.append(f"  rotated: {', '.join(kinds) or 'nothing'}{size}; proven on {len(rot['blocks'])} block(s), "
                     f"largest relative error {max(errors, default=0):.2e}")
    return lines


def unquantized_experts_lines(report: dict) -> list[str]:
    """--allow-unquantized-experts: what stayed in full precision, and why."""
    carried = report.get("unquantized_experts")
    if not carried:
        return []
    return [f"  UNQUANTIZED routed experts (--allow-unquantized-experts): {len(carried)} module(s) in full "
            f"precision, e.g. {carried[0]['module']} ({carried[0]['reason']})"]


def write_report_png(report: dict, path: Path) -> Path | None:
    """Per-layer relative error, per-block time by phase and, for an MoE, tokens per expert; ``None`` without
    matplotlib."""
    try:  # the object API, not pyplot: no global state, and half the import and layout time
        from matplotlib.figure import Figure
    except ImportError:
        logger.info("matplotlib is not installed: no %s (pip install matplotlib)", path.name)
        return None
    layers = list(report["layers"].items())
    experts = (report.get("experts") or {}).get("tokens") or {}
    fig = Figure(figsize=(11, 10 if experts else 7))
    fig.subplots_adjust(left=0.07, right=0.98, top=0.95, bottom=0.06, hspace=0.4)
    ax1, ax2, *ax3 = fig.subplots(3 if experts else 2, 1)
    if experts:  # tokens per expert: where the router sent them, and what each one's statistics saw
        ax = ax3[0]
        for eprefix, t in experts.items():
            ax.plot(t["routed"], ".", alpha=0.7, label=f"{eprefix}: routed")
        calibrated = sorted({c for t in experts.values() for c in t["calibrated"]})
        ax.set_xlabel("expert")
        ax.set_ylabel("calibration tokens")
        ax.set_title(f"tokens per expert (calibrated: {calibrated[0]}" + (f"-{calibrated[-1]}" if len(calibrated) > 1
                                                                       else "") +
                     f"; {len(report['experts'].get('rtn', []))} rounded to nearest)")
        if len(experts) <= 6:
            ax.legend(fontsize="small")
    if layers:
        x = range(len(layers))
        ax1.plot(x, [e["rel_err"] for _, e in layers], ".", label=report["args"].get("algo", ""))
        if "rtn_rel_err" in layers[0][1]:
            ax1.plot(x, [e.get("rtn_rel_err", math.nan) for _, e in layers], ".", alpha=0.5, label="RTN, same H")
        ax1.legend()
        ax1.set_xlabel("Linear (model order)")
        ax1.set_ylabel(f"relative error ({layers[0][1].get('metric', '')})")
    ax1.set_title(f"{report['source']}: per-layer quantization error")
    blocks = {}
    for r in report["ranks"]:  # per block, the slowest rank's phases
        for b in r["blocks"]:
            if b["block"] not in blocks or b["seconds"] > blocks[b["block"]]["seconds"]:
                blocks[b["block"]] = b
    order = sorted(blocks)
    phases = [p for p in ("fill", "calibrate", "tune", "solve", "forward", "write", "write_wait")
              if any(p in blocks[b] for b in order)]
    bottom = [0.0] * len(order)
    for p in phases:
        vals = [blocks[b].get(p, 0.0) for b in order]
        ax2.bar(order, vals, bottom=bottom, label=p)
        bottom = [a + v for a, v in zip(bottom, vals)]
    ax2.set_xlabel("block")
    ax2.set_ylabel("seconds (slowest rank)")
    ax2.set_title("time per block")
    if phases:
        ax2.legend(ncol=len(phases), fontsize="small")
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=90)
    tmp.replace(path)
    return path
