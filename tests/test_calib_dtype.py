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
  for a bf16-compute job.
"""

from __future__ import annotations

import json

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
    base = dict(model=str(bf16["llama"]), output=str(tmp_path / "o"), scheme="W4A16", algo="gptq", **JOB)
    res = run_ranks(quantize_jobs, 1, [dict(calib_dtype="float32", **base), dict(calib_dtype="auto", **base),
                                       dict(calib_dtype="model", **base)], timeout=300)[0]
    from sq.config import cpu_has_bf16_matrix_units

    # auto is float32 on a CPU without bf16 matrix units (the job float32 finished, already
    # complete), the model's dtype on one with them (AMX: refused like "model")
    assert res[0] is None, res
    refused = res[1:] if cpu_has_bf16_matrix_units() else res[2:]
    assert res[1] is None or cpu_has_bf16_matrix_units(), res
    for r in refused:
        assert "finished sq checkpoint made with different settings" in r and "calib_dtype" in r, res
