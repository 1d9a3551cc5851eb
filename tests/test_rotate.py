"""``--rotate r1,r2`` (``sq.pipeline.rotation``, ``sq.quant.rotate``): offline rotations fused into the weights.

- the Hadamard constructions are orthogonal at the sizes models use; block-diagonal ones too;
- a rotated output computes the source's function: loaded by transformers, its logits are the source's up to
  W8A16's own error, with the tied ``lm_head`` untied and every norm's scale folded away; each block's proof
  (recorded in the report) exact to float32 rounding on float32 weights;
- 1 vs 2 ranks (and ``--ep 2`` on an MoE) bit-identical; killed after block 0 and rerun, bit-identical;
- GPTQ on a rotated model runs at 2 ranks and loads;
- refusals: an unknown rotation, a block size that divides nothing, an in-memory model, ``--model-free``,
  ``--target-bits``; a model whose layout cannot be rotated is refused by name on every rank, nothing written
  (the whole zoo: ``tests/test_zoo.py::test_zoo_rotate``).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from harness import run_cli, run_ranks
from quant_ref import quantize_jobs, read_tensors
from sq.formats.transforms import blockwise
from sq.quant.rotate import hadamard, online_hadamard, orthogonal, rotate_head_columns, rotate_head_rows, rotate_input, rotate_output
from sq.testing.zoo import check_rotated


@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 60, 64, 80, 96, 112, 128, 180, 576, 896, 1536, 2560])
def test_hadamard_is_orthogonal(n):
    h = hadamard(n)
    assert h is not None and set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))


def test_no_hadamard_of_an_impossible_order_and_a_random_orthogonal_instead():
    assert hadamard(6) is None and hadamard(10) is None
    q, kind = orthogonal(10, 0)
    assert kind == "random" and torch.allclose(q @ q.T, torch.eye(10, dtype=torch.float64), atol=1e-12)


def test_orthogonal_is_seeded_and_block_diagonal_keeps_groups_apart():
    a, _ = orthogonal(64, 3)
    assert torch.equal(a, orthogonal(64, 3)[0]) and not torch.equal(a, orthogonal(64, 4)[0])
    q, kind = orthogonal(64, 0, block=16)
    assert kind == "hadamard" and torch.allclose(q @ q.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    mask = torch.block_diag(*[torch.ones(16, 16)] * 4).bool()
    assert torch.all(q[~mask] == 0) and torch.all(q[mask] != 0)
    with pytest.raises(ValueError):
        orthogonal(64, 0, block=24)


def test_weight_maths_keeps_the_function():
    """Reader ``W diag(g) Q`` on ``x Q / rms``, writer ``Q^T W``, heads: the products they replace."""
    torch.manual_seed(0)
    q = orthogonal(12, 0)[0].float()
    x, w, g = torch.randn(5, 12), torch.randn(7, 12), torch.rand(12) + 0.5
    assert torch.allclose((x @ q) @ rotate_input(w, q, g).T, (x * g) @ w.T, atol=1e-5)
    w_out, b = torch.randn(12, 7), torch.randn(12)
    z = torch.randn(5, 7)
    assert torch.allclose(z @ rotate_output(w_out, q).T + rotate_output(b, q), (z @ w_out.T + b) @ q, atol=1e-5)
    h = orthogonal(4, 1)[0].float()
    wv, wo = torch.randn(8, 12), torch.randn(12, 8)  # 2 heads of 4
    v = x @ wv.T
    assert torch.allclose((x @ rotate_head_rows(wv, h).T) @ rotate_head_columns(wo, h).T, v @ wo.T, atol=1e-5)
    qb = online_hadamard(12, 0, block=4)  # R4: input and weight columns by the same I ⊗ Q_b
    assert torch.equal(qb, online_hadamard(36, 0, block=4)) and online_hadamard(12, 0, block=6) is None
    assert torch.equal((qb * 2).round().abs(), torch.ones(4, 4, dtype=torch.float64))  # sqrt(b) Q_b is ±1
    assert torch.allclose(blockwise(x, qb.float()) @ blockwise(w, qb.float()).T, x @ w.T, atol=1e-5)


def _job(model, out, **kw) -> dict:
    return dict(model=str(model), output=str(out), algo="rtn", scheme="W8A16", group_size=16, rotate=("r1", "r2"),
                timeout_s=120) | kw


@pytest.fixture(scope="module")
def rotated(checkpoints, tmp_path_factory):
    """RTN W8A16 under --rotate r1,r2: llama (tied embeddings) and qwen3_moe at 2 ranks (ep 2) and 1 rank."""
    root = tmp_path_factory.mktemp("rotate")
    for world in (2, 1):
        jobs = [_job(checkpoints["llama"], root / f"llama-w{world}"),
                _job(checkpoints["qwen3_moe"], root / f"moe-w{world}", ep=world)]
        assert run_ranks(quantize_jobs, world, jobs, timeout=300)[0] == [None, None]
    return root


@pytest.mark.parametrize("kind,src", [("llama", "llama"), ("moe", "qwen3_moe")])
def test_rotated_output_computes_the_source_function(rotated, checkpoints, kind, src):
    out = rotated / f"{kind}-w2"
    check_rotated(checkpoints[src], out)  # loads, no missing/unexpected keys, logits within W8A16's error
    report = json.loads((out / "sq_report.json").read_text())["rotation"]
    assert report["r1"] == "hadamard" and report["root"]["error"] < 1e-4
    assert report["blocks"] and all(b["error"] < 1e-4 for b in report["blocks"].values()), report["blocks"]
    assert all(b["heads"] > 0 and b["norms"] == 2 for b in report["blocks"].values())
    tensors = read_tensors(out)
    norms = [k for k in tensors if k.endswith("norm.weight") and "layernorm" in k or k == "model.norm.weight"]
    assert norms and all(torch.equal(tensors[k], torch.ones_like(tensors[k])) for k in norms)  # folded away
    if kind == "llama":  # tied in the source: the rotated lm_head is a tensor of its own
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is False and "lm_head.weight" in tensors
        assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_one_and_two_ranks_bit_identical(rotated, kind):
    a, b = read_tensors(rotated / f"{kind}-w1"), read_tensors(rotated / f"{kind}-w2")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]


def _argv(model, out, *extra) -> list[str]:
    return ["sq.ptq", "--model", str(model), "--output", str(out), "--algo", "rtn", "--scheme", "W8A16",
            "--group-size", "16", "--rotate", "r1,r2", "--timeout", "120", *extra]


def test_killed_and_resumed_bit_identical(rotated, checkpoints, tmp_path):
    out = tmp_path / "o"
    argv = _argv(checkpoints["llama"], out)
    # rank 1 killed once block 1's shard is written: block 0 done everywhere, so the rerun restarts at 1,
    # rotating the root again and blocks 1.. only
    killed = run_cli(argv, 2, timeout=300, env={"SQ_FAULT": "after-shard-write:1:1"})
    assert killed.returncode != 0 and not (out / "model.safetensors.index.json").exists()
    again = run_cli(argv, 2, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert json.loads((out / "sq_report.json").read_text())["resumed_from_block"] == 1
    a, b = read_tensors(out), read_tensors(rotated / "llama-w2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gptq_on_a_rotated_model(checkpoints, tmp_path):
    out = tmp_path / "o"
    res = run_cli(_argv(checkpoints["llama"], out, "--algo", "gptq", "--nsamples", "4", "--seqlen", "16",
                        "--scheme", "W4A16", "--rotate-block", "8"), 2, timeout=300)
    assert res.returncode == 0, res.output[-3000:]
    report = json.loads((out / "sq_report.json").read_text())
    assert report["rotation"]["block"] == 8 and report["args"]["rotate"] == ["r1", "r2"]
    check_rotated(checkpoints["llama"], out, max_rel=0.5)  # W4's error, not a rotation's: loads and runs


def test_every_algorithm_on_a_rotated_model(checkpoints, tmp_path):
    """Each registered algorithm sees the rotated blocks: the output loads and computes the source's function
    up to W4's error (a rotation undone or applied twice would be ~1)."""
    from sq.quant.algorithms import algorithm_names

    algos = [a for a in algorithm_names() if a != "rtn"]
    fast = {"signround": dict(iters=4, batch_size=4)}
    jobs = [_job(checkpoints["llama"], tmp_path / a, algo=a, scheme="W4A16", nsamples=4, seqlen=16, **fast.get(a, {}))
            for a in algos]
    assert run_ranks(quantize_jobs, 2, jobs, timeout=600)[0] == [None] * len(jobs)
    for a in algos:
        assert check_rotated(checkpoints["llama"], tmp_path / a, max_rel=0.5)["logit_rel_err"] < 0.5, a


