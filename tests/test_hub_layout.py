"""Checkpoints in the Hub's layout where transformers' conversion mapping transposes (Qwen3-VL-MoE).

The Hub's Qwen3-VL-MoE stores ``model.language_model.layers.N.mlp.experts.gate_up_proj`` as ``[E, H, 2I]`` and
``down_proj`` as ``[E, I, H]``; the model's parameters are ``[E, 2I, H]`` / ``[E, H, I]`` and transformers'
conversion mapping reads them through ``Transpose(1, 2, check_dims=True)``.  The zoo writes that layout
(``sq.testing.zoo.hub_transposed_layout``).  References: transformers' own ``from_pretrained`` of the same
folder, and the same seeded model saved by ``save_pretrained`` (the model's own layout).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from ckpt_edit import copy_ckpt, edit_tensors
from harness import run_cli, run_ranks
from quant_ref import read_tensors
from sq.errors import LoadRefused
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton
from sq.synthetic import build_checkpoint
from sq.testing.zoo import build_zoo, hub_transposed_layout, tiny_config

EXPERTS = "model.language_model.layers.{}.mlp.experts.{}"
KEYS = [EXPERTS.format(i, p) for i in (0, 1) for p in ("gate_up_proj", "down_proj")]


def _save_pretrained(path: Path, text: dict | None = None) -> Path:
    """The zoo's qwen3_vl_moe as ``save_pretrained`` writes it (the model's layout): ``build_zoo`` minus its
    Hub step; ``text`` overrides text_config sizes."""
    cfg = tiny_config("qwen3_vl_moe")
    cfg["text_config"] = {**cfg["text_config"], **(text or {})}
    return build_checkpoint(path, "qwen3_vl_moe", cfg, seed=0, dtype=torch.float32, shards=2, image_text=True,
                            tokenizer_vocab_size=512)[0]


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    return build_zoo(tmp_path_factory.mktemp("hub") / "qwen3_vl_moe", "qwen3_vl_moe")


@pytest.fixture(scope="module")
def model_layout(tmp_path_factory) -> Path:
    return _save_pretrained(tmp_path_factory.mktemp("sp") / "qwen3_vl_moe")


def _transformers_state(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.state_dict()


@pytest.mark.parametrize("chunk", [1 << 24, 700, 50, 1])  # whole box; several experts; rows of one expert; 1 element
@pytest.mark.parametrize("direct", [True, False])
def test_transposed_boxes_equal_a_transpose(tmp_path, monkeypatch, chunk, direct):
    """Every box of the model's view (expert slabs, an expert's row range as a dp rank holds it, single
    elements, an fp32 source into bf16) equals the same box of the stored tensor transposed, bit for bit,
    and asks for exactly the stored box's bytes, in pieces of at most ``TRANSPOSE_CHUNK_ELEMENTS``."""
    from contextlib import ExitStack

    from safetensors.torch import save_file

    from sq.load import fill as F
    from sq.load.source import scan_checkpoint

    monkeypatch.setattr(F, "TRANSPOSE_CHUNK_ELEMENTS", chunk)
    stored = torch.randn(5, 24, 40, generator=torch.Generator().manual_seed(0))  # [E, H, 2I]
    save_file({"w": stored}, tmp_path / "model.safetensors")
    src = scan_checkpoint(tmp_path)
    tf = F.Transposed(src.tensors["w"], (1, 2))
    assert tf.shape == (5, 40, 24) and tf.sources((1, 2, 3), (2, 4, 5)) == [("w", (1, 3, 2), (2, 5, 4))]
    view = stored.transpose(1, 2)
    pieces = []
    real = F.ReadFiles.read_box
    monkeypatch.setattr(F.ReadFiles, "read_box", lambda self, info, o, n: pieces.append(n) or real(self, info, o, n))
    for dtype in (torch.float32, torch.bfloat16):
        for off, n in [((0, 0, 0), (5, 40, 24)), ((2, 0, 0), (2, 40, 24)), ((1, 20, 0), (3, 20, 24)),
                       ((4, 39, 23), (1, 1, 1)), ((0, 7, 5), (5, 9, 11))]:
            pieces.clear()
            dest = torch.empty(n, dtype=dtype)
            with ExitStack() as stack:
                nbytes = tf.read_into(F.ReadFiles(src, stack, direct), dest, off, n)
            assert torch.equal(dest, view[tuple(slice(o, o + k) for o, k in zip(off, n))].to(dtype)), (off, n)
            assert nbytes == 4 * n[0] * n[1] * n[2], (off, n)
            assert all(p[0] * p[1] * p[2] <= max(chunk, 1) for p in pieces), pieces


