"""Every data-free preset through the real pipeline: the rows each rank quantizes give the same
checkpoint at 1, 2 and 3 ranks (cross-row statistics all-reduced, NVFP4 global scales shared by
fused partners), transformers loads it with no missing or unexpected keys, and presets that need
what the pipeline does not do yet are refused on every rank.  Equality with the compressed-tensors
library per weight: tests/test_presets.py."""

from __future__ import annotations

import json

import pytest
import torch

from harness import run_cli, run_ranks
from quant_ref import quantize_jobs, read_tensors

DATA_FREE = ["FP8_BLOCK", "NVFP4A16", "MXFP4A16", "MXFP8A16", "W8A8", "W4A8", "W4AFP8"]
MOE = ["NVFP4A16", "W8A8"]  # fused experts: per-expert global scales, gate/up shared (MXFP4: 48 % 32 != 0 here)


def _job(model, out, scheme, **kw):
    return dict(model=str(model), output=str(out), algo="rtn", scheme=scheme, group_size=16, timeout_s=120, **kw)


@pytest.fixture(scope="module")
def runs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    for world in (1, 2, 3):
        jobs = [_job(checkpoints["llama"], root / f"llama-{p}-w{world}", p) for p in DATA_FREE]
        jobs += [_job(checkpoints["qwen3_moe"], root / f"moe-{p}-w{world}", p) for p in MOE]
        errors = run_ranks(quantize_jobs, world, jobs, timeout=600)[0]
        assert errors == [None] * len(jobs), errors
    errors = run_ranks(quantize_jobs, 2, [_job(checkpoints["qwen3_moe"], root / f"moe-{p}-ep2", p, ep=2)
                                          for p in MOE], timeout=600)[0]
    assert errors == [None] * len(MOE), errors
    return root


CASES = [pytest.param("llama", p, id=f"llama-{p}") for p in DATA_FREE] + \
        [pytest.param("moe", p, id=f"moe-{p}") for p in MOE]
# transformers 5.24 fuses per-expert tensors while loading compressed-tensors MoE checkpoints; for the
# unpacked int8 ``weight`` of int-quantized experts its converter collects nothing ("torch.cat(): expected
# a non-empty list of Tensors"); the dense W8A8 checkpoint loads.  vLLM reads per-expert names itself.
LOAD_XFAIL = {("moe", "W8A8"): "transformers 5.24 cannot fuse int-quantized per-expert tensors while loading"}


def _same(a, b):
    ta, tb = read_tensors(a), read_tensors(b)
    assert ta.keys() == tb.keys()
    diff = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not diff, diff[:5]


@pytest.mark.parametrize("kind,preset", CASES)
def test_world_sizes_write_identical_checkpoints(runs, kind, preset):
    for other in ("w2", "w3") + (("ep2",) if kind == "moe" else ()):
        _same(runs / f"{kind}-{preset}-w1", runs / f"{kind}-{preset}-{other}")


@pytest.mark.parametrize("kind,preset", CASES)
def test_loads_in_transformers(runs, kind, preset):
    from transformers import AutoModelForCausalLM

    if (kind, preset) in LOAD_XFAIL:
        with pytest.raises(RuntimeError, match="conversion of the weights"):
            AutoModelForCausalLM.from_pretrained(runs / f"{kind}-{preset}-w2", dtype=torch.bfloat16)
        pytest.xfail(LOAD_XFAIL[kind, preset])

    model, info = AutoModelForCausalLM.from_pretrained(runs / f"{kind}-{preset}-w2", output_loading_info=True,
                                                       dtype=torch.bfloat16)  # fp4 decompresses to bf16
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    qc = json.loads((runs / f"{kind}-{preset}-w2" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]
    if preset == "FP8_BLOCK":
        return  # the library's FP8 block forward needs widths that are multiples of 128 (docs/output.md)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(1, 9)[None]).logits.float()).all()


def test_nvfp4_partners_share_one_global_scale(runs):
    t = read_tensors(runs / "llama-NVFP4A16-w2")
    for layer in range(2):
        p = f"model.layers.{layer}."
        qkv = {t[p + f"self_attn.{n}_proj.weight_global_scale"].item() for n in "qkv"}
        gu = {t[p + f"mlp.{n}_proj.weight_global_scale"].item() for n in ("gate", "up")}
        assert len(qkv) == 1 and len(gu) == 1, (qkv, gu)


def test_gptq_refuses_formats_it_cannot_solve(checkpoints, tmp_path):
    res = run_cli(["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(tmp_path / "o"), "--algo", "gptq",
                   "--scheme", "FP8_BLOCK", "--nsamples", "4", "--seqlen", "16"], 2, timeout=120, stop_on_failure=False)
    assert res.codes == [2, 2] and "--algo gptq solves per-channel and per-group" in res.stderr, res.output[-2000:]