@pytest.mark.parametrize("extra,words", [
    (["--rotate", "r3"], "vLLM applies no attention transforms"),
    (["--rotate", "r4", "--algo", "awq", "--scheme", "W4A16"], "--rotate r4 with --algo awq"),
    (["--rotate", "r4", "--rotate-block", "48"], "--rotate-block 48 does not divide down_proj's input size 128"),
    (["--rotate-block", "24"], "--rotate-block 24 does not divide the hidden size 64"),
    (["--target-bits", "5", "--candidates", "W4A16,W8A16"], "--rotate with --target-bits"),
    (["--model-free"], "model-free quantization never builds"),
])
def test_refused_on_every_rank_before_anything_is_written(checkpoints, tmp_path, extra, words):
    res = run_cli(_argv(checkpoints["llama"], tmp_path / "o", *extra), 2, timeout=120, stop_on_failure=False)
    assert res.codes == [2, 2] and words in res.stderr and "Traceback" not in res.output, res.output[-3000:]
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


def test_r4_refused_on_routed_experts(checkpoints, tmp_path):
    argv = _argv(checkpoints["qwen3_moe"], tmp_path / "o")
    argv[argv.index("r1,r2")] = "r4"
    res = run_cli(argv, 2, timeout=120, stop_on_failure=False)
    assert res.codes == [2, 2] and "holds routed experts; vLLM applies online transforms" in res.stderr, res.output[-3000:]
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


