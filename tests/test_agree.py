"""Ranks that disagree are refused before anything is written (``sq.agree``).

Each case gives the ranks different inputs the way a distributed job can: node-local checkpoint copies
that differ (``config.json``, a shard's bytes), another ``--output`` per rank, Python API calls with other
arguments on one rank.  Every rank must exit 2 (or raise ``SqError``) naming the field and the ranks,
with no traceback, no hang, and nothing written to the output.
"""

from __future__ import annotations

import os

import pytest
import torch

from ckpt_edit import copy_ckpt, edit_config, edit_tensors
from harness import run_cli, run_ranks
from sq.errors import SqError

JOB = ["--scheme", "W4A16", "--algo", "gptq", "--group-size", "16", "--nsamples", "4", "--seqlen", "32",
       "--timeout", "60"]


def _per_rank(args: list[str], *, nodes: bool = False):
    return run_cli(["per_rank_cli", *(["--nodes"] if nodes else []), "sq.ptq", *args], 2, timeout=180,
                   stop_on_failure=False)


def _refused(res, *words: str) -> str:
    assert all(c == 2 for c in res.codes), (res.codes, res.output[-3000:])
    assert "Traceback" not in res.output, res.output[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("sq: error:")]
    text = "\n".join(errors)
    for w in words:
        assert w in text, text
    assert "nothing was written" in text or "differ between ranks" in text, text
    return text


def _nothing_written(*outs):
    for out in outs:
        assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


def test_node_local_copies_with_another_config_are_refused(llama_ckpt, tmp_path):
    """Only rms_norm_eps differs on rank 1's copy: every rank refuses, naming the config and rank 1."""
    copy_ckpt(llama_ckpt, tmp_path / "copy0")
    copy_ckpt(llama_ckpt, tmp_path / "copy1")
    edit_config(tmp_path / "copy1", rms_norm_eps=1e-5)
    out = tmp_path / "out"
    res = _per_rank(["--model", str(tmp_path / "copy{rank}"), "--output", str(out), *JOB])
    text = _refused(res, "source.config_sha256", "rank(s) [1]")
    assert res.stderr.count("sq: error:") == text.count("sq: error:")  # rank 0 speaks for both
    _nothing_written(out)


def test_identical_node_local_copies_at_other_paths_agree(llama_ckpt, tmp_path):
    """The same bytes under another path and another mtime are the same source: the job runs."""
    copy_ckpt(llama_ckpt, tmp_path / "copy0")
    copy_ckpt(llama_ckpt, tmp_path / "copy1")
    for f in (tmp_path / "copy1").iterdir():
        os.utime(f, ns=(0, 1_000_000_000))
    out = tmp_path / "out"
    res = _per_rank(["--model", str(tmp_path / "copy{rank}"), "--output", str(out), *JOB])
    assert res.returncode == 0, res.output[-3000:]
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("verify", ["stat", "content"])
def test_a_shard_whose_bytes_differ_between_nodes_is_refused(llama_ckpt, tmp_path, verify):
    """Same header, one weight changed on rank 1's node: by default (``stat``) the sampled digest of every
    tensor's blocks sees it; --verify-source content hashes each node's copy whole."""
    copy_ckpt(llama_ckpt, tmp_path / "copy0")
    copy_ckpt(llama_ckpt, tmp_path / "copy1")

    def bump(tensors):  # every shard is rewritten; the q_proj weights in it changed, headers as they were
        return {k: v + 1 if k.endswith("q_proj.weight") else v for k, v in tensors.items()}
    edit_tensors(tmp_path / "copy1", bump)
    out = tmp_path / "out"
    res = _per_rank(["--model", str(tmp_path / "copy{rank}"), "--output", str(out), "--verify-source", verify,
                     *JOB], nodes=True)
    text = _refused(res, "differ between ranks", "rank(s) [1]")
    assert ("sampled bytes" in text) == (verify == "stat"), text
    _nothing_written(out)


def test_another_output_per_rank_is_refused(llama_ckpt, tmp_path):
    res = _per_rank(["--model", str(llama_ckpt), "--output", str(tmp_path / "out{rank}"), *JOB])
    _refused(res, "'output'", "rank(s) [1]")
    _nothing_written(tmp_path / "out0", tmp_path / "out1")


def test_another_argument_per_rank_is_refused(llama_ckpt, tmp_path):
    """--algo differs: the ranks would take different collectives (rank 0 reads calibration data, rank 1
    does not) and hang until the timeout; refused first instead."""
    out = tmp_path / "out"
    res = _per_rank(["--model", str(llama_ckpt), "--output", str(out), "--scheme", "W4A16", "--group-size", "16",
                     "--nsamples", "4", "--seqlen", "32", "--timeout", "60", "--algo", "{rank:gptq,rtn}"])
    _refused(res, "'algo'", "rank(s) [1]")
    _nothing_written(out)


