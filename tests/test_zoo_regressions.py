"""Zoo families in configurations the zoo's own entry does not have, each once broken inside sq's set-up.

Each variant is the zoo type's tiny config with a few ordinary changes (bf16 weights beside the float32
routers, norms and state parameters transformers keeps, a per-layer head size), quantized with GPTQ W4A16
at 2 ranks and proven by ``check_output`` (loads in transformers with no missing / unexpected keys, the
dequantized source's logits; bf16 sources within bf16's rounding of the reference).  Every tensor the
output carries keeps its stored dtype.  Also: models transformers cannot load quantized (their
``_init_weights`` reads a quantized Linear's ``.weight``) are refused by name on every rank, nothing
written; decoder stacks not called ``layers`` are found.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from harness import run_cli
from sq.synthetic import build_checkpoint
from sq.testing.zoo import check_output, float32_state, hub_transposed_layout, read_safetensors_dir, tiny_config

# (id, model_type, overrides, dtype, float32 leaves rewritten into the shards, --ep): each failed before its fix
VARIANTS = [
    # float32 router / e_score_correction_bias in a bf16 MoE block: "Cannot concatenate overlapping meshes"
    ("ernie-bf16-ep2", "ernie4_5_moe", {"num_hidden_layers": 3}, torch.bfloat16, (), 2),
    ("dsv4-bf16-ep1", "deepseek_v4", {}, torch.bfloat16, (), 1),
    ("afmoe-bf16-ep2", "afmoe", {"num_hidden_layers": 3}, torch.bfloat16, (), 2),
    # float32 state parameters beside bf16 weights: "FSDP expects uniform original parameter dtype"
    ("kimi-fp32-state", "kimi_linear", {}, torch.bfloat16, ("A_log", "dt_bias"), 2),
    # full-attention layers with their own head size: AmbiguousGlobalPerLayerAttributeError on head_dim
    ("gemma4-global-head", "gemma4_text", {"global_head_dim": 32}, torch.float32, (), 1),
    # no shared experts: zero-width shared-expert Linears (a raw reshape / unpad RuntimeError on both paths)
    ("dsv3-no-shared-experts", "deepseek_v3", {"n_shared_experts": 0}, torch.float32, (), 2),
]


def _gptq(src: Path, out: Path, ep: int) -> list[str]:
    return ["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", "W4A16", "--algo", "gptq",
            "--group-size", "8", "--nsamples", "4", "--seqlen", "32"] + (["--ep", str(ep)] if ep > 1 else [])


@pytest.mark.parametrize("vid,model_type,overrides,dtype,fp32,ep", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_variant_quantizes(vid, model_type, overrides, dtype, fp32, ep, tmp_path):
    src = build_checkpoint(tmp_path / "src", model_type, tiny_config(model_type) | overrides, seed=0, dtype=dtype,
                           shards=2, tokenizer_vocab_size=512)[0]
    hub_transposed_layout(src, model_type)
    if fp32:
        assert float32_state(src, fp32)
    out = tmp_path / "out"
    res = run_cli(_gptq(src, out, ep), 2, timeout=240)
    assert res.returncode == 0, res.output[-4000:]
    source, written = read_safetensors_dir(src), read_safetensors_dir(out)
    changed = {k: (source[k].dtype, written[k].dtype) for k in source
               if k in written and written[k].dtype != source[k].dtype}
    # carried tensors keep their stored dtype where the model has it too (transformers' float32 routers / norms
    # in a bf16 model); a float32 tensor the model builds in bf16 (Kimi-Linear's A_log) is written in bf16
    assert set(changed) == {k for k in changed if k.rsplit(".", 1)[-1] in fp32}, changed
    assert {source[k].dtype for k in source} >= ({torch.float32, torch.bfloat16} if dtype == torch.bfloat16 else set())
    # a bf16 source's reference weights round to bf16 where the output's do not: bf16's error on the logits
    check_output(src, out, atol=2e-3 if dtype == torch.bfloat16 else 1e-4)
    shutil.rmtree(out)
    if vid == "dsv3-no-shared-experts":  # model-free too
        res = run_cli(["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", "W4A16", "--algo", "rtn",
                       "--group-size", "8", "--model-free"], 2, timeout=240)
        assert res.returncode == 0, res.output[-4000:]
        check_output(src, out)


_STACKS = {
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=128, vocab_size=528,
                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=1),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_inner=128, vocab_size=528, n_positions=1024,
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=1024, vocab_size=528,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                 ffn_config={"hidden_size": 64, "ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2}),
}


@pytest.mark.parametrize("model_type,stack", [("falcon", "transformer.h"), ("gpt_bigcode", "transformer.h"),
                                              ("dbrx", "transformer.blocks")])
def test_decoder_stack_found_by_structure(model_type, stack):
    from transformers import AutoConfig, AutoModelForCausalLM

    from sq.anatomy import decoder_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **_STACKS[model_type]))
    assert [n for n, _ in decoder_blocks(model)] == [f"{stack}.0", f"{stack}.1"]


@pytest.mark.parametrize("model_type,words", [("falcon", "transformer.h.0.self_attention.query_key_value"),
                                              ("gpt_bigcode", "transformer.h.0.attn.c_proj")])
def test_unloadable_quantized_layout_refused_by_name(model_type, words, tmp_path):
    """On the model path and model-free alike (model-free wrote such outputs with exit 0)."""
    src = build_checkpoint(tmp_path / "src", model_type, _STACKS[model_type], seed=0, dtype=torch.float32, shards=1,
                           tokenizer_vocab_size=512)[0]
    for mode, argv in (("gptq", _gptq(src, tmp_path / "out", 1)),
                       ("model-free", ["sq.ptq", "--model", str(src), "--output", str(tmp_path / "out-mf"),
                                       "--scheme", "W4A16", "--algo", "rtn", "--group-size", "16", "--model-free"])):
        out = Path(argv[argv.index("--output") + 1])
        res = run_cli(argv, 2, timeout=240, stop_on_failure=False)
        assert all(c == 2 for c in res.codes), (mode, res.output[-3000:])
        assert "Traceback" not in res.output and res.stderr.count("sq: error:") == 1, (mode, res.stderr[-3000:])
        # (the model path names the first block's first Linear; model-free its Linears in key order: the
        # --ignore names every leaf either way)
        assert (words if mode == "gptq" else words.rpartition(".")[2]) in res.stderr, (mode, res.stderr)
        assert "transformers cannot load a quantized checkpoint" in res.stderr, (mode, res.stderr)
        assert not out.exists() or not any(out.iterdir()), mode
