"""Every refusal: decided before anything is materialized, with a message naming what is wrong."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn as nn

from ckpt_edit import copy_ckpt, edit_config, edit_index, edit_tensors
from harness import run_ranks
from sq.errors import LoadRefused
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton


def refusal(path, **kw) -> str:
    """Build the skeleton and plan; return the refusal text after checking nothing left meta."""
    model = None
    with pytest.raises(LoadRefused) as e:
        model = build_skeleton(path, dtype=torch.float32, **kw)
        plan_load(model, path, **kw)
    if model is not None:
        assert all(p.device.type == "meta" for p in model.parameters()), "refusal after mutation"
        assert all(b.device.type == "meta" for b in model.buffers())
    return str(e.value)


def test_missing_expert_key_is_named_not_stacked(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["qwen3_moe"], tmp_path / "c")
    gone = "model.layers.1.mlp.experts.5.gate_proj.weight"
    edit_tensors(path, lambda t: {k: v for k, v in t.items() if k != gone})
    msg = refusal(path)
    assert gone in msg and "expert 5" in msg and "model.layers.1.mlp.experts.gate_up_proj" in msg


def test_missing_mixtral_expert_key(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["mixtral"], tmp_path / "c")
    gone = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    edit_tensors(path, lambda t: {k: v for k, v in t.items() if k != gone})
    assert gone in refusal(path)


def test_shape_mismatch_names_both_shapes(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    edit_config(path, vocab_size=cfg["vocab_size"] + 64)
    msg = refusal(path)
    assert "shape mismatch" in msg and "model.embed_tokens.weight" in msg
    assert str(cfg["vocab_size"] + 64) in msg and str(cfg["vocab_size"]) in msg


def test_unfilled_parameter(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    gone = "model.layers.1.post_attention_layernorm.weight"
    edit_tensors(path, lambda t: {k: v for k, v in t.items() if k != gone})
    assert re.search(rf"parameter '{re.escape(gone)}' .* has no checkpoint key", refusal(path))


def test_persistent_buffer_without_key(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["deepseek_v3"], tmp_path / "c")
    edit_tensors(path, lambda t: {k: v for k, v in t.items() if "e_score_correction_bias" not in k})
    msg = refusal(path)
    assert "persistent buffer" in msg and "e_score_correction_bias" in msg


def test_unresolved_key_scheme_low_coverage(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    edit_tensors(path, lambda t: {f"backbone.0.{k.replace('model.', 'trunk.')}": v for k, v in t.items()})
    assert "key scheme is not understood" in refusal(path)


def test_every_problem_listed_at_once(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    gone = ["model.layers.0.input_layernorm.weight", "model.norm.weight"]
    edit_tensors(path, lambda t: {k: v for k, v in t.items() if k not in gone})
    (path / "extra.safetensors").write_bytes(sorted(path.glob("model-*.safetensors"))[0].read_bytes())
    msg = refusal(path)
    assert all(g in msg for g in gone) and "extra.safetensors" in msg


def test_root_module_holding_parameters(checkpoints):
    path = checkpoints["llama"]
    model = build_skeleton(path, dtype=torch.float32)
    model.register_parameter("stray", nn.Parameter(torch.empty(3, device="meta")))
    with pytest.raises(LoadRefused, match="holds parameters directly .*stray"):
        plan_load(model, path)


def test_pickle_only_checkpoint(checkpoints, tmp_path):
    path = tmp_path / "c"
    path.mkdir()
    (path / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    assert "only pickle checkpoints (pytorch_model.bin)" in refusal(path)


def test_remote_code_needs_the_flag(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    edit_config(path, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    assert "--trust-remote-code" in refusal(path)


def test_index_names_missing_file(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    edit_index(path, lambda wm: {**wm, "model.norm.weight": "model-99999-of-99999.safetensors"})
    msg = refusal(path)
    assert "model-99999-of-99999.safetensors" in msg and "missing" in msg


def test_index_path_outside_folder(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    (tmp_path / "evil.safetensors").write_bytes(b"")
    edit_index(path, lambda wm: {**wm, "model.norm.weight": "../evil.safetensors"})
    assert "outside the checkpoint folder" in refusal(path)


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_bad_safetensors_header(checkpoints, tmp_path, damage):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    victim = sorted(path.glob("*.safetensors"))[1]
    data = victim.read_bytes()
    if damage == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.write_bytes(data[:8] + b"{\x00garbage" + data[17:])
    msg = refusal(path)
    assert victim.name in msg and damage in msg


def test_stray_safetensors_not_in_index(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    first = sorted(path.glob("model-*.safetensors"))[0]
    (path / "consolidated.safetensors").write_bytes(first.read_bytes())
    assert "consolidated.safetensors" in refusal(path)


def test_already_quantized_config(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    edit_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    msg = refusal(path)
    assert "already" in msg and "fp8" in msg.lower()


def test_already_quantized_tensors(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    edit_tensors(path, lambda t: {k: (v.to(torch.int8) if k.endswith("q_proj.weight") else v) for k, v in t.items()})
    assert "int/fp8 data" in refusal(path)


def _load_bad_shape(rank, world, path):
    from sq.load.loader import load_sharded

    try:
        load_sharded(path, dtype=torch.float32)
    except LoadRefused as e:
        return str(e)
    return None


def test_shape_refusal_identical_on_every_rank(checkpoints, tmp_path):
    path = copy_ckpt(checkpoints["qwen3_moe"], tmp_path / "c")
    edit_tensors(path, lambda t: {k: (v[:-1] if k == "model.layers.1.mlp.experts.3.up_proj.weight" else v)
                                  for k, v in t.items()})
    msgs = run_ranks(_load_bad_shape, 2, str(path), timeout=120)
    assert msgs[0] is not None and msgs[0] == msgs[1]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in msgs[0]


def test_tensor_both_filled_and_carried(checkpoints, monkeypatch):
    """The exporter would write a carried-over key next to its quantized twin: refused by name."""
    import sq.load.loader as loader
    from sq.load.keymap import build_keymap

    def doctored(model, tensors):
        km = build_keymap(model, tensors)
        km.carried.append("model.norm.weight")
        return km

    monkeypatch.setattr(loader, "build_keymap", doctored)
    path = checkpoints["llama"]
    model = build_skeleton(path, dtype=torch.float32)
    with pytest.raises(LoadRefused, match=r"both filled and carried over: \['model.norm.weight'\]"):
        plan_load(model, path)
    assert all(p.device.type == "meta" for p in model.parameters())
