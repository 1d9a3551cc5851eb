"""The memory preflight (``sq.pipeline.footprint``): each rank's predicted peak against the peak it measured
(``VmHWM``), a job beyond this machine refused before it loads anything, and ``sq.plan``'s memory table.

The fixtures are sized so that what the prediction models -- the block, the chain, GPTQ's Hessians and
sweep, SignRound's tuning -- is a large share of the peak, not only the process's base (~400 MiB of
interpreter, torch and transformers on every rank, measured at the preflight): a model that forgot a part
or counted one twice misses by more than the tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import run_cli, run_python

TOLERANCE = 0.15  # issue 38: predicted peak RSS within 15% of measured
MIB = 1 << 20

# four blocks: the prediction is a run's steady state, where the C heap holds what earlier blocks freed until it
# is trimmed every few blocks (a one- or two-block run peaks lower)
WIDE = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=8,
            num_hidden_layers=4, vocab_size=512, max_position_embeddings=512)
MOE_WIDE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=32,
                num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_hidden_layers=4,
                vocab_size=512, max_position_embeddings=512)
CASES = {
    # (fixture, world, arguments); "wide": WIDE's Llama (a 4096-wide down_proj: 128 MiB of float64 Hessian,
    # 256 MiB for its factorization)
    "rtn-wide": ("wide", 2, ["--algo", "rtn"]),
    "gptq-wide": ("wide", 2, ["--algo", "gptq", "--nsamples", "16", "--seqlen", "256"]),
    "gptq-wide-one-rank": ("wide", 1, ["--algo", "gptq", "--nsamples", "8", "--seqlen", "256"]),
    "signround-wide": ("wide", 2, ["--algo", "signround", "--iters", "2", "--nsamples", "16", "--seqlen", "256"]),
    "awq-wide": ("wide", 2, ["--algo", "awq", "--nsamples", "16", "--seqlen", "256", "--n-grid", "5"]),
    # MOE_WIDE's Qwen3-MoE: 12.6 M expert parameters per block (50 MiB in float32), stacked expert solves
    "moe-gptq-ep2": ("moe_wide", 2, ["--algo", "gptq", "--ep", "2", "--nsamples", "16", "--seqlen", "128"]),
    "moe-gptq-ep1": ("moe_wide", 2, ["--algo", "gptq", "--ep", "1", "--nsamples", "16", "--seqlen", "128"]),
    "moe-rtn": ("moe_wide", 2, ["--algo", "rtn"]),
    # model-free (sq.modelfree.footprint): units read ahead and quantized one at a time, a layer's outputs, the
    # previous layer's files, the row-split units' gather on their owner (forced here: 8 MiB and up)
    "modelfree-wide": ("wide", 2, ["--algo", "rtn", "--model-free"]),
    "modelfree-wide-split": ("wide", 2, ["--algo", "rtn", "--model-free", "SQ_MODELFREE_SPLIT_BYTES=8388608"]),
    "modelfree-moe": ("moe_wide", 2, ["--algo", "rtn", "--model-free"]),
    # a DeepSeek-V3 in the official FP8 layout (128 x 128 scale blocks), its MTP layer carried by rank 0: both paths
    "fp8-rtn": ("dsv3_fp8", 2, ["--algo", "rtn", "--ep", "2"]),
    "modelfree-fp8": ("dsv3_fp8", 2, ["--algo", "rtn", "--model-free"]),
}
PARTS = ("root", "block", "chain", "activations", "algorithm", "heap", "units", "layer", "split")  # both paths


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    from sq.testing.checkpoints import build_llama

    return build_llama(tmp_path_factory.mktemp("footprint") / "wide", shards=2, **WIDE)


@pytest.fixture(scope="module")
def moe_wide(tmp_path_factory) -> Path:
    from sq.testing.checkpoints import build_qwen3_moe

    return build_qwen3_moe(tmp_path_factory.mktemp("footprint") / "moe", shards=2, **MOE_WIDE)


@pytest.fixture(scope="module")
def dsv3_fp8(tmp_path_factory) -> Path:
    from sq.testing.checkpoints import build_deepseek_v3_fp8

    return build_deepseek_v3_fp8(tmp_path_factory.mktemp("footprint") / "dsv3-fp8", weight_block_size=(128, 128),
                                 hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                                 num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
                                 kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                                 n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                                 first_k_dense_replace=1, vocab_size=4096)


@pytest.mark.parametrize("case", list(CASES))
def test_each_ranks_peak_is_predicted(case, request, tmp_path):
    fixture, world, args = CASES[case]
    env = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))
    args = [a for a in args if not ("=" in a and not a.startswith("-"))]
    src = request.getfixturevalue(fixture)
    out = tmp_path / "out"
    argv = ["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", "W4A16", "--group-size", "64", *args]
    res = run_python(argv, timeout=600, env=env) if world == 1 else run_cli(argv, world, timeout=600, env=env)
    assert res.returncode == 0, res.output[-4000:]
    report = json.loads((out / "sq_report.json").read_text())
    memory = report["memory"]
    modelled = sum(memory.get(k, 0) for k in PARTS)
    if "SQ_MODELFREE_SPLIT_BYTES" in env:
        assert report["time"]["predicted_read_bytes"] and memory["split"] > 0, memory
    table = []
    for r in sorted(report["ranks"], key=lambda r: r["rank"]):
        pred, meas = r["predicted_peak_bytes"], r["peak_rss_bytes"]
        table.append(f"rank {r['rank']}: predicted {pred / MIB:.0f} MiB (base {r['base_rss_bytes'] / MIB:.0f}), "
                     f"measured {meas / MIB:.0f} MiB ({pred / meas - 1:+.1%})")
    print(f"\n{case}: " + "; ".join(table) + f"; modelled parts {modelled / MIB:.0f} MiB")
    for r, line in zip(sorted(report["ranks"], key=lambda r: r["rank"]), table):
        assert abs(r["predicted_peak_bytes"] / r["peak_rss_bytes"] - 1) <= TOLERANCE, line
    assert memory["available_bytes"] > 0 and memory["need_bytes"] > 0, memory


@pytest.fixture(scope="module")
def huge(tmp_path_factory) -> Path:
    """A 3.5 B-parameter Llama whose weights are a hole in a sparse file: its headers are real, its disk use is
    nothing.  Quantizing it with GPTQ would need ~113 GiB per rank for a block's Hessians and sweep alone."""
    from sq.testing.checkpoints import build_sparse_llama

    return build_sparse_llama(tmp_path_factory.mktemp("footprint") / "huge", hidden_size=8192,
                              intermediate_size=65536, num_attention_heads=64, num_key_value_heads=8,
                              num_hidden_layers=2)