def test_r4_online_rotation_written_as_transform_config(checkpoints, tmp_path):
    """--rotate r1,r2,r4: down_proj's weights rotated, the rotation stored and declared as compressed-tensors'
    transform_config; loaded with it hooked on (sq.formats.transforms) the output is the source's function, and
    without it it is not; 1 vs 2 ranks bit-identical."""
    outs = {}
    for world, block in ((2, 16), (1, 16), (2, None)):
        out = outs[world, block] = tmp_path / f"w{world}-{block}"
        extra = ["--rotate-block", str(block)] if block else []
        argv = _argv(checkpoints["llama"], out, *extra)
        argv[argv.index("r1,r2")] = "r1,r2,r4"
        res = run_cli(argv, world, timeout=300)
        assert res.returncode == 0, res.output[-3000:]
    out = outs[2, 16]
    cfg = json.loads((out / "config.json").read_text())
    tc = cfg["quantization_config"]["transform_config"]["config_groups"]["R4"]
    targets = [f"model.layers.{i}.mlp.down_proj" for i in range(cfg["num_hidden_layers"])]
    assert tc["type"] == "random-hadamard" and tc["head_dim"] == 16 and not tc["randomize"]
    assert [(a["location"], a["inverse"], a["targets"]) for a in tc["apply"]] == [
        ("input", False, targets), ("weight_input", True, targets)]
    tensors = read_tensors(out)
    mats = [tensors[t + ".R4_input.weight"] for t in targets]
    assert all(torch.equal(m, mats[0]) for m in mats) and mats[0].shape == (16, 16)
    assert set(mats[0].unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(mats[0].double() @ mats[0].double().T, 16 * torch.eye(16, dtype=torch.float64))
    report = json.loads((out / "sq_report.json").read_text())["rotation"]
    assert report["r4"]["head_dim"] == 16 and all(b["online"] == 1 for b in report["blocks"].values())
    for o in (out, outs[2, None]):
        check_rotated(checkpoints["llama"], o)  # with the online rotation hooked on: the source's function
    whole = json.loads((outs[2, None] / "config.json").read_text())["quantization_config"]["transform_config"]
    assert whole["config_groups"]["R4"]["head_dim"] is None
    assert read_tensors(outs[2, None])[targets[0] + ".R4_input.weight"].shape == (128, 128)
    a = read_tensors(outs[1, 16])
    assert a.keys() == tensors.keys() and all(torch.equal(a[k], tensors[k]) for k in a)
    # without the online rotation the stored down_proj weights compute something else
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 27).reshape(2, 12)
    with torch.no_grad():
        ref, got = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)(input_ids=ids).logits.float()
                    for p in (checkpoints["llama"], out))
    assert float((got - ref).norm() / ref.norm()) > 0.1


