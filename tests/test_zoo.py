"""The conformance zoo: every architecture family of ``sq.testing.zoo.ZOO`` through GPTQ W4A16 on the CLI.

Each model_type's tiny seeded checkpoint is quantized at 2 ranks (``--ep 2`` for MoE: experts split over
the ranks) and, for one type per family, at 1 rank; the output must load in transformers with no missing
or unexpected keys and give the logits of the source with each quantized weight replaced by its
dequantized value (``check_output``: an exact layout check, float tolerance only).  Types sq cannot write
a loadable quantized layout for are refused by name, with exit 2 on every rank and nothing written.
``docs/models.md`` is this matrix (``python bench/zoo.py`` regenerates it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from harness import run_cli
from sq.testing.zoo import ZOO, build_zoo, check_output

TEXT = [t for t, e in ZOO.items() if e.family != "vlm"]
# refused by name, with the words the message must hold
REFUSED = {"llama4_text": "SequentialLlama4TextExperts"}
ONE_RANK = {"llama", "gemma3_text", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "nemotron_h"}


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def _args(src: Path, out: Path, moe: bool) -> list[str]:
    args = ["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", "W4A16", "--algo", "gptq",
            "--group-size", "8", "--nsamples", "4", "--seqlen", "32"]
    return args + (["--ep", "2"] if moe else [])


@pytest.mark.parametrize("model_type", TEXT)
def test_zoo_gptq(model_type, zoo_root):
    src = build_zoo(zoo_root / model_type, model_type)
    moe = ZOO[model_type].family == "moe"
    worlds = (1, 2) if model_type in ONE_RANK else (2,)
    for world in worlds:
        out = zoo_root / f"{model_type}-out{world}"
        # a refusal: every rank runs to its own exit (torchrun would stop the others at the first exit)
        res = run_cli(_args(src, out, moe and world == 2), world, timeout=240,
                      stop_on_failure=model_type not in REFUSED)
        if model_type in REFUSED:
            assert res.returncode != 0 and all(c == 2 for c in res.codes), res.output[-3000:]
            assert REFUSED[model_type] in res.stderr and "Traceback" not in res.output, res.stderr[-3000:]
            assert res.stderr.count("sq: error:") == 1, res.stderr  # rank 0 speaks for all
            assert not (out / "config.json").exists()
            continue
        assert res.returncode == 0, res.output[-4000:]
        check_output(src, out)
        shutil.rmtree(out)
    shutil.rmtree(src)
