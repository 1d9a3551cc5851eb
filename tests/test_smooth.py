"""``--smooth ALPHA`` (``sq.quant.smooth``): SmoothQuant's migration before the algorithm.

- The first block's ``input_layernorm`` is divided by exactly llm-compressor's ``s`` (computed here from the
  source model's own forward on the calibration windows: the norm output's range, twice the q/k/v columns'
  absmax), and q/k/v's columns carry ``s``: ``norm * W`` is the source's up to the weights' rounding.
- Every norm -> Linears pair of every block is smoothed (gate/up behind ``post_attention_layernorm`` too),
  and the dequantized checkpoint computes what the source does up to quantization.
- 1 and 2 ranks, and a killed then resumed run, write the same bits.
- Refusals: a strength out of (0, 1], with AWQ, with rotations, with --skip-nonfinite.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_cli, run_ranks
from quant_ref import load_any, quantize_jobs, read_tensors
from sq.testing.checkpoints import build_llama
from test_ptq_moe import _same_bits

NS, SEQ, ALPHA = 8, 32, 0.5
JOB = dict(scheme="W8A8", algo="gptq", nsamples=NS, seqlen=SEQ, smooth=ALPHA)


@pytest.fixture(scope="module")
def smoothed(tmp_path_factory):
    root = tmp_path_factory.mktemp("smooth")
    src = build_llama(root / "src")
    jobs = [dict(model=str(src), output=str(root / "w2"), **JOB)]
    assert run_ranks(quantize_jobs, 2, jobs, timeout=300)[0] == [None]
    jobs = [dict(model=str(src), output=str(root / "w1"), **JOB)]
    assert run_ranks(quantize_jobs, 1, jobs, timeout=300)[0] == [None]
    return src, root


def _windows(ckpt):
    from transformers import AutoTokenizer

    from sq.calib.data import calibration_windows, read_corpus, tokenize_corpus

    tok = AutoTokenizer.from_pretrained(ckpt)
    return calibration_windows(tokenize_corpus(tok, read_corpus("builtin:pydoc").text(tok)), NS, SEQ)


def _deq(out: dict, name: str) -> torch.Tensor:
    """A W8A8 Linear's dequantized weight (int8 codes times the per-row scale)."""
    return out[f"{name}.weight"].float() * out[f"{name}.weight_scale"].float()


@torch.no_grad()
def test_the_first_norm_takes_llm_compressors_scales(smoothed):
    src, root = smoothed
    model = load_any(src)
    seen = []
    h = model.model.layers[0].input_layernorm.register_forward_hook(lambda m, a, o: seen.append(o.reshape(-1, o.shape[-1])))
    model(_windows(src))
    h.remove()
    y = torch.cat(seen)
    act = y.amax(0) - y.amin(0)
    attn = model.model.layers[0].self_attn
    w = 2.0 * torch.cat([p.weight.abs() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]).amax(0)
    s = (act.pow(ALPHA) / w.pow(1 - ALPHA)).clamp_min(1e-5)
    srcs, out = read_tensors(src), read_tensors(root / "w1")
    norm = "model.layers.0.input_layernorm.weight"
    torch.testing.assert_close(out[norm], srcs[norm] / s, rtol=1e-5, atol=0)
    assert (s.max() / s.min()) > 1.2 and not torch.allclose(s, torch.ones_like(s))  # channels scaled apart
    for p in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{p}"
        torch.testing.assert_close(_deq(out, name) / s, srcs[f"{name}.weight"], rtol=0.05, atol=2e-3)


def test_every_norm_is_smoothed_and_the_checkpoint_keeps_the_function(smoothed):
    src, root = smoothed
    srcs, out = read_tensors(src), read_tensors(root / "w1")
    norms = [k for k in srcs if k.endswith("layernorm.weight")]
    assert len(norms) == 6 and all(not torch.equal(out[k], srcs[k]) for k in norms)
    ids = _windows(src)[:2]
    with torch.no_grad():
        ref = load_any(src)(ids).logits
        got = load_any(root / "w1")(ids).logits
    rel = (got - ref).norm() / ref.norm()
    assert rel < 0.05, rel


