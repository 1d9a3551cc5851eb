"""SignRound (``--algo signround``): the tuned quantizer's maths, and the distributed runs.

- at its start (v = 0, alpha = beta = 1) the tuned quantizer is RTN, bit for bit (fp32 weights);
  the exported (q, scale, zp) reproduce the differentiable forward; gradients reach v, alpha, beta;
- a 2-rank run (dense and MoE) lowers every block's loss, writes a checkpoint transformers loads,
  whose logits match the source with the tuned weights the files hold;
- 1 rank and 2 ranks agree (equal batch sizes, different samples per step): within the tolerance
  stated in the test;
- refusals: float8 schemes (fp4 NVFP4 / MXFP4 are tuned: tests/test_algos_formats.py), --ep > 1;
- on the real demo model (SmolLM2-135M, bf16) the tuned blocks' loss drops.
Resume (kill mid-block and between blocks, bit-identical) is in tests/test_resume.py.
"""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest
import torch

from harness import run_ranks
from quant_ref import load_any, quantize_jobs, read_tensors
from sq.quant import rtn
from sq.formats.schemes import get_scheme
from sq.quant.signround import tuned_qdq, tuned_quantize

GS = 16
TUNE = dict(algo="signround", group_size=GS, nsamples=8, seqlen=32, iters=30, batch_size=4)


@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM", "W3A16", "W2A16"])
def test_tuned_quantizer_starts_at_rtn(name):
    scheme = get_scheme(name, GS)
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    v, a, b = torch.zeros_like(w), torch.ones(24, 4), torch.ones(24, 4)
    q, scale, zp, deq = tuned_quantize(w, v, a, b, scheme)
    rq_scale, rq_zp = rtn.compute_qparams(w, scheme)
    assert torch.equal(scale, rq_scale)
    assert (zp is None and rq_zp is None) or torch.equal(zp, rq_zp)
    assert torch.equal(q, rtn.quantize(w, rq_scale, rq_zp, scheme))
    assert torch.equal(deq, rtn.fake_quantize(w, scheme))
    assert torch.equal(tuned_qdq(w, v, a, b, scheme), deq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["W4A16", "W4A16_ASYM"])
def test_exported_weights_are_the_tuned_forward_and_gradients_flow(name, dtype):
    """The tuning forward quantizes with the scale the checkpoint holds (rounded to the weight's dtype,
    also for groups whose scale is below bf16's eps: large models' weights): every code the steps tuned
    is the code written."""
    scheme = get_scheme(name, GS)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(8, 32, generator=g) * torch.tensor([1.0, 0.01, 0.003, 1e-4]).repeat(2)[:, None]).to(dtype)
    v = (torch.rand(8, 32, generator=g) - 0.5).requires_grad_()
    a = (0.5 + 0.5 * torch.rand(8, 2, generator=g)).requires_grad_()
    b = (0.5 + 0.5 * torch.rand(8, 2, generator=g)).requires_grad_()
    fwd = tuned_qdq(w.float(), v, a, b, scheme, dtype=dtype)
    q, scale, zp, deq = tuned_quantize(w, v.detach(), a.detach(), b.detach(), scheme)
    codes = (fwd.detach().unflatten(-1, (2, GS)) / scale.float().unsqueeze(-1)).flatten(-2)
    if zp is not None:
        codes = codes + zp.float().repeat_interleave(GS, -1)
    assert torch.equal(codes.round().to(torch.int8), q)
    torch.testing.assert_close(deq, fwd.detach().to(dtype), rtol=1e-6, atol=0)
    ((fwd - w.float()) ** 2).sum().backward()
    for t in (v, a, b):
        assert t.grad is not None and t.grad.abs().sum() > 0


def _decompressed_reference(src: Path, out: Path):
    """The source model with every quantized weight replaced by what the output's files decompress to."""
    from sq.formats.compressed import decompress_weight
    from sq.quant.recipe import scheme_tag

    model = load_any(src, dtype=torch.float32)
    got = read_tensors(out)
    report = json.loads((out / "sq_report.json").read_text())
    scheme = dataclasses.replace(get_scheme("W4A16", GS), int_grid="full")  # SignRound's --int-grid auto
    params = dict(model.named_parameters())
    for name, tag in report["assignment"].items():
        assert tag == scheme_tag(scheme)
        if f"{name}.weight_packed" in got:  # a Linear
            t = {k.removeprefix(name + "."): v for k, v in got.items() if k.startswith(name + ".weight_")}
            params[f"{name}.weight"].data.copy_(decompress_weight(t, scheme))
        else:  # fused experts, per-expert on disk: name.{e}.{gate,up,down}_proj
            gu, down = params[f"{name}.gate_up_proj"], params[f"{name}.down_proj"]
            inter = down.shape[2]
            for e in range(gu.shape[0]):
                def w(p):
                    pre = f"{name}.{e}.{p}."
                    return decompress_weight({k.removeprefix(pre): v for k, v in got.items() if k.startswith(pre)},
                                             scheme)
                gu.data[e, :inter] = w("gate_proj")
                gu.data[e, inter:] = w("up_proj")
                down.data[e] = w("down_proj")
    return model


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("signround")
    two = [dict(model=str(checkpoints["llama"]), output=str(root / "llama-w2"), **TUNE),
           dict(model=str(checkpoints["qwen3_moe"]), output=str(root / "moe-w2"), **TUNE),
           dict(model=str(checkpoints["llama"]), output=str(root / "llama-w2-rtn"), algo="rtn", group_size=GS),
           # refusals, before anything is written
           dict(model=str(checkpoints["llama"]), output=str(root / "no-ep"), ep=2, **TUNE),
           dict(model=str(checkpoints["llama"]), output=str(root / "no-fp8"), scheme="FP8_DYNAMIC", **TUNE)]
    errors = run_ranks(quantize_jobs, 2, two, timeout=600)[0]
    one = run_ranks(quantize_jobs, 1, [dict(model=str(checkpoints["llama"]), output=str(root / "llama-w1"), **TUNE)],
                    timeout=600)[0]
    return root, dict(zip(["llama-w2", "moe-w2", "llama-w2-rtn", "no-ep", "no-fp8"], errors)), one[0]


