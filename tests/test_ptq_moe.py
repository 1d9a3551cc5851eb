"""PTQ on every fixture architecture (dense, Qwen3-MoE per-expert and fused, Mixtral, DeepSeek-V3 + MTP, VLM).

- transformers loads each output with no missing keys (unexpected ones only the carried MTP
  layer, which transformers itself ignores only as layer 61) and its logits match the
  fake-quantized source (relative error <= 1e-3);
- tensor names are the checkpoint's per-expert layout, never transformers' fused names;
- RTN output is bit-identical at world sizes 1, 2, 3 and at ep 1 vs 2; GPTQ at ep 1 vs 2 too;
- an expert no calibration token reaches falls back to RTN and is counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import run_ranks
from quant_ref import fake_quantized_reference, load_any, read_tensors
from sq.formats.schemes import get_scheme

ARCHS = ["llama", "qwen3_moe", "qwen3_moe_fused", "mixtral", "deepseek_v3", "vlm"]
GS = 16


def _quantize_all(rank, world, jobs):
    from sq.config import PTQConfig
    from sq.pipeline.job import quantize_model

    for job in jobs:
        quantize_model(PTQConfig.build(**job))
    return True


def _run(jobs, world, timeout=300):
    run_ranks(_quantize_all, world, jobs, timeout=timeout)


def _same_bits(a: Path, b: Path) -> list[str]:
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))[:5]
    return [k for k in ta if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
            or not torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8))]


@pytest.fixture(scope="module")
def rtn_outputs(checkpoints, tmp_path_factory):
    """RTN W4A16 g16 of every architecture at world 2, plus the world / ep variants of two MoEs."""
    root = tmp_path_factory.mktemp("ptq")
    base = dict(scheme="W4A16", algo="rtn", group_size=GS)
    jobs2 = [dict(model=str(checkpoints[a]), output=str(root / f"{a}-w2"), **base) for a in ARCHS]
    jobs2 += [dict(model=str(checkpoints[a]), output=str(root / f"{a}-w2-ep2"), ep=2, **base)
              for a in ("qwen3_moe", "mixtral")]
    _run(jobs2, 2)
    _run([dict(model=str(checkpoints[a]), output=str(root / f"{a}-w1"), **base) for a in ("qwen3_moe", "deepseek_v3")], 1)
    _run([dict(model=str(checkpoints[a]), output=str(root / f"{a}-w3"), **base) for a in ("qwen3_moe", "deepseek_v3")], 3)
    return root


@pytest.mark.parametrize("arch", ARCHS)
def test_rtn_output_loads_and_matches_fake_quant(checkpoints, rtn_outputs, arch):
    out = rtn_outputs / f"{arch}-w2"
    model, info = load_any(out, dtype=torch.float32, output_loading_info=True)
    carried = json.loads((out / "sq_report.json").read_text())["carried_over"]
    assert not info["missing_keys"], info["missing_keys"]
    mtp = {".".join(k.split(".")[:3]) + "." for k in carried}  # e.g. "model.layers.3."
    assert all(any(k.startswith(p) for p in mtp) for k in info["unexpected_keys"]), info["unexpected_keys"]
    ref = fake_quantized_reference(load_any(checkpoints[arch], dtype=torch.float32), get_scheme("W4A16", GS))
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert ((a - b).norm() / b.norm()).item() <= 1e-3
    # carried-over tensors are byte-for-byte the source's
    src, got = read_tensors(checkpoints[arch]), read_tensors(out)
    for k in carried:
        assert torch.equal(src[k].view(torch.uint8), got[k].view(torch.uint8)), k


def test_checkpoint_layout_names(rtn_outputs):
    names = set(read_tensors(rtn_outputs / "qwen3_moe-w2"))
    assert "model.layers.0.mlp.experts.5.gate_proj.weight_packed" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale" in names
    assert not any("gate_up_proj" in n for n in names)
    assert "model.layers.0.mlp.gate.weight" in names  # the router stays full precision
    mixtral = set(read_tensors(rtn_outputs / "mixtral-w2"))
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight_packed" in mixtral
    fused = set(read_tensors(rtn_outputs / "qwen3_moe_fused-w2"))
    assert "model.layers.0.mlp.experts.5.up_proj.weight_packed" in fused
    cfg = json.loads((rtn_outputs / "qwen3_moe-w2" / "config.json").read_text())["quantization_config"]
    assert "lm_head" in cfg["ignore"] and "model.layers.0.mlp.gate" in cfg["ignore"]
    assert cfg["format"] == "pack-quantized"


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_rtn_bit_identical_across_world_sizes(rtn_outputs, arch):
    for w in ("w1", "w3"):
        assert _same_bits(rtn_outputs / f"{arch}-w2", rtn_outputs / f"{arch}-{w}") == []


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_rtn_bit_identical_ep1_ep2(rtn_outputs, arch):
    assert _same_bits(rtn_outputs / f"{arch}-w2", rtn_outputs / f"{arch}-w2-ep2") == []


def test_gptq_moe_ep1_equals_ep2_and_loads(checkpoints, tmp_path):
    base = dict(model=str(checkpoints["deepseek_v3"]), scheme="W4A16", algo="gptq", group_size=GS,
                nsamples=8, seqlen=32)
    _run([dict(output=str(tmp_path / "ep1"), **base), dict(output=str(tmp_path / "ep2"), ep=2, **base)], 2)
    assert _same_bits(tmp_path / "ep1", tmp_path / "ep2") == []
    model, info = load_any(tmp_path / "ep1", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"]
    report = json.loads((tmp_path / "ep1" / "sq_report.json").read_text())
    assert report["experts_rtn_fallback"] == 0  # calibrate-all: every expert sees every token
    ex = report["experts"]  # the policy, stated, and each expert's tokens: routed and calibrated (every token)
    assert "calibrate-all" in ex["policy"] and ex["rtn"] == []
    top_k = json.loads((checkpoints["deepseek_v3"] / "config.json").read_text())["num_experts_per_tok"]
    assert len(ex["tokens"]) == 2  # the two MoE layers
    for eprefix, t in ex["tokens"].items():
        assert len(t["routed"]) == len(t["calibrated"]) == 8, eprefix
        assert set(t["calibrated"]) == {8 * 32}, t  # every calibration token, whichever rank holds it
        assert sum(t["routed"]) == 8 * 32 * top_k, t  # each token at its top_k experts
    for name, layer in report["layers"].items():
        assert layer["rel_err"] <= layer["rtn_rel_err"] + 1e-9, name


def test_unreached_experts_fall_back_to_rtn_and_are_counted(checkpoints, tmp_path):
    # 4 calibration tokens, top-2 routing, no calibrate-all: some of the 2 x 8 experts see no token
    _run([dict(model=str(checkpoints["qwen3_moe"]), output=str(tmp_path / "o"), algo="gptq", group_size=GS,
               nsamples=2, seqlen=2, calibrate_all_experts=False)], 2)
    report = json.loads((tmp_path / "o" / "sq_report.json").read_text())
    assert 1 <= report["experts_rtn_fallback"] <= 2 * 8
    ex = report["experts"]  # named, with the policy that sent them to RTN, and every expert's token counts
    assert "routed" in ex["policy"] and len(ex["rtn"]) == report["experts_rtn_fallback"]
    for name in ex["rtn"]:
        prefix, e = name.rsplit(".", 1)
        assert ex["tokens"][prefix]["calibrated"][int(e)] == 0 == ex["tokens"][prefix]["routed"][int(e)], name
    assert all(r == c for t in ex["tokens"].values() for r, c in zip(t["routed"], t["calibrated"]))


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
def test_experts_sharing_one_hessian_are_solved_stacked_with_per_expert_bits(scheme, monkeypatch):
    """Under calibrate-all every expert's gate/up reads the same Hessian, so the experts' rows
    are solved a few experts per sweep; each expert's result equals its own solve."""
    from types import SimpleNamespace

    from torch import nn

    from sq.quant.work import BlockWork
    from sq.quant.algorithms import gptq as gptq_algo
    from sq.quant.gptq import GPTQ, GPTQConfig

    torch.manual_seed(0)
    E, inter, hidden = 8, 32, 64
    ex = nn.Module()
    ex.gate_up_proj = nn.Parameter((torch.randn(E, 2 * inter, hidden) * 0.05).bfloat16(), requires_grad=False)
    ex.down_proj = nn.Parameter((torch.randn(E, hidden, inter) * 0.05).bfloat16(), requires_grad=False)
    x = torch.randn(512, hidden) @ torch.randn(hidden, hidden) / 8
    shared = GPTQ(hidden)
    shared.add_batch(x)
    mids = {}
    for e in range(E):
        mids[e] = GPTQ(inter)
        mids[e].add_batch(torch.randn(256, inter))
    s = get_scheme(scheme, 16)
    orig = {k: p.detach().clone() for k, p in ex.named_parameters()}
    alg = gptq_algo.GPTQAlgorithm(GPTQConfig())
    want = [alg._rows(GPTQ.from_hessian(shared.H.clone(), shared.nsamples), orig["gate_up_proj"][e].clone(), s, "x")
            for e in range(E)]

    monkeypatch.setattr(gptq_algo, "EXPERT_STACK_ELEMS", 3 * 2 * inter * hidden)  # sweeps of 3, 3, 2 experts
    calib = SimpleNamespace(experts=ex, calibrate_all=True, mine=range(E), h_in=dict.fromkeys(range(E), shared), h_mid=mids)
    work = BlockWork(0, "", nn.Module(), [], [], [], [], 0, None, torch.device("cpu"), 0, 1, 1, 0, True,
                     state={"calibs": {id(ex): calib}})
    names, real = [], alg._rows
    monkeypatch.setattr(alg, "_rows", lambda g, w, sc, name, *a, **k: names.append(name) or real(g, w, sc, name, *a, **k))
    got = {p: list(alg.solve_experts(work, "mlp.experts", ex, p, ex._parameters[p], 0, s)) for p in ("gate_up_proj", "down_proj")}
    assert alg.fallback_experts(work) == []
    assert [n for n in names if "gate_up" in n] == [f"mlp.experts.{r}.gate_up_proj" for r in ("0-2", "3-5", "6-7")]
    for e, w in enumerate(want):
        g = got["gate_up_proj"][e]
        assert torch.equal(g.q, w.q) and torch.equal(g.scale, w.scale), e
        assert (g.zero_point is None and w.zero_point is None) or torch.equal(g.zero_point, w.zero_point), e
        assert torch.equal(g.deq, w.deq), e
    deq_down = torch.stack([x.deq for x in got["down_proj"]])
    assert not torch.equal(deq_down, orig["down_proj"])  # quantized per expert against its own Hessian