def test_a_job_beyond_this_machine_is_refused_before_it_loads(huge, tmp_path):
    out = tmp_path / "out"
    res = run_cli(["sq.ptq", "--model", str(huge), "--output", str(out), "--scheme", "W4A16", "--algo", "gptq",
                   "--nsamples", "8", "--seqlen", "64"], 2, timeout=300)
    assert res.returncode != 0 and 2 in res.codes, res.output[-4000:]  # the first rank to refuse stops the other
    assert "sq: error: host memory: the 2 rank(s) of one node would need about" in res.output, res.output[-4000:]
    assert "the largest part is the algorithm: GPTQ's float32 Hessians" in res.output
    assert "--no-preflight" in res.output
    assert not out.exists()  # refused before the output folder was claimed


@pytest.fixture(scope="module")
def huge_dense(tmp_path_factory) -> Path:
    """A Llama each of whose MLP projections is 16384 x 131072 (4 GiB in bfloat16), its weights a hole in a sparse
    file: model-free RTN on two ranks would need ~34 GiB per rank, mostly RTN's float32 copies of one projection."""
    from sq.testing.checkpoints import build_sparse_llama

    return build_sparse_llama(tmp_path_factory.mktemp("footprint") / "huge-dense", hidden_size=16384,
                              intermediate_size=131072, num_attention_heads=128, num_key_value_heads=8,
                              num_hidden_layers=1)


