"""The key-mapping table: which rule maps which checkpoint key, per fixture architecture, and the traps."""

from __future__ import annotations

import pytest
import torch

from ckpt_edit import copy_ckpt, edit_tensors
from sq.load.keymap import build_keymap
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton
from sq.load.source import scan_checkpoint


def keymap_of(path):
    model = build_skeleton(path, dtype=torch.float32)
    return model, build_keymap(model, scan_checkpoint(path).tensors)


# fixture -> (a checkpoint key, the rule expected to map it, the model tensor it fills)
TABLE = [
    ("llama", "model.layers.0.self_attn.q_proj.weight", "exact", "model.layers.0.self_attn.q_proj.weight"),
    ("llama", "model.embed_tokens.weight", "exact", "model.embed_tokens.weight"),
    ("qwen3_moe", "model.layers.0.mlp.experts.3.up_proj.weight", "conversion", "model.layers.0.mlp.experts.gate_up_proj"),
    ("qwen3_moe", "model.layers.1.mlp.experts.7.down_proj.weight", "conversion", "model.layers.1.mlp.experts.down_proj"),
    ("qwen3_moe", "model.layers.0.mlp.gate.weight", "exact", "model.layers.0.mlp.gate.weight"),
    ("qwen3_moe_fused", "model.layers.0.mlp.experts.gate_up_proj", "exact", "model.layers.0.mlp.experts.gate_up_proj"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.1.w3.weight", "conversion",
     "model.layers.0.mlp.experts.gate_up_proj"),
    ("mixtral", "model.layers.0.block_sparse_moe.gate.weight", "conversion", "model.layers.0.mlp.gate.weight"),
    ("deepseek_v3", "model.layers.1.mlp.experts.0.gate_proj.weight", "conversion",
     "model.layers.1.mlp.experts.gate_up_proj"),
    ("deepseek_v3", "model.layers.1.mlp.shared_experts.up_proj.weight", "exact",
     "model.layers.1.mlp.shared_experts.up_proj.weight"),
    ("deepseek_v3", "model.layers.1.mlp.gate.e_score_correction_bias", "exact",
     "model.layers.1.mlp.gate.e_score_correction_bias"),
]


@pytest.mark.parametrize("arch,key,rule,target", TABLE)
def test_rule_table(checkpoints, arch, key, rule, target):
    _, km = keymap_of(checkpoints[arch])
    assert km.rules()[key] == rule
    assert any(p.ckpt_key == key for p in km.pieces[target])


def test_per_expert_boxes_follow_the_index_in_the_key(checkpoints):
    _, km = keymap_of(checkpoints["qwen3_moe"])
    boxes = {p.ckpt_key: p for p in km.pieces["model.layers.0.mlp.experts.gate_up_proj"]}
    gate, up = boxes["model.layers.0.mlp.experts.5.gate_proj.weight"], boxes["model.layers.0.mlp.experts.5.up_proj.weight"]
    inter = gate.lengths[1]
    assert gate.offsets == (5, 0, 0) and up.offsets == (5, inter, 0) and gate.stack_dim == 0


def test_mtp_keys_are_carried_never_mapped(checkpoints):
    path = checkpoints["deepseek_v3"]
    model, km = keymap_of(path)
    n = model.config.num_hidden_layers
    mtp = sorted(k for k in scan_checkpoint(path).tensors if k.startswith(f"model.layers.{n}."))
    assert f"model.layers.{n}.shared_head.norm.weight" in mtp
    assert sorted(km.carried) == mtp
    assert [p.ckpt_key for p in km.pieces["model.norm.weight"]] == ["model.norm.weight"]
    plan = plan_load(model, path)  # and the whole plan accepts it
    assert sorted(plan.carried) == mtp


def test_vlm_prefix(checkpoints):
    path = checkpoints["vlm"]
    model, km = keymap_of(path)
    ckpt = scan_checkpoint(path).tensors
    lm_keys = [k for k in ckpt if ".layers.0.mlp.down_proj" in k and "visual" not in k]
    assert lm_keys and not any(k in dict(model.named_parameters()) for k in lm_keys)
    assert not km.carried and not km.problems


def test_suffix_rule_for_an_unknown_prefix(checkpoints, tmp_path):
    """No conversion rule knows ``language_model.``: the longest unique suffix maps every key."""
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    edit_tensors(path, lambda t: {f"language_model.{k}": v for k, v in t.items()})
    model, km = keymap_of(path)
    assert set(km.rules().values()) == {"suffix"} and not km.carried and not km.problems
    assert km.pieces["model.layers.1.mlp.up_proj.weight"][0].ckpt_key == "language_model.model.layers.1.mlp.up_proj.weight"


def test_suffix_rule_ambiguous_and_digit_guard(checkpoints, tmp_path):
    """``layers.9.mlp...`` may not drop a layer index; a suffix several model keys share stays unmapped."""
    path = copy_ckpt(checkpoints["llama"], tmp_path / "c")
    extra = {"model.layers.9.post_attention_layernorm.weight", "mlp.up_proj.weight", "extra.norm.weight"}

    def add(t):
        if "model.norm.weight" in t:
            t = dict(t)
            for k in extra:
                t[k] = t["model.norm.weight"].clone()
        return t

    edit_tensors(path, add)
    _, km = keymap_of(path)
    assert {"model.layers.9.post_attention_layernorm.weight", "mlp.up_proj.weight"} <= set(km.carried)
    # "extra.norm.weight" -> suffix "norm.weight" is unique (model.norm.weight) but already exactly filled
    assert "extra.norm.weight" in km.carried
    assert [p.ckpt_key for p in km.pieces["model.norm.weight"]] == ["model.norm.weight"]


def test_overlap_check_finds_every_overlapping_pair_and_nothing_else():
    """The sweep in ``_check_pieces`` against the all-pairs definition, on stacked experts with gaps,
    a duplicated expert, a box straddling two experts and split rows."""
    import itertools
    import random

    from sq.load.keymap import KeyMap, Piece, _check_pieces
    from sq.load.source import TensorInfo

    target, shape = "experts.gate_up_proj", (64, 8, 4)
    pieces = [Piece(f"e{e}.{h}", target, (e, 4 * h, 0), (1, 4, 4), stack_dim=0) for e in range(64) for h in (0, 1)]
    pieces += [Piece("dup", target, (17, 0, 0), (1, 4, 4), stack_dim=0),  # = e17.0
               Piece("straddle", target, (40, 2, 0), (2, 4, 4)),  # e40.0, e40.1, e41.0, e41.1
               Piece("tail", target, (63, 6, 2), (1, 2, 2))]  # e63.1
    random.Random(0).shuffle(pieces)
    tensors = {p.ckpt_key: TensorInfo(p.ckpt_key, "f.safetensors", torch.float32, tuple(p.lengths), (0, 0)) for p in pieces}
    km = KeyMap(pieces={target: pieces})
    _check_pieces(km, {target: shape}, tensors)
    found = {frozenset(m.split("'")[1::2][:2]) for m in km.problems if "both fill the same part" in m}
    expected = {frozenset((a.ckpt_key, b.ckpt_key)) for a, b in itertools.combinations(pieces, 2)
                if all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths))}
    assert found == expected and len(expected) == 6, (found, expected)
