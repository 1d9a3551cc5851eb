"""MXFP4 sources (gpt-oss as OpenAI ships it): dequantization, sharded reads, PTQ, refusals, model-free.

The fixture (``sq.testing.mxfp4.build_gpt_oss_mxfp4``) is the zoo's tiny ``gpt_oss`` with its experts
rounded to MXFP4: ``mxfp4`` holds bf16 tensors and the experts' blocks / scales, ``reference`` the exact
value of each (bf16 values, stored in float32).  References:
transformers' own ``convert_moe_packed_tensors`` (random blocks, every box) and transformers loading
the MXFP4 fixture with ``Mxfp4Config(dequantize=True)`` (the fixture's packer and its layout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckpt_edit import copy_ckpt, edit_config, edit_tensors, load_refusal
from harness import run_cli, run_ranks
from quant_ref import read_tensors
from sq.load import mxfp4
from sq.load.loader import plan_load
from sq.load.meta import build_skeleton
from sq.testing.mxfp4 import build_gpt_oss_mxfp4, dequantize_mxfp4, quantize_mxfp4

EXPERTS = "model.layers.{}.mlp.experts.{}"


@pytest.fixture(scope="module")
def fixture(tmp_path_factory) -> tuple[Path, Path]:
    return build_gpt_oss_mxfp4(tmp_path_factory.mktemp("gpt-oss"))


def _random_pair(e=3, r=40, g=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, r, g, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (e, r, g), generator=gen, dtype=torch.uint8)
    scales[0, 0] = torch.tensor([0, 1, 255], dtype=torch.uint8)[:g]  # the smallest and largest scale bytes
    return blocks, scales


def _box(dest_dtype, blocks, scales, offsets, lengths):
    dest = torch.empty(lengths, dtype=dest_dtype)

    def read_b(e, ne, r, nr, g0, g1):
        return blocks[e:e + ne, r:r + nr, g0:g1]

    def read_s(e, ne, r, nr, g0, g1):
        return scales[e:e + ne, r:r + nr, g0:g1]

    nbytes = mxfp4.dequantize_box_into(dest, read_b, read_s, offsets, lengths)
    return dest, nbytes


# ----------------------------------------------------------------------------- the maths


@pytest.mark.parametrize("chunk", [1 << 22, 96, 40])  # whole box; several experts per step; row steps in one expert
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_boxes_equal_transformers_dequantization(chunk, dtype, monkeypatch):
    """Every box (odd expert slabs, input columns starting and ending inside a block, single rows) equals
    the same slice of transformers' whole-tensor dequantization, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    monkeypatch.setattr(mxfp4, "CHUNK_ELEMENTS", chunk)
    blocks, scales = _random_pair()
    ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)  # [E, G * 32, R]
    assert tuple(ref.shape) == (3, 96, 40)
    boxes = [((0, 0, 0), (3, 96, 40)), ((1, 0, 0), (1, 96, 40)), ((1, 0, 0), (2, 96, 40)),
             ((0, 5, 3), (3, 70, 17)), ((2, 33, 39), (1, 1, 1)), ((0, 31, 0), (2, 2, 40)), ((1, 64, 20), (2, 32, 20))]
    for off, n in boxes:
        got, nbytes = _box(dtype, blocks, scales, off, n)
        want = ref[tuple(slice(o, o + k) for o, k in zip(off, n))]
        assert torch.equal(got, want), (off, n)
        g = -(-(off[1] + n[1]) // 32) - off[1] // 32
        assert nbytes == n[0] * n[2] * g * 17, (off, n)  # only the blocks the box touches, and their scales


def test_every_scale_byte_as_transformers():
    """All 256 E8M0 bytes against every code: the smallest scale (subnormal products) and 255 (the format's
    NaN byte; transformers overflows values of 1 or more to inf) come out exactly as transformers' do."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16).contiguous()
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16).contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        got, _ = _box(dtype, blocks, scales, (0, 0, 0), (1, 512, 256))
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(got, want) and not got.isnan().any(), dtype
        assert got.isinf().any()


def test_fixture_packer_round_trips_and_is_what_transformers_reads(fixture):
    """The fixture's own packer (written from the format) against transformers, and the fixture against
    transformers' MXFP4 load: the dequantized source is the reference exactly."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(2, 5, 64) * torch.logspace(-3, 2, 5).reshape(1, 5, 1)
    b, s = quantize_mxfp4(w)
    assert b.shape == (2, 5, 2, 16) and s.shape == (2, 5, 2)
    assert torch.equal(convert_moe_packed_tensors(b, s, dtype=torch.float32).transpose(1, 2), dequantize_mxfp4(b, s))
    b2, s2 = quantize_mxfp4(dequantize_mxfp4(b, s))  # rounded values are MXFP4 values: a fixed point
    assert torch.equal(dequantize_mxfp4(b2, s2), dequantize_mxfp4(b, s))

    mx_dir, ref_dir = fixture
    model = AutoModelForCausalLM.from_pretrained(mx_dir, quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.bfloat16)
    ref = read_tensors(ref_dir)
    got = model.state_dict()
    assert set(got) == set(ref)
    assert [k for k in ref if not torch.equal(got[k], ref[k].to(torch.bfloat16))] == []
    assert all(torch.equal(v.to(torch.bfloat16).float(), v) for v in ref.values())  # bf16 values
    assert ref[EXPERTS.format(0, "gate_up_proj")].shape == (4, 64, 256)


# ----------------------------------------------------------------------------- the plan and sharded reads


def test_plan_maps_each_pair_onto_the_model_parameter(fixture):
    mx_dir, ref_dir = fixture
    plan = plan_load(build_skeleton(mx_dir), mx_dir)
    assert plan.mxfp4 is not None and plan.fp8 is None and plan.dtype == torch.bfloat16
    assert sorted(plan.mxfp4.pairs) == sorted(EXPERTS.format(i, p) for i in (0, 1) for p in ("gate_up_proj",
                                                                                             "down_proj"))
    rules = plan.keymap.rules()
    assert rules[EXPERTS.format(1, "down_proj")] == "exact"
    assert not plan.mxfp4.packed_keys & set(rules) and plan.carried == []
    pair = plan.mxfp4.pairs[EXPERTS.format(0, "gate_up_proj")]
    assert pair.blocks.shape == (4, 256, 2, 16) and pair.scales.shape == (4, 256, 2) and pair.shape == (4, 64, 256)


def test_an_mxfp4_tensor_with_no_slot_is_carried_dequantized(fixture, tmp_path):
    """A pair beyond the model's layers (as an MTP layer would be) is carried under its dequantized name."""
    path = copy_ckpt(fixture[0], tmp_path / "c")
    src, extra = EXPERTS.format(1, "down_proj"), EXPERTS.format(2, "down_proj")
    edit_tensors(path, lambda t: {**t, **{extra + sfx: t[src + sfx].clone()
                                          for sfx in ("_blocks", "_scales") if src + sfx in t}})
    plan = plan_load(build_skeleton(path), path)
    assert plan.carried == [extra]
    got = plan.read_carried(extra)
    assert plan.carried_specs()[extra] == (got.dtype, tuple(got.shape))
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), read_tensors(fixture[1])[src])


