"""One run lifecycle (``sq.run``) for both drivers: the same fault, fired in the block pipeline and in
model-free quantization of the same checkpoint, leaves the same folder and resumes the same way.

The dense Llama fixture (3 blocks), RTN W4A16 at 2 ranks, where both drivers write the same tensors:
after each kill of a chain the killed rank has left the same files and the same manifest in both folders,
each rerun restarts at the same block, and the finished outputs are equal file for file (tensor for tensor; which rank wrote
which tensor is each driver's own) -- so a fault point cannot behave differently in one driver.  (How far the rank that was not killed got before the
launcher stopped it is timing: model-free ranks share no collective between layers.)
(``tests/test_layering.py`` checks the other half: the lifecycle's parts are named only in ``sq.run``.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness import run_cli
from test_ptq_moe import _same_bits

GS = 16
# a layer's file written but not recorded (rank 1); halfway through a file (rank 0, whose temp file is
# left behind); before the index, at the very end
CHAIN = ["after-shard-write:1:1", "mid-shard-write:0:2", "index-merge:0"]


def _state(out: Path, rank: int) -> dict:
    """What the killed rank left: its manifest's blocks and temp files; the run state and the index."""
    tag = f"rank{rank:05d}"
    manifest = out / ".sq-run" / f"rank-{rank:05d}" / "manifest.json"
    return {"manifest": [e["block"] for e in json.loads(manifest.read_text())["blocks"]] if manifest.exists() else None,
            "temp": sorted(p.name for p in out.glob(f".*{tag}*.tmp")), "run.json": (out / ".sq-run/run.json").exists(),
            "index": (out / "model.safetensors.index.json").exists()}


def _chain(args: list[str], out: Path) -> list[dict]:
    seen = []
    for fault in [*CHAIN, None]:
        res = run_cli(args, 2, timeout=180, env={"SQ_FAULT": fault} if fault else {})
        restart = re.findall(r"resuming at block (\d+) of 3", res.output)
        step = {"fault": fault, "failed": res.returncode != 0, "restart": restart[:1],
                **(_state(out, int(fault.split(":")[1])) if fault else {})}
        if fault is not None:
            assert res.returncode != 0 and f"fault injection: SIGKILL at {fault.split(':')[0]}" in res.output, \
                res.output[-3000:]
        else:
            assert res.returncode == 0, res.output[-3000:]
        seen.append(step)
    return seen


@pytest.mark.timeout(900)
def test_a_fault_point_behaves_the_same_in_both_drivers(checkpoints, tmp_path):
    model, mf = tmp_path / "model", tmp_path / "mf"
    base = ["sq.ptq", "--model", str(checkpoints["llama"]), "--algo", "rtn", "--scheme", "W4A16", "--group-size",
            str(GS), "--timeout", "60"]
    a = _chain([*base, "--output", str(model)], model)
    b = _chain([*base, "--output", str(mf), "--model-free"], mf)
    for x, y in zip(a, b):
        assert x == y, f"the drivers part at {x['fault']}:\n  model path: {x}\n  model-free: {y}"
    assert [s["restart"] for s in a] == [[], ["1"], ["2"], ["3"]]
    assert _same_bits(model, mf) == []
    index = [json.loads((out / "model.safetensors.index.json").read_text()) for out in (model, mf)]
    assert set(index[0]["weight_map"]) == set(index[1]["weight_map"])  # which rank wrote what is each driver's own
    for out in (model, mf):
        assert not (out / ".sq-run").exists() and list((out / "sq_logs").glob("rank-*.log"))
