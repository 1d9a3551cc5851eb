"""Served by a real engine: sq's outputs of the demo model loaded and scored by vLLM's CPU build.

vLLM runs in its own venv (``.venv-vllm``, built by ``./setup.sh --serving``, which the README's test
command runs); each check is ``sq.engines.compare``: the same token ids scored by transformers (fp32, as
``sq.eval``) and by vLLM, perplexity within 2%, greedy tokens equal up to a near-tie, no vLLM warning
about the checkpoint, every Linear built with the expected compressed-tensors scheme.  Which presets
vLLM's CPU build runs, and in which dtype, is in docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

from harness import run_cli, run_python
from sq.engines.compare import PROMPT, Case, Divergence, compare_all, dequantized_copy, first_divergence
from sq.engines.vllm_client import engine_python
from sq.errors import SqError

# the served fixture quantizes every case, then one vLLM process serves them all: ~6 min on two cores of an
# AMD EPYC or a Xeon with AMX; the limits are hang guards with room for a busy machine
pytestmark = pytest.mark.timeout(1500)

NWINDOWS, SEQLEN = 4, 512
LINEARS = 30 * 4  # SmolLM2: 30 layers x (qkv_proj, o_proj, gate_up_proj, down_proj) as vLLM fuses them
# Calibration sized for a serving check, not for quality: the format and the path that writes it are the subject.
# (GPTQ's search scores 30 blocks x 4 units x 2 candidates, each a GPTQ solve: 97 s of sq's clock at 16 x 256,
# 56 s of wall at 8 x 128)
CALIB = {"rtn": [], "gptq": ["--nsamples", "8", "--seqlen", "128"],
         "awq": ["--nsamples", "8", "--seqlen", "128", "--n-grid", "5"],
         "signround": ["--nsamples", "8", "--seqlen", "128", "--iters", "5", "--batch-size", "4"]}


@pytest.fixture(scope="session")
def engine() -> str:
    try:
        return engine_python()
    except SqError as e:
        pytest.fail(f"{e}. The README's test command builds it: ./setup.sh --serving")


@pytest.fixture(scope="session")
def demo_tokens(smollm2_ckpt):
    from transformers import AutoTokenizer

    from sq.calib.data import BUILTIN_PYDOC, eval_windows, read_corpus, tokenize_corpus

    tokenizer = AutoTokenizer.from_pretrained(smollm2_ckpt)
    tokens = tokenize_corpus(tokenizer, read_corpus(BUILTIN_PYDOC).text(tokenizer))
    return eval_windows(tokens, NWINDOWS, SEQLEN), tokenizer(PROMPT)["input_ids"]


@pytest.fixture(scope="session")
def served_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("served")


# a mixed-precision search whose two schemes vLLM's CPU build both runs (in bf16)
SEARCH = ["--target-bits", "6", "--candidates", "W4A16,FP8_DYNAMIC"]


def _quantize(root, smollm2_ckpt, algo: str, scheme: str):
    """``scheme``: a preset, ``+full`` for ``--int-grid full``, ``+rot`` for ``--rotate r1,r2``, ``+search``
    for the mixed-precision search ``SEARCH``."""
    out = root / f"{algo}-{scheme}"
    if (out / "config.json").is_file():
        return out
    scheme, _, grid = scheme.partition("+")
    args = ["sq.ptq", "--model", str(smollm2_ckpt), "--output", str(out), "--scheme", scheme, "--algo", algo,
            "--group-size", "64", *CALIB[algo]]
    args += {"rot": ["--rotate", "r1,r2"], "search": SEARCH}.get(grid, ["--int-grid", grid] if grid else [])
    if algo == "gptq":  # the distributed path users run: 2 ranks, each solving its share of every block
        result = run_cli(args, 2, timeout=600)
    else:
        result = run_python(args, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


# (algorithm, preset, vLLM dtype, the scheme class vLLM must build every Linear with).  vLLM's CPU WNA16
# GEMM has no float32 kernel ("cpu_gemm_wna16 not implemented for 'Float'"), so int4 weight-only outputs run
# in bf16 as they are served; W8A8 and FP8_DYNAMIC run in fp32 (bf16 works too, 2-5x slower on this CPU).
CASES = [
    ("rtn", "W4A16", "bfloat16", "CompressedTensorsWNA16"),
    ("rtn", "W4A16+full", "bfloat16", "CompressedTensorsWNA16"),  # --int-grid full: signed scales
    ("rtn", "W4A16+rot", "bfloat16", "CompressedTensorsWNA16"),  # --rotate r1,r2: rotated, lm_head untied
    ("rtn", "W4A16_ASYM", "bfloat16", "CompressedTensorsWNA16"),
    ("rtn", "W8A8", "float32", "CompressedTensorsW8A8Int8"),
    ("rtn", "FP8_DYNAMIC", "float32", "CompressedTensorsW8A8Fp8"),
    ("gptq", "W4A16", "bfloat16", "CompressedTensorsWNA16"),
    ("awq", "W4A16", "bfloat16", "CompressedTensorsWNA16"),
    ("signround", "W4A16", "bfloat16", "CompressedTensorsWNA16"),
]


def _untied(smollm2_ckpt, ckpt):
    """The demo model with an ``lm_head.weight`` stored beside its tied embeddings (half of them)."""
    from safetensors.torch import load_file, save_file

    ckpt.mkdir()
    for f in smollm2_ckpt.iterdir():
        if f.is_file() and f.name != "model.safetensors.index.json":
            (ckpt / f.name).symlink_to(f)
    index = json.loads((smollm2_ckpt / "model.safetensors.index.json").read_text())
    embed = load_file(smollm2_ckpt / index["weight_map"]["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    save_file({"lm_head.weight": embed * 0.5}, ckpt / "lm_head.safetensors", metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return ckpt


@pytest.fixture(scope="session")
def served(engine, smollm2_ckpt, demo_tokens, served_dir):
    """Every case quantized by sq, read by transformers, then served by one vLLM process, in order."""
    cases = {}
    for algo, scheme, dtype, _ in CASES:
        out = _quantize(served_dir, smollm2_ckpt, algo, scheme)
        reference = None
        if scheme == "W4A16_ASYM":
            reference = dequantized_copy(out, served_dir / "dense-W4A16_ASYM", scheme, 64)
        cases[f"{algo}-{scheme}"] = Case(out, dtype, reference)
    cases["gptq-search"] = Case(_quantize(served_dir, smollm2_ckpt, "gptq", "W4A16+search"), "bfloat16")
    cases["rtn-W8A16"] = Case(_quantize(served_dir, smollm2_ckpt, "rtn", "W8A16"), "bfloat16")
    cases["untied"] = Case(_untied(smollm2_ckpt, served_dir / "untied"), "float32")
    windows, prompt = demo_tokens
    results = dict(zip(cases, compare_all(list(cases.values()), windows, prompt, python=engine, timeout=1200)))
    # float32 activations where this CPU's kernel library has them (an AMD EPYC's); else the half dtype
    # the kernel asks for (int8 / fp8 GEMMs with AMX take bf16 only): found by trying, never by CPU flags
    half = [k for k, r in results.items() if isinstance(r, SqError) and _wants_half(str(r))]
    if half:
        again = [dataclasses.replace(cases[k], dtype="bfloat16") for k in half]
        results.update(zip(half, compare_all(again, windows, prompt, python=engine, timeout=900)))
    return results


def _wants_half(message: str) -> bool:
    """vLLM's int8 / fp8 GEMM on this CPU takes half-precision activations only (a Xeon with AMX)."""
    return "expect A to be bfloat16 or half" in message