# ----------------------------------------------------------------------------- the Python API


def _tiny(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=False))


def _api_per_rank(rank, world, out, field, values):
    from torch.distributed.fsdp import fully_shard

    import sq

    model = _tiny()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    kwargs = {"algo": "gptq", "group_size": 16, "output": str(out)}
    kwargs[field] = values[rank]
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(7))
    output = kwargs.pop("output")
    try:
        sq.quantize(model, output, calibration=calib, **kwargs)
    except SqError as e:
        return e.problems
    return None


@pytest.mark.parametrize("field,values", [("group_size", (16, 32)), ("algo", ("gptq", "rtn")),
                                          ("output", ("OUT0", "OUT1"))])
def test_api_calls_with_other_arguments_per_rank_are_refused(tmp_path, field, values):
    """Every rank raises SqError naming the field (no hang till the process-group timeout, no half-written
    folders), whatever the argument: a scheme detail, the algorithm, the output folder."""
    if field == "output":
        values = tuple(str(tmp_path / v) for v in values)
    got = run_ranks(_api_per_rank, 2, tmp_path / "out", field, values, timeout=120, collective_timeout=30)
    for problems in got:
        assert problems is not None, got
        assert any(f"'{field}'" in p and "rank(s) [1]" in p for p in problems), problems
    assert got[0] == got[1]
    for out in (tmp_path / "out", tmp_path / "OUT0", tmp_path / "OUT1"):
        assert not out.exists() or not any(out.iterdir())


def _between_samples(t: torch.Tensor) -> torch.Tensor:
    """``t`` with one element changed that none of the sampled digest's blocks covers (a quarter in)."""
    from sq.agree import SAMPLE_BYTES, SAMPLES

    assert t.numel() * t.element_size() > 8 * SAMPLES * SAMPLE_BYTES, t.shape  # room between the samples
    t = t.clone()
    t.view(-1)[t.numel() // 4] += 1
    return t


@pytest.mark.parametrize("model_free", [False, True], ids=["model", "model-free"])
@pytest.mark.parametrize("edit", ["whole", "between-samples"])
@pytest.mark.parametrize("verify", ["stat", "content"])
def test_a_shard_edited_in_place_with_its_mtime_restored(llama_ckpt, tmp_path, verify, edit, model_free):
    """`cp -p` / `rsync -a` over a shard: a tensor rewritten at its shape is seen by the default's sampled
    digest; one element changed between its samples is not (documented: "already complete" on the old bytes)
    -- content re-hashes the shards and names the changed one, on the model path and model-free alike."""
    src = copy_ckpt(llama_ckpt, tmp_path / "src")
    out = tmp_path / "out"
    args = ["sq.ptq", "--model", str(src), "--output", str(out), "--scheme", "W4A16", "--algo", "rtn",
            "--group-size", "16", "--verify-source", verify, *(["--model-free"] if model_free else [])]
    assert run_cli(args, 1, timeout=120).returncode == 0
    index = (src / "model.safetensors.index.json").read_bytes()
    stats = {f: f.stat() for f in src.glob("*.safetensors")}
    change = (lambda v: v + 1) if edit == "whole" else _between_samples
    edit_tensors(src, lambda t: {k: change(v) if k.endswith("layers.0.mlp.up_proj.weight") else v
                                 for k, v in t.items()})
    (src / "model.safetensors.index.json").write_bytes(index)
    for f, st in stats.items():
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert f.stat().st_size == st.st_size
    res = run_cli(args, 1, timeout=120)
    if verify == "stat" and edit == "between-samples":
        assert res.returncode == 0 and "already complete" in res.output, res.output[-3000:]
    else:
        assert res.returncode != 0 and "different settings (source.files." in res.stderr, res.output[-3000:]
        assert ("sha256" if verify == "content" else "sample_sha256") in res.stderr


def test_a_stopped_rank_is_an_sq_error_naming_it_and_the_rerun_resumes(llama_ckpt, tmp_path):
    """Rank 1 SIGSTOPped at block 1 with --timeout 10: rank 0 says which rank stopped answering and that the
    same command resumes (no raw gloo traceback); the rerun resumes at block 1."""
    out = tmp_path / "out"
    args = ["sq.ptq", "--model", str(llama_ckpt), "--output", str(out), *JOB[:-1], "10"]
    res = run_cli(args, 2, timeout=180, env={"SQ_FAULT": "stop:1:1"})
    assert res.codes[0] == 3, (res.codes, res.output[-3000:])
    rank0 = [ln for ln in res.stderr.splitlines() if ln.startswith("sq: error: rank 0:")]
    assert len(rank0) == 1 and "rank(s) [1]" in rank0[0] and "rerun the same command" in rank0[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    again = run_cli(args, 2, timeout=180)
    assert again.returncode == 0, again.output[-3000:]
    assert "resuming at block 1" in again.output, again.output[-3000:]