def _load(rank, world, path):
    """Each rank's local shards (ep 1 and ep 2) against the reference, and the bytes it asked for."""
    from safetensors.torch import load_file

    from sq.load.fill import local_box
    from sq.load.loader import load_sharded

    ref = {}
    for f in Path(path).parent.joinpath("reference").glob("*.safetensors"):
        ref.update(load_file(f))
    out = {}
    for ep in (1, 2):
        model = load_sharded(path, ep=ep)
        bad, experts = [], []
        for n, t in model.named_parameters():
            local, off = local_box(t)
            want = ref[n][tuple(slice(o, o + s) for o, s in zip(off, local.shape))].to(torch.bfloat16)
            if local.dtype != want.dtype or not torch.equal(local, want):
                bad.append(n)
            if n.endswith("experts.gate_up_proj"):
                experts.append((off[0], local.shape[0]))
        out[ep] = dict(bad=bad, experts=sorted(set(experts)), bytes_read=model.sq_plan.reader().bytes_read)
    return out


def test_each_rank_dequantizes_only_its_experts(fixture):
    """At 2 ranks (ep 1: FSDP2 slabs of 2 experts; ep 2: 2 experts per rank) every local shard equals the
    reference, and each rank asks the files for exactly half the checkpoint: its experts' blocks and
    scales (every dimension here splits evenly) and its half of every other tensor."""
    mx_dir, _ = fixture
    from sq.load.source import scan_checkpoint

    total = sum(t.nbytes for t in scan_checkpoint(mx_dir).tensors.values())
    res = run_ranks(_load, 2, str(mx_dir), timeout=120)
    for ep in (1, 2):
        for rank, r in enumerate(res):
            assert r[ep]["bad"] == [], (ep, rank, r[ep]["bad"])
            assert r[ep]["experts"] == [(2 * rank, 2)], (ep, rank, r[ep]["experts"])
            assert r[ep]["bytes_read"] == total // 2, (ep, rank, r[ep]["bytes_read"], total)


