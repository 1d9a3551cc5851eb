"""The conformance zoo: every model_type of ``sq.testing.zoo.ZOO`` (dense, MoE, hybrid, VLM) through the CLI.

``--rotate r1,r2`` (RTN W8A16, 1 rank) on every type too: either the output computes the source's function
(``check_rotated``: logits within W8A16's error, every block's proof exact to float32 rounding) or the run is
refused by name (``ROTATE_REFUSED``: a LayerNorm, a sandwich norm, gated attention values, experts sq does not
rotate, a layout whose proof fails); never a wrong checkpoint.

Each type's tiny seeded checkpoint is quantized with GPTQ W4A16 at 2 ranks (``--ep 2`` for MoE: experts
split over the ranks), and at 1 rank with GPTQ W4A16 and model-free RTN W4A16 (all 1-rank runs in one
interpreter, ``sq.testing.zoo_one_rank``).  Every output must load in transformers (as the source's own class: a VLM
as its ``*ForConditionalGeneration``) with no missing or unexpected keys, quantize no router and no vision
tower, and give the logits of the source with each quantized weight replaced by its dequantized value
(``check_output``: an exact layout check, float tolerance only).  Types sq cannot write a loadable quantized
layout for are refused by name, with exit 2 on every rank and nothing written.  ``docs/models.md`` is this
matrix (``python bench/zoo.py`` regenerates it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import run_cli
from sq.testing.zoo import ZOO, build_zoo, check_output

# refused by name on the model path (GPTQ), with the words the message must hold; model-free carries
# their experts per expert
REFUSED = {"llama4_text": "SequentialLlama4TextExperts", "llama4": "SequentialLlama4TextExperts"}


# refused by --rotate r1,r2, with the words of the reason (each a layout a rotation does not commute with)
_SANDWICH = "normalizes a branch's output before the residual add"
_NOT_EXPERTS = "reads the residual stream but is neither a Linear-like weight"
_NO_FINAL_NORM = "the final norm that lm_head reads cannot be told"
_R2 = "--rotate r2: block 1"
ROTATE_REFUSED = {
    "cohere": "it centres its input", "cohere2": "it centres its input",
    "deepseek_v4": _NOT_EXPERTS, "gpt_oss": _NOT_EXPERTS, "granitemoe": _NOT_EXPERTS,
    "granitemoehybrid": _NOT_EXPERTS, "granitemoeshared": _NOT_EXPERTS, "longcat_flash": _NOT_EXPERTS,
    "qwen3_vl_moe": _NOT_EXPERTS,
    "afmoe": _SANDWICH, "exaone4": _SANDWICH, "flex_olmo": _SANDWICH, "gemma2": _SANDWICH, "gemma3": _SANDWICH, "gemma3_text": _SANDWICH,
    "gemma4_text": _SANDWICH, "zamba2": _SANDWICH, "glm4": _SANDWICH, "olmo2": _SANDWICH, "olmo3": _SANDWICH,
    "falcon_h1": "--rotate r1: block 0", "minimax": "--rotate r1: block 0", "kimi_linear": "--rotate r2: block 0",
    "qwen3_5": _R2, "qwen3_5_moe_text": _R2, "qwen3_5_text": _R2, "qwen3_next": _R2,
    "nemotron": _NO_FINAL_NORM, "phi": _NO_FINAL_NORM, "phimoe": _NO_FINAL_NORM, "stablelm": _NO_FINAL_NORM,
    "starcoder2": _NO_FINAL_NORM,
    **REFUSED,
}


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module")
def sources(zoo_root) -> dict[str, Path]:
    return {t: build_zoo(zoo_root / t, t) for t in ZOO}


@pytest.fixture(scope="module")
def one_rank(sources, zoo_root) -> dict[tuple[str, str], dict]:
    res = run_cli(["sq.testing.zoo_one_rank", str(zoo_root), *sources], 1, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    records = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    return {(r["type"], r["mode"]): r for r in records}


@pytest.mark.parametrize("model_type", list(ZOO))
def test_zoo_rotate(model_type, one_rank):
    r = one_rank[model_type, "rotate"]
    assert r["traceback"] is None, r["traceback"]
    if model_type in ROTATE_REFUSED:
        assert r["rc"] == 2 and len(r["errors"]) == 1 and ROTATE_REFUSED[model_type] in r["errors"][0], r
        return
    assert r["rc"] == 0, r
    assert isinstance(r["check"], dict), r["check"]


@pytest.mark.parametrize("mode", ["gptq", "model-free"])
@pytest.mark.parametrize("model_type", list(ZOO))
def test_zoo_one_rank(model_type, mode, one_rank):
    r = one_rank[model_type, mode]
    assert r["traceback"] is None, r["traceback"]
    if mode == "gptq" and model_type in REFUSED:
        assert r["rc"] == 2 and len(r["errors"]) == 1 and REFUSED[model_type] in r["errors"][0], r
        return
    assert r["rc"] == 0, r
    assert isinstance(r["check"], dict), r["check"]


def _args(src: Path, out: Path, moe: bool, allow_carried: bool = False) -> list[str]:
    args = ["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", "W4A16", "--algo", "gptq",
            "--group-size", "8", "--nsamples", "4", "--seqlen", "32"]
    return args + (["--ep", "2"] if moe else []) + (["--allow-unquantized-experts"] if allow_carried else [])


@pytest.mark.parametrize("model_type", list(ZOO))
def test_zoo_gptq_two_ranks(model_type, sources, zoo_root):
    src, out = sources[model_type], zoo_root / f"{model_type}-gptq-2"
    # a refusal: every rank runs to its own exit (torchrun would stop the others at the first exit)
    res = run_cli(_args(src, out, ZOO[model_type].moe, ZOO[model_type].allow_carried(False)), 2, timeout=240,
                  stop_on_failure=model_type not in REFUSED)
    if model_type in REFUSED:
        assert res.returncode != 0 and all(c == 2 for c in res.codes), res.output[-3000:]
        assert REFUSED[model_type] in res.stderr and "Traceback" not in res.output, res.stderr[-3000:]
        assert res.stderr.count("sq: error:") == 1, res.stderr  # rank 0 speaks for all
        assert not (out / "config.json").exists()
        return
    assert res.returncode == 0, res.output[-4000:]
    check_output(src, out)
    shutil.rmtree(out)
