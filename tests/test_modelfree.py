"""Model-free quantization (``sq.ptq --model-free``, ``sq.modelfree``): no model is built, and the
output equals the model path's RTN output tensor for tensor, config included, at 1 and 2 ranks.

The model path's outputs (one rank: its 1 vs 2 rank identity is ``test_ptq_moe``'s) and the
model-free runs each go through one set of forked ranks (``run_ranks``); the CLI's own behaviour
(automatic fallback, refusals, kill and resume) through ``run_cli``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckpt_edit import copy_ckpt, edit_config, edit_tensors
from harness import run_cli, run_ranks
from quant_ref import quantize_jobs
from test_ptq_moe import _same_bits

GS = 16
# (fixture, scheme): a dense model, per-expert and fused MoEs, an FP8 block-scaled DeepSeek-V3 (+ MTP)
CASES = [("llama", "W4A16"), ("qwen3_moe", "FP8_BLOCK"), ("qwen3_moe_fused", "NVFP4A16"),
         ("deepseek_v3_fp8", "W4A16"), ("deepseek_v3_fp8", "NVFP4A16"), ("deepseek_v3", "recipe")]
# mixed precision: experts FP8_BLOCK, attention NVFP4A16 but o_proj left out, the rest W4A16
RECIPE = """default: W4A16
rules:
  - {match: 'experts', scheme: FP8_BLOCK}
  - {match: 'o_proj', scheme: null}
  - {match: 'self_attn', scheme: NVFP4A16}
"""
POINTS = ["after-shard-write:0:1", "manifest-replace:0", "mid-shard-write:1", "index-merge:0"]


def modelfree_jobs(rank, world, jobs) -> list[str | None]:
    """``run_ranks`` target: ``sq.modelfree.quantize_checkpoint`` for each job; None or the SqError."""
    from sq.errors import SqError
    from sq.modelfree import quantize_checkpoint
    from sq.quant.blockwise import PTQConfig

    out = []
    for job in jobs:
        try:
            quantize_checkpoint(PTQConfig.build(**job))
            out.append(None)
        except SqError as e:
            out.append(str(e))
    return out


def _job(ckpt, out, scheme) -> dict:
    if scheme == "recipe":
        recipe = Path(out).parent / "recipe.yaml"
        recipe.write_text(RECIPE)
        return dict(model=str(ckpt), output=str(out), recipe=str(recipe), algo="rtn", group_size=GS, timeout_s=60)
    return dict(model=str(ckpt), output=str(out), scheme=scheme, algo="rtn", group_size=GS, timeout_s=60)


def _qc(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def _same(a: Path, b: Path) -> None:
    assert _same_bits(a, b) == []
    assert _qc(a) == _qc(b)
    ia, ib = (json.loads((p / "model.safetensors.index.json").read_text()) for p in (a, b))
    assert set(ia["weight_map"]) == set(ib["weight_map"]) and ia["metadata"] == ib["metadata"]


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    """The model path's RTN outputs (1 rank) and the model-free ones at 1 and 2 ranks."""
    root = tmp_path_factory.mktemp("modelfree")
    out = {(a, s, k): root / f"{a}-{s}-{k}" for a, s in CASES for k in ("model", "mf1", "mf2")}
    assert run_ranks(quantize_jobs, 1, [_job(checkpoints[a], out[a, s, "model"], s) for a, s in CASES],
                     timeout=300)[0] == [None] * len(CASES)
    for world in (1, 2):
        jobs = [_job(checkpoints[a], out[a, s, f"mf{world}"], s) for a, s in CASES]
        assert run_ranks(modelfree_jobs, world, jobs, timeout=300)[0] == [None] * len(CASES)
    return out


@pytest.mark.parametrize("arch,scheme", CASES)
def test_model_free_equals_model_path_at_1_and_2_ranks(runs, arch, scheme):
    for world in (1, 2):
        _same(runs[arch, scheme, f"mf{world}"], runs[arch, scheme, "model"])
    report = json.loads((runs[arch, scheme, "mf2"] / "sq_report.json").read_text())
    assert report["mode"] == "model-free" and report["world_size"] == 2
    # every rank wrote its own files
    writers = {m[1] for p in runs[arch, scheme, "mf2"].iterdir() if (m := re.match(r"model-rank(\d+)-block", p.name))}
    assert writers == {"00000", "00001"}