def _xfail_if_the_engine_has_no_kernel_here(error: SqError) -> None:
    """vLLM's CPU build loads one of three kernel libraries by the CPU's ISA (``CpuPlatform.import_kernels``:
    ``_C`` with avx512_bf16, ``_C_AVX512``, ``_C_AVX2``), and ``_C_AVX2`` has no WNA16 GEMM.  On such a machine
    an int4 output cannot be served by this engine at all: reported as an expected failure naming the
    reason, never on a machine whose library has the kernel (there it fails)."""
    missing = re.search(r"cpu_gemm_wna16|Failed to find a kernel|not implemented for", str(error))
    if missing and not torch.cpu._is_avx512_supported():
        pytest.xfail(f"vLLM's AVX2 kernel library cannot serve this preset on this CPU: {error}")


@pytest.mark.parametrize("algo,scheme,dtype,expected", CASES, ids=[f"{a}-{s}" for a, s, _, _ in CASES])
def test_vllm_serves_it_as_transformers_reads_it(served, algo, scheme, dtype, expected):
    """Perplexity within 2%, greedy tokens equal up to a near-tie, no warning, every Linear quantized.

    W4A16_ASYM: transformers 5.24 + compressed-tensors 0.20.1 refuse the packed zero points of any
    asymmetric pack-quantized checkpoint (llm-compressor's too), so its reference is the dense model
    sq's own dequantization gives.
    """
    result = served[f"{algo}-{scheme}"]
    if isinstance(result, SqError):
        _xfail_if_the_engine_has_no_kernel_here(result)
        raise result
    record = result.record()
    print(json.dumps(record))  # the CI log keeps the numbers
    assert result.vllm.schemes == {expected: LINEARS}, result.vllm.quant_methods
    assert record["versions"]["compressed-tensors"] == "0.17.0"  # sq writes with 0.20: the skew users hit
    assert not result.failures(), result.failures()


