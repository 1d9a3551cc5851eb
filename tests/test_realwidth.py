"""Real widths, planned without weights (header-only checkpoints of a DeepSeek-V3 layer): collective traffic per rank and block, bounded by design: at most each dense Hessian once (reduced to the rank
that solves it, in its accumulator dtype), the activations the ranks must exchange, and the weights FSDP2 and the
solvers must gather.  The budget is computed here from a real DeepSeek-V3 layer's shapes (header-only checkpoint,
no weights); the plan's prediction (``sq.plan``, the same number ``sq_report.json`` keeps as
``time.collective_bytes_per_block``) must stay within it.  An all-reduce of float64 Hessians (how sq combined them
before) predicts 4.4x the budget on this layer and fails."""

from __future__ import annotations

import math
import re

import pytest

from sq.plan import build_parser, plan_job
from sq.ptq import config_from
from sq.testing.checkpoints import build_sparse
from sq.testing.realwidth import real_config

NSAMPLES, SEQLEN, EXPERTS = 16, 512, 16


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    model_type, cfg = real_config("DeepSeek-V3", layers=1, experts=EXPERTS)
    return build_sparse(tmp_path_factory.mktemp("dsv3") / "ckpt", model_type, **cfg), cfg


def _hbytes(n: int) -> int:  # float64 up to 4096 wide (128 MiB), float32 beyond (sq.quant.gptq.hessian_dtype)
    return 8 if n <= 4096 else 4


def budget(cfg: dict, world: int, ep: int) -> int:
    """Bytes a rank may move per block of GPTQ at ``world`` ranks and ``--ep ep``: the dense Hessians once each,
    the experts' token exchange of both passes (every --ep rank's hidden states gathered, the outputs all-reduced;
    calibrate-all gathers them once more), FSDP2's gathers of the dense weights in each forward, and the dense rows
    gathered to their solvers and scattered back (bf16)."""
    h, q, kv, heads, vd = (cfg[k] for k in ("hidden_size", "q_lora_rank", "kv_lora_rank", "num_attention_heads",
                                              "v_head_dim"))
    inter = cfg["moe_intermediate_size"] * cfg["n_shared_experts"]
    hessians = [h, q, kv, heads * vd, h, inter]  # q_a/kv_a, q_b, kv_b, o_proj, shared gate/up, shared down
    dense_linears = (h * q + q * heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
                     + h * (kv + cfg["qk_rope_head_dim"]) + kv * heads * (cfg["qk_nope_head_dim"] + vd)
                     + heads * vd * h + 3 * h * inter)
    tokens = math.ceil(NSAMPLES / world) * SEQLEN  # this rank's
    steps = math.ceil(NSAMPLES / world / 4)  # calibration forwards per pass (sq.quant.forward.CALIB_BATCH)
    exchange = 2 * 3 * tokens * ep * h * 2 + tokens * world * h * 2
    gathers = 2 * steps * (dense_linears + 4 * h) * 2  # (+ norms, router: a few rows of h)
    return sum(_hbytes(n) * n * n for n in hessians) + exchange + gathers + 2 * dense_linears * 2


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_predicted_traffic_is_within_the_budget(layer, world, ep, tmp_path):
    path, cfg = layer
    args = ["--model", str(path), "--output", str(tmp_path / "o"), "--algo", "gptq", "--scheme", "W4A16",
            "--group-size", "128", "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN), "--ep", str(ep)]
    p, _ = plan_job(config_from(build_parser().parse_args(args)), nproc_per_node=world)
    got, cap = p["time"]["collective_bytes_per_block"], budget(cfg, world, ep)
    assert got <= cap, f"{got / 2**30:.2f} GiB per rank and block, budget {cap / 2**30:.2f} GiB"
    # the budget is tight enough to catch a regression: float64 all-reduced Hessians alone would exceed it
    hessians = [cfg["hidden_size"]] * 2 + [cfg["q_lora_rank"], cfg["kv_lora_rank"],
                                           cfg["num_attention_heads"] * cfg["v_head_dim"], cfg["moe_intermediate_size"]]
    assert 16 * sum(n * n for n in hessians) > cap


def test_a_layer_that_does_not_fit_is_refused_naming_the_layout_that_does(tmp_path):
    """64 experts at --ep 2 on two ranks of a 12 GiB node do not fit (each rank holds 32 experts, 2.8 GB in bf16,
    with their codes; about 7.5 GiB a rank): sq.plan refuses in seconds and names the smallest layout of such
    nodes that fits."""
    model_type, cfg = real_config("DeepSeek-V3", layers=1, experts=64)
    path = build_sparse(tmp_path / "ckpt", model_type, **cfg)
    args = ["--model", str(path), "--output", str(tmp_path / "o"), "--algo", "gptq", "--scheme", "W4A16",
            "--group-size", "128", "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN), "--ep", "2"]
    p, problems = plan_job(config_from(build_parser().parse_args(args)), nproc_per_node=2, host_memory=12)
    assert not p["fits"] and problems
    fits = re.search(r"it fits on (\d+) such nodes: --nnodes (\d+) --nproc-per-node 2 --ep (\d+) \(predicted peak", problems[0])
    assert fits and fits[1] == fits[2] and int(fits[1]) > 1, problems[0]
    assert problems[0].endswith("or pass --no-preflight to try anyway"), problems[0]


def test_fit_memory_is_named_then_taken(tmp_path, monkeypatch):
    """Two MoE layers: the second block computes while the first one's files (2 x 64 experts' codes) are written
    in the background.  On a node just too small for that, the plan names --fit-memory (the files written first,
    the same output); with it, the job fits and the plan says what was chosen.  (The base a plan counts is the
    planning process's RSS, which moves by more than the 1 MiB this node is short between the calls: fixed.)"""
    import sq.memory

    monkeypatch.setattr(sq.memory, "rss_bytes", lambda: 400 << 20)
    model_type, cfg = real_config("DeepSeek-V3", layers=2, experts=64)
    path = build_sparse(tmp_path / "ckpt", model_type, **cfg)
    args = ["--model", str(path), "--output", str(tmp_path / "o"), "--algo", "gptq", "--scheme", "W4A16",
            "--group-size", "128", "--nsamples", str(NSAMPLES), "--seqlen", str(SEQLEN), "--ep", "2"]
    roomy, _ = plan_job(config_from(build_parser().parse_args(args)), nproc_per_node=2, host_memory=1000)
    tight = (roomy["memory"]["need_bytes"] - (1 << 20)) / 2**30
    p, problems = plan_job(config_from(build_parser().parse_args(args)), nproc_per_node=2, host_memory=tight)
    assert not p["fits"] and "--fit-memory makes it fit on these ranks" in problems[0], problems
    p, problems = plan_job(config_from(build_parser().parse_args([*args, "--fit-memory"])), nproc_per_node=2,
                           host_memory=tight)
    assert p["fits"] and not problems, problems
    assert p["memory"]["fit"]["write_overlap"] is False and p["memory"]["need_bytes"] < roomy["memory"]["need_bytes"]


def test_without_overlap_each_blocks_files_are_written_before_the_next_block():
    import threading

    from sq.run import BlockFiles

    files, gate, done = BlockFiles(), threading.Event(), threading.Event()
    files.submit(lambda: (gate.wait(60), done.set()))  # overlapped: still writing when submit returns
    assert not done.is_set()
    gate.set()
    files.close()
    files, done = BlockFiles(), threading.Event()
    files.overlap = False
    files.submit(done.set)  # --fit-memory's choice: written before submit returns
    assert done.is_set()
    files.close()
