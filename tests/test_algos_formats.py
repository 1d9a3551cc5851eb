"""GPTQ and SignRound on the serving formats (issue 17): NVFP4 / MXFP4 (fp4 e2m1 values, fp8 or e8m0
group scales, NVFP4's global scale from the all-reduced statistics), W8A8 and W4A8 with GPTQ.

- unit: GPTQ against a Hessian with no cross-column terms (H = c I: no error to propagate) gives
  exactly RTN's bits -- the quantizer inside the sweep is the format's own; SignRound's tuned
  quantizer at its start (v = 0, alpha = beta = 1) is RTN, and its export is its forward;
- real gloo runs of the tiny Llama: GPTQ at 2 ranks loads in transformers, fused partners share one
  ``weight_global_scale``, beats RTN's output error through H on most layers, and 1 rank writes the
  same bits; SignRound at 2 ranks with iters=0 writes exactly RTN's checkpoint, a few steps lower
  every block's loss, and the output loads;
- refusals: GPTQ with per-tensor / 2-D block scales, SignRound with fp8, name the scheme.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_ranks
from quant_ref import checkpoint_bit_diff, exact_bits, quantize_jobs, read_tensors
from sq.quant import rtn
from sq.quant.rtn import rtn_rows
from sq.quant.gptq import GPTQ
from sq.formats.schemes import get_scheme
from sq.quant.signround import tuned_global_scale, tuned_qdq, tuned_quantize

CALIB = dict(nsamples=4, seqlen=32, timeout_s=120)
GPTQ_SCHEMES = ["NVFP4A16", "MXFP4A16", "W8A8", "W4A8"]
SR_SCHEMES = ["NVFP4A16", "MXFP4A16"]
SR = dict(algo="signround", batch_size=2, **CALIB)


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(exact_bits(a), exact_bits(b))


# ---------------------------------------------------------------- unit: the quantizers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16", "MXFP8A16"])
@pytest.mark.parametrize("actorder", [True, False])
def test_gptq_without_error_to_propagate_is_rtn(name, dtype, actorder):
    """H = c I: each column's error has nowhere to go, so GPTQ is RTN -- bit for bit, scales (fp8 /
    e8m0) and NVFP4's global scale included, with scales fixed up front (act-order) or computed per
    group mid-sweep; also for a shard of rows under the whole weight's statistics."""
    s = get_scheme(name)
    w = (torch.randn(48, 128, generator=torch.Generator().manual_seed(3)) * 0.05).to(dtype)
    g = GPTQ.from_hessian(torch.eye(128, dtype=torch.float64) * 7, 10)
    for rows, stats in ((w, None), (w[16:40], rtn.local_stats(w, s) or None)):
        r, ref = g.quantize(rows, s, actorder=actorder, stats=stats), rtn_rows(rows, s, stats)
        assert _same_bits(r.q, ref.q) and _same_bits(r.scale, ref.scale) and _same_bits(r.weight, ref.deq)
        assert (r.global_scale is None) == (ref.global_scale is None) == (name != "NVFP4A16")
        assert r.global_scale is None or _same_bits(r.global_scale, ref.global_scale)


