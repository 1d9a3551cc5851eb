"""Model-free quantization (``sq.ptq --model-free``, ``sq.modelfree``): no model is built, and the
output equals the model path's RTN output tensor for tensor, config included, at 1 and 2 ranks,
and with dense Linears row-split over 2 ranks.

The model path's outputs (one rank: its 1 vs 2 rank identity is ``test_ptq_moe``'s) and the
model-free runs each go through one set of forked ranks (``run_ranks``); the CLI's own behaviour
(automatic fallback, refusals, kill and resume, a failed write) through ``run_cli``.
``SQ_MODELFREE_SPLIT_BYTES=1`` (tests only) row-splits every dense Linear group, which the
fixtures are far too small to need.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ckpt_edit import copy_ckpt, edit_config, edit_tensors
from harness import run_cli, run_ranks
from quant_ref import quantize_jobs
from test_ptq_moe import _same_bits

GS = 16
# (fixture, scheme): a dense model, per-expert and fused MoEs, an FP8 block-scaled DeepSeek-V3 (+ MTP)
CASES = [("llama", "W4A16"), ("qwen3_moe", "FP8_BLOCK"), ("qwen3_moe_fused", "NVFP4A16"), ("mixtral_fused", "W4A16"),
         ("deepseek_v3_fp8", "W4A16"), ("deepseek_v3_fp8", "NVFP4A16"), ("deepseek_v3", "recipe")]
# mixed precision: experts FP8_BLOCK, attention NVFP4A16 but o_proj left out, the rest W4A16
RECIPE = """default: W4A16
rules:
  - {match: 'experts', scheme: FP8_BLOCK}
  - {match: 'o_proj', scheme: null}
  - {match: 'self_attn', scheme: NVFP4A16}
"""
POINTS = ["after-shard-write:0:1", "manifest-replace:0", "mid-shard-write:1", "index-merge:0"]
# row-split: every dense Linear group's rows over both ranks; "llama_wide" has Linears of 128-384 rows, so
# FP8_BLOCK's 128-row blocks are cut between ranks (the other fixtures' < 128 rows all land on one rank)
SPLIT = {"SQ_MODELFREE_SPLIT_BYTES": "1"}
SPLIT_CASES = [*CASES, ("llama_wide", "FP8_BLOCK")]


def modelfree_jobs(rank, world, jobs) -> list[str | None]:
    """``run_ranks`` target: ``sq.modelfree.quantize_checkpoint`` for each job; None or the SqError."""
    from sq.errors import SqError
    from sq.modelfree import quantize_checkpoint
    from sq.config import PTQConfig

    out = []
    for job in jobs:
        try:
            quantize_checkpoint(PTQConfig.build(**job))
            out.append(None)
        except SqError as e:
            out.append(str(e))
    return out


def modelfree_split_jobs(rank, world, jobs) -> list[str | None]:
    """``modelfree_jobs`` with every dense Linear group row-split over the ranks."""
    os.environ.update(SPLIT)
    try:
        return modelfree_jobs(rank, world, jobs)
    finally:
        for k in SPLIT:
            os.environ.pop(k)


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
    """The model path's RTN outputs (1 rank) and the model-free ones at 1 and 2 ranks, and at 2 ranks
    with every dense Linear group row-split."""
    import torch

    from sq.testing.checkpoints import build_llama

    root = tmp_path_factory.mktemp("modelfree")
    ckpts = {a: checkpoints[a] for a, _ in CASES}
    ckpts["llama_wide"] = build_llama(root / "llama_wide", dtype=torch.bfloat16, hidden_size=256,
                                      intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
    out = {(a, s, k): root / f"{a}-{s}-{k}" for a, s in SPLIT_CASES for k in ("model", "mf1", "mf2", "split2")}
    assert run_ranks(quantize_jobs, 1, [_job(ckpts[a], out[a, s, "model"], s) for a, s in SPLIT_CASES],
                     timeout=300)[0] == [None] * len(SPLIT_CASES)
    for world in (1, 2):
        jobs = [_job(ckpts[a], out[a, s, f"mf{world}"], s) for a, s in CASES]
        assert run_ranks(modelfree_jobs, world, jobs, timeout=300)[0] == [None] * len(CASES)
    jobs = [_job(ckpts[a], out[a, s, "split2"], s) for a, s in SPLIT_CASES]
    assert run_ranks(modelfree_split_jobs, 2, jobs, timeout=300)[0] == [None] * len(SPLIT_CASES)
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


@pytest.mark.parametrize("arch,scheme", SPLIT_CASES)
def test_row_split_linears_equal_the_model_path(runs, arch, scheme):
    """Rows of every dense Linear group read and quantized on both ranks (NVFP4's global scale and
    FP8_BLOCK's block absmax all-reduced, q/k/v and gate/up sharing one global scale across the
    ranks), gathered to one writer: the same tensors as the model path's."""
    out = runs[arch, scheme, "split2"]
    _same(out, runs[arch, scheme, "model"])
    sig = json.loads((out / "sq_report.json").read_text())["run_signature"]
    assert sig["row_split"] and all(".layers." in name for name in sig["row_split"])