def test_a_model_free_job_beyond_this_machine_is_refused_and_planned(huge_dense, tmp_path):
    out = tmp_path / "out"
    res = run_cli(["sq.ptq", "--model", str(huge_dense), "--output", str(out), "--scheme", "W4A16", "--algo", "rtn",
                   "--model-free"], 2, timeout=300)
    assert res.returncode != 0 and 2 in res.codes, res.output[-4000:]
    assert "sq: error: host memory: the 2 rank(s) of one node would need about" in res.output, res.output[-4000:]
    assert "predicted by sq.modelfree.footprint" in res.output and "--no-preflight" in res.output
    assert not out.exists()  # refused before the output folder was claimed
    # sq.plan plans the same job: too big for 8 GiB per node, fits a stated 4 TiB one, split over more ranks
    args = ["--scheme", "W4A16", "--algo", "rtn", "--model-free", "--nproc-per-node", "2"]
    res, small = _plan(huge_dense, tmp_path, *args, "--host-memory", "8")
    assert res.returncode == 2 and not small["fits"] and small["mode"] == "model-free", res.stderr[-3000:]
    assert "predicted by sq.modelfree.footprint" in res.stderr
    res, big = _plan(huge_dense, tmp_path, *args, "--host-memory", "4096")
    assert res.returncode == 0 and big["fits"], res.stderr[-3000:]
    m = big["memory"]
    assert m["parts"] == ["units", "layer", "split", "heap"] and big["row_split"] == 0, m  # nothing balances better
    assert big["predicted_output_bytes"] > 0 and len(big["time"]["predicted_read_bytes"]) == 2, big
    # on 8 ranks the MLP projections are split by rows: each rank quantizes its rows, their owners gather the codes
    res, eight = _plan(huge_dense, tmp_path, *args[:-1], "8", "--host-memory", "4096")
    assert res.returncode == 0 and eight["row_split"] > 0 and eight["memory"]["split"] > 0, res.stderr[-3000:]
    assert eight["memory"]["units"] < m["units"], (eight["memory"], m)


def _plan(src: Path, tmp_path: Path, *args: str):
    res = run_python(["sq.plan", "--model", str(src), "--output", str(tmp_path / "out"), "--json", *args], timeout=300)
    lines = [l for l in res.stdout.splitlines() if l.startswith("{")]
    return res, json.loads(lines[-1]) if lines else None


def test_plan_predicts_memory_for_a_launch_and_a_stated_machine(huge, tmp_path):
    args = ["--scheme", "W4A16", "--algo", "rtn"]
    res1, one = _plan(huge, tmp_path, *args, "--host-memory", "4096")
    assert res1.returncode == 0, res1.stderr[-3000:]
    res2, two = _plan(huge, tmp_path, *args, "--nproc-per-node", "2", "--host-memory", "4096")
    assert res2.returncode == 0, res2.stderr[-3000:]
    m1, m2 = one["memory"], two["memory"]
    assert one["fits"] and m1["where"] == "--host-memory" and m1["available_bytes"] == 4096 << 30
    # a block's shard halves over two ranks, its gathered copy does not; the node holds both ranks
    assert m2["block"] < m1["block"] and two["world"] == 2
    assert m2["need_bytes"] == pytest.approx(2 * m2["predicted_peak_bytes"], rel=0.01)
    res3, small = _plan(huge, tmp_path, *args, "--host-memory", "1")
    assert res3.returncode == 2 and not small["fits"], res3.stderr[-3000:]
    assert "host memory: the 1 rank(s) of one node would need about" in res3.stderr
    assert "and --host-memory gives 1.00 GiB; the largest part is the block" in res3.stderr


def test_plan_counts_a_gpu_jobs_host_side(huge, tmp_path):
    """--device cuda: the parts are the GPU's, and the host side is checked apart (the block's files and chain
    cache serialized in host memory, rank 0's root at the end) against the node's memory."""
    args = ["--scheme", "W4A16", "--algo", "rtn", "--device", "cuda", "--gpu-memory", "4096",
            "--nproc-per-node", "8", "--tflops", "400"]
    res, fits = _plan(huge, tmp_path, *args, "--host-memory", "4096")
    assert res.returncode == 0 and fits["fits"], res.stderr[-3000:]
    m = fits["memory"]
    assert m["device"] == "cuda" and m["host_where"] == "--host-memory", m
    # a block's files pass through host memory (its quantized share, twice: tensors and their serialized bytes)
    assert m["base"] < m["predicted_host_peak_bytes"] <= m["predicted_host_peak_rank0_bytes"], m
    assert m["host_need_bytes"] == 7 * m["predicted_host_peak_bytes"] + m["predicted_host_peak_rank0_bytes"], m
    res, small = _plan(huge, tmp_path, *args, "--host-memory", "0.5")
    assert res.returncode == 2 and not small["fits"], res.stderr[-3000:]
    assert "host memory: the 8 rank(s) of one node would need about" in res.stderr and "beside their GPUs" in res.stderr
    assert "GPU memory" not in res.stderr  # the GPUs have room
