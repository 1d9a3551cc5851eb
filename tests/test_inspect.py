"""The main job's command line: torchrun -m sq.inspect on 2 ranks, and its errors."""

from __future__ import annotations

import json

from ckpt_edit import copy_ckpt, edit_config
from harness import run_cli, run_torchrun


def test_inspect_two_ranks_reports_and_scores(checkpoints):
    res = run_cli(["sq.inspect", "--model", str(checkpoints["llama"]), "--ppl", "--seqlen", "32",
                        "--nwindows", "4", "--json"], 2, timeout=180)
    assert res.returncode == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and len(report["ranks"]) == 2
    assert report["rules"] == {"exact": report["tensors"]}
    assert 1 < report["perplexity"] < 1e4
    shard = [r["shard_bytes"] for r in report["ranks"]]
    assert max(shard) < 0.6 * sum(shard)


def test_inspect_refusal_is_a_clean_error_on_every_rank(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    edit_config(path, vocab_size=999)
    res = run_torchrun(["sq.inspect", "--model", str(path)], 2, timeout=120)
    assert res.returncode != 0
    assert res.stderr.count("sq: error: shape mismatch") >= 1, res.stderr[-3000:]  # rank 0 speaks for all ranks
    assert "/sq/" not in res.stderr  # no traceback through sq's code (torchrun prints its own)


def test_bad_flag_is_a_clean_error():
    res = run_torchrun(["sq.inspect", "--model", "x", "--ep", "notanumber"], 1, timeout=60)
    assert res.returncode != 0 and "sq: error: argument --ep" in res.stderr and "/sq/" not in res.stderr
