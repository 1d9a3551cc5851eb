"""Hessians past 4096 inputs (DeepSeek-V3's o_proj reads 16384, its experts 7168): accumulated in float32, and
prepared for the solve with a working set of about three of them, not the float64 copies and whole permuted
and flipped copies of the narrow path (which stays float64 and bit-identical to what it was)."""

from __future__ import annotations

import pytest
import torch

from sq.formats.schemes import get_scheme
from sq.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from sq.quant import gptq
from sq.quant.gptq import GPTQ, GPTQConfig


def test_the_dtype_follows_the_width():
    assert gptq.hessian_dtype(4096) == torch.float64 and gptq.hessian_dtype(4097) == torch.float32
    assert GPTQ(7168, device="meta").H.dtype == torch.float32
    assert GPTQ(576).H.dtype == torch.float64


def _wide(monkeypatch):
    monkeypatch.setattr(gptq, "F64_HESSIAN_BYTES", 0)  # every width takes the wide path


def test_wide_sums_over_ranks_and_solves_match_the_float64_path(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 128, 256, generator=g) * (torch.rand(256, generator=g) + 0.1)
    w = torch.randn(96, 256, generator=g)
    s = get_scheme("W4A16", 64)
    narrow = GPTQ(256)
    narrow.add_batch(x)
    _wide(monkeypatch)
    whole, halves = GPTQ(256), [GPTQ(256), GPTQ(256)]
    whole.add_batch(x)
    halves[0].add_batch(x[:2])
    halves[1].add_batch(x[2:])
    assert whole.H.dtype == torch.float32
    summed = GPTQ.from_hessian(halves[0].H + halves[1].H, 512)
    # float32 sums: another summation order (another rank count) agrees to float32 rounding, not bit for bit
    torch.testing.assert_close(summed.H, whole.H, rtol=1e-5, atol=1e-5 * float(whole.H.abs().max()))
    torch.testing.assert_close(whole.H.double(), narrow.H, rtol=1e-5, atol=1e-5 * float(narrow.H.abs().max()))
    a, b = whole.quantize(w, s, actorder=True), narrow.quantize(w, s, actorder=True)
    assert (a.q == b.q).float().mean() > 0.99
    assert abs(a.loss - b.loss) <= 1e-3 * b.loss


@pytest.mark.parametrize("wide", [True, False])
def test_the_prepared_factor_is_the_same_maths(wide, monkeypatch):
    """U^T U = (H + damp I)^-1 in sweep order, whichever path prepared it."""
    if wide:
        _wide(monkeypatch)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 300, 200, generator=g)
    acc = GPTQ(200)
    acc.add_batch(x)
    prep = acc._prepare(GPTQConfig(actorder=True), torch.device("cpu"), "t")
    H = acc.H.double() * (2.0 / acc.nsamples)
    p = prep.perm
    Hd = H[p][:, p] + prep.damp * torch.eye(200, dtype=torch.float64)
    U = prep.Hs.double() * prep.hdiag.double()[:, None]
    assert float((U.T @ U - torch.linalg.inv(Hd)).norm() / torch.linalg.inv(Hd).norm()) < 1e-4


def test_preparing_a_wide_hessian_holds_about_three_of_it(monkeypatch):
    """At 4096 wide a float32 Hessian is 64 MiB: preparing it (permuted copy, factor, flip, residual check) grows
    the process by about three of those beyond the accumulator (measured 2.8-3.3; the narrow path's float64
    copies, two whole permuted copies and a flipped one measured 7.6)."""
    _wide(monkeypatch)
    n = 4096
    g = torch.Generator().manual_seed(2)
    acc = GPTQ(n)
    x = torch.randn(1, 2 * n, n, generator=g)
    acc.add_batch(x)
    del x
    H = acc.H  # mirrored before measuring
    one = 4 * n * n
    if not reset_peak_rss():
        pytest.skip("this kernel cannot reset the peak RSS")
    before = rss_bytes()
    acc._prepare(GPTQConfig(actorder=True), torch.device("cpu"), "wide")
    grown = peak_rss_bytes() - before
    assert H.dtype == torch.float32
    assert grown < 4.5 * one, f"prepare grew {grown / one:.2f} Hessians"


def test_the_wide_path_through_the_pipeline(checkpoints, tmp_path):
    """Every Hessian float32 (SQ_F64_HESSIAN_BYTES=0) on the MoE fixture at 2 ranks: each dense sum reduced to its
    solver, the report's terms from the solvers, the reported errors below RTN's, killed mid-block and rerun
    bit-identical, and the output loads."""
    import json

    from harness import run_cli
    from quant_ref import read_tensors
    from sq.testing.checkpoints import load_with_transformers

    argv = lambda out: ["sq.ptq", "--model", str(checkpoints["qwen3_moe"]), "--output", str(out), "--algo", "gptq",
                        "--scheme", "W4A16", "--group-size", "16", "--nsamples", "4", "--seqlen", "16", "--ep", "2"]
    env = {"SQ_F64_HESSIAN_BYTES": "0"}
    whole = run_cli(argv(tmp_path / "a"), 2, timeout=300, env=env)
    assert whole.returncode == 0, whole.output[-3000:]
    report = json.loads((tmp_path / "a" / "sq_report.json").read_text())
    assert report["layers"] and all(0 < e["rel_err"] < e["rtn_rel_err"] for e in report["layers"].values()), report["layers"]
    killed = run_cli(argv(tmp_path / "b"), 2, timeout=300, env={**env, "SQ_FAULT": "calib:1:1"})
    assert killed.returncode != 0
    again = run_cli(argv(tmp_path / "b"), 2, timeout=300, env=env)
    assert again.returncode == 0, again.output[-3000:]
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = load_with_transformers(tmp_path / "a", dtype=torch.float32)
    assert model is not None
