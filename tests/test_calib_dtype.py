"""Calibration forwards in float32 over bfloat16 weights (``--calib-dtype``, FSDP2 mixed precision).

On a bf16 checkpoint (the fixtures are built in bf16 here; most other tests use float32 ones,
where the cast is a no-op):
- GPTQ on Qwen3-MoE at 2 ranks: ``--ep 1`` (FSDP2 casts the experts it gathers) and ``--ep 2``
  (sq's expert-parallel forward casts its experts) write bit-identical tensors in float32;
- float32 and the model's dtype give other bits (the setting takes effect) but the same tensor
  names, dtypes and shapes: only activations change precision, never what is written;
- GPTQ, AWQ, SignRound and static FP8 activation scales run in float32 over bf16 weights (AWQ and
  SignRound put quantized candidates into the forward: cast to its dtype) and their outputs load;
  FP8's ``input_scale`` keeps the model's dtype;
- the resolved dtype is part of the resume signature: a finished float32 output is not taken
  for a bf16-compute job;
- ``mixed`` (SignRound's: float32 weights and residual stream, autocast matmuls) is what ``auto`` takes for
  SignRound where the half dtype is faster, resumes bit-identically, and is refused for other algorithms.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from harness import run_ranks
from quant_ref import load_any, quantize_jobs, read_tensors
from sq.testing.checkpoints import build_llama, build_qwen3_moe
from test_ptq_moe import _same_bits

GS = 16
JOB = dict(group_size=GS, nsamples=8, seqlen=32)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    return {"llama": build_llama(root / "llama", dtype=torch.bfloat16),
            "qwen3_moe": build_qwen3_moe(root / "qwen3_moe", dtype=torch.bfloat16)}


def _layout(d):
    return {k: (t.dtype, tuple(t.shape)) for k, t in read_tensors(d).items()}


def test_gptq_moe_float32_ep1_equals_ep2_and_differs_from_bf16_compute(bf16, tmp_path):
    base = dict(model=str(bf16["qwen3_moe"]), scheme="W4A16", algo="gptq", **JOB)
    jobs = [dict(output=str(tmp_path / "ep1"), calib_dtype="float32", **base),
            dict(output=str(tmp_path / "ep2"), calib_dtype="float32", ep=2, **base),
            dict(output=str(tmp_path / "model"), calib_dtype="model", **base)]
    assert run_ranks(quantize_jobs, 2, jobs, timeout=300)[0] == [None] * 3
    assert _same_bits(tmp_path / "ep1", tmp_path / "ep2") == []
    assert _same_bits(tmp_path / "ep1", tmp_path / "model")  # activations in float32: other Hessians
    assert _layout(tmp_path / "ep1") == _layout(tmp_path / "model")
    sig = json.loads((tmp_path / "ep1" / "sq_report.json").read_text())["run_signature"]
    assert sig["args"]["calib_dtype"] == "float32"


@pytest.mark.parametrize("algo,scheme,extra", [
    ("awq", "W4A16", {}),
    ("signround", "W4A16", dict(iters=4, batch_size=4)),
    ("rtn", "FP8", {}),  # static input_scale from the observed forward
])
def test_algorithms_in_float32_over_bf16_weights(bf16, tmp_path, algo, scheme, extra):
    jobs = [dict(model=str(bf16["llama"]), output=str(tmp_path / d), scheme=scheme, algo=algo, calib_dtype=d,
                 **JOB, **extra) for d in ("float32", "model")]
    assert run_ranks(quantize_jobs, 2, jobs, timeout=300)[0] == [None, None]
    assert _layout(tmp_path / "float32") == _layout(tmp_path / "model")
    tensors = read_tensors(tmp_path / "float32")
    if scheme == "FP8":
        scales = {k: t for k, t in tensors.items() if k.endswith("input_scale")}
        assert scales and {t.dtype for t in scales.values()} == {torch.bfloat16}
        ref = read_tensors(tmp_path / "model")
        for k, t in scales.items():  # the same statistic, from more precise activations
            assert torch.allclose(t.float(), ref[k].float(), rtol=0.05), k
    model, info = load_any(tmp_path / "float32", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_calib_dtype_is_in_the_resume_signature(bf16, tmp_path):
    """float32 finished the folder: ``auto`` takes the choice recorded there (complete, nothing to do),
    ``model`` computes otherwise and is refused by name."""
    base = dict(model=str(bf16["llama"]), output=str(tmp_path / "o"), scheme="W4A16", algo="gptq", **JOB)
    res = run_ranks(quantize_jobs, 1, [dict(calib_dtype="float32", **base), dict(calib_dtype="auto", **base),
                                       dict(calib_dtype="model", **base)], timeout=300)[0]
    assert res[:2] == [None, None], res
    assert "finished sq checkpoint made with different settings" in res[2] and "calib_dtype" in res[2], res


def test_probe_flags_and_cache(tmp_path, monkeypatch):
    """The probe's rules: a flag wins, a recorded choice next, GPU and float32 models keep their dtype;
    otherwise both dtypes are timed on the job's shapes, kept in the cache, and the half dtype is taken
    only when it is MARGIN faster."""
    from sq import probe

    monkeypatch.setenv("SQ_CACHE_DIR", str(tmp_path))
    cpu, shapes = torch.device("cpu"), [(64, 128), (128, 64)]
    assert probe.calib_dtype_choice("float32", shapes, torch.bfloat16, cpu).dtype == torch.float32
    assert probe.calib_dtype_choice("model", shapes, torch.bfloat16, cpu).dtype is None
    assert probe.calib_dtype_choice("auto", shapes, torch.bfloat16, cpu, recorded="float32").why == "recorded"
    assert probe.calib_dtype_choice("auto", shapes, torch.bfloat16, torch.device("cuda")).why == "gpu"
    assert probe.calib_dtype_choice("auto", shapes, torch.float32, cpu).why == "float32 model"
    first = probe.calib_dtype_choice("auto", shapes, torch.bfloat16, cpu)
    assert first.why == "probe" and set(first.seconds) == {"bfloat16", "float32"}
    assert all(v > 0 for v in first.seconds.values())
    assert (first.dtype is None) == (first.seconds["bfloat16"] * probe.MARGIN < first.seconds["float32"])
    [cached] = (tmp_path / "probes").glob("*.json")
    assert json.loads(cached.read_text()) == pytest.approx({"half": first.seconds["bfloat16"],
                                                             "float32": first.seconds["float32"]}, abs=1e-6)
    assert probe.calib_dtype_choice("auto", shapes, torch.bfloat16, cpu).seconds == first.seconds  # from the cache
    cached.write_text(json.dumps({"half": 1.0, "float32": 2.0}))
    assert probe.calib_dtype_choice("auto", shapes, torch.bfloat16, cpu).dtype is None
    cached.write_text(json.dumps({"half": 1.0, "float32": 1.05}))  # within the margin: float32
    assert probe.calib_dtype_choice("auto", shapes, torch.bfloat16, cpu).dtype == torch.float32
    assert probe.calib_dtype_choice("auto", shapes, torch.bfloat16, cpu, half="mixed").name == "float32"
    # mixed: float32 weights and residuals, matmuls autocast to the model's half dtype
    cached.write_text(json.dumps({"half": 1.0, "float32": 2.0}))
    mixed = probe.calib_dtype_choice("auto", shapes, torch.bfloat16, cpu, half="mixed")
    assert (mixed.name, mixed.dtype, mixed.autocast, mixed.why) == ("mixed", torch.float32, torch.bfloat16, "probe")
    assert mixed.to_dict()["autocast"] == "bfloat16"
    assert probe.calib_dtype_choice("mixed", shapes, torch.float16, cpu).autocast == torch.float16
    assert probe.calib_dtype_choice("auto", shapes, torch.bfloat16, cpu, recorded="mixed").name == "mixed"
    assert probe.calib_dtype_choice("auto", shapes, torch.bfloat16, torch.device("cuda"), half="mixed").name == "mixed"
    flat = probe.calib_dtype_choice("mixed", shapes, torch.float32, cpu)  # no half dtype: as it is
    assert (flat.name, flat.why) == ("model", "float32 model")


def _calib_probe_file(cache):
    """The calibration dtype probe's cache file (beside it: the Hessian products' probe, sq.probe)."""
    [path] = [p for p in (cache / "probes").glob("*.json") if "half" in json.loads(p.read_text())]
    return path


def test_auto_is_measured_recorded_and_kept_by_a_resumed_run(bf16, tmp_path, monkeypatch):
    """``auto`` on a bf16 model: the probe's times and choice in the report and the signature, the same
    on both ranks; killed and resumed after the machine's cached times were changed to favour the other
    dtype, the rerun computes as the run it continues (``recorded``) and ends bit-identical to an
    uninterrupted run with that dtype pinned."""
    from harness import run_cli

    cache, out, pinned = tmp_path / "cache", tmp_path / "o", tmp_path / "pinned"
    args = ["sq.ptq", "--model", str(bf16["llama"]), "--output", str(out), "--algo", "gptq", "--group-size", str(GS),
            "--nsamples", "8", "--seqlen", "32", "--timeout", "60"]
    res = run_cli(args, 2, timeout=300, env={"SQ_CACHE_DIR": str(cache), "SQ_FAULT": "after-shard-write:0:1"})
    assert res.returncode != 0 and "--calib-dtype auto:" in res.output, res.output[-3000:]
    chose_bf16 = re.search(r"--calib-dtype auto: (\w+)", res.output)[1] == "bfloat16"
    cached = _calib_probe_file(cache)
    flipped = {"half": 1.0, "float32": 0.5} if chose_bf16 else {"half": 0.5, "float32": 1.0}
    cached.write_text(json.dumps(flipped))
    res = run_cli(args, 2, timeout=300, env={"SQ_CACHE_DIR": str(cache)})
    assert res.returncode == 0 and "resuming at block 1" in res.output, res.output[-3000:]
    report = json.loads((out / "sq_report.json").read_text())
    want = "model" if chose_bf16 else "float32"
    assert report["speed"]["why"] == "recorded" and report["speed"]["calib_dtype"] == want
    assert report["run_signature"]["args"]["calib_dtype"] == want
    job = dict(model=str(bf16["llama"]), output=str(pinned), scheme="W4A16", algo="gptq", calib_dtype=want, **JOB)
    monkeypatch.setenv("SQ_CACHE_DIR", str(cache))  # the Hessian products as this machine's probe chose them
    assert run_ranks(quantize_jobs, 2, [job], timeout=300)[0] == [None]
    assert _same_bits(out, pinned) == []


def test_signround_under_auto_is_mixed_or_float32(bf16, tmp_path, monkeypatch):
    """SignRound's gradients flow through the forwards: where the probe finds the half dtype faster,
    ``auto`` takes ``mixed`` (float32 weights and residual stream, autocast matmuls) instead of the model's
    dtype, else float32: the output equals the pinned one's each way, and mixed computes otherwise."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SQ_CACHE_DIR", str(cache))  # the ranks take the caller's environment
    base = dict(model=str(bf16["llama"]), scheme="W4A16", algo="signround", iters=2, batch_size=4, **JOB)

    def run(*names):
        jobs = [dict(output=str(tmp_path / n), calib_dtype=n.split("-")[0], **base) for n in names]
        assert run_ranks(quantize_jobs, 2, jobs, timeout=300)[0] == [None] * len(jobs)

    run("auto-first")  # measures, and caches this machine's times
    cached = _calib_probe_file(cache)
    cached.write_text(json.dumps({"half": 0.5, "float32": 1.0}))
    run("auto-half", "mixed")
    cached.write_text(json.dumps({"half": 1.0, "float32": 0.5}))
    run("auto-float32", "float32")
    report = json.loads((tmp_path / "auto-half" / "sq_report.json").read_text())
    speed = report["speed"]
    assert speed["why"] == "probe" and speed["calib_dtype"] == "mixed" and speed["autocast"] == "bfloat16"
    for r in report["ranks"]:  # the machine beside the timings: recorded, never a rule
        assert r["machine"]["cores"] >= 1 and r["machine"]["cpu"] and r["machine"]["torch_cpu_capability"]
    speed = json.loads((tmp_path / "auto-float32" / "sq_report.json").read_text())["speed"]
    assert speed["why"] == "probe" and speed["calib_dtype"] == "float32"
    assert _same_bits(tmp_path / "auto-half", tmp_path / "mixed") == []
    assert _same_bits(tmp_path / "auto-float32", tmp_path / "float32") == []
    losses = [[b["loss_first"] for b in json.loads((tmp_path / d / "sq_report.json").read_text())["signround"].values()]
              for d in ("mixed", "float32")]
    assert losses[0] != losses[1]  # the matmuls in bf16: other losses (the tiny steps may keep RTN's bits)
    assert _layout(tmp_path / "mixed") == _layout(tmp_path / "float32")
    sig = json.loads((tmp_path / "mixed" / "sq_report.json").read_text())["run_signature"]
    assert sig["args"]["calib_dtype"] == "mixed"