def test_r4_killed_and_resumed_bit_identical(checkpoints, tmp_path):
    """The online rotation's matrices and transform_config survive a kill: block 0's shard (with its
    R4_input.weight) is kept, the rest rotated on the rerun, the config names every down_proj."""
    outs = {}
    for name, env in (("fresh", {}), ("killed", {"SQ_FAULT": "after-shard-write:1:1"})):
        argv = _argv(checkpoints["llama"], tmp_path / name, "--rotate-block", "16")
        argv[argv.index("r1,r2")] = "r1,r2,r4"
        if env:
            killed = run_cli(argv, 2, timeout=300, env=env)
            assert killed.returncode != 0 and not (tmp_path / name / "model.safetensors.index.json").exists()
        res = run_cli(argv, 2, timeout=300)
        assert res.returncode == 0, res.output[-3000:]
        outs[name] = tmp_path / name
    assert json.loads((outs["killed"] / "sq_report.json").read_text())["resumed_from_block"] == 1
    a, b = read_tensors(outs["fresh"]), read_tensors(outs["killed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ca, cb = (json.loads((o / "config.json").read_text())["quantization_config"] for o in outs.values())
    assert ca["transform_config"] == cb["transform_config"] and ca["transform_config"]["config_groups"]


@pytest.mark.parametrize("apply,randomize,words", [
    ([{"targets": ["re:.*down_proj$"], "location": "output"}], False, "online transform sq cannot apply (location output)"),
    ([{"targets": ["re:.*q_proj$"], "location": "q_attn"}], False, "(location q_attn)"),
    ([{"targets": ["re:.*down_proj$"], "location": "input"}], True, "randomize (a matrix per module)"),
    ([{"targets": ["re:.*down_proj$"], "location": "input"}], False, "no *.R4_input.weight tensor is stored"),
    ([{"targets": ["re:.*down_proj$"], "location": "input"}], False, "match no module of the loaded Linear"),
    ([{"targets": ["re:.*"], "location": "input"}], False, "not a square block of"),
])
def test_an_online_transform_sq_cannot_apply_is_refused(tmp_path, apply, randomize, words):
    """A checkpoint whose transform_config sq cannot apply is one SqError, never a model loaded without it."""
    from sq.errors import SqError
    from sq.formats.transforms import apply_online_transforms

    from safetensors.torch import save_file

    tc = {"config_groups": {"R4": {"type": "hadamard", "apply": apply, "randomize": randomize}}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"transform_config": tc}}))
    if "stored" not in words:  # the matrix present: the refusal is about something else
        save_file({"x.R4_input.weight": torch.ones(3, 3)}, tmp_path / "model.safetensors")
    with pytest.raises(SqError, match=re.escape(words)):
        apply_online_transforms(torch.nn.Linear(4, 4), tmp_path)


def test_in_memory_model_refused(checkpoints, tmp_path):
    res = run_ranks(_in_memory, 1, str(checkpoints["llama"]), str(tmp_path / "o"), timeout=120)[0]
    assert "--rotate rewrites every weight of the model" in res, res


def _in_memory(rank, world, src, out):
    import sq
    from sq.errors import SqError
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    try:
        sq.quantize(model, out, scheme="W8A16", algo="rtn", group_size=16, rotate=("r1",))
    except SqError as e:
        return str(e)
    return "not refused"
