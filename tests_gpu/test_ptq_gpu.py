"""sq.ptq on CUDA with NCCL (one GPU per rank, up to 2): the CPU suite's main checks.

- RTN W4A16 on GPUs writes the same tensors, bit for bit, as on CPU (gloo): the same maths in
  float32 on both devices;
- GPTQ (dense and MoE at --ep auto) and SignRound run end to end on GPUs, calibrate in the
  model's dtype (``--calib-dtype auto`` on GPU), and their outputs load in transformers with
  GPTQ's error no worse than RTN's on every Linear.
"""

import json

import pytest
import torch

from harness import run_ranks
from quant_ref import load_any, quantize_jobs
from test_ptq_moe import _same_bits

JOB = dict(scheme="W4A16", group_size=16, nsamples=8, seqlen=32)


def _world() -> int:
    return max(1, min(torch.cuda.device_count(), 2))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_rtn_on_gpus_equals_cpu(checkpoints, tmp_path, arch):
    jobs = [dict(model=str(checkpoints[arch]), output=str(tmp_path / "gpu"), algo="rtn", **JOB)]
    assert run_ranks(quantize_jobs, _world(), jobs, backend="nccl", timeout=600)[0] == [None]
    cpu = [dict(model=str(checkpoints[arch]), output=str(tmp_path / "cpu"), algo="rtn", **JOB)]
    assert run_ranks(quantize_jobs, _world(), cpu, timeout=600)[0] == [None]
    assert _same_bits(tmp_path / "gpu", tmp_path / "cpu") == []


@pytest.mark.parametrize("arch,algo", [("llama", "gptq"), ("qwen3_moe", "gptq"), ("llama", "signround")])
def test_calibrated_on_gpus_load(checkpoints, tmp_path, arch, algo):
    extra = dict(iters=4, batch_size=4) if algo == "signround" else {}
    jobs = [dict(model=str(checkpoints[arch]), output=str(tmp_path / "o"), algo=algo, **JOB, **extra)]
    assert run_ranks(quantize_jobs, _world(), jobs, backend="nccl", timeout=600)[0] == [None]
    report = json.loads((tmp_path / "o" / "sq_report.json").read_text())
    assert report["run_signature"]["args"]["calib_dtype"] == "model"
    if algo == "gptq":
        for name, layer in report["layers"].items():
            assert layer["rel_err"] <= layer["rtn_rel_err"] + 1e-9, name
    model, info = load_any(tmp_path / "o", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