def test_the_zoo_writes_the_hub_layout(hub, model_layout):
    """Only the four expert tensors differ from save_pretrained's layout, each by its dims 1 and 2, and
    transformers loads both folders to the same model."""
    got, ref = read_tensors(hub), read_tensors(model_layout)
    assert set(got) == set(ref)
    assert sorted(k for k in got if not (got[k].shape == ref[k].shape and torch.equal(got[k], ref[k]))) == sorted(KEYS)
    for k in KEYS:
        assert torch.equal(got[k], ref[k].transpose(1, 2))
    assert got[EXPERTS.format(0, "gate_up_proj")].shape == (4, 64, 96)  # [E, H, 2I]
    assert got[EXPERTS.format(0, "down_proj")].shape == (4, 48, 64)  # [E, I, H]
    a, b = _transformers_state(hub), _transformers_state(model_layout)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_plan_reads_the_experts_transposed(hub):
    plan = plan_load(build_skeleton(hub), hub)
    rules = plan.keymap.rules()
    assert {k: rules[k] for k in KEYS} == dict.fromkeys(KEYS, "transposed")
    assert plan.keymap.transposed == dict.fromkeys(KEYS, (1, 2)) and plan.keymap.notes == []
    assert {r for k, r in rules.items() if k not in KEYS} == {"exact"} and plan.carried == []
    piece, = plan.keymap.pieces[EXPERTS.format(0, "gate_up_proj")]
    assert piece.lengths == (4, 96, 64) and piece.offsets == (0, 0, 0)


def _load(rank, world, path, ref_path):
    """Each rank's local shards (ep 1: FSDP2 slabs; ep 2: its experts) against transformers' state dict, and
    every stored box the expert tensors were read through (key, offsets, lengths, preadv)."""
    from safetensors.torch import load_file

    from sq.load import fill as F
    from sq.load.fill import local_box
    from sq.load.loader import load_sharded

    ref = {}
    for f in Path(ref_path).glob("*.safetensors"):
        ref.update(load_file(f))
    boxes = []
    real = F.ReadFiles.read_box

    def read_box(self, info, offsets, lengths):
        buf, direct = real(self, info, offsets, lengths)
        boxes.append((info.key, tuple(offsets), tuple(lengths), direct))
        return buf, direct

    F.ReadFiles.read_box = read_box
    out = {}
    try:
        for ep in (1, 2):
            boxes.clear()
            model = load_sharded(path, ep=ep, dtype=torch.float32)
            bad, experts = [], []
            for n, t in model.named_parameters():
                local, off = local_box(t)
                want = ref[n][tuple(slice(o, o + s) for o, s in zip(off, local.shape))]
                if local.dtype != want.dtype or not torch.equal(local, want):
                    bad.append(n)
                if n.endswith("experts.gate_up_proj"):
                    experts.append((off[0], local.shape[0]))
            out[ep] = dict(bad=bad, experts=sorted(set(experts)), boxes=sorted(boxes),
                           bytes_read=model.sq_plan.reader().bytes_read)
    finally:
        F.ReadFiles.read_box = real
    return out


def test_two_ranks_read_only_their_experts_transposed(hub, tmp_path):
    """At 2 ranks (ep 1 and ep 2) every local shard equals transformers' ``from_pretrained`` of the Hub layout;
    each rank reads each expert tensor once, as the one stored box of its own two experts (``[2r:2r+2, :, :]``,
    one ``preadv``), and asks the files for exactly half the checkpoint."""
    from safetensors.torch import save_file

    from sq.load.source import scan_checkpoint

    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    save_file({k: v.contiguous() for k, v in _transformers_state(hub).items()}, ref_dir / "model.safetensors")
    total = sum(t.nbytes for t in scan_checkpoint(hub).tensors.values())
    res = run_ranks(_load, 2, str(hub), str(ref_dir), timeout=240)
    for ep in (1, 2):
        for rank, r in enumerate(res):
            assert r[ep]["bad"] == [], (ep, rank, r[ep]["bad"])
            assert r[ep]["experts"] == [(2 * rank, 2)], (ep, rank, r[ep]["experts"])
            shapes = {k: (4, 64, 96) if "gate_up" in k else (4, 48, 64) for k in KEYS}
            assert r[ep]["boxes"] == sorted((k, (2 * rank, 0, 0), (2, *shapes[k][1:]), True) for k in KEYS), r[ep]
            assert r[ep]["bytes_read"] == total // 2, (ep, rank, r[ep]["bytes_read"], total)


