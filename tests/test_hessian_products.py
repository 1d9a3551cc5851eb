"""GPTQ's Hessian products of bf16 inputs, bf16 operands or float32: measured, never read off a CPU flag.

- The probe's rules: a recorded choice is taken, nothing is measured on a GPU or for float32 inputs, both
  forms are timed on the job's widths and cached, and bf16 operands are taken only where they win by the
  margin and the CPU has them.
- The process-wide setting is what ``GPTQ.add_batch`` multiplies in (oneDNN's bf16 mode on or off).
- A job without Hessians (AWQ) neither measures their products nor records a choice.
- In a job on a bf16 model: the probe's choice is in the report and the run signature; killed and resumed
  after the machine's cached times were flipped, the rerun multiplies as the run it continues and ends
  bit-identical to an uninterrupted run that chose the same.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_cli, run_ranks
from quant_ref import quantize_jobs
from sq import probe
from sq.quant import gptq
from sq.testing.checkpoints import build_llama
from test_ptq_moe import _same_bits

CPU = torch.device("cpu")
WIDTHS = [64, 128]  # build_llama's: hidden 64 (q/k/v/o/gate/up), intermediate 128 (down)


def _seed(cache, bf16_wins: bool) -> None:
    """The Hessian probe's cache for build_llama's widths as a rank (one thread) keys it: bf16 operands
    twice as fast, or half as fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = cache / "probes" / probe.hessian_probe_file(WIDTHS, CPU).name
    finally:
        torch.set_num_threads(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bf16": 0.5, "float32": 1.0} if bf16_wins else {"bf16": 1.0, "float32": 0.5}))


def test_probe_rules_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SQ_CACHE_DIR", str(tmp_path))
    have = gptq.bf16_products_available()
    assert probe.hessian_products_choice(WIDTHS, torch.bfloat16, CPU, recorded=True) == (have, {"why": "recorded"})
    assert probe.hessian_products_choice(WIDTHS, torch.bfloat16, CPU, recorded=False) == (False, {"why": "recorded"})
    assert probe.hessian_products_choice(WIDTHS, torch.bfloat16, torch.device("cuda")) == (False, {})
    assert probe.hessian_products_choice(WIDTHS, torch.float32, CPU) == (False, {})  # float32 inputs: float32
    assert probe.hessian_products_choice([], torch.bfloat16, CPU) == (False, {})
    on, rec = probe.hessian_products_choice(WIDTHS * 2, torch.bfloat16, CPU)  # measured, widths once each
    secs = rec["seconds"]
    assert rec["why"] == "probe" and secs["float32"] > 0 and (secs["bf16"] is None) == (not have)
    assert on == (have and secs["bf16"] * probe.HESSIAN_MARGIN < secs["float32"])
    path = probe.hessian_probe_file(WIDTHS, CPU)
    assert path.parent == tmp_path / "probes" and json.loads(path.read_text())["float32"] == pytest.approx(
        secs["float32"], abs=1e-6)
    path.write_text(json.dumps({"bf16": 0.5, "float32": 1.0}))
    assert probe.hessian_products_choice(WIDTHS, torch.bfloat16, CPU)[0] == have  # cached: not measured again
    path.write_text(json.dumps({"bf16": 1.0, "float32": 1.04}))  # within the margin: float32
    assert probe.hessian_products_choice(WIDTHS, torch.bfloat16, CPU)[0] is False
    assert probe.hessian_probe_file([64, 256], CPU) != path  # per width set


@pytest.mark.parametrize("on", [False, True])
def test_the_setting_is_what_add_batch_multiplies_in(on, monkeypatch):
    """``use_bf16_products`` switches oneDNN's float32 matmuls to bf16 operands around the Hessian's
    products of bf16 inputs (where the CPU has the mode), and only there; the sums are the same products."""
    seen = []
    real = gptq.sym_products

    def spy(H, xs, band=None):
        seen.append(torch.backends.mkldnn.matmul.fp32_precision)
        real(H, xs, band)

    monkeypatch.setattr(gptq, "sym_products", spy)
    x = torch.randn(2, 32, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    try:
        gptq.use_bf16_products(on)
        acc = gptq.GPTQ(48)
        acc.add_batch(x)
        acc.add_batch(x.float())  # float32 inputs: float32 products whatever the setting
    finally:
        gptq.use_bf16_products(None)
    bf16 = on and gptq.bf16_products_available()
    assert seen == ["bf16" if bf16 else seen[-1]] * 2 + [seen[-1]] * 2 and seen[-1] != "bf16"
    ref = 2 * sum(s.double().T @ s.double() for s in x)
    torch.testing.assert_close(acc.H, ref, rtol=2e-6, atol=2e-6 * float(ref.abs().max()))


def test_a_job_records_its_choice_and_a_resumed_run_keeps_it(tmp_path, monkeypatch):
    src = build_llama(tmp_path / "llama", dtype=torch.bfloat16)
    have = gptq.bf16_products_available()
    cache, out = tmp_path / "cache", tmp_path / "o"
    args = ["sq.ptq", "--model", str(src), "--output", str(out), "--algo", "gptq", "--group-size", "16",
            "--nsamples", "8", "--seqlen", "32", "--calib-dtype", "model", "--timeout", "60"]
    _seed(cache, True)
    res = run_cli(args, 2, timeout=300, env={"SQ_CACHE_DIR": str(cache), "SQ_FAULT": "after-shard-write:0:1"})
    assert res.returncode != 0 and "GPTQ Hessian products:" in res.output, res.output[-3000:]
    _seed(cache, False)  # the machine now favours float32: the resumed run keeps what it recorded
    res = run_cli(args, 2, timeout=300, env={"SQ_CACHE_DIR": str(cache)})
    assert res.returncode == 0 and "resuming at block 1" in res.output, res.output[-3000:]
    want = "bf16" if have else "float32"
    report = json.loads((out / "sq_report.json").read_text())
    assert report["speed"]["hessian"] == {"products": want, "why": "recorded"}
    assert report["run_signature"]["args"]["hessian_products"] == want
    # uninterrupted runs that chose by the probe: the resumed one's bits where they chose the same
    monkeypatch.setenv("SQ_CACHE_DIR", str(cache))
    jobs = [dict(model=str(src), output=str(tmp_path / n), scheme="W4A16", algo="gptq", calib_dtype="model",
                 group_size=16, nsamples=8, seqlen=32) for n in ("f32", "bf16")]
    assert run_ranks(quantize_jobs, 2, jobs[:1], timeout=300)[0] == [None]
    _seed(cache, True)
    assert run_ranks(quantize_jobs, 2, jobs[1:], timeout=300)[0] == [None]
    for name, products in (("f32", "float32"), ("bf16", want)):
        rep = json.loads((tmp_path / name / "sq_report.json").read_text())
        assert rep["speed"]["hessian"]["products"] == products and rep["speed"]["hessian"]["why"] == "probe"
        assert rep["run_signature"]["args"]["hessian_products"] == products
    assert _same_bits(out, tmp_path / "bf16") == []


def test_a_job_without_hessians_neither_measures_nor_records_them(tmp_path):
    """AWQ on a bf16 model computes no Hessian: no probe of their products, none in its signature or report."""
    src = build_llama(tmp_path / "llama", dtype=torch.bfloat16)
    cache, out = tmp_path / "cache", tmp_path / "o"
    res = run_cli(["sq.ptq", "--model", str(src), "--output", str(out), "--algo", "awq", "--group-size", "16",
                   "--nsamples", "8", "--seqlen", "32", "--calib-dtype", "model", "--timeout", "60"], 2, timeout=300,
                  env={"SQ_CACHE_DIR": str(cache)})
    assert res.returncode == 0, res.output[-3000:]
    assert "GPTQ Hessian products" not in res.output
    measured = [json.loads(f.read_text()) for f in (cache / "probes").glob("*.json")]
    assert not [m for m in measured if set(m) == {"bf16", "float32"}]
    report = json.loads((out / "sq_report.json").read_text())
    assert "hessian" not in report["speed"] and "hessian_products" not in report["run_signature"]["args"]
    assert report["run_signature"]["args"]["calib_dtype"] == "model"
