"""Hostile inputs, round 4 (issue 56, item 5): ``sq.plan`` refuses what ``sq.ptq`` refuses, by the same code
(``sq.pipeline.checks``), and validates its own flags; the crashes and raw errors the issue lists end in a
clean ``sq: error:`` (or, where decided so, in a run that works), before anything is created.

The agreement test runs both commands over one table of bad inputs (real processes, the tiny Llama fixture,
one rank; ``--ep`` and model-free at two) and asserts the same ``sq: error:`` lines from each, exit 2, no
traceback, and ``--output`` never created (or left as it was).  Every other class has its own test.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from ckpt_edit import copy_ckpt, edit_index, edit_tensors
from harness import run_cli, run_ranks
from hostile import assert_refused, snapshot

GS = "32"
RTN = ["--algo", "rtn", "--group-size", GS]
GPTQ = ["--algo", "gptq", "--group-size", GS, "--nsamples", "4", "--seqlen", "16"]
GPTAQ = ["--algo", "gptaq", "--group-size", GS, "--nsamples", "4", "--seqlen", "16"]


def _errors(result) -> list[str]:
    return [l for l in result.stderr.splitlines() if l.startswith("sq: error: ")]


# ----------------------------------------------------------------------------- sq.plan and sq.ptq agree

def _short_corpus(tmp: Path) -> list[str]:
    (tmp / "short.txt").write_text("def f():\n    return 1\n")
    return [*GPTQ, "--dataset", str(tmp / "short.txt")]


def _file_output(tmp: Path) -> Path:
    (tmp / "afile").write_text("not a folder\n")
    return tmp / "afile"


def _nonempty_output(tmp: Path) -> Path:
    (tmp / "full").mkdir()
    (tmp / "full" / "notes.txt").write_text("mine\n")
    return tmp / "full"


# name -> (extra argv, pattern of one error line, the --output to use (None: tmp/out, which must stay absent))
AGREE = {
    "nsamples-0": (lambda t: [*GPTQ, "--nsamples", "0"], r"--nsamples must be positive, got 0", None),
    "seqlen-negative": (lambda t: [*GPTQ, "--seqlen", "-1"], r"--seqlen must be positive, got -1", None),
    "rotate-block-0": (lambda t: [*RTN, "--rotate", "r1", "--rotate-block", "0"],
                       r"^sq: error: --rotate-block must be positive, got 0$", None),
    "ep-3": (lambda t: [*RTN, "--ep", "3"], r"--ep 3 does not divide the world size 1 .*--ep auto", None),
    "output-file": (lambda t: RTN, r"--output .*afile exists and is not a directory", _file_output),
    "output-nonempty": (lambda t: RTN, r"--output .*full is not empty", _nonempty_output),
    "corpus-short": (_short_corpus, r"calibration data: 4 windows x 16 tokens = 64 tokens, but the corpus has only",
                     None),
    "resume-require": (lambda t: [*RTN, "--resume", "require"], r"--resume require: .*out holds no run to resume",
                       None),
    "rotate-r3": (lambda t: [*RTN, "--rotate", "r3"], r"--rotate r3: unknown rotation", None),
    "smooth-2": (lambda t: [*RTN, "--smooth", "2"], r"--smooth must be a migration strength in \(0, 1\]", None),
    "target-bits-100": (lambda t: [*GPTQ, "--target-bits", "100"], r"--target-bits must be .* above 0 and below 64",
                        None),
    "target-bits-64": (lambda t: [*GPTQ, "--target-bits", "64"], r"above 0 and below 64 .*got 64$", None),
    "candidates-unknown": (lambda t: [*GPTQ, "--target-bits", "5", "--candidates", "W4A16,FOO"],
                           r"--candidates FOO: unknown scheme 'FOO'", None),
    "candidates-alone": (lambda t: [*GPTQ, "--candidates", "W4A16,W2A16"],
                         r"--candidates W4A16,W2A16 are the schemes --target-bits chooses from", None),
    "ignore-nomatch": (lambda t: [*RTN, "--ignore", "nomatch"], r"--ignore 'nomatch' matches no module", None),
    "int-grid-full-asym": (lambda t: [*RTN, "--scheme", "W4A16_ASYM", "--int-grid", "full"],
                           r"--int-grid full changes only symmetric integer schemes; W4A16_ASYM", None),
    "gptaq-alpha-negative": (lambda t: [*GPTAQ, "--gptaq-alpha", "-1"],
                             r"--algo gptaq: --gptaq-alpha must be a finite number >= 0, got -1", None),
    "gptaq-alpha-nan": (lambda t: [*GPTAQ, "--gptaq-alpha", "nan"], r"--gptaq-alpha must be a finite number", None),
    "gptaq-fp8-block": (lambda t: [*GPTAQ, "--scheme", "FP8_BLOCK"], r"^sq: error: --algo gptaq solves per-channel",
                        None),
}


@pytest.mark.parametrize("case", sorted(AGREE))
def test_plan_and_ptq_refuse_alike(case, checkpoints, tmp_path):
    extra, pattern, output = AGREE[case]
    argv = extra(tmp_path)
    out = output(tmp_path) if output is not None else tmp_path / "out"
    job = ["--model", str(checkpoints["llama"]), "--output", str(out), *argv]
    before = snapshot(out, checkpoints["llama"])
    plan = run_cli(["sq.plan", *job], 1, timeout=120, stop_on_failure=False)
    ptq = run_cli(["sq.ptq", *job], 1, timeout=120, stop_on_failure=False)
    for result in (plan, ptq):
        assert_refused(result, 1, pattern)
    assert _errors(plan) == _errors(ptq), (_errors(plan), _errors(ptq))
    assert "rotate_block" not in plan.stderr + ptq.stderr  # flags as typed
    assert snapshot(out, checkpoints["llama"]) == before, "a refusal created or changed --output or the source"


@pytest.mark.parametrize("model_free", [False, True], ids=["model", "model-free"])
def test_ep_refused_alike_at_two_ranks(model_free, checkpoints, tmp_path):
    """--ep 3 at 2 ranks: the job refuses it on every rank; sq.plan with --nproc-per-node 2 the same way
    (model-free too: nothing is expert-parallel there, but a value the model path refuses is a typo)."""
    out = tmp_path / "out"
    job = ["--model", str(checkpoints["llama"]), "--output", str(out), *RTN, "--ep", "3",
           *(["--model-free"] if model_free else [])]
    ptq = run_cli(["sq.ptq", *job], 2, timeout=120, stop_on_failure=False)
    plan = run_cli(["sq.plan", *job, "--nproc-per-node", "2"], 1, timeout=120, stop_on_failure=False)
    pattern = r"--ep 3 does not divide the world size 2 \(the ranks: --nproc-per-node x --nnodes\); give one of 1, 2"
    assert_refused(ptq, 2, pattern)
    assert_refused(plan, 1, pattern)
    assert set(_errors(plan)) == set(_errors(ptq))
    assert not out.exists()


# ----------------------------------------------------------------------------- sq.plan's own flags

def _plan(argv, capsys) -> tuple[int, str, str]:
    from sq.plan import main

    code = main(argv)
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.mark.parametrize("flag,value", [
    ("--host-memory", "nan"), ("--host-memory", "0"), ("--host-memory", "-1"), ("--host-memory", "inf"),
    ("--gpu-memory", "-3"), ("--tflops", "nan"), ("--tflops", "0"), ("--tflops", "inf"),
    ("--mem-bandwidth", "-1"), ("--read-bandwidth", "0"), ("--link-bandwidth", "nan"),
    ("--nproc-per-node", "0"), ("--nnodes", "-2"),
])
def test_plan_refuses_bad_numbers(flag, value, checkpoints, tmp_path, capsys):
    code, out, err = _plan(["--model", str(checkpoints["llama"]), "--output", str(tmp_path / "out"), *RTN,
                            "--device", "cuda", "--tflops", "10", flag, value], capsys)
    assert code == 2, err
    assert re.search(rf"^sq: error: argument {flag}: must be a (finite number of .* above 0|whole number of at "
                     rf"least 1), got '{re.escape(value)}'$", err, re.M), err
    assert out == "" and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_plan_launch_flags(checkpoints, tmp_path, capsys):
    """--gpu-memory is a GPU job's; --device cuda without a GPU here needs it (decided: refused, not 'fits')."""
    job = ["--model", str(checkpoints["llama"]), "--output", str(tmp_path / "out"), *RTN]
    code, _, err = _plan([*job, "--gpu-memory", "80"], capsys)
    assert code == 2 and "sq: error: --gpu-memory is each GPU's memory, for --device cuda" in err, err
    if not torch.cuda.is_available():
        code, _, err = _plan([*job, "--device", "cuda"], capsys)
        assert code == 2 and "--device cuda: this machine has no GPU to measure; state each GPU's memory with " \
                              "--gpu-memory GIB" in err, err
    code, out, err = _plan([*job, "--device", "cuda", "--gpu-memory", "80", "--tflops", "100", "--json"], capsys)
    assert code == 0, err
    plan = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert plan["fits"] is True and plan["memory"]["available_bytes"] == 80 * 2**30


