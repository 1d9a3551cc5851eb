"""The full-range integer grid (``--int-grid full``, ``QuantScheme.int_grid``): auto-round's symmetric grid.

- the maths: each group's larger-magnitude extreme lands on -8 (int4), so the scale is signed; codes fill
  -8..7; weight error below the standard grid's on Gaussian weights; ties and all-zero groups defined;
- the scheme: only symmetric int takes it, ``standard`` is stored as None (presets and resume signatures
  unchanged), recipes name it per rule and a float preset with it is refused;
- end to end at 2 ranks, RTN / GPTQ / SignRound / AWQ and model-free: the checkpoint holds negative
  scales, transformers + compressed-tensors decompress every Linear to exactly sq's dequantization
  (RTN: to the fake-quantized source), and 1 rank writes GPTQ's bits as 2 do.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from harness import run_ranks
from quant_ref import fake_quantized_reference, load_any, quantize_jobs, read_tensors
from sq.errors import SqError
from sq.formats.schemes import QuantScheme, get_scheme, with_int_grid
from sq.formats.specs import spec_for
from sq.quant import rtn
from sq.quant.recipe import make_assigner, scheme_tag
from test_ptq_moe import _same_bits

GS = 16
FULL = dataclasses.replace(get_scheme("W4A16", GS), int_grid="full")


def test_full_range_maths():
    w = torch.tensor([[0.8, -0.2, 0.1, 0.0], [-0.8, 0.2, 0.1, 0.0], [0.4, -0.4, 0.0, 0.1], [0.0] * 4])
    s = dataclasses.replace(get_scheme("W4A16", 4), int_grid="full")
    scale, zp = rtn.compute_qparams(w, s)
    assert zp is None
    # positive extreme the larger: negative scale, it lands on -8; negative extreme: positive scale;
    # a tie: negative (auto-round's); an all-zero group: the eps, codes 0
    assert scale[:3, 0].tolist() == pytest.approx([-0.1, 0.1, -0.05])
    assert scale[3, 0] == torch.finfo(torch.float32).eps
    q = rtn.quantize(w, scale, zp, s)
    assert q[:, 0].tolist() == [-8, -8, -8, 0] and q[3].tolist() == [0, 0, 0, 0]
    assert torch.equal(rtn.fake_quantize(w[:2], s)[:, 0], w[:2, 0])  # the extreme is exact
    # Gaussian weights: lower error than the standard grid (auto-round's measured 0.84x on SmolLM2)
    g = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    std = (rtn.fake_quantize(g, get_scheme("W4A16", 64)) - g).square().mean()
    full = (rtn.fake_quantize(g, dataclasses.replace(get_scheme("W4A16", 64), int_grid="full")) - g).square().mean()
    assert full < 0.9 * std
    codes = rtn.quantize(g, *rtn.compute_qparams(g, FULL), FULL)
    assert codes.min() == -8 and codes.max() == 7
    # bf16 weights: the scale is the extreme / 8, exact in any dtype
    gb = g.to(torch.bfloat16)
    sb, _ = rtn.compute_qparams(gb, FULL)
    assert sb.dtype == torch.bfloat16 and torch.equal(sb.abs() * 8, gb.unflatten(-1, (-1, GS)).abs().amax(-1))


def test_scheme_and_recipe_rules(tmp_path):
    assert spec_for(FULL).full_range and not spec_for(get_scheme("W4A16", GS)).full_range
    plain = get_scheme("W4A16", GS)
    assert dataclasses.replace(plain, int_grid="standard") == plain  # stored as None: same signature
    assert "int_grid" not in plain.to_dict() and FULL.to_dict()["int_grid"] == "full"
    assert QuantScheme.from_dict(FULL.to_dict()) == FULL
    assert scheme_tag(FULL) == "int4-symfull-group16" and scheme_tag(plain) == "int4-sym-group16"
    for bad in ("W4A16_ASYM", "NVFP4", "FP8"):
        with pytest.raises(ValueError, match="int_grid"):
            dataclasses.replace(get_scheme(bad, GS), int_grid="full")
    with pytest.raises(ValueError, match="int_grid must be one of"):
        dataclasses.replace(plain, int_grid="wide")
    assert with_int_grid(get_scheme("NVFP4"), "full") == get_scheme("NVFP4")  # the flag skips what it cannot take
    # --int-grid reaches the default and every rule's symmetric int scheme; a rule's own grid wins
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"default": "W4A16", "rules": [
        {"match": "q_proj", "scheme": "W8A16"}, {"match": "k_proj", "scheme": "W4A16_ASYM"},
        {"match": "v_proj", "scheme": {"preset": "W4A16", "group_size": 32, "int_grid": "full"}}]}))
    a = make_assigner("W4A16", GS, (), recipe, "full")
    assert [a.assign(n).int_grid for n in ("x.q_proj", "x.k_proj", "x.v_proj", "x.o_proj")] == [
        "full", None, "full", "full"]
    b = make_assigner("W4A16", GS, (), recipe)
    assert [b.assign(n).int_grid for n in ("x.q_proj", "x.v_proj", "x.o_proj")] == [None, "full", None]
    recipe.write_text(json.dumps({"rules": [{"match": "q", "scheme": {"preset": "NVFP4", "int_grid": "full"}}]}))
    with pytest.raises(SqError, match="rule 1.*int_grid"):
        make_assigner("W4A16", GS, (), recipe)
    with pytest.raises(SqError, match="--int-grid must be one of"):
        make_assigner("W4A16", GS, (), None, "wide")


@pytest.fixture(scope="module")
def outputs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    llama = str(checkpoints["llama"])
    base = dict(model=llama, scheme="W4A16", group_size=GS, nsamples=8, seqlen=32, int_grid="full")
    jobs = [dict(output=str(root / "rtn"), algo="rtn", **base),
            dict(output=str(root / "gptq"), algo="gptq", **base),
            dict(output=str(root / "signround"), algo="signround", iters=4, batch_size=4, **base),
            dict(output=str(root / "awq"), algo="awq", **base)]
    assert run_ranks(quantize_jobs, 2, jobs, timeout=600)[0] == [None] * len(jobs)
    assert run_ranks(quantize_jobs, 1, [dict(output=str(root / "gptq-1"), algo="gptq", **base)],
                     timeout=300)[0] == [None]
    return root


@pytest.mark.parametrize("algo", ["rtn", "gptq", "signround", "awq"])
def test_transformers_reads_the_full_grid_back(checkpoints, outputs, algo):
    from sq.formats.compressed import decompress_weight

    out = outputs / algo
    tensors = read_tensors(out)
    scales = torch.cat([t.flatten() for k, t in tensors.items() if k.endswith("weight_scale")])
    assert (scales < 0).any() and (scales > 0).any()  # signed scales are written as they are
    report = json.loads((out / "sq_report.json").read_text())
    assert set(report["assignment"].values()) == {scheme_tag(FULL)}
    model, info = load_any(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():  # any decompress-on-first-forward hook has run
        model(input_ids=torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0)))
    got = model.state_dict()
    ref = fake_quantized_reference(load_any(checkpoints["llama"], dtype=torch.float32), FULL).state_dict()
    linears = [k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")]
    assert linears
    for name in linears:
        mine = decompress_weight({k.removeprefix(name + "."): v for k, v in tensors.items()
                                  if k.startswith(name + ".weight_")}, FULL).to(torch.float32)
        assert torch.equal(got[name + ".weight"], mine), name  # transformers reads sq's values
        if algo == "rtn":
            assert torch.equal(mine, ref[name + ".weight"]), name  # RTN: the full-grid fake quantization


def test_one_rank_writes_two_ranks_bits(outputs):
    assert _same_bits(outputs / "gptq", outputs / "gptq-1") == []


def test_model_free_writes_the_pipeline_rtn_bits(checkpoints, outputs, tmp_path):
    from harness import run_cli

    out = tmp_path / "mf"
    res = run_cli(["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(out), "--algo", "rtn",
                   "--model-free", "--group-size", str(GS), "--int-grid", "full"], 2, timeout=300)
    assert res.returncode == 0, res.output[-3000:]
    mine, pipe = read_tensors(out), read_tensors(outputs / "rtn")
    assert set(mine) == set(pipe)
    assert [k for k in mine if not torch.equal(mine[k], pipe[k])] == []


def test_auto_is_the_algorithms_grid():
    """``--int-grid auto`` (the default): SignRound tunes on auto-round's full grid, as auto-round does;
    every other algorithm keeps compressed-tensors' grid (the presets stay llm-compressor's bits)."""
    from sq.config import PTQConfig
    from sq.ptq import parse_args

    job = dict(model="m", output="o")
    assert PTQConfig.build(algo="signround", **job).grid == "full"
    assert PTQConfig.build(algo="signround", int_grid="standard", **job).grid == "standard"
    for algo in ("rtn", "gptq", "awq"):
        assert PTQConfig.build(algo=algo, **job).grid == "standard"
    assert PTQConfig.build(algo="gptq", int_grid="full", **job).grid == "full"
    assert parse_args(["--model", "m", "--output", "o", "--algo", "signround"]).grid == "full"
    assert "--int-grid must be one of auto, standard, full" in " ".join(
        PTQConfig.build(algo="gptq", int_grid="wide", **job).problems())


def test_a_reported_error_never_goes_negative_in_bf16():
    """The report's output error ``e^T H e`` is computed with bf16 operands where the forwards are bf16;
    bf16's rounding can make a positive definite H indefinite (here: 1, 0.9945, 0.99 rounds to 1,
    0.99609375, 0.98828125) and an error along its weak direction then comes out negative (a GPTQ run of
    SmolLM2 on the full-range grid stopped on math.sqrt of one): such a term is computed again in
    float32."""
    from sq.quant.work import err_terms

    H = torch.tensor([[1.0, 0.9945], [0.9945, 0.99]], dtype=torch.float64)
    w = torch.tensor([[0.5, 0.5]])
    e = torch.tensor([[0.25, -0.25]])
    num, den = err_terms(w, [w - e], H, {}, torch.bfloat16)
    want = float(e.double() @ H @ e.double().T)
    assert num == pytest.approx(want, rel=1e-3) and num > 0
    assert den == pytest.approx(float(w.double() @ H @ w.double().T), rel=1e-2)


@pytest.mark.parametrize("n,band", [(576, 128), (200, 64), (64, 128)])
def test_row_forms_read_one_block_triangle_only(n, band):
    """``row_forms`` (the report's ``e H e^T`` per row) over H's lower block triangle equals the full
    product, and reads nothing right of the diagonal blocks (garbage there changes nothing)."""
    from sq.quant.work import row_forms

    g = torch.Generator().manual_seed(n)
    x = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
    H = x.T @ x
    a = torch.randn(7, n, generator=g, dtype=torch.float64)
    want = ((a @ H) * a).sum(1)
    torch.testing.assert_close(row_forms(a, H, band).double(), want, rtol=1e-6, atol=0)
    upper = H.clone()
    for p in range(0, n, band):  # right of each diagonal block: never read
        upper[p:p + band, p + band:] = float("nan")
    torch.testing.assert_close(row_forms(a, upper, band).double(), want, rtol=1e-6, atol=0)