def test_work_is_split_by_bytes_and_rows_only_where_it_balances():
    from sq.modelfree.plan import TensorSlot, Unit, row_ranges, split_by_bytes
    from sq.quant.recipe import make_assigner

    fp8, w4 = (make_assigner(s, 128, [], None).assign("m.layers.0.mlp.down_proj") for s in ("FP8_BLOCK", "W4A16"))

    def dense(n):
        return Unit(0, [TensorSlot("m.layers.0.mlp.down_proj.weight", "m.layers.0.mlp.down_proj.")], w4, "d", n)

    def expert(n):
        return Unit(0, [TensorSlot("m.layers.0.mlp.experts.0.down_proj.weight", "p.")], w4, "e", n)

    kept = Unit(0, [TensorSlot("m.layers.0.input_layernorm.weight", None)], None, "k", 100)
    # many small units: whole units balance, nothing is split
    assert split_by_bytes([dense(10)] * 20, 4) == ([0, 1, 2, 3] * 5, [])
    # one Linear dominates: its rows are spread, the rest balance around it
    assert split_by_bytes([dense(100), dense(10), dense(10)], 2) == ([0, 0, 1], [0])
    # only dense Linears are split: experts go whole (by index), copied tensors too
    assert split_by_bytes([expert(100), dense(10), dense(10)], 2)[1] == []
    assert split_by_bytes([kept, dense(10), dense(10)], 2)[1] == []
    # a split that would not lower the busiest rank is not made
    assert split_by_bytes([expert(100), expert(100), expert(100), dense(1)], 2)[1] == []
    # one rank: nothing to balance; split_at (tests) forces splits, owners take turns
    assert split_by_bytes([dense(100), dense(10)], 1) == ([0, 0], [])
    assert split_by_bytes([dense(100), dense(10), kept], 2, split_at=1) == ([0, 1, 0], [0, 1])
    # rows cut at FP8_BLOCK's 128-row blocks; per-group scales anywhere on a row
    assert row_ranges(300, fp8, 2) == [(0, 128), (128, 300)]
    assert row_ranges(300, fp8, 4) == [(0, 0), (0, 128), (128, 256), (256, 300)]
    assert row_ranges(7, w4, 3) == [(0, 2), (2, 4), (4, 7)]


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


def test_row_split_killed_resumes_bit_identical(checkpoints, runs, tmp_path):
    """Killed after a layer's file and before its manifest entry, and halfway through a file, with
    row-split Linears (a resumed run row-splits only the layers it has left): bit-identical."""
    out = tmp_path / "o"
    args = ["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(out), "--algo", "rtn", "--scheme",
            "W4A16", "--group-size", str(GS), "--timeout", "60", "--model-free"]
    restarts = []
    for fault in ["after-shard-write:0:1", "mid-shard-write:1:2", None]:
        res = run_cli(args, 2, timeout=120, env={**SPLIT, "SQ_FAULT": fault} if fault else SPLIT)
        restarts += [int(x) for x in re.findall(r"resuming at block (\d+) of 3", res.output)[:1]]
        assert (res.returncode == 0) == (fault is None), res.output[-3000:]
    assert restarts == [1, 2], restarts
    _same(out, runs["llama", "W4A16", "model"])


