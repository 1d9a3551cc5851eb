"""--target-bits: scores per unit and candidate, the allocation under the budget, the recipe, and the
job around them (2 ranks vs 1, killed mid-search and resumed, refusals on every rank)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness import run_cli, run_ranks
from quant_ref import quantize_jobs, read_tensors
from sq.errors import SqError
from sq.formats.schemes import get_scheme
from sq.pipeline.search import Unit, allocate, effective_bits

GS = 16


def test_effective_bits_count_what_the_format_stores():
    def bits(name, out=576, inp=576, gs=64):
        return effective_bits(get_scheme(name, group_size=gs), out, inp)

    shape = 128 / (576 * 576)  # the int64 [2] weight_shape record
    # int4 codes packed 8 to an int32, one bf16 scale per group
    assert bits("W4A16") == pytest.approx(4.25 + shape, abs=1e-9)
    assert bits("W4A16", inp=512, gs=128) == pytest.approx(4.125 + 128 / (576 * 512), abs=1e-9)
    # asymmetric: an int4 zero point per group too (packed along the rows)
    assert bits("W4A16_ASYM") == pytest.approx(4.25 + 4 / 64 + shape, abs=1e-9)
    # int8, one bf16 scale per group
    assert bits("W8A16") == pytest.approx(8.25 + shape, abs=1e-9)
    # FP8 per channel: one bf16 scale per row
    assert bits("FP8_DYNAMIC") == pytest.approx(8 + 16 / 576, abs=1e-9)
    # NVFP4: e2m1 codes, an fp8 scale per 16, a float32 global scale
    assert bits("NVFP4A16") == pytest.approx(4.5 + 32 / 576**2 + shape, rel=1e-4)


def _units():
    # scores W4 / W8: unit b gains most per bit, then a; c nothing
    return [Unit(["a"], [[10, 100]], {"W4": 5.0, "W8": 1.0}), Unit(["b"], [[10, 100]], {"W4": 9.0, "W8": 1.0}),
            Unit(["c"], [[10, 100]], {"W4": 1.0, "W8": 1.0})]


BITS = {"W4": 4.0, "W8": 8.0}


def _cost(u, c):
    return BITS[c] * u.params


@pytest.mark.parametrize("target,want", [(4.0, ["W4", "W4", "W4"]), (5.4, ["W4", "W8", "W4"]),
                                         (6.7, ["W8", "W8", "W4"]), (8.0, ["W8", "W8", "W4"])])
def test_allocation_takes_the_best_gain_per_bit_within_the_budget(target, want):
    units = _units()
    reached = allocate(units, _cost, target)
    assert [u.choice for u in units] == want
    assert reached <= target + 1e-12
    assert reached == pytest.approx(sum(BITS[u.choice] * u.params for u in units) / 3000)


def test_allocation_refusals_and_disallowed_candidates():
    with pytest.raises(SqError, match="below what the cheapest candidates store"):
        allocate(_units(), _cost, 3.9)
    units = [Unit(["a"], [[1, 10]], {"W4": math.inf, "W8": 2.0}), Unit(["b"], [[1, 10]], {"W4": 3.0, "W8": 1.0})]
    allocate(units, _cost, 6.0)  # a can only take W8 (W4's groups do not divide it): b stays at W4
    assert [u.choice for u in units] == ["W8", "W4"]
    with pytest.raises(SqError, match="no candidate"):
        allocate([Unit(["a"], [[1, 10]], {"W4": math.inf})], _cost, 8.0)


def _job(model, out, **kw) -> dict:
    return dict(model=str(model), output=str(out), algo="gptq", scheme="W4A16", group_size=GS, nsamples=4, seqlen=16,
                timeout_s=120, target_bits=8.0, candidates=("W4A16", "W8A16"), **kw)


def _argv(model, out, *extra) -> list[str]:
    return ["sq.ptq", "--model", str(model), "--output", str(out), "--group-size", str(GS), "--nsamples", "4",
            "--seqlen", "16", "--timeout", "120", "--target-bits", "8", "--candidates", "W4A16,W8A16", *extra]


def _search_runs(checkpoint, root):
    """The same search at 2 ranks and at 1 (``root / w2``, ``root / w1``)."""
    for world in (2, 1):
        errors = run_ranks(quantize_jobs, world, [_job(checkpoint, root / f"w{world}")], timeout=600)[0]
        assert errors == [None], errors
    return root


@pytest.fixture(scope="module")
def searched(checkpoints, tmp_path_factory):
    return _search_runs(checkpoints["llama"], tmp_path_factory.mktemp("search"))


def test_search_writes_the_recipe_it_quantized_with(searched):
    from transformers import AutoModelForCausalLM

    out = searched / "w2"
    report = json.loads((out / "sq_report.json").read_text())
    search = report["search"]
    assert 6.1 < search["bits_reached"] <= 8.0  # float32 fixture: W4A16 g16 stores 6.02, W8A16 10.02
    choices = {u["choice"] for u in search["units"].values()}
    assert choices == {"W4A16", "W8A16"}, search["units"]
    # fused partners share their choice; the recipe file says what the checkpoint holds
    for key, u in search["units"].items():
        for name in key.split(" + "):
            assert report["assignment"][name].startswith("int4" if u["choice"] == "W4A16" else "int8"), (name, u)
    assert any(" + " in key for key in search["units"]), "q/k/v read one input: one unit"
    text = (out / "sq_recipe.yaml").read_text()
    assert text.startswith("# written by sq --target-bits 8") and "rules:" in text
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert len(json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]) == 2


def test_the_recipe_file_reruns_to_the_same_checkpoint(checkpoints, searched, tmp_path):
    """OUT/sq_recipe.yaml is exactly what the search quantized with: given back as --recipe, without
    the search, it writes the same tensors."""
    job = _job(checkpoints["llama"], tmp_path / "again", recipe=str(searched / "w2" / "sq_recipe.yaml"))
    job["target_bits"] = None
    errors = run_ranks(quantize_jobs, 2, [job], timeout=600)[0]
    assert errors == [None], errors
    a, b = read_tensors(tmp_path / "again"), read_tensors(searched / "w2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_and_two_ranks_choose_the_same_recipe(searched):
    one, two = (json.loads((searched / w / "sq_report.json").read_text())["search"] for w in ("w1", "w2"))
    assert {k: u["choice"] for k, u in one["units"].items()} == {k: u["choice"] for k, u in two["units"].items()}
    for k, u in one["units"].items():
        for c, s in u["scores"].items():
            assert s == pytest.approx(two["units"][k]["scores"][c], rel=1e-3), (k, c)


def test_killed_mid_search_resumes_to_the_same_output(checkpoints, searched, tmp_path):
    out = tmp_path / "o"
    argv = _argv(checkpoints["llama"], out)
    killed = run_cli(argv, 2, timeout=300, env={"SQ_FAULT": "search:0:1"})
    assert killed.returncode != 0 and "fault injection: SIGKILL at search" in killed.output
    assert (out / ".sq-run" / "search" / "block-00000.json").is_file()
    assert not (out / "sq_recipe.yaml").exists()
    again = run_cli(argv, 2, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert "scores of 2 block(s) kept from an earlier run" in again.output, again.output[-3000:]
    assert (out / "sq_recipe.yaml").read_text() == (searched / "w2" / "sq_recipe.yaml").read_text()
    a, b = read_tensors(out), read_tensors(searched / "w2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_killed_after_the_search_reuses_its_recipe(checkpoints, searched, tmp_path):
    out = tmp_path / "o"
    argv = _argv(checkpoints["llama"], out)
    killed = run_cli(argv, 2, timeout=300, env={"SQ_FAULT": "after-shard-write:1:1"})
    assert killed.returncode != 0
    again = run_cli(argv, 2, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert "the search finished in an earlier run" in again.output, again.output[-3000:]
    assert "resuming at block" in again.output, again.output[-3000:]
    a, b = read_tensors(out), read_tensors(searched / "w2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "sq_report.json").read_text())["search"]["units"]


@pytest.mark.parametrize("extra,why", [
    (["--algo", "rtn"], "--algo rtn reads none"),
    (["--candidates", "W4A16"], "at least two schemes"),
    (["--candidates", "W4A16,W9A16"], "--candidates W9A16"),
    (["--recipe", "r.yaml"], "cannot be given beside --recipe"),
    (["--target-bits", "5"], "below what the cheapest candidates store on this model (6.02"),
    (["--algo", "rtn", "--model-free"], "model-free quantization reads no calibration data, but --target-bits"),
])
def test_refused_on_every_rank_before_writing(checkpoints, tmp_path, extra, why):
    (tmp_path / "r.yaml").write_text("default: W4A16\n")
    argv = _argv(checkpoints["llama"], tmp_path / "o", *extra)
    res = run_cli(argv, 2, timeout=120, stop_on_failure=False, cwd=str(tmp_path))
    assert res.codes == [2, 2] and why in res.stderr, res.output[-3000:]
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def searched_moe(checkpoints, tmp_path_factory):
    return _search_runs(checkpoints["qwen3_moe"], tmp_path_factory.mktemp("search-moe"))


def test_moe_experts_module_is_one_unit(searched_moe):
    """Qwen3-MoE at 2 ranks (expert parallel) and 1: each block's routed-experts module is one unit
    (a recipe names experts by their module), scored by quantizing every expert; the same choice on
    both.  (transformers 5.24 does not load a mixed-recipe MoE checkpoint, searched or written by
    hand: docs/recipes.md, "Loading mixed recipes".)"""
    one, two = (json.loads((searched_moe / w / "sq_report.json").read_text()) for w in ("w1", "w2"))
    units = two["search"]["units"]
    experts = [k for k in units if k.endswith(".mlp.experts")]
    assert experts and all(math.isfinite(s) for k in experts for s in units[k]["scores"].values())
    assert {k: u["choice"] for k, u in units.items()} == {k: u["choice"] for k, u in one["search"]["units"].items()}
    for k in experts:
        assert two["assignment"][k].startswith("int4" if units[k]["choice"] == "W4A16" else "int8")
    a, b = read_tensors(searched_moe / "w1"), read_tensors(searched_moe / "w2")
    assert a.keys() == b.keys()


def test_moe_refuses_candidates_with_cross_row_scales(checkpoints, tmp_path):
    argv = _argv(checkpoints["qwen3_moe"], tmp_path / "o")
    argv[argv.index("--candidates") + 1] = "W4A16,NVFP4A16"
    res = run_cli(argv, 2, timeout=120, stop_on_failure=False)
    assert res.codes == [2, 2] and "--candidates NVFP4A16: scales with a statistic" in res.stderr, res.output[-3000:]
