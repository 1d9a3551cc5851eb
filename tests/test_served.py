"""``--served-activations`` (``sq.quant.served``): GPTQ's quantized chain rounds each Linear's input as served.

- the activation rounding is compressed-tensors' own: the library's fake quantization of a Linear's input
  (NVFP4 under the observed global scale, MXFP4, FP8 / INT8 per token, FP8 static) equals sq's, bitwise;
- GPTQ and GPTAQ with the flag at 1 and 2 ranks write the same bits, and not those of a run without it;
  killed mid-run and rerun, the same bits again;
- refused by name: an algorithm other than GPTQ / GPTAQ, weight-only schemes, quantized routed experts.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_cli, run_ranks
from quant_ref import quantize_jobs, read_tensors
from sq.quant.served import ServedActivations, activation_spec


def _job(model, out, **kw) -> dict:
    return dict(model=str(model), output=str(out), algo="gptaq", scheme="NVFP4", nsamples=8, seqlen=32,
                served_activations=True, timeout_s=120) | kw


@pytest.mark.parametrize("kind,preset", [("nvfp4_static_global", "NVFP4"), ("mxfp4_dynamic", "MXFP4"),
                                         ("fp8_dynamic_token", "FP8_DYNAMIC"), ("int8_dynamic_token", "W8A8"),
                                         ("fp8_static_tensor", "FP8")])
def test_rounding_is_the_librarys(kind, preset):
    """The library's input fake quantization (``forward_quantize`` with the args sq writes for the preset, its
    static scale from the same absmax) against the hook's, on a Linear's input [batch, tokens, 64]."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from compressed_tensors.quantization.utils import generate_gparam

    from sq.formats.schemes import get_scheme
    from sq.formats.specs import ACTIVATIONS

    torch.manual_seed(0)
    x = torch.randn(2, 8, 64) * torch.logspace(-2, 1, 64)  # channels of very different sizes
    absmax = x.abs().amax().reshape(1)
    args = QuantizationArgs(**ACTIVATIONS[get_scheme(preset).activations])
    from compressed_tensors.quantization import QuantizationStatus

    lin = torch.nn.Linear(64, 4)
    lin.quantization_status = QuantizationStatus.FROZEN
    if kind == "nvfp4_static_global":
        lin.input_global_scale = torch.nn.Parameter(generate_gparam(-absmax, absmax), requires_grad=False)
    if kind == "fp8_static_tensor":
        lin.input_scale = torch.nn.Parameter((absmax / 448).float(), requires_grad=False)
    want = forward_quantize(lin, x, "input", args)
    name = type("L", (), {})
    lin_ = name()
    lin_.name, lin_.module, lin_.scheme = "l", torch.nn.Identity(), get_scheme(preset)
    assert activation_spec(lin_.scheme.activations) is not None
    with ServedActivations([lin_], {"l": absmax}):
        got = lin_.module(x)
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.fixture(scope="module")
def served_runs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    for world in (2, 1):
        jobs = [_job(checkpoints["llama"], root / f"gptaq-w{world}"),
                _job(checkpoints["llama"], root / f"gptq-w{world}", algo="gptq", scheme="MXFP4")]
        assert run_ranks(quantize_jobs, world, jobs, timeout=300)[0] == [None, None]
    jobs = [_job(checkpoints["llama"], root / "gptaq-off", served_activations=False)]
    assert run_ranks(quantize_jobs, 2, jobs, timeout=300)[0] == [None]
    return root


@pytest.mark.parametrize("algo", ["gptaq", "gptq"])
def test_one_and_two_ranks_bit_identical(served_runs, algo):
    a, b = read_tensors(served_runs / f"{algo}-w1"), read_tensors(served_runs / f"{algo}-w2")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    assert json.loads((served_runs / f"{algo}-w2" / "sq_report.json").read_text())["args"]["served_activations"]


def test_the_flag_changes_the_fit(served_runs):
    a, b = read_tensors(served_runs / "gptaq-w2"), read_tensors(served_runs / "gptaq-off")
    changed = [k for k in a if k.endswith("weight_packed") and not torch.equal(a[k], b[k])]
    assert len(changed) > len([k for k in a if k.endswith("weight_packed")]) // 2, changed


def test_killed_and_resumed_bit_identical(served_runs, checkpoints, tmp_path):
    out = tmp_path / "o"
    argv = ["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(out), "--algo", "gptaq", "--scheme",
            "NVFP4", "--nsamples", "8", "--seqlen", "32", "--served-activations", "--timeout", "120"]
    killed = run_cli(argv, 2, timeout=300, env={"SQ_FAULT": "after-shard-write:1:1"})
    assert killed.returncode != 0 and not (out / "model.safetensors.index.json").exists()
    again = run_cli(argv, 2, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert json.loads((out / "sq_report.json").read_text())["resumed_from_block"] == 1
    a, b = read_tensors(out), read_tensors(served_runs / "gptaq-w2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra,words", [
    (["--algo", "rtn"], "--algo rtn calibrates another way"),
    (["--scheme", "W4A16"], "no quantized Linear's scheme quantizes its activations"),
])
def test_refused_on_every_rank(checkpoints, tmp_path, extra, words):
    argv = ["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(tmp_path / "o"), "--algo", "gptq",
            "--scheme", "NVFP4", "--nsamples", "4", "--seqlen", "16", "--served-activations", "--timeout", "120",
            *extra]
    res = run_cli(argv, 2, timeout=120, stop_on_failure=False)
    assert res.codes == [2, 2] and words in res.stderr and "Traceback" not in res.output, res.output[-3000:]
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


def test_refused_with_routed_experts(checkpoints, tmp_path):
    argv = ["sq.ptq", "--model", str(checkpoints["qwen3_moe"]), "--output", str(tmp_path / "o"), "--algo", "gptq",
            "--scheme", "NVFP4", "--nsamples", "4", "--seqlen", "16", "--served-activations", "--timeout", "120"]
    res = run_cli(argv, 2, timeout=120, stop_on_failure=False)
    assert res.codes == [2, 2] and "routed experts keep float activations" in res.stderr, res.output[-3000:]