def test_a_failed_write_in_the_writer_thread_is_raised_and_resumes(checkpoints, runs, tmp_path):
    """Layers are written by a background thread: its error (the disk full halfway through layer 1's
    file) is the run's error, named as the model path names it, nothing after it is written or
    recorded, no temporary file is left, and the same command resumes at that layer."""
    out = tmp_path / "o"
    args = ["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(out), "--algo", "rtn", "--group-size",
            str(GS), "--timeout", "60", "--model-free"]
    res = run_cli(args, 2, timeout=120, env={"SQ_FAULT": "enospc:1:1"})
    assert res.returncode != 0
    assert re.search(r"sq: error: no space left on the device while writing .*model-rank00001-block00001"
                     r"\.safetensors", res.stderr), res.stderr[-3000:]
    assert not list(out.glob(".model-rank00001-*.tmp"))  # (rank 0 is killed when rank 1 fails: anywhere)
    assert not list(out.glob("model-rank00001-block0000[12].safetensors"))
    manifest = json.loads((out / ".sq-run" / "rank-00001" / "manifest.json").read_text())
    assert [e["block"] for e in manifest["blocks"]] == [0]
    res = run_cli(args, 2, timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    assert "resuming at block 1 of 3" in res.output
    _same(out, runs["llama", "W4A16", "model"])


def test_nonfinite_row_split_linear_is_refused_on_every_rank_or_kept(checkpoints, tmp_path):
    """NaN/Inf in a row-split Linear: the all-reduced flag refuses it on every rank at once, naming
    it; with --skip-nonfinite it is gathered whole, as it is, and listed in ignore -- the same output
    as one rank quantizing whole tensors."""
    src = copy_ckpt(checkpoints["llama"], tmp_path / "nan")
    key = "model.layers.1.mlp.down_proj.weight"

    def poison(t):
        if key in t:
            w = t[key].clone()
            w[3, 5], w[60, 1] = float("nan"), float("inf")  # rows of rank 0 and of rank 1
            t = {**t, key: w}
        return t

    edit_tensors(src, poison)
    args = ["sq.ptq", "--model", str(src), "--algo", "rtn", "--group-size", str(GS), "--timeout", "60",
            "--model-free"]
    res = run_cli([*args, "--output", str(tmp_path / "o1")], 2, timeout=120, env=SPLIT, stop_on_failure=False)
    assert res.codes == [2, 2], res.output[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"sq: error: {key} holds NaN or Inf")]
    assert len(lines) == 1 and "--skip-nonfinite" in lines[0], res.stderr[-3000:]  # rank 0 speaks for all
    res = run_cli([*args, "--output", str(tmp_path / "o2"), "--skip-nonfinite"], 2, timeout=120, env=SPLIT)
    assert res.returncode == 0, res.output[-3000:]
    res = run_cli([*args, "--output", str(tmp_path / "o3"), "--skip-nonfinite"], 1, timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    _same(tmp_path / "o2", tmp_path / "o3")
    assert "model.layers.1.mlp.down_proj" in _qc(tmp_path / "o2")["ignore"]


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
    assert len(lines) == 1, res.stderr[-2000:]  # at 2 ranks too: rank 0 speaks for all
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
    # transformers knows llama: the model has no slot for it, so it is carried as it is (as the model path does)
    res = run_cli([*args, "--output", str(tmp_path / "o0")], 1, timeout=120)
    assert res.returncode == 0, res.output[-3000:]
    assert "model.layers.0.mlp.lookup.weight" in json.loads(
        (tmp_path / "o0" / "model.safetensors.index.json").read_text())["weight_map"]
    # an architecture transformers does not know: names and shapes only, so it is named instead of guessed
    edit_config(src, model_type="llama_next", architectures=["LlamaNextForCausalLM"])
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


# ----------------------------------------------------------------------------- layouts from the meta model
# zoo checkpoints (sq.testing.zoo) whose layout names alone cannot tell: fused 3-D experts stored
# [E, H, 2I] (llama4_text: transformers loads them per expert only; gpt_oss: carried fused), linear-attention
# and conv tensors beside attention (qwen3_next), small gates and routers that are nn.Linear (qwen2_moe),
# a router statistic renamed by the conversion mapping (ernie4_5_moe)
# nemotron_h: up/down-only experts quantized per expert; kimi_linear: tensors the checkpoint splits over keys and
# sq leaves unquantized (q/k/v conv weights) must be written whole under the model's name, as the model path does;
# llama4_text / gpt_oss carry their experts, with --allow-unquantized-experts only
ZOO_CASES = {"llama4_text": (1,), "gpt_oss": (1,), "qwen3_next": (1, 2), "qwen2_moe": (1, 2), "ernie4_5_moe": (1,),
             "nemotron_h": (2,), "kimi_linear": (1,)}


def _cli(src, out, nproc, *extra):
    return run_cli(["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", "W4A16", "--group-size",
                    str(GS), "--algo", "rtn", "--model-free", "--timeout", "60", *extra], nproc, timeout=180)


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory):
    from sq.testing.zoo import build_zoo

    root = tmp_path_factory.mktemp("mfzoo")
    runs = {}
    for t, worlds in ZOO_CASES.items():
        src = build_zoo(root / t, t)
        allow = ["--allow-unquantized-experts"] if t in ("llama4_text", "gpt_oss") else []
        for w in worlds:
            runs[t, w] = (src, root / f"{t}-out{w}", _cli(src, root / f"{t}-out{w}", w, *allow))
    return runs


