"""End-to-end PTQ: torchrun / python -m sq.ptq on the tiny Llama, loaded back by transformers.

Reference: the source weights fake-quantized by ``sq.quant.rtn`` in one process; N-rank
RTN outputs must be bit-identical to 1-rank; GPTQ must beat RTN layer by layer on the
same Hessians.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from harness import run_cli, run_python
from quant_ref import read_tensors

GROUP = 32  # divides the fixture's hidden 64 and intermediate 128
CALIB = ["--nsamples", "8", "--seqlen", "32"]


def _ptq(src: Path, out: Path, world: int, *args: str, timeout: float = 120.0):
    argv = ["sq.ptq", "--model", str(src), "--output", str(out), *args]
    res = run_python(argv, timeout=timeout) if world == 1 else run_cli(argv, world, timeout=timeout)
    return res


def _ok(res):
    assert res.returncode == 0, res.output[-4000:]


@pytest.fixture(scope="module")
def rtn_outputs(checkpoints, tmp_path_factory):
    """RTN W4A16 of the tiny Llama at world sizes 1, 2 and 3."""
    src = checkpoints["llama"]
    root = tmp_path_factory.mktemp("ptq-rtn")
    outs = {}
    for world in (1, 2, 3):
        outs[world] = root / f"w{world}"
        _ok(_ptq(src, outs[world], world, "--algo", "rtn", "--scheme", "W4A16", "--group-size", str(GROUP)))
    return src, outs


@pytest.fixture(scope="module")
def gptq_output(checkpoints, tmp_path_factory):
    src = checkpoints["llama"]
    out = tmp_path_factory.mktemp("ptq-gptq") / "out"
    res = _ptq(src, out, 2, "--algo", "gptq", "--scheme", "W4A16", "--group-size", str(GROUP), *CALIB)
    _ok(res)
    (out.parent / "console.txt").write_text(res.output)
    return src, out


def test_run_leaves_logs_summary_and_picture(gptq_output):
    """Per-rank log files, one progress line per block with an ETA, the summary, sq_report.png."""
    src, out = gptq_output
    n_blocks = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    console = (out.parent / "console.txt").read_text()
    for b in range(1, n_blocks + 1):
        assert f"block {b}/{n_blocks} done in " in console and "ETA " in console
    assert "done in " in console and "rank 1: peak RSS" in console
    assert "largest relative error (output (through H))" in console
    logs = sorted((out / "sq_logs").iterdir())
    assert [p.name for p in logs] == ["rank-00000.log", "rank-00001.log"]
    assert f"block {n_blocks}/{n_blocks} done" in logs[0].read_text()
    assert "[sq r1 " in logs[1].read_text()  # every rank writes its own file, rank 1 included
    png = (out / "sq_report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _load(out: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def test_rtn_two_ranks_loads_and_matches_fake_quant_reference(rtn_outputs):
    from transformers import AutoModelForCausalLM

    from sq.quant import rtn
    from sq.formats.schemes import get_scheme

    src, outs = rtn_outputs
    out = outs[2]
    model = _load(out)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["format"] == "pack-quantized" and "lm_head" in qc["ignore"]
    assert config.get("tie_word_embeddings") is True
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert "lm_head.weight" not in names  # tied in the source: no key of its own
    assert "model.layers.0.self_attn.q_proj.weight_packed" in names
    for f in ("tokenizer.json", "generation_config.json", "sq_report.json"):
        assert (out / f).is_file(), f

    scheme = get_scheme("W4A16", GROUP)
    ref = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for n, m in ref.named_modules():
            if isinstance(m, torch.nn.Linear) and n.startswith("model.layers."):
                m.weight.copy_(rtn.fake_quantize(m.weight, scheme))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    got, want = _logits(model, ids), _logits(ref, ids)
    rel = float((got - want).norm() / want.norm())
    assert rel <= 1e-3, rel


def test_rtn_bit_identical_across_world_sizes(rtn_outputs):
    _, outs = rtn_outputs
    base = read_tensors(outs[1])
    for world in (2, 3):
        other = read_tensors(outs[world])
        assert set(other) == set(base), world
        for k, v in base.items():
            assert other[k].dtype == v.dtype and torch.equal(other[k], v), (world, k)


def test_gptq_two_ranks_loads_and_beats_rtn(gptq_output):
    src, out = gptq_output
    model = _load(out)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(_logits(model, ids)).all()
    report = json.loads((out / "sq_report.json").read_text())
    layers = report["layers"]
    n_blocks = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert len(layers) == 7 * n_blocks  # q, k, v, o, gate, up, down per block
    for name, e in layers.items():
        assert 0 < e["rel_err"] < e["rtn_rel_err"], (name, e)
    assert len(report["ranks"]) == 2 and all(r["peak_rss_bytes"] > 0 for r in report["ranks"])
    assert report["args"]["algo"] == "gptq"


def test_group_size_not_dividing_refused_on_every_rank(checkpoints, tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = _ptq(checkpoints["llama"], out, 2, "--algo", "rtn", "--group-size", "48", timeout=60)
    assert res.returncode != 0
    assert "sq: error:" in res.stderr and "group size 48 does not divide in_features 64" in res.stderr, res.stderr[-2000:]
    assert "model.layers.0.self_attn.q_proj" in res.stderr
    assert time.monotonic() - t0 < 60
    assert not out.exists() or not any(out.iterdir())


def test_non_empty_output_refused(checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    res = _ptq(checkpoints["llama"], out, 1, "--algo", "rtn", "--group-size", str(GROUP), timeout=60)
    assert res.returncode != 0
    assert "sq: error:" in res.stderr and "is not empty" in res.stderr, res.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_bad_arguments_refused_in_process(tmp_path):
    from sq.ptq import main

    assert main(["--model", "x", "--output", str(tmp_path / "o"), "--scheme", "W3"]) == 2
    assert main(["--model", "x", "--output", str(tmp_path / "o"), "--algo", "awq"]) == 2
