"""Routed experts are quantized or the run is refused: never a "W4A16" output with its experts in bf16.

- up/down-only experts (Nemotron-H: ``down(act(up x))``) quantize on the model path, at ``--ep 1`` and
  ``--ep 2`` with the same bits;
- experts beside zero-compute slots (LongCat-Flash) quantize model-free, every stored slot included;
- experts sq cannot quantize (GraniteMoE: no per-expert layout transformers loads back) are refused by name on
  every rank before anything is written, on the model path and model-free, unless
  ``--allow-unquantized-experts`` (then ``sq_report.json`` and the summary name them);
- ``check_output`` fails on an output with full-precision routed experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import run_cli
from sq.testing.zoo import build_zoo, check_output, read_safetensors_dir, routed_expert_weights

GPTQ = ["--scheme", "W4A16", "--algo", "gptq", "--group-size", "8", "--nsamples", "4", "--seqlen", "32"]
RTN_MODEL_FREE = ["--scheme", "W4A16", "--algo", "rtn", "--group-size", "8", "--model-free"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    return root, {t: build_zoo(root / t, t) for t in ("nemotron_h", "longcat_flash", "granitemoe")}


def _ptq(src: Path, out: Path, args: list[str], nproc: int, **kw):
    return run_cli(["sq.ptq", "--model", str(src), "--output", str(out), *args], nproc, timeout=240, **kw)


def test_up_down_experts_quantized_same_bits_at_ep1_and_ep2(zoo):
    root, src = zoo
    outs = {}
    for ep in (1, 2):
        out = root / f"nemotron-ep{ep}"
        res = _ptq(src["nemotron_h"], out, [*GPTQ, "--ep", str(ep)], 2)
        assert res.returncode == 0, res.output[-3000:]
        summary = check_output(src["nemotron_h"], out)  # fails on any bf16 expert
        assert summary["quantized"] == 18, summary  # 10 Linears + 4 experts x (up, down)
        outs[ep] = read_safetensors_dir(out)
    expert_keys = [k for k in outs[1] if ".experts." in k]
    assert len(expert_keys) == 4 * 2 * 3 and all(k.rsplit(".", 1)[1].startswith("weight_") for k in expert_keys)
    assert outs[1].keys() == outs[2].keys()
    for k in outs[1]:  # the experts' calibration, Hessians and solve under EP are those of FSDP2
        assert outs[1][k].equal(outs[2][k]), k


def test_zero_compute_slots_quantized_model_free(zoo):
    root, src = zoo
    out = root / "longcat-mf"
    res = _ptq(src["longcat_flash"], out, RTN_MODEL_FREE, 1)
    assert res.returncode == 0, res.output[-3000:]
    check_output(src["longcat_flash"], out)
    tensors = read_safetensors_dir(out)
    # the routed experts' 4 down_proj and all 6 stored gate/up slots (2 zero-compute: loaded, never computed)
    packed = {k for k in tensors if ".experts." in k and k.endswith(".weight_packed")}
    assert len({k for k in packed if k.startswith("model.layers.0.")}) == 4 + 6 * 2, sorted(packed)
    assert json.loads((out / "sq_report.json").read_text())["unquantized_experts"] == []


@pytest.mark.parametrize("mode", ["gptq", "model-free"])
def test_carried_experts_refused_unless_allowed(zoo, mode):
    root, src = zoo
    args, nproc = (GPTQ, 2) if mode == "gptq" else (RTN_MODEL_FREE, 1)
    out = root / f"granite-{mode}"
    res = _ptq(src["granitemoe"], out, args, nproc, stop_on_failure=False)
    assert res.returncode != 0 and all(c == 2 for c in res.codes), res.output[-3000:]
    assert "Traceback" not in res.output and res.stderr.count("sq: error:") == 1, res.stderr[-3000:]
    assert "routed experts sq cannot quantize" in res.stderr and "block_sparse_moe" in res.stderr, res.stderr
    assert "--allow-unquantized-experts" in res.stderr
    assert not out.exists()

    res = _ptq(src["granitemoe"], out, [*args, "--allow-unquantized-experts"], nproc)
    assert res.returncode == 0, res.output[-3000:]
    report = json.loads((out / "sq_report.json").read_text())
    carried = report["unquantized_experts"]
    assert [c["module"] for c in carried] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] or \
        len(carried) == 2, carried
    assert all("per-expert" in c["reason"] for c in carried), carried
    assert "UNQUANTIZED routed experts (--allow-unquantized-experts): 2 module(s)" in res.stderr, res.stderr[-3000:]
    # the output check refuses it unless told the experts are carried on purpose
    assert routed_expert_weights(read_safetensors_dir(out))
    with pytest.raises(AssertionError, match="routed expert weight"):
        check_output(src["granitemoe"], out, carried_experts=False)
    check_output(src["granitemoe"], out)  # the zoo entry names why granitemoe's experts are carried


@pytest.fixture(scope="module")
def dbrx(tmp_path_factory) -> Path:
    """A tiny DBRX: its experts are 2-D ``[E * I, H]`` parameters (``w1`` / ``v1`` / ``w2``) of one
    ``DbrxExpertGLU`` module per block, beside a ``router.layer`` Linear with E outputs."""
    import torch

    from sq.synthetic import build_checkpoint

    cfg = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=528, tie_word_embeddings=False,
               attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
               ffn_config=dict(moe_num_experts=4, ffn_hidden_size=48, moe_top_k=2))
    return build_checkpoint(tmp_path_factory.mktemp("dbrx") / "src", "dbrx", cfg, seed=0, dtype=torch.float32,
                            shards=2, tokenizer_vocab_size=512)[0]


@pytest.mark.parametrize("mode", ["gptq", "model-free"])
def test_experts_in_2d_parameters_of_their_own_refused_by_name(dbrx, tmp_path, mode):
    """DBRX quantized its attention (and its router) and wrote its experts in bf16 with exit 0; now refused
    on every rank, on both paths, naming the module and its parameters, nothing written."""
    args, nproc = (GPTQ, 2) if mode == "gptq" else (RTN_MODEL_FREE, 1)
    out = tmp_path / "out"
    res = _ptq(dbrx, out, args, nproc, stop_on_failure=False)
    assert res.returncode != 0 and all(c == 2 for c in res.codes), res.output[-3000:]
    assert "Traceback" not in res.output, res.output[-3000:]
    assert "routed experts sq cannot quantize: transformer.blocks.0.ffn.experts.mlp and 1 more" in res.stderr, \
        res.stderr[-3000:]
    assert "DbrxExpertGLU keeps its experts in 2-D parameters" in res.stderr
    assert not out.exists()