def test_plan_json_is_strict(checkpoints, tmp_path, capsys):
    """--json is strict JSON; stated speeds at the edge of a float's range are refused instead of printing
    Infinity / NaN."""
    job = ["--model", str(checkpoints["llama"]), "--output", str(tmp_path / "out"), *RTN, "--json"]
    code, out, err = _plan([*job, "--tflops", "100", "--host-memory", "1e-6"], capsys)
    assert code == 2 and "Traceback" not in err, err  # 1e-6 GiB of host memory holds nothing: printed, then refused
    plan = json.loads(out.strip().splitlines()[0], parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert plan["fits"] is False and all(math.isfinite(v) for v in plan["time"]["phases"].values())
    code, out, err = _plan([*job, "--tflops", "1e308", "--mem-bandwidth", "1e308", "--read-bandwidth", "1e-300"],
                           capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert re.search(r"^sq: error: the plan's time\.\S+.* came out non-finite: the stated --tflops", err, re.M), err


# ----------------------------------------------------------------------------- --smooth with RTN, dynamic activations

@pytest.mark.parametrize("scheme", ["W8A8", "FP8_BLOCK"])
def test_smooth_rtn_dynamic_activations_runs(scheme, checkpoints, tmp_path):
    """Decided: it works (RTN reads data for the smoothing alone; the next block's inputs are each block's
    full-precision outputs).  It crashed every rank after .sq-run/ was created."""
    out = tmp_path / "out"
    r = run_cli(["sq.ptq", "--model", str(checkpoints["llama"]), "--output", str(out), "--algo", "rtn",
                 "--scheme", scheme, "--smooth", "0.5", "--nsamples", "4", "--seqlen", "16"], 1, timeout=180,
                stop_on_failure=False)
    assert r.codes == [0], r.stderr[-3000:]
    report = json.loads((out / "sq_report.json").read_text())
    assert report["args"]["smooth"] == 0.5 if "args" in report else True
    if scheme == "W8A8":
        from sq.testing.checkpoints import load_with_transformers

        model = load_with_transformers(out)
        assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()


# ----------------------------------------------------------------------------- sq.eval

def _eval(argv, capsys) -> tuple[int, str]:
    from sq.eval import main

    code = main(argv)
    return code, capsys.readouterr().err


def test_eval_unfinished_run(tmp_path, capsys):
    out = tmp_path / "out"
    (out / ".sq-run" / "rank-00000").mkdir(parents=True)
    code, err = _eval(["--model", str(out), "--nwindows", "2", "--seqlen", "16"], capsys)
    assert code == 2 and "is an unfinished sq.ptq run" in err and "tokenizer" not in err.lower(), err


def test_eval_truncated_shard(checkpoints, tmp_path, capsys):
    ck = copy_ckpt(checkpoints["llama"], tmp_path / "ck")
    shard = sorted(ck.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = _eval(["--model", str(ck), "--nwindows", "2", "--seqlen", "16"], capsys)
    assert code == 2 and "Traceback" not in err, err
    assert re.search(rf"^sq: error: {re.escape(str(shard))}: .*truncated", err, re.M), err


def test_eval_seqlen_beyond_context(checkpoints, capsys):
    """Decided: refused (windows past max_position_embeddings score extrapolation, not the model)."""
    code, err = _eval(["--model", str(checkpoints["llama"]), "--nwindows", "1", "--seqlen", "1025"], capsys)
    assert code == 2 and "--seqlen 1025 is beyond the model's context (1024 tokens" in err, err
    code, err = _eval(["--model", str(checkpoints["llama"]), "--nwindows", "0"], capsys)
    assert code == 2 and "--nwindows must be at least 1, got 0" in err, err


# ----------------------------------------------------------------------------- the Python API's calibration

def _bad_calibration(rank, world, root):
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import sq
    from sq.errors import SqError

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    good = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    cases = {"list": good.tolist(), "negative": good.clone().index_fill_(1, torch.tensor([3]), -5),
             "vocab": good.clone().index_fill_(1, torch.tensor([2]), 256), "empty": good[:, :0]}
    msgs = {}
    for name, calib in cases.items():
        try:
            sq.quantize(model, f"{root}/{name}", algo="gptq", group_size=32, calibration=calib)
            msgs[name] = None
        except SqError as e:
            msgs[name] = str(e)
    return msgs


def test_api_bad_calibration(tmp_path):
    (msgs,) = run_ranks(_bad_calibration, 1, str(tmp_path), timeout=120)
    assert "expected a torch.Tensor of integer token ids [nsamples, seqlen], got a list" in msgs["list"]
    assert "token id -5 at row 0, column 3 is outside the model's vocabulary (ids 0..255" in msgs["negative"]
    assert "token id 256 at row 0, column 2 is outside the model's vocabulary" in msgs["vocab"]
    assert "every row needs at least 2 tokens" in msgs["empty"]
    assert list(tmp_path.iterdir()) == [], "a refusal left something behind"


def test_api_setting_named_as_keyword():
    from sq.config import PTQConfig
    from sq.errors import SqError

    with pytest.raises(SqError, match=r"--algo gptaq: gptaq_alpha must be a finite number >= 0, got -1"):
        PTQConfig.build(model="m", output="o", algo="gptaq", gptaq_alpha=-1.0)


# ----------------------------------------------------------------------------- the source checkpoint

def test_tensor_missing_from_index_is_read_from_its_file(checkpoints, tmp_path):
    """Decided: a tensor a listed shard holds and the index forgets is read from that shard (transformers
    does), with a warning naming it; it was refused as 'index puts it in None'."""
    ck = copy_ckpt(checkpoints["llama"], tmp_path / "ck")
    key = "model.layers.1.mlp.up_proj.weight"
    edit_index(ck, lambda wm: {k: v for k, v in wm.items() if k != key})
    out = tmp_path / "out"
    r = run_cli(["sq.ptq", "--model", str(ck), "--output", str(out), *RTN], 1, timeout=120, stop_on_failure=False)
    assert r.codes == [0], r.stderr[-3000:]
    assert "does not list 1 tensor(s) its listed files hold" in r.stderr and key in r.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.up_proj.weight_packed" in index


def test_skip_nonfinite_works_with_gptq(checkpoints, tmp_path):
    """The refusal's advice, taken: GPTQ quantizes every other Linear (the one after the NaN too) and writes
    the damaged Linear as stored; before, down_proj was refused for a non-finite Hessian."""
    ck = copy_ckpt(checkpoints["llama"], tmp_path / "ck")
    key = "model.layers.1.mlp.up_proj.weight"

    def poison(tensors):
        if key in tensors:
            tensors[key][3, 5] = float("nan")
        return tensors

    edit_tensors(ck, poison)
    out = tmp_path / "out"
    r = run_cli(["sq.ptq", "--model", str(ck), "--output", str(out), *GPTQ, "--skip-nonfinite"], 1, timeout=180,
                stop_on_failure=False)
    assert r.codes == [0], r.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.up_proj" in cfg["ignore"]
    assert not any("down_proj" in n for n in cfg["ignore"])
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.down_proj.weight_packed" in index
    with safe_open(out / index[key], "pt") as f:
        stored = f.get_tensor(key)
    assert torch.isnan(stored[3, 5]) and torch.isfinite(stored).sum() == stored.numel() - 1
