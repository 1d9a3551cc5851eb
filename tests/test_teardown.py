"""An API user's 2-rank script that loads a model with ``sq.load_sharded`` and returns must exit 0, every time.

A gloo worker thread that drops a finished collective's Python tensors while the interpreter finalizes
aborts the process ("terminate called without an active exception"): 4 of 70 runs of this script on the
DeepSeek-V3 fixture at ``--ep 2`` before ``sq.dist.teardown_at_exit``.  Real interpreters (torchrun), not
the harness's forked ranks (which leave through ``os._exit``).

``SQ_TEARDOWN_RUNS=50 .venv/bin/python -m pytest tests/test_teardown.py`` runs it 50 times.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness import run_torchrun

RUNS = int(os.environ.get("SQ_TEARDOWN_RUNS", "4"))


def test_a_load_sharded_script_exits_cleanly_every_time(checkpoints):
    ckpt = checkpoints["deepseek_v3"]
    for i in range(RUNS):
        res = run_torchrun(["teardown_probe", str(ckpt), "2"], 2, timeout=120, cwd=str(Path(__file__).parent))
        assert res.returncode == 0 and "terminate called" not in res.stderr, (i, res.stderr[-3000:])
        assert res.stdout.count(": loaded ") == 2, res.stdout