def test_one_and_two_ranks_and_a_resumed_run_write_the_same_bits(smoothed, tmp_path):
    src, root = smoothed
    assert _same_bits(root / "w1", root / "w2") == []
    out = tmp_path / "o"
    argv = ["sq.ptq", "--model", str(src), "--output", str(out), "--algo", "gptq", "--scheme", "W8A8",
            "--nsamples", str(NS), "--seqlen", str(SEQ), "--smooth", str(ALPHA), "--timeout", "120"]
    killed = run_cli(argv, 2, timeout=300, env={"SQ_FAULT": "after-shard-write:1:1"})
    assert killed.returncode != 0 and not (out / "model.safetensors.index.json").exists()
    again = run_cli(argv, 2, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert json.loads((out / "sq_report.json").read_text())["resumed_from_block"] == 1
    assert _same_bits(root / "w2", out) == []


@pytest.mark.parametrize("extra,words", [
    (dict(smooth=1.5), "--smooth must be a migration strength in (0, 1]"),
    (dict(smooth=0.0), "--smooth must be a migration strength in (0, 1]"),
    (dict(smooth=0.5, algo="awq", scheme="W4A16"), "--smooth with --algo awq"),
    (dict(smooth=0.5, rotate=("r1",)), "--smooth with --rotate"),
    (dict(smooth=0.5, skip_nonfinite=True), "--smooth with --skip-nonfinite"),
])
def test_refusals(smoothed, tmp_path, extra, words):
    src, _ = smoothed
    job = {**dict(model=str(src), output=str(tmp_path / "out"), **JOB), **extra}
    res = run_ranks(quantize_jobs, 1, [job], timeout=120)[0]
    assert res[0] is not None and words in res[0], res
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_moe_norms_feed_every_expert_and_the_router(tmp_path):
    """Qwen3-MoE: ``post_attention_layernorm`` feeds every expert's gate/up and the router (scaled, never
    quantized); expert-parallel and FSDP2 ranks write the same bits."""
    from sq.testing.checkpoints import build_qwen3_moe

    src = build_qwen3_moe(tmp_path / "src")
    job = dict(model=str(src), scheme="W8A8", algo="gptq", nsamples=NS, seqlen=SEQ, smooth=ALPHA)
    jobs = [dict(job, output=str(tmp_path / "ep2"), ep=2), dict(job, output=str(tmp_path / "ep1"), ep=1)]
    assert run_ranks(quantize_jobs, 2, jobs, timeout=300)[0] == [None, None]
    assert _same_bits(tmp_path / "ep1", tmp_path / "ep2") == []
    srcs, out = read_tensors(src), read_tensors(tmp_path / "ep2")
    norm = "model.layers.0.post_attention_layernorm.weight"
    assert not torch.equal(out[norm], srcs[norm])
    router = "model.layers.0.mlp.gate.weight"
    s = srcs[norm] / out[norm]  # the scale the norm was divided by
    torch.testing.assert_close(out[router], srcs[router] * s, rtol=1e-5, atol=0)
    for e in (0, 7):  # (transformers 5.24 cannot load W8A8 routed experts: the columns are checked instead)
        for p in ("gate_proj", "up_proj"):
            name = f"model.layers.0.mlp.experts.{e}.{p}"
            torch.testing.assert_close(_deq(out, name) / s, srcs[f"{name}.weight"], rtol=0.05, atol=2e-3)


def test_a_block_without_known_norm_pairs_is_refused_before_anything_is_written(tmp_path):
    from sq.testing.zoo import build_zoo

    src = build_zoo(tmp_path / "gemma3", "gemma3_text")
    job = dict(model=str(src), output=str(tmp_path / "out"), **JOB)
    res = run_ranks(quantize_jobs, 1, [job], timeout=120)[0]
    assert res[0] is not None and "--smooth has no smoothing mappings for Gemma3DecoderLayer" in res[0], res
    assert not any((tmp_path / "out").glob("*.safetensors"))