@pytest.mark.parametrize("arch,world", [(t, w) for t, ws in ZOO_CASES.items() for w in ws])
def test_zoo_layouts_from_the_meta_model_load_back(zoo_runs, arch, world):
    """Every quantized name is a source tensor of the source shape, transformers loads the output with
    no missing or unexpected keys, the logits are the dequantized source's, no router is quantized."""
    from sq.testing.zoo import check_output, read_safetensors_dir

    src, out, res = zoo_runs[arch, world]
    assert res.returncode == 0, res.output[-3000:]
    summary = check_output(src, out)
    assert summary["quantized"] > 0
    written = read_safetensors_dir(out)
    qc = _qc(out)
    if arch == "nemotron_h":  # up/down-only experts quantized per expert, under the checkpoint's names
        assert {f"backbone.layers.1.mixer.experts.{e}.{p}.weight_packed" for e in range(4)
                for p in ("up_proj", "down_proj")} <= set(written)
        assert not any(k.endswith("experts.up_proj") or k.endswith("experts.down_proj") for k in written)
    if arch in ("llama4_text", "gpt_oss"):  # attention quantized, experts carried unquantized
        assert any("self_attn.q_proj.weight_packed" in k for k in written)
        assert not any("experts" in k and k.endswith("weight_packed") for k in written)
        assert "carried unquantized" in res.output and "--allow-unquantized-experts" in res.output
        assert json.loads((out / "sq_report.json").read_text())["unquantized_experts"]
    if arch == "gpt_oss":  # no per-expert layout transformers loads back: kept fused, as stored
        assert written["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 256)
    if arch == "llama4_text":  # transformers loads Llama4's experts per expert: [out, in] of the stored [in, out]
        source = read_safetensors_dir(src)
        gate_up = source["model.layers.0.feed_forward.experts.gate_up_proj"]
        assert written["model.layers.0.feed_forward.experts.1.up_proj.weight"].equal(gate_up[1][:, 128:].T)
        assert "model.layers.0.feed_forward.experts.1.up_proj" in qc["ignore"]
    if arch == "qwen2_moe":  # routers and the shared expert's [1, H] gate carried, listed in ignore
        assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"} <= set(qc["ignore"])
        assert "model.layers.0.mlp.shared_expert_gate.weight" in written
        assert "model.layers.0.mlp.experts.0.gate_proj.weight_packed" in written
    if arch == "qwen3_next":  # the linear-attention projections quantized, conv / A_log / dt_bias carried
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight_packed" in written
        assert {"model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.A_log"} <= set(written)
    if arch == "ernie4_5_moe":
        assert "model.layers.1.mlp.moe_statics.e_score_correction_bias" in written


def test_unknown_model_type_with_a_3d_tensor_is_refused_by_name(checkpoints, tmp_path):
    """Without the model, a fused 3-D tensor's orientation cannot be proven: refused, never guessed."""
    src = copy_ckpt(checkpoints["qwen3_moe_fused"], tmp_path / "next")
    edit_config(src, model_type="qwen3_moe_next", architectures=["Qwen3MoeNextForCausalLM"])
    out = tmp_path / "o"
    res = _cli(src, out, 1)
    assert res.returncode != 0 and res.codes == [2], (res.codes, res.output[-3000:])
    assert re.search(r"sq: error: model\.layers\.0\.mlp\.experts\.gate_up_proj \[\d+, \d+, \d+\]: a 3-D tensor.*"
                     r"--ignore 'model\\\.layers\\\.0\\\.mlp\\\.experts\\\.gate_up_proj'", res.stderr), res.stderr
    assert "experts.down_proj" in res.stderr
    assert not out.exists() or not any(out.iterdir())