# ----------------------------------------------------------------------------- PTQ, end to end


def test_gptq_w4a16_ep2_from_mxfp4_equals_reference(fixture, tmp_path):
    from sq.testing.zoo import check_output

    mx_dir, ref_dir = fixture
    out = tmp_path / "out"
    res = run_cli(["sq.ptq", "--model", str(mx_dir), "--output", str(out), "--scheme", "W4A16", "--algo", "gptq",
                   "--group-size", "8", "--nsamples", "4", "--seqlen", "32", "--ep", "2",
                   "--allow-unquantized-experts"], 2, timeout=240)  # gpt-oss' experts: carried, said so
    assert res.returncode == 0, res.output[-4000:]
    summary = check_output(ref_dir, out)  # loads with no missing / unexpected keys; logits of the reference
    assert summary["quantized"] > 0
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and "modules_to_not_convert" not in qc
    assert "mxfp4" not in json.dumps(cfg)
    got, ref = read_tensors(out), read_tensors(ref_dir)
    assert not [k for k in got if k.endswith(("_blocks", "_scales"))]
    # experts carried unquantized under the model's names, exactly the dequantized source; sinks, biases too
    for i in (0, 1):
        for leaf in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            k = EXPERTS.format(i, leaf)
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k].float(), ref[k]), k
        k = f"model.layers.{i}.self_attn.sinks"
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k].float(), ref[k]), k


# ----------------------------------------------------------------------------- refusals


def _drop(key):
    return lambda t: {k: v for k, v in t.items() if k != key}


def _set(key, value):
    return lambda t: {**t, key: value}