@pytest.mark.parametrize("arch,out", [("llama", "llama-w2"), ("qwen3_moe", "moe-w2")])
def test_two_ranks_lower_every_block_loss_and_load(checkpoints, runs, arch, out):
    root, errors, _ = runs
    assert errors[out] is None, errors[out]
    report = json.loads((root / out / "sq_report.json").read_text())
    assert report["args"]["algo"] == "signround"
    for block, t in report["signround"].items():
        assert t["loss_best"] < 0.9 * t["loss_first"], (block, t)
    model, info = load_any(root / out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    ref = _decompressed_reference(checkpoints[arch], root / out)
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert ((a - b).norm() / b.norm()).item() <= 1e-3


def test_tuned_weights_differ_from_rtn(runs):
    root, errors, _ = runs
    sr, rt = read_tensors(root / "llama-w2"), read_tensors(root / "llama-w2-rtn")
    packed = [k for k in sr if k.endswith("weight_packed")]
    assert packed and sum(not torch.equal(sr[k], rt[k]) for k in packed) == len(packed)


def test_one_rank_and_two_ranks_agree(checkpoints, runs):
    """Each rank draws its share of every step's batch from its own samples, so 1 and 2 ranks tune on
    different (equally sized) batches and end at different roundings of equal quality.  Stated
    tolerance: on held-out tokens, the 2-rank model's output error against the source is within 25 %
    of the 1-rank model's (measured: 0.1180 vs 0.1219, 3 %).  (Not compared with RTN here: on this
    random-weight model, tuned on 8 windows of text, random-token logits are not what it tunes for;
    quality is measured on the real model in docs/benchmarks.md.)"""
    root, errors, one = runs
    assert one is None, one
    src = load_any(checkpoints["llama"], dtype=torch.float32)
    ids = torch.randint(0, 400, (4, 32), generator=torch.Generator().manual_seed(123))

    def err(path):
        with torch.no_grad():
            a, b = load_any(path, dtype=torch.float32)(input_ids=ids).logits, src(input_ids=ids).logits
        return ((a - b).norm() / b.norm()).item()

    e1, e2 = err(root / "llama-w1"), err(root / "llama-w2")
    assert abs(e2 - e1) <= 0.25 * e1, (e1, e2)


def test_refusals(runs):
    _, errors, _ = runs
    assert "--algo signround runs with --ep 1" in errors["no-ep"]
    assert "tunes integer and fp4" in errors["no-fp8"] and "FP8_DYNAMIC" in errors["no-fp8"] and "float8" in errors["no-fp8"]


@pytest.mark.timeout(600)
def test_loss_decreases_on_the_demo_model(smollm2_ckpt, tmp_path):
    """The real SmolLM2-135M (bf16) at 2 ranks: tuning lowers the loss of the blocks it tunes (the first
    two; the others are left unquantized to keep this short).  On the full-range grid (SignRound's
    default) block 0's RTN start can already be the best these 12 short steps find, as auto-round's own
    log shows for it: the best kept is never worse, and some block gains 10%."""
    job = dict(model=str(smollm2_ckpt), output=str(tmp_path / "o"), algo="signround", group_size=64,
               nsamples=4, seqlen=64, iters=12, batch_size=2, ignore=(r"layers\.([2-9]|[12][0-9])\.",))
    assert run_ranks(quantize_jobs, 2, [job], timeout=540)[0] == [None]
    tuned = json.loads((tmp_path / "o" / "sq_report.json").read_text())["signround"]
    assert sorted(tuned) == ["model.layers.0", "model.layers.1"]
    assert all(t["loss_best"] <= t["loss_first"] for t in tuned.values()), tuned
    assert min(t["loss_best"] / t["loss_first"] for t in tuned.values()) < 0.9, tuned
