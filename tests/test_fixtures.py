"""The tiny checkpoint fixtures: layout on disk, tokenizer, and transformers round trip."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sq.files import INDEX_NAME
from sq.testing.checkpoints import (
    FIXTURES,
    load_with_transformers,
    mtp_keys,
    read_index,
    read_tensors,
    verify_checkpoint,
)

PER_EXPERT = re.compile(r"\.experts\.\d+\.")


def _file_keys(path: Path) -> dict[str, set[str]]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out[f.name] = set(h.keys())
    return out


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_is_a_complete_sharded_checkpoint(checkpoints, name):
    path = checkpoints[name]
    index = read_index(path)
    files = _file_keys(path)
    assert len(files) >= 3, f"{name}: only {sorted(files)}"
    assert set(index.values()) == set(files), "index must name exactly the shard files present"
    for fname, keys in files.items():
        assert {k for k, f in index.items() if f == fname} == keys, fname
    assert (path / "config.json").is_file() and (path / "generation_config.json").is_file()


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_tokenizer_matches_vocab(checkpoints, name):
    from transformers import AutoConfig, AutoTokenizer

    path = checkpoints[name]
    tok = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    assert len(tok) == vocab
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<s>", 0, "</s>", 1)
    ids = tok("def f(x): return x", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "def f(x): return x"


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_transformers_loads_what_was_saved(checkpoints, name):
    verify_checkpoint(checkpoints[name])


def test_norm_weights_are_not_trivial(checkpoints):
    for name in FIXTURES:
        tensors = read_tensors(checkpoints[name])
        norms = [k for k in tensors if k.endswith("norm.weight")]
        assert norms, name
        for key in norms:
            t = tensors[key].float()
            assert t.std() > 0.01 and not torch.all(t == 1), f"{name}: {key} is constant"


def test_per_expert_layout_on_disk(qwen3_moe_ckpt):
    keys = set(read_index(qwen3_moe_ckpt))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.1.mlp.experts.7.{proj}.weight" in keys
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)


def test_fused_layout_on_disk(qwen3_moe_fused_ckpt, qwen3_moe_ckpt):
    keys = set(read_index(qwen3_moe_fused_ckpt))
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    assert "model.layers.1.mlp.experts.down_proj" in keys
    assert not any(PER_EXPERT.search(k) for k in keys)
    fused = read_tensors(qwen3_moe_fused_ckpt)
    split = read_tensors(qwen3_moe_ckpt)
    gate_up = fused["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    assert gate_up.shape == (8, 96, 64)
    # same seed -> same weights: expert 3's gate rows come first, then its up rows
    e3 = torch.cat([split[f"model.layers.1.mlp.experts.3.{p}.weight"] for p in ("gate_proj", "up_proj")])
    assert torch.equal(gate_up[3], e3)


def test_mixtral_original_layout_on_disk(mixtral_ckpt):
    keys = set(read_index(mixtral_ckpt))
    for w in ("w1", "w2", "w3"):
        assert f"model.layers.0.block_sparse_moe.experts.3.{w}.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert not any(".mlp." in k for k in keys)


def test_deepseek_mtp_layer_in_its_own_shard(deepseek_v3_ckpt):
    from transformers import AutoConfig

    n = AutoConfig.from_pretrained(deepseek_v3_ckpt).num_hidden_layers
    index = read_index(deepseek_v3_ckpt)
    mtp = mtp_keys(index, n)
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "self_attn.q_a_proj.weight", "mlp.gate.weight"):  # fmt: skip
        assert f"model.layers.{n}.{suffix}" in mtp
    mtp_files = {index[k] for k in mtp}
    assert len(mtp_files) == 1
    (mtp_file,) = mtp_files
    assert mtp_file == sorted(set(index.values()))[-1]
    assert _file_keys(deepseek_v3_ckpt)[mtp_file] == set(mtp)
    assert load_file(deepseek_v3_ckpt / mtp_file)[f"model.layers.{n}.shared_head.norm.weight"].shape == (64,)
    total = json.loads((deepseek_v3_ckpt / INDEX_NAME).read_text())["metadata"]["total_size"]
    assert total == sum(t.numel() * t.element_size() for t in read_tensors(deepseek_v3_ckpt).values())
    # MLA, shared experts and a dense first layer, as in the real model
    assert "model.layers.0.mlp.gate_proj.weight" in index
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in index
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in index
    model_keys = set(load_with_transformers(deepseek_v3_ckpt).state_dict())
    assert not any(k.startswith(f"model.layers.{n}.") for k in model_keys)


def test_vlm_prefix_differs_from_model(vlm_ckpt):
    disk = set(read_index(vlm_ckpt))
    model = load_with_transformers(vlm_ckpt)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    mem = set(model.state_dict())
    assert "model.layers.0.mlp.down_proj.weight" in disk
    assert "model.language_model.layers.0.mlp.down_proj.weight" in mem
    assert any(k.startswith("visual.") for k in disk) and any(k.startswith("model.visual.") for k in mem)
    assert not (disk & mem) - {"lm_head.weight"}
    # every disk key names a model key by a suffix (what the loader's suffix rule relies on)
    for key in disk:
        assert any(m.endswith("." + key.removeprefix("model.")) or m == key for m in mem), key


def test_fixtures_are_deterministic(tmp_path):
    a = read_tensors(FIXTURES["qwen3_moe"](tmp_path / "a", seed=3))
    b = read_tensors(FIXTURES["qwen3_moe"](tmp_path / "b", seed=3))
    c = read_tensors(FIXTURES["qwen3_moe"](tmp_path / "c", seed=4))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[q], c[q])


def test_size_overrides_and_dtype(tmp_path):
    path = FIXTURES["llama"](tmp_path / "l", num_hidden_layers=2, vocab_size=300, dtype=torch.bfloat16)
    tensors = read_tensors(path)
    assert tensors["model.embed_tokens.weight"].shape == (300, 64)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert not any(k.startswith("model.layers.2.") for k in tensors)
    verify_checkpoint(path)


def _rename_on_disk(path: Path, old: str, new: str) -> None:
    index_path = path / INDEX_NAME
    index = json.loads(index_path.read_text())
    fname = index["weight_map"].pop(old)
    index["weight_map"][new] = fname
    tensors = load_file(path / fname)
    tensors[new] = tensors.pop(old)
    save_file(tensors, str(path / fname), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def _loading_bug(monkeypatch, mutate) -> None:
    """Make the transformers load inside verify_checkpoint go wrong the way ``mutate`` says."""
    import sq.testing.checkpoints as ckpts

    real = ckpts.load_with_transformers

    def buggy(path, dtype="auto"):
        model = real(path, dtype)
        with torch.no_grad():
            mutate(model.state_dict())
        return model

    monkeypatch.setattr(ckpts, "load_with_transformers", buggy)


def test_verify_names_a_wrong_value(llama_ckpt, monkeypatch):
    key = "model.layers.1.post_attention_layernorm.weight"
    _loading_bug(monkeypatch, lambda sd: sd[key].add_(1e-3))
    with pytest.raises(AssertionError, match=re.escape(key) + " differs"):
        verify_checkpoint(llama_ckpt)


def test_verify_catches_swapped_experts(qwen3_moe_ckpt, monkeypatch):
    def swap(sd):
        t = sd["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, H]
        t[[2, 5]] = t[[5, 2]].clone()

    _loading_bug(monkeypatch, swap)
    with pytest.raises(AssertionError, match=r"layers\.0\.mlp\.experts\.gate_up_proj differs"):
        verify_checkpoint(qwen3_moe_ckpt)


def test_verify_names_unmapped_keys(llama_ckpt, tmp_path):
    bad = Path(shutil.copytree(llama_ckpt, tmp_path / "bad"))
    _rename_on_disk(bad, "model.layers.1.post_attention_layernorm.weight", "model.layers.1.post_attn_norm.weight")
    with pytest.raises(AssertionError) as info:
        verify_checkpoint(bad)
    assert "model.layers.1.post_attn_norm.weight has no unique model slot" in str(info.value)
    assert "model.layers.1.post_attention_layernorm.weight is not in the checkpoint" in str(info.value)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_model_runs_forward(checkpoints, name):
    model = load_with_transformers(checkpoints[name], torch.float32).eval()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(2, vocab - 8, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 16, vocab) and torch.isfinite(logits).all()