def test_vllm_serves_a_searched_mixed_precision_output(served):
    """``--target-bits 6 --candidates W4A16,FP8_DYNAMIC`` (GPTQ, 2 ranks): a recipe of two schemes in one
    config; vLLM builds each Linear with its scheme (fused q/k/v and gate/up share one, else vLLM refuses
    the fusion) and serves it as transformers reads it."""
    result = served["gptq-search"]
    if isinstance(result, SqError):
        _xfail_if_the_engine_has_no_kernel_here(result)
        raise result
    record = result.record()
    print(json.dumps(record))
    schemes = result.vllm.schemes
    assert set(schemes) == {"CompressedTensorsWNA16", "CompressedTensorsW8A8Fp8"}, schemes
    assert sum(schemes.values()) == LINEARS, schemes
    assert not result.failures(), result.failures()


def test_a_preset_the_cpu_engine_cannot_run_is_one_clear_error(served):
    """W8A16: vLLM 0.32's CPU WNA16 kernels take uint4 only; the refusal reaches the user as one SqError
    naming the checkpoint and vLLM's own reason, and the next checkpoint in the same engine still runs
    (the GPU check covers this preset, bench/gpu_check.sh)."""
    error = served["rtn-W8A16"]
    assert isinstance(error, SqError)
    assert re.fullmatch(r"vLLM 0\.32\.0 cannot serve \S+/rtn-W8A16: ValueError: Failed to find a kernel that can "
                        r"implement the WNA16 linear layer\. Reasons: .*uint8b128.*", str(error)), str(error)
    assert not isinstance(served["untied"], SqError)


def test_a_checkpoint_vllm_warns_about_fails_the_check(served):
    """A warning about the weights (tied embeddings with a different lm_head stored) is a serving problem
    the check reports, not noise it drops."""
    result = served["untied"]
    assert any("word embeddings are tied" in p for p in result.vllm.problems), result.vllm.log
    assert any(f.startswith("vLLM warned: ") for f in result.failures())


def test_eval_engine_vllm_and_both(engine, smollm2_ckpt, served_dir):
    """``python -m sq.eval --engine vllm`` scores the same windows as the transformers path; ``--engine
    both`` prints both, the greedy agreement, and exits 0 when they agree."""
    out = _quantize(served_dir, smollm2_ckpt, "rtn", "W8A8")
    dtype = "float32"
    common = ["sq.eval", "--model", str(out), "--nwindows", "2", "--engine-python", engine]
    served = run_python([*common, "--engine-dtype", dtype, "--engine", "vllm"], timeout=600)
    if served.returncode and _wants_half(served.stderr):
        dtype = "bfloat16"
        served = run_python([*common, "--engine-dtype", dtype, "--engine", "vllm"], timeout=600)
    assert served.returncode == 0, served.stderr[-3000:]
    assert f"engine: vLLM 0.32.0, dtype {dtype}, schemes {{'CompressedTensorsW8A8Int8': 120}}" in served.stdout
    common += ["--engine-dtype", dtype]
    both = run_python([*common, "--engine", "both", "--new-tokens", "8"], timeout=600)
    assert both.returncode == 0, both.stderr[-3000:]
    ppl = float(served.stdout.split("perplexity: ")[1].split()[0])
    assert f"vLLM {ppl:.2f}" in both.stdout
    assert both.stdout.rstrip().endswith("engines agree")