def test_square_on_the_swapped_dims_reads_as_transformers_does(tmp_path, caplog):
    """moe_intermediate_size 32: gate_up_proj is [E, 64, 64], square on dims 1 and 2, so its orientation
    cannot be proven from shapes.  transformers' ``Transpose(check_dims=True)`` then reads it as stored; so does
    sq (and says so), while ``down_proj`` [E, 32, 64] is still proven transposed.  Every tensor sq fills equals
    transformers' ``from_pretrained`` of the same folder."""
    from sq.load.loader import fill

    path = _save_pretrained(tmp_path / "square", {"moe_intermediate_size": 32})
    assert hub_transposed_layout(path, "qwen3_vl_moe") == sorted(KEYS)
    model = build_skeleton(path, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="sq.load.loader"):
        plan = plan_load(model, path)
    gate_up, down = EXPERTS.format(0, "gate_up_proj"), EXPERTS.format(0, "down_proj")
    assert plan.keymap.rules()[gate_up] == "exact" and plan.keymap.rules()[down] == "transposed"
    assert gate_up not in plan.keymap.transposed
    assert "square on dimensions [1, 2]" in caplog.text and "read as stored" in caplog.text
    fill(model, plan, plan.root_names)
    for names in plan.block_names:
        fill(model, plan, names)
    ref = _transformers_state(path)
    got = model.state_dict()
    assert [k for k in ref if not torch.equal(got[k], ref[k])] == []
    assert not torch.equal(got[gate_up], read_tensors(path)[gate_up].transpose(1, 2))  # not transposed


def test_a_shape_neither_orientation_is_refused_by_name(hub, tmp_path):
    path = copy_ckpt(hub, tmp_path / "c")
    key = EXPERTS.format(1, "down_proj")
    edit_tensors(path, lambda t: {**t, key: t[key][:, :40].contiguous()} if key in t else t)
    with pytest.raises(LoadRefused) as e:
        plan_load(build_skeleton(path), path)
    assert any(f"shape mismatch: checkpoint {key!r} is [4, 40, 64]" in p and "dimensions 1 and 2 swapped" in p
               for p in e.value.problems), e.value.problems


def _ptq(src, out, *extra):
    # its experts are carried (no per-expert layout transformers loads back): said so explicitly
    res = run_cli(["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", "W4A16", "--group-size", "8",
                   "--algo", "rtn", "--allow-unquantized-experts", *extra], 1, timeout=240)
    assert res.returncode == 0, res.output[-4000:]
    return read_tensors(out)


def test_outputs_from_the_hub_layout(hub, model_layout, tmp_path):
    """RTN W4A16 from the Hub layout: model-free equals the model path tensor for tensor, and both equal
    model-free from save_pretrained's layout, except the carried experts, written as each source stores
    them (the Hub's orientation, vLLM's ``is_fused_checkpoint_transposed`` loader reads only that one)."""
    from sq.testing.zoo import check_output

    hub_model = _ptq(hub, tmp_path / "hub-model")
    hub_free = _ptq(hub, tmp_path / "hub-free", "--model-free")
    sp_free = _ptq(model_layout, tmp_path / "sp-free", "--model-free")
    assert set(hub_model) == set(hub_free) == set(sp_free)
    assert [k for k in hub_free if not torch.equal(hub_free[k], hub_model[k])] == []
    assert sorted(k for k in hub_free if not (hub_free[k].shape == sp_free[k].shape
                                              and torch.equal(hub_free[k], sp_free[k]))) == sorted(KEYS)
    source = read_tensors(hub)
    for k in KEYS:
        assert torch.equal(hub_free[k], source[k]) and torch.equal(hub_free[k], sp_free[k].transpose(1, 2))
    assert any(k.endswith(".weight_packed") for k in hub_free)
    check_output(hub, tmp_path / "hub-model")
    check_output(hub, tmp_path / "hub-free")


def test_model_free_refuses_a_transposed_tensor_it_would_split(checkpoints, tmp_path, monkeypatch):
    """A fused expert tensor stored transposed where the model's layout quantizes it per expert (Qwen3-MoE's
    fused ``gate_up_proj`` with a ``Transpose`` converter added to its mapping: no shipped model has both)
    is refused by model-free by name, never split in the stored orientation."""
    import transformers.conversion_mapping as cm
    from transformers.core_model_loading import Transpose, WeightConverter

    from sq.load.layout import checkpoint_layout
    from sq.load.source import scan_checkpoint

    path = copy_ckpt(checkpoints["qwen3_moe_fused"], tmp_path / "c")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    edit_tensors(path, lambda t: {k: (v.transpose(1, 2).contiguous() if k.endswith("experts.gate_up_proj") else v)
                                  for k, v in t.items()})
    cm.get_checkpoint_conversion_mapping("qwen3_moe")  # builds the cache
    mapping = cm._checkpoint_conversion_mapping_cache["qwen3_moe"] + [
        WeightConverter("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj", operations=[Transpose(1, 2, True)])]
    monkeypatch.setitem(cm._checkpoint_conversion_mapping_cache, "qwen3_moe", mapping)
    source = scan_checkpoint(path)
    layout = checkpoint_layout(path, source.tensors)
    assert layout is not None and key in layout.refused and key not in layout.fused
    assert "stored transposed against model" in layout.refused[key] and "quantized per expert" in layout.refused[key]
    assert "model.layers.0.mlp.experts.down_proj" in layout.fused  # stored as the model has it: split as before