def _correlated(seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(128, 128, generator=g) / 128**0.5
    x = torch.randn(1024, 128, generator=g) @ mix + 0.05 * torch.randn(1024, 128, generator=g)
    x[:, :8] *= 5.0
    return x, (torch.randn(64, 128, generator=g) * 0.05).to(torch.bfloat16)


@pytest.mark.parametrize("name", ["NVFP4A16", "MXFP4A16"])
def test_gptq_fp4_beats_rtn_and_stacks_exactly(name):
    """On correlated inputs GPTQ's output error is well under RTN's; the stored tensors reconstruct the
    weight it optimized; rows solved stacked (experts sharing a Hessian, each under its own global
    scale) are bit-identical to each solved alone."""
    from sq.formats.compressed import compress_weight, decompress_weight

    x, w = _correlated()
    s = get_scheme(name)
    g = GPTQ(128)
    g.add_batch(x)
    r = g.quantize(w, s)
    ref = x @ w.float().T
    e_gptq = float((ref - x @ r.weight.float().T).norm() / ref.norm())
    e_rtn = float((ref - x @ rtn.fake_quantize(w, s).float().T).norm() / ref.norm())
    assert e_gptq < 0.7 * e_rtn, (e_gptq, e_rtn)  # measured: NVFP4 0.056 vs 0.098, MXFP4 0.060 vs 0.110
    assert r.rel_err == pytest.approx(e_gptq, rel=2e-3)
    assert torch.equal(decompress_weight(compress_weight(r, s, w.shape), s).to(w.dtype), r.weight)
    w2 = w * 3
    both = g.quantize(torch.cat([w, w2]), s, stats=[rtn.local_stats(w, s) or None, rtn.local_stats(w2, s) or None])
    alone = g.quantize(w2, s)
    assert torch.equal(both.weight, torch.cat([r.weight, alone.weight]))
    if name == "NVFP4A16":
        assert torch.equal(both.global_scale, torch.cat([r.global_scale, alone.global_scale]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", SR_SCHEMES)
def test_signround_fp4_starts_at_rtn_and_exports_its_forward(name, dtype):
    s = get_scheme(name)
    w = (torch.randn(24, 64, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    G = s.num_groups(64)
    v, a, b = torch.zeros(24, 64), torch.ones(24, G), torch.ones(24, G)
    q, scale, zp, deq = tuned_quantize(w, v, a, b, s)
    ref = rtn_rows(w, s)
    assert zp is None and _same_bits(q, ref.q) and _same_bits(scale, ref.scale) and _same_bits(deq, ref.deq)
    gs = tuned_global_scale(w, s)
    assert (gs is None and ref.global_scale is None) or _same_bits(gs, ref.global_scale)
    # the forward's values (v = +0 added may turn a -0.0 into +0.0, which no loss sees)
    assert torch.equal(tuned_qdq(w.float(), v, a, b, s, dtype=dtype).to(dtype), deq)
    # tuned parameters: the export is the forward's value, and gradients reach v, alpha, beta
    g = torch.Generator().manual_seed(1)
    v = (torch.rand(24, 64, generator=g) - 0.5).requires_grad_()
    a = (0.5 + 0.5 * torch.rand(24, G, generator=g)).requires_grad_()
    b = (0.5 + 0.5 * torch.rand(24, G, generator=g)).requires_grad_()
    fwd = tuned_qdq(w.float(), v, a, b, s, dtype=dtype)
    assert torch.equal(fwd.detach().to(dtype), tuned_quantize(w, v.detach(), a.detach(), b.detach(), s)[3])
    ((fwd - w.float()) ** 2).sum().backward()
    for t in (v, a, b):
        assert t.grad is not None and t.grad.abs().sum() > 0


# ---------------------------------------------------------------- the distributed runs


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("algos_formats")
    llama = str(checkpoints["llama"])

    def job(name, scheme, **kw):
        return dict(model=llama, output=str(root / name), scheme=scheme, group_size=16, **kw)

    two = [job(f"gptq-{p}-w2", p, algo="gptq", **CALIB) for p in GPTQ_SCHEMES]
    two += [job(f"sr0-{p}", p, iters=0, **SR) for p in SR_SCHEMES]
    two += [job(f"sr-{p}", p, iters=12, **SR) for p in SR_SCHEMES]
    two += [job(f"rtn-{p}", p, algo="rtn", timeout_s=120) for p in SR_SCHEMES]
    # refusals, before anything is written
    two += [job("no-gptq-FP8_BLOCK", "FP8_BLOCK", algo="gptq", **CALIB),
            job("no-sr-MXFP8A16", "MXFP8A16", iters=2, **SR)]
    errors = run_ranks(quantize_jobs, 2, two, timeout=600)[0]
    one = run_ranks(quantize_jobs, 1, [job(f"gptq-{p}-w1", p, algo="gptq", **CALIB) for p in GPTQ_SCHEMES],
                    timeout=600)[0]
    names = [j["output"].rsplit("/", 1)[-1] for j in two]
    return root, dict(zip(names, errors)), dict(zip(GPTQ_SCHEMES, one))


def _report(path):
    return json.loads((path / "sq_report.json").read_text())


def _loads(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(1, 9)[None]).logits.float()).all()


def _partners_share_global_scale(path):
    t = read_tensors(path)
    for layer in range(3):
        p = f"model.layers.{layer}."
        qkv = {t[p + f"self_attn.{n}_proj.weight_global_scale"].item() for n in "qkv"}
        gu = {t[p + f"mlp.{n}_proj.weight_global_scale"].item() for n in ("gate", "up")}
        assert len(qkv) == 1 and len(gu) == 1, (qkv, gu)


@pytest.mark.parametrize("preset", GPTQ_SCHEMES)
def test_gptq_two_ranks_loads_and_beats_rtn(runs, preset):
    root, errors, _ = runs
    out = root / f"gptq-{preset}-w2"
    assert errors[out.name] is None, errors[out.name]
    layers = _report(out)["layers"]
    better = [n for n, e in layers.items() if e["rel_err"] < e["rtn_rel_err"]]
    # measured at 2 ranks: GPTQ below RTN on all 21 Linears for each preset; mean rel_err vs RTN's:
    # NVFP4A16 0.056 vs 0.096, MXFP4A16 0.064 vs 0.113, W8A8 0.0034 vs 0.0061, W4A8 0.050 vs 0.087
    assert len(better) >= 0.8 * len(layers), {n: (e["rel_err"], e["rtn_rel_err"]) for n, e in layers.items()}
    _loads(out)
    if preset.startswith("NVFP4"):
        _partners_share_global_scale(out)


@pytest.mark.parametrize("preset", GPTQ_SCHEMES)
def test_gptq_one_and_two_ranks_write_the_same_bits(runs, preset):
    """Hessians are summed in float64 per sample and each rank solves its rows against the same H and
    the same all-reduced global scale, so the world size does not change a bit here."""
    root, errors, one = runs
    assert one[preset] is None, one[preset]
    diff = checkpoint_bit_diff(root / f"gptq-{preset}-w1", root / f"gptq-{preset}-w2")
    assert not diff, diff[:5]


@pytest.mark.parametrize("preset", SR_SCHEMES)
def test_signround_no_steps_is_rtn(runs, preset):
    root, errors, _ = runs
    assert errors[f"sr0-{preset}"] is None and errors[f"rtn-{preset}"] is None, errors
    diff = checkpoint_bit_diff(root / f"sr0-{preset}", root / f"rtn-{preset}")
    assert not diff, diff[:5]


@pytest.mark.parametrize("preset", SR_SCHEMES)
def test_signround_steps_lower_the_block_loss_and_load(runs, preset):
    root, errors, _ = runs
    out = root / f"sr-{preset}"
    assert errors[out.name] is None, errors[out.name]
    tuned = _report(out)["signround"]
    assert len(tuned) == 3
    for block, t in tuned.items():
        # measured loss_best / loss_first per block: NVFP4A16 0.67 0.36 0.42, MXFP4A16 0.81 0.29 0.48
        assert t["loss_best"] < 0.9 * t["loss_first"], (block, t)
    _loads(out)
    packed = read_tensors(out)
    rtn_out = read_tensors(root / f"rtn-{preset}")
    assert any(not torch.equal(packed[k], rtn_out[k]) for k in packed if k.endswith("weight_packed"))
    if preset.startswith("NVFP4"):
        _partners_share_global_scale(out)


def test_refusals_name_the_scheme(runs):
    _, errors, _ = runs
    e = errors["no-gptq-FP8_BLOCK"]
    assert e and "--algo gptq" in e and "FP8_BLOCK" in e and "2-D block" in e, e
    e = errors["no-sr-MXFP8A16"]
    assert e and "--algo signround" in e and "MXFP8A16" in e and "float8" in e, e
