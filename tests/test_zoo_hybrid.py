"""Non-persistent buffers recomputed like transformers' loader, per-layer calibration arguments
(hybrid / interleaved models) and the zoo's hybrids end to end through GPTQ at 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import run_cli
from sq.load.loader import _fresh_buffers
from sq.load.meta import build_skeleton
from sq.testing.zoo import build_zoo, check_output, tiny_config

HYBRIDS = ["gemma3_text", "falcon_h1", "qwen3_next", "bamba", "apertus"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {t: build_zoo(root / t, t) for t in HYBRIDS}


def _from_config(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **(tiny_config(model_type) | overrides))
    torch.manual_seed(0)
    return cfg, AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", ["gemma", "gemma3_text", "falcon_h1", "qwen3_next"])
def test_recomputed_buffers_equal_a_normally_built_model(zoo, tmp_path, model_type):
    """embed_scale (Gemma), mup_vector (Falcon-H1), rotary tables: what a CPU ``from_config`` holds,
    same dtype; the meta skeleton is left as it was (buffers on meta, no init flags)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = zoo.get(model_type) or build_zoo(tmp_path / model_type, model_type)
    model = build_skeleton(src, dtype=torch.float32)
    values, problems = _fresh_buffers(model)
    assert problems == []
    expected = dict(model.named_buffers())
    assert set(values) == {n for n in expected if n.rpartition(".")[2] in
                           model.get_submodule(n.rpartition(".")[0])._non_persistent_buffers_set}
    assert all(b.device.type == "meta" for b in model.buffers())
    assert not any(hasattr(t, "_is_hf_initialized") for t in [*model.parameters(), *model.buffers()])
    ref = dict(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32).named_buffers())
    for name, v in values.items():
        assert v.dtype == ref[name].dtype and torch.equal(v, ref[name]), name
    if model_type.startswith("gemma"):
        assert "model.embed_tokens.embed_scale" in values
    if model_type == "falcon_h1":
        assert any(n.endswith("mamba.mup_vector") for n in values)


@pytest.mark.parametrize("model_type,overrides", [
    # sliding and global layers: other masks and another rotary table (window 8 < 24 tokens)
    ("gemma3_text", {"num_hidden_layers": 4, "sliding_window": 8,
                     "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("gemma4_text", {}),  # each layer its own per-layer input (a positional argument)
    ("bamba", {}),        # mamba and attention layers: other masks; layers return (hidden, weights)
    ("falcon_h1", {}),    # layers return a tuple the loop indexes
    ("qwen3_next", {}),
])
def test_block_chain_equals_the_model_forward(model_type, overrides):
    """Block by block on the captured inputs gives the model's own last hidden state: every block
    got the arguments the model's loop gives it, not block 0's."""
    from sq.anatomy import decoder_blocks
    from sq.quant.forward import block_forward, capture_block0

    cfg, model = _from_config(model_type, **overrides)
    ids = torch.randint(0, 400, (3, 24), generator=torch.Generator().manual_seed(0))
    inputs = capture_block0(model, ids, "cpu")
    blocks = decoder_blocks(model)
    for _, block in blocks:
        outs = block_forward(block, inputs, len(inputs), inputs[0])
        inputs = [(y, kw) for y, (_, kw) in zip(outs, inputs)]
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    inner = model.get_submodule(blocks[0][0].rsplit(".", 2)[0])
    norm = getattr(inner, "norm", None) or getattr(inner, "final_layernorm")
    torch.testing.assert_close(norm(inputs[0][0]), ref[-1], rtol=0, atol=1e-5)
    if overrides.get("layer_types"):
        assert inputs[0][1].per_block, "the global layers' arguments differ from block 0's"


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_gptq_two_ranks_output_checks(zoo, tmp_path, model_type):
    out = tmp_path / "out"
    r = run_cli(["sq.ptq", "--model", str(zoo[model_type]), "--output", str(out), "--scheme", "W4A16",
                 "--group-size", "16", "--algo", "gptq", "--nsamples", "4", "--seqlen", "32"], 2, timeout=240)
    assert r.returncode == 0, r.output[-4000:]
    summary = check_output(zoo[model_type], out)
    assert summary["quantized"] > 0


@pytest.mark.parametrize("model_type,routers", [("qwen3_next", {"gate", "shared_expert_gate"}), ("bamba", set()),
                                                ("gemma3", set()), ("nemotron_h", {"gate"})])
def test_convolutions_and_vectors_are_not_experts(model_type, routers):
    """A linear-attention / SSM conv1d kernel [C, 1, K] and SigLIP's probe [1, 1, H] are 3-D but not experts:
    neither carried as 'experts' nor turning a sibling Linear with C (or 1) rows into a 'router'."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from sq import anatomy
    from sq.testing.zoo import ZOO, tiny_config

    auto = AutoModelForImageTextToText if ZOO[model_type].family == "vlm" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(AutoConfig.for_model(model_type, **tiny_config(model_type)))
    assert {n.rsplit(".", 1)[-1] for n in anatomy.routers(model)} == routers
    carried = anatomy.carried_experts(model)
    assert all("experts" in name.rsplit(".", 1)[-1] for name, _ in carried), carried