def test_unknown_model_type_is_quantized_without_a_model(checkpoints, runs, tmp_path):
    src = copy_ckpt(checkpoints["llama"], tmp_path / "next")
    edit_config(src, model_type="llama_next", architectures=["LlamaNextForCausalLM"])
    out = tmp_path / "o"
    res = run_cli(["sq.ptq", "--model", str(src), "--output", str(out), "--algo", "rtn", "--group-size", str(GS),
                   "--timeout", "60"], 2, timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    assert "quantizing it model-free" in res.output
    _same(out, runs["llama", "W4A16", "model"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama_next"
    # the same job with calibration (--algo gptq) still takes the model path, which names the problem
    res = run_cli(["sq.ptq", "--model", str(src), "--output", str(tmp_path / "o2"), "--algo", "gptq"], 1, timeout=120)
    assert res.returncode != 0 and "llama_next" in res.stderr and "does not know" in res.stderr


def test_killed_anywhere_resumes_bit_identical(checkpoints, runs, tmp_path):
    ckpt, out = checkpoints["qwen3_moe"], tmp_path / "o"
    args = ["sq.ptq", "--model", str(ckpt), "--output", str(out), "--algo", "rtn", "--scheme", "FP8_BLOCK",
            "--group-size", str(GS), "--timeout", "60", "--model-free"]
    n = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    restarts = []
    for fault in [*POINTS, None]:
        res = run_cli(args, 2, timeout=120, env={"SQ_FAULT": fault} if fault else {})
        restarts += [int(x) for x in re.findall(rf"resuming at block (\d+) of {n}", res.output)[:1]]
        if fault is None:
            assert res.returncode == 0, res.output[-3000:]
        else:
            assert res.returncode != 0 and f"fault injection: SIGKILL at {fault.split(':')[0]}" in res.output
    assert restarts and restarts == sorted(restarts) and restarts[-1] == n, restarts
    _same(out, runs["qwen3_moe", "FP8_BLOCK", "model"])
    assert not (out / ".sq-run").exists()
    res = run_cli(args, 2, timeout=120)  # finished: nothing to do
    assert res.returncode == 0 and "already complete" in res.output


@pytest.mark.parametrize("extra,needle", [
    (["--algo", "gptq"], "--algo gptq needs it"),
    (["--algo", "rtn", "--scheme", "NVFP4"], "static activation scales"),
    (["--algo", "rtn", "--kv-cache", "fp8"], "--kv-cache fp8 needs it"),
])
def test_calibrated_jobs_are_refused_model_free(checkpoints, tmp_path, extra, needle):
    res = run_cli(["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(tmp_path / "o"), "--model-free",
                   *extra], 2 if extra[1] == "gptq" else 1, timeout=120)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.startswith("sq: error:") and needle in line]
    assert len(lines) == (2 if extra[1] == "gptq" else 1), res.stderr[-2000:]
    assert "model-free" in lines[0]
    assert not (tmp_path / "o").exists()


def test_unclassified_tensors_are_named_with_the_flag_to_override(checkpoints, tmp_path):
    import torch

    src = copy_ckpt(checkpoints["llama"], tmp_path / "odd")

    def add(t):
        if "model.layers.0.input_layernorm.weight" in t:
            t["model.layers.0.mlp.lookup.weight"] = torch.zeros(8, 64)
        return t

    edit_tensors(src, add)
    args = ["sq.ptq", "--model", str(src), "--algo", "rtn", "--group-size", str(GS), "--model-free"]
    res = run_cli([*args, "--output", str(tmp_path / "o")], 1, timeout=120)
    assert res.returncode != 0
    assert re.search(r"sq: error: model\.layers\.0\.mlp\.lookup\.weight \[8, 64\].*--ignore", res.stderr), res.stderr
    res = run_cli([*args, "--output", str(tmp_path / "o2"), "--ignore", r"model\.layers\.0\.mlp\.lookup"], 1,
                  timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    from safetensors import safe_open

    index = json.loads((tmp_path / "o2" / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tmp_path / "o2" / index["model.layers.0.mlp.lookup.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.lookup.weight").shape == (8, 64)
