"""Every registered algorithm x a representative scheme x (dense, MoE) through the same checks.

A new algorithm registered in ``sq.quant.algorithms`` gets these for free:

- its output loads in transformers with no missing or unexpected keys, and runs;
- 1 vs 2 ranks: RTN bit-identical; calibrated algorithms (whose Hessian sums / batches are split
  differently) within a stated bound: every layer's relative error within 25 % of the other run's;
- killed after writing its first block on one rank and rerun: bit-identical to an uninterrupted run;
- a refusal (a group size that divides nothing) raised on every rank, exit 2, nothing written;
- a data-free algorithm's resume signature ignores the calibration settings.

Only ``FAST`` (test speed) is per algorithm; everything else is the same code for all.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_cli, run_ranks
from quant_ref import quantize_jobs, read_tensors
from sq.quant.algorithms import algorithm_names, config_type, make_algorithm

ALGOS = algorithm_names()
# fewer steps than the defaults, for CI time only; a batch of every sample (4), so 1 and 2 ranks take the
# same steps (2 ranks draw 2 each from their own) instead of comparing roundings tuned on other batches
FAST = {"signround": dict(iters=6, batch_size=4)}
KINDS = {"dense": "llama", "moe": "qwen3_moe"}
GS = 16
SCHEME = "W4A16"


def _calibrated(algo: str) -> bool:
    return make_algorithm(config_type(algo)()).calibrated


def _job(model, out, algo) -> dict:
    return dict(model=str(model), output=str(out), algo=algo, scheme=SCHEME, group_size=GS, nsamples=4, seqlen=16,
                timeout_s=120, **FAST.get(algo, {}))


def _argv(model, out, algo) -> list[str]:
    a = ["sq.ptq", "--model", str(model), "--output", str(out), "--algo", algo, "--scheme", SCHEME,
         "--group-size", str(GS), "--nsamples", "4", "--seqlen", "16", "--timeout", "120"]
    for k, v in FAST.get(algo, {}).items():
        a += [f"--{k.replace('_', '-')}", str(v)]
    return a


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """Uninterrupted runs of every (algorithm, kind) at 2 ranks and at 1 rank (one launch per world size)."""
    root = tmp_path_factory.mktemp("conformance")
    cases = [(a, k) for a in ALGOS for k in KINDS]
    for world in (2, 1):
        jobs = [_job(checkpoints[KINDS[k]], root / f"{a}-{k}-w{world}", a) for a, k in cases]
        errors = run_ranks(quantize_jobs, world, jobs, timeout=900)[0]
        assert errors == [None] * len(jobs), errors
    return root


CASES = [pytest.param(a, k, id=f"{a}-{k}") for a in ALGOS for k in KINDS]


@pytest.mark.parametrize("algo,kind", CASES)
def test_loads_in_transformers(runs, algo, kind):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(runs / f"{algo}-{kind}-w2", output_loading_info=True,
                                                       dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(torch.arange(1, 17)[None]).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("algo,kind", CASES)
def test_one_and_two_ranks_agree(runs, algo, kind):
    one, two = runs / f"{algo}-{kind}-w1", runs / f"{algo}-{kind}-w2"
    if not _calibrated(algo):
        a, b = read_tensors(one), read_tensors(two)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
        return
    e1 = json.loads((one / "sq_report.json").read_text())["layers"]
    e2 = json.loads((two / "sq_report.json").read_text())["layers"]
    assert e1.keys() == e2.keys()
    for name in e1:
        a, b = e1[name]["rel_err"], e2[name]["rel_err"]
        assert abs(a - b) <= 0.25 * max(a, b) + 1e-6, (name, a, b)


@pytest.mark.parametrize("algo,kind", CASES)
def test_killed_and_resumed_bit_identical(runs, checkpoints, algo, kind, tmp_path):
    out = tmp_path / "o"
    argv = _argv(checkpoints[KINDS[kind]], out, algo)
    killed = run_cli(argv, 2, timeout=300, env={"SQ_FAULT": "after-shard-write:1:0"})
    assert killed.returncode != 0 and not (out / "model.safetensors.index.json").exists()
    again = run_cli(argv, 2, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    a, b = read_tensors(out), read_tensors(runs / f"{algo}-{kind}-w2")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


@pytest.mark.parametrize("algo,kind", CASES)
def test_refused_on_every_rank(checkpoints, algo, kind, tmp_path):
    argv = _argv(checkpoints[KINDS[kind]], tmp_path / "o", algo)
    argv[argv.index("--group-size") + 1] = "7"
    res = run_cli(argv, 2, timeout=120, stop_on_failure=False)
    assert res.codes == [2, 2], res.output[-3000:]
    assert "group size 7 does not divide" in res.stderr and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("algo", [a for a in ALGOS if not _calibrated(a)])
def test_data_free_signature_ignores_calibration_settings(checkpoints, algo, tmp_path):
    """Changing a calibration knob an algorithm never reads does not block resuming its run."""
    out = tmp_path / "o"
    argv = _argv(checkpoints["llama"], out, algo)
    assert run_cli(argv, 2, timeout=120, env={"SQ_FAULT": "after-shard-write:0:1"}).returncode != 0
    argv[argv.index("--nsamples") + 1] = "8"
    argv[argv.index("--seqlen") + 1] = "32"
    res = run_cli(argv + ["--seed", "3", "--dataset", "other.txt"], 2, timeout=120)
    assert res.returncode == 0 and "resuming at block 1" in res.output, res.output[-3000:]