def test_eval_engine_vllm_without_an_engine_is_one_clear_error(smollm2_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("SQ_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    result = run_python(["sq.eval", "--model", str(smollm2_ckpt), "--engine", "vllm", "--nwindows", "1"], timeout=300)
    assert result.returncode == 2
    assert f"sq: error: --engine-python {tmp_path}/nowhere/python: no such file" in result.stderr


def test_an_interpreter_without_vllm_is_one_clear_error(smollm2_ckpt):
    import sys

    from sq.engines.vllm_client import run_vllm

    with pytest.raises(SqError, match=r"^\S+ cannot run vLLM: ModuleNotFoundError: No module named 'vllm'$"):
        run_vllm(smollm2_ckpt, prompt=[1, 2], new_tokens=1, python=sys.executable, timeout=300)


def test_first_divergence_and_near_ties():
    def step(token, top):
        return {"token": token, "top": top}

    same = [step(1, [[1, -0.1], [2, -3.0]])]
    assert first_divergence(same, same) is None
    tf = [step(1, [[1, -0.1], [2, -3.0]]), step(5, [[5, -0.50], [6, -0.55]])]
    vl = [step(1, [[1, -0.2], [2, -2.0]]), step(6, [[6, -0.40], [5, -0.90]])]
    d = first_divergence(tf, vl)
    assert (d.position, d.transformers_token, d.vllm_token) == (1, 5, 6)
    assert d.transformers_margin == pytest.approx(0.05) and d.vllm_margin == pytest.approx(0.5)
    assert d.near_tie(0.1) and not d.near_tie(0.01)
    far = Divergence(0, 1, 2, float("inf"), 0.5)  # vLLM's choice is not in transformers' top 2
    assert not far.near_tie(0.1) and far.near_tie(0.6)


def test_fp8_gemm_routing_is_measured_and_exact():
    """The worker measures torch's CPU fp8 GEMM both ways and routes it through the emulation only where that
    is several times faster and gives the same numbers; either way the routed ``torch._scaled_mm`` is the
    exact product of the fp8 values (run in sq's own torch: the worker imports nothing from vLLM for this)."""
    script = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("worker", sys.argv[1])
worker = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker)
report = worker._route_fp8_gemm()
g = torch.Generator().manual_seed(1)
a = torch.randn(48, 320, generator=g).to(torch.float8_e4m3fn)
b = torch.randn(192, 320, generator=g).to(torch.float8_e4m3fn).t()
out = torch._scaled_mm(a, b, scale_a=torch.ones(1), scale_b=torch.ones(1), out_dtype=torch.float32)
exact = a.double() @ b.double()
print(json.dumps(report | {"err": float((out.double() - exact).abs().max() / exact.abs().max())}))
"""
    from sq.engines.vllm_client import WORKER

    result = subprocess.run([sys.executable, "-c", script, str(WORKER)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["used"] in ("emulated", "default") and report["same"], report
    assert report["used"] == "default" or report["emulated_s"] * 4 < report["onednn_s"], report
    assert report["err"] < 1e-5, report


def test_int4_served_with_int8_activations_is_reported(engine, served, served_dir, demo_tokens, monkeypatch):
    """vLLM's CPU build may run int4 weights with int8 activations (``VLLM_CPU_INT4_W4A8=1``, its default where
    the CPU has AMX tiles): W4A8, not the W4A16 the checkpoint holds.  sq's check turns that off, and when a
    user turns it back on the check names it instead of reporting a mere perplexity gap."""
    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "1")
    windows, prompt = demo_tokens
    (result,) = compare_all([Case(served_dir / "rtn-W4A16", "bfloat16")], windows[:1], prompt, python=engine,
                            timeout=900)
    assert not isinstance(result, SqError), result
    named = [f for f in result.failures() if "int8 activations" in f]
    if result.vllm.w4a8:  # this CPU's engine took W4A8 (found by asking the engine, not by CPU flags)
        assert result.vllm.w4a8 == LINEARS and named, result.record()
    else:
        assert not named and result.vllm.schemes == {"CompressedTensorsWNA16": LINEARS}, result.record()
    assert all(not r.vllm.w4a8 for r in served.values() if not isinstance(r, SqError))  # the default check: W4A16


def _llama128(root):
    from sq.testing.checkpoints import build_llama

    return build_llama(root, dtype=torch.bfloat16, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, num_hidden_layers=2)


def _moe128(root):
    from sq.testing.checkpoints import build_qwen3_moe

    return build_qwen3_moe(root, dtype=torch.bfloat16, hidden_size=256, moe_intermediate_size=128,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                           num_hidden_layers=2)


# Presets vLLM's CPU build runs only where its kernel library has the kernel (AMX tiles): (case, model,
# preset, sq.ptq flags, what vLLM must build, the refusal where it has no kernel).  Two layers each.
MOE_BUILT = {"schemes": {"CompressedTensorsWNA16": 2 * 2}, "quant_methods": {"CompressedTensorsWNA16MoEMethod": 2}}
MOE_REFUSAL = r"No WNA16 MoE backend supports|Failed to find a kernel"
KERNEL_DEPENDENT = [
    ("fp8-block", _llama128, "FP8_BLOCK", ["--algo", "rtn"], {"schemes": {"CompressedTensorsW8A8Fp8": 2 * 4}},
     r"requires AMX tile support|Failed to find a kernel"),
    ("moe-w4a16", _moe128, "W4A16", ["--algo", "rtn", "--group-size", "64"], MOE_BUILT, MOE_REFUSAL),
    # --rotate r4: down_proj's input rotated online (transform_config). vLLM 0.32's CPU build cannot apply an
    # online transform at all (its dense fallback calls the CPU GEMM on a module without one); the GPU runs it
    ("w4a16-r4", _llama128, "W4A16", ["--algo", "rtn", "--group-size", "64", "--rotate", "r4", "--rotate-block", "64"],
     {"schemes": {"CompressedTensorsWNA16": 2 * 4}}, r"'HadamardTransform' object has no attribute 'cpu_linear'"),
    # the path MoE users run: 2 ranks, experts split between them (--ep 2), GPTQ
    ("moe-gptq-ep2", _moe128, "W4A16", ["--algo", "gptq", "--group-size", "64", "--ep", "2", "--nsamples", "16",
                                        "--seqlen", "128"], MOE_BUILT, MOE_REFUSAL),
]


@pytest.mark.parametrize("case,build,preset,flags,built,refusal", KERNEL_DEPENDENT, ids=[k[0] for k in KERNEL_DEPENDENT])
def test_served_where_the_engine_has_its_kernel(engine, tmp_path, case, build, preset, flags, built, refusal):
    """FP8_BLOCK at widths that are multiples of 128 (a random Llama, hidden 256) and a W4A16 MoE (a random
    Qwen3-MoE, every layer's experts packed; RTN, and GPTQ on 2 ranks with the experts split between them):
    vLLM's CPU build has their kernels only with AMX tiles (bf16).  An online rotation (``--rotate r4``), which
    vLLM's CPU build cannot apply on any CPU: one SqError, never a checkpoint served without its rotation.
    Found by asking the engine: where it builds the layers (a Xeon with AMX) the output is served as
    transformers reads it; where it does not (an AMD EPYC), the refusal is one SqError naming vLLM's reason."""
    from sq.calib.data import BUILTIN_PYDOC, eval_windows, load_tokenizer, read_corpus, tokenize_corpus

    src = build(tmp_path / "src")
    out = tmp_path / case
    args = ["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", preset, *flags]
    res = run_cli(args, 2, timeout=300) if "--ep" in flags else run_python(args, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    tokenizer = load_tokenizer(src)
    windows = eval_windows(tokenize_corpus(tokenizer, read_corpus(BUILTIN_PYDOC).text(tokenizer)), 4, 256)
    (result,) = compare_all([Case(out, "bfloat16")], windows, tokenizer(PROMPT)["input_ids"], python=engine,
                            timeout=900)
    if isinstance(result, SqError):
        assert re.search(rf"cannot serve \S+/{case}: .*({refusal})", str(result)), str(result)
        return
    print(json.dumps(result.record()))
    assert result.vllm.schemes == built["schemes"], result.vllm.quant_methods
    for method, n in built.get("quant_methods", {}).items():
        assert result.vllm.quant_methods.get(method) == n, result.vllm.quant_methods
    assert not result.failures(), result.failures()
