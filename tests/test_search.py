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


def _search_runs(checkpoint, root, **kw):
    """The same search at 2 ranks and at 1 (``root / w2``, ``root / w1``)."""
    for world in (2, 1):
        errors = run_ranks(quantize_jobs, world, [_job(checkpoint, root / f"w{world}", **kw)], timeout=600)[0]
        assert errors == [None], errors
    return root


@pytest.fixture(scope="module")
def searched(checkpoints, tmp_path_factory):
    return _search_runs(checkpoints["llama"], tmp_path_factory.mktemp("search"))


@pytest.fixture(scope="module")
def searched_mse(checkpoints, tmp_path_factory):
    return _search_runs(checkpoints["llama"], tmp_path_factory.mktemp("search-mse"), search_score="mse")


def test_search_writes_the_recipe_it_quantized_with(searched):
    from transformers import AutoModelForCausalLM

    out = searched / "w2"
    report = json.loads((out / "sq_report.json").read_text())
    search = report["search"]
    assert search["score"] == "fisher" and search["score_quantizer"] == "gptq"  # the defaults for a dense GPTQ job
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


@pytest.mark.parametrize("fixture", ["searched", "searched_mse"])
def test_one_and_two_ranks_choose_the_same_recipe(fixture, request):
    searched = request.getfixturevalue(fixture)
    one, two = (json.loads((searched / w / "sq_report.json").read_text())["search"] for w in ("w1", "w2"))
    assert one["score"] == two["score"] == ("mse" if fixture == "searched_mse" else "fisher")
    assert {k: u["choice"] for k, u in one["units"].items()} == {k: u["choice"] for k, u in two["units"].items()}
    for k, u in one["units"].items():
        for c, s in u["scores"].items():
            assert s == pytest.approx(two["units"][k]["scores"][c], rel=1e-3), (k, c)


@pytest.mark.parametrize("score", ["mse", "fisher"])
def test_killed_mid_search_resumes_to_the_same_output(checkpoints, score, request, tmp_path):
    """Killed after block 1's scores: mse scores blocks first to last, fisher last to first (its
    gradient comes back from the logits); the rerun keeps those scores and ends bit-identical."""
    searched = request.getfixturevalue("searched_mse" if score == "mse" else "searched")
    out = tmp_path / "o"
    argv = _argv(checkpoints["llama"], out, "--search-score", score)
    killed = run_cli(argv, 2, timeout=300, env={"SQ_FAULT": "search:0:1"})
    assert killed.returncode != 0 and "fault injection: SIGKILL at search" in killed.output
    kept = sorted(f.name for f in (out / ".sq-run" / "search").glob("block-*.json"))
    assert "block-00001.json" in kept and ("block-00000.json" in kept) == (score == "mse"), kept
    if score == "fisher":  # this rank's block inputs, kept while the search runs
        assert (out / ".sq-run" / "search" / "inputs-rank00000").is_dir()
    assert not (out / "sq_recipe.yaml").exists()
    again = run_cli(argv, 2, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert f"scores of {len(kept)} block(s) kept from an earlier run" in again.output, again.output[-3000:]
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
    assert two["search"]["score"] == "mse"  # auto: routed experts have no backward
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


@pytest.mark.parametrize("tied", [False, True])
def test_fisher_gradients_are_the_models_own(tied):
    """--search-score fisher's gradients at each block's output -- the head's (``head_grads``: the model's
    own norm and lm_head after the layers) carried back block by block (``block_grads``) -- equal
    autograd's through the whole model with the next-token loss (transformers' own ``labels`` loss)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sq.quant.forward import block_forward, block_grads, capture_block0, head_grads

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
    model.eval()
    ids = torch.randint(0, 96, (3, 12))
    outs = {}

    def keep(i):
        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            y.retain_grad()
            outs[i] = y
        return hook

    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(model.model.layers)]
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for h in hooks:
        h.remove()
    for p in model.parameters():
        p.requires_grad_(False)
    inputs = capture_block0(model, ids, "cpu")
    chain = [inputs]
    for layer in model.model.layers:
        ys = block_forward(layer, chain[-1], len(chain[-1]), chain[-1][0])
        chain.append([(y, kw) for y, (_, kw) in zip(ys, chain[-1])])
    g = head_grads(model, [h for h, _ in chain[-1]], ids, ids.shape[0] * (ids.shape[1] - 1))
    for i in reversed(range(3)):
        torch.testing.assert_close(torch.cat(g), outs[i].grad, rtol=1e-4, atol=1e-7)
        g = block_grads(model.model.layers[i], chain[i], g, len(chain[i]), chain[i][0])
    assert all(not p.requires_grad for p in model.parameters())  # put back as they were


def test_moe_refuses_fisher_scores(checkpoints, tmp_path):
    """Routed experts' expert-parallel forward is not differentiable: asked for, the loss's gradient
    scores are refused on every rank (auto scores such a model by mse: test_moe_experts_module_is_one_unit)."""
    argv = _argv(checkpoints["qwen3_moe"], tmp_path / "o", "--search-score", "fisher")
    res = run_cli(argv, 2, timeout=120, stop_on_failure=False)
    assert res.codes == [2, 2] and "--search-score fisher carries the loss's gradient" in res.stderr, res.output[-3000:]
    assert not (tmp_path / "o").exists()


def _layer_scores(rank, world, solver):
    """Layer 0 of a seeded tiny Llama scored on 4 windows (this rank's ``rank::world``), by ``solver``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sq.formats.schemes import get_scheme
    from sq.pipeline.search import _score_block, score_solver
    from sq.quant.forward import capture_block0
    from sq.quant.gptq import GPTQConfig
    from sq.quant.work import Linear

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval().requires_grad_(False)
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    inputs = capture_block0(model, ids[rank::world], "cpu")
    layer = model.model.layers[0]
    lins = [Linear(f"model.layers.0.{n}", m, f"model.layers.0.{n}", 0, None) for n, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear)]
    schemes = {c: get_scheme(c, group_size=GS) for c in ("W4A16", "W8A16")}
    units, _ = _score_block(layer, lins, [], schemes, inputs, 1, inputs[0], None,
                            gptq=score_solver(GPTQConfig()) if solver == "gptq" else None)
    return {u.key(): u.scores for u in units}


def test_gptq_jobs_score_the_error_gptq_leaves():
    """A GPTQ job's search scores each unit as GPTQ quantizes it (against the unit's Hessian summed over
    the ranks' tokens): below RTN's error at 4 bits, and the same at 1 and 2 ranks."""
    rtn_one, gptq_one = (run_ranks(_layer_scores, 1, s, timeout=300)[0] for s in ("rtn", "gptq"))
    gptq_two = run_ranks(_layer_scores, 2, "gptq", timeout=300)[0]
    assert rtn_one.keys() == gptq_one.keys() and len(gptq_one) == 4  # q/k/v, o, gate/up, down
    for k in gptq_one:
        assert gptq_one[k]["W4A16"] < rtn_one[k]["W4A16"], (k, gptq_one[k], rtn_one[k])
        for c in ("W4A16", "W8A16"):
            assert gptq_two[k][c] == pytest.approx(gptq_one[k][c], rel=1e-4), (k, c)