def test_mixed_signround_resumes_bit_identical_and_is_signrounds_alone(bf16, tmp_path):
    """``--calib-dtype mixed`` killed after block 1's files and resumed ends bit-identical to an
    uninterrupted run (the chain cache holds its float32 activations); GPTQ refuses it by name."""
    from harness import run_cli

    out, pinned = tmp_path / "o", tmp_path / "pinned"
    args = ["sq.ptq", "--model", str(bf16["llama"]), "--output", str(out), "--algo", "signround", "--iters", "2",
            "--batch-size", "4", "--group-size", str(GS), "--nsamples", "8", "--seqlen", "32", "--calib-dtype",
            "mixed", "--timeout", "60"]
    res = run_cli(args, 2, timeout=300, env={"SQ_FAULT": "after-shard-write:0:1"})
    assert res.returncode != 0, res.output[-3000:]
    res = run_cli(args, 2, timeout=300)
    assert res.returncode == 0 and "resuming at block 1" in res.output, res.output[-3000:]
    job = dict(model=str(bf16["llama"]), output=str(pinned), scheme="W4A16", algo="signround", iters=2,
               batch_size=4, calib_dtype="mixed", **JOB)
    gptq = {**{k: v for k, v in job.items() if k not in ("iters", "batch_size")}, "output": str(tmp_path / "gptq"),
            "algo": "gptq"}
    res = run_ranks(quantize_jobs, 2, [job, gptq], timeout=300)[0]
    assert res[0] is None and "--calib-dtype mixed is SignRound's" in res[1], res
    assert _same_bits(out, pinned) == []