GU, DOWN = EXPERTS.format(1, "gate_up_proj"), EXPERTS.format(1, "down_proj")
QC = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                          "model.embed_tokens", "lm_head"]}
BAD = {
    "blocks without scales": (_drop(DOWN + "_scales"), None, [f"'{DOWN}_blocks' uint8 [4, 64, 4, 16]",
                                                              f"have no scales '{DOWN}_scales'"]),
    "scales without blocks": (_drop(DOWN + "_blocks"), None, [f"scales '{DOWN}_scales' uint8 [4, 64, 4]",
                                                              f"have no blocks '{DOWN}_blocks'"]),
    "scale shape": (_set(GU + "_scales", torch.zeros(4, 256, 3, dtype=torch.uint8)), None,
                    [f"scale shape mismatch: '{GU}_scales' is [4, 256, 3]", "need [4, 256, 2]"]),
    "block width": (_set(GU + "_blocks", torch.zeros(4, 256, 4, 8, dtype=torch.uint8)), None,
                    [f"'{GU}_blocks' uint8 [4, 256, 4, 8]", "not [experts, rows, blocks, 16]"]),
    "int8 blocks": (_set(GU + "_blocks", torch.zeros(4, 256, 2, 16, dtype=torch.int8)), None,
                    [f"'{GU}_blocks' int8", "must both be uint8"]),
    "dequantized shape": (lambda t: {**t, GU + "_blocks": torch.zeros(4, 256, 1, 16, dtype=torch.uint8),
                                     GU + "_scales": torch.zeros(4, 256, 1, dtype=torch.uint8)}, None,
                          [f"'{GU}_blocks' + '{GU}_scales' (MXFP4, [4, 256, 1, 16] blocks) dequantizes to [4, 32, 256]",
                           f"model '{GU}' is [4, 64, 256]"]),
    "stored twice": (_set(GU, torch.zeros(4, 64, 256, dtype=torch.bfloat16)), None,
                     [f"'{GU}' is stored twice", "bfloat16 [4, 64, 256]"]),
    "unknown field": (None, {**QC, "weight_block_size": [32]}, ["fields ['weight_block_size'] sq does not know"]),
    "other variant": (None, {"quant_method": "mxfp8"}, ["quant_method='mxfp8'", "already quantized",
                                                        "MXFP4 sources"]),
    "experts not converted": (None, {**QC, "modules_to_not_convert": ["model.layers.*.mlp.experts"]},
                              ["names 'model.layers.0.mlp.experts', yet", "_blocks'", "is MXFP4"]),
    "names nothing": (None, {**QC, "modules_to_not_convert": ["model.layers.*.mlp.shared_experts"]},
                      ["'model.layers.*.mlp.shared_experts', which matches no module"]),
    "not a list": (None, {**QC, "modules_to_not_convert": "lm_head"}, ["is not a list of module name patterns"]),
    "no quantization_config": (None, {}, ["no quantization_config: the format is unknown",
                                          "'model.layers.0.mlp.experts.down_proj_blocks' uint8"]),
}


_refusal = load_refusal


@pytest.mark.parametrize("case", sorted(BAD))
def test_refused_by_name(fixture, tmp_path, case):
    edit, qc, words = BAD[case]
    path = copy_ckpt(fixture[0], tmp_path / "c")
    if edit is not None:
        edit_tensors(path, edit)
    if qc is not None:
        edit_config(path, quantization_config=qc or None)
    msg = _refusal(path)
    for w in words:
        assert w in msg, (w, msg)


def test_mxfp4_config_without_pairs(fixture, tmp_path):
    path = copy_ckpt(fixture[1], tmp_path / "c")
    edit_config(path, quantization_config=QC)
    assert "says the source is MXFP4 (quant_method 'mxfp4') but none of its" in _refusal(path)


def test_cli_refusal_writes_nothing(fixture, tmp_path):
    path = copy_ckpt(fixture[0], tmp_path / "c")
    edit_tensors(path, _drop(DOWN + "_scales"))
    out = tmp_path / "out"
    res = run_cli(["sq.ptq", "--model", str(path), "--output", str(out), "--scheme", "W4A16", "--algo", "rtn",
                   "--group-size", "8"], 2, timeout=120, stop_on_failure=False)
    assert all(c == 2 for c in res.codes), res.output[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("sq: error:")]
    # rank 0 speaks for all: the half pair, and the parameter it leaves unfilled
    assert len(errors) == 2 and f"have no scales '{DOWN}_scales'" in errors[0], res.stderr
    assert f"'{DOWN}' [4, 128, 64] has no checkpoint key" in errors[1], res.stderr
    assert "Traceback" not in res.output and not out.exists()


# ----------------------------------------------------------------------------- model-free


def test_model_free_refuses_mxfp4_in_one_line(fixture, tmp_path):
    out = tmp_path / "out"
    res = run_cli(["sq.ptq", "--model", str(fixture[0]), "--output", str(out), "--scheme", "W4A16", "--algo", "rtn",
                   "--group-size", "8", "--model-free"], 1, timeout=120)
    assert res.codes == [2], res.output[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("sq: error:")]
    assert len(errors) == 1 and "MXFP4" in errors[0] and "run without --model-free" in errors[0], res.stderr
    assert "Traceback" not in res.output and not out.exists()