@pytest.mark.parametrize("arch,world,algo,want", [
    ("qwen3_moe", 2, "gptq", 2), ("qwen3_moe", 4, "rtn", 4), ("qwen3_moe", 3, "gptq", 1),
    ("qwen3_moe", 6, "gptq", 2), ("qwen3_moe", 2, "signround", 1), ("qwen3_moe", 2, "awq", 1),
    ("llama", 2, "gptq", 1), ("qwen3_moe", 1, "gptq", 1)])
def test_auto_ep(checkpoints, arch, world, algo, want, caplog):
    """--ep auto: the largest divisor of the world size that splits every experts module evenly
    (the fixture's 8 experts), 1 for dense models and for algorithms that hold experts under FSDP2."""
    from sq.load.meta import build_skeleton
    from sq.quant.algorithms import algo_config, make_algorithm
    from sq.pipeline.targets import auto_ep

    model = build_skeleton(checkpoints[arch])
    with caplog.at_level("INFO", logger="sq.pipeline.targets"):
        assert auto_ep(model, world, make_algorithm(algo_config(algo))) == want
    if arch != "llama" and 1 < want < world:
        assert "8 experts do not split evenly over 6 ranks; --ep 2" in caplog.text


def test_default_ep_is_auto_on_moe(checkpoints, tmp_path):
    """Without --ep, a 2-rank MoE job runs expert-parallel (the report's resolved ep) and writes the
    same bits as --ep 1."""
    base = dict(model=str(checkpoints["qwen3_moe"]), scheme="W4A16", algo="rtn", group_size=GS)
    _run([dict(output=str(tmp_path / "auto"), **base), dict(output=str(tmp_path / "ep1"), ep=1, **base)], 2)
    report = json.loads((tmp_path / "auto" / "sq_report.json").read_text())
    assert report["args"]["ep"] == 2 and report["run_signature"]["args"]["ep"] == 2
    assert _same_bits(tmp_path / "auto", tmp_path / "ep1") == []
