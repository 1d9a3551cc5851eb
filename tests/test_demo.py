"""demo: model specs — resolution, the concurrent-safe cache, and the real SmolLM2 model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sq import demo
from sq.demo import default_cache_dir
from sq.resolve import resolve_model
from sq.errors import SqError


def test_unknown_demo_name_lists_known(tmp_path):
    with pytest.raises(SqError, match=r"unknown demo model 'demo:llama4'; known: demo:smollm2, demo:tiny-moe"):
        resolve_model("demo:llama4", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_non_demo_specs(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path
    assert isinstance(resolve_model(str(tmp_path)), Path)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # a hub id, unchanged
    with pytest.raises(SqError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "model.gguf").write_bytes(b"x")
    with pytest.raises(SqError, match="is a file"):
        resolve_model(str(tmp_path / "model.gguf"))


def test_cache_dir_precedence():
    assert default_cache_dir({"SQ_CACHE_DIR": "/a", "XDG_CACHE_HOME": "/b"}) == Path("/a")
    assert default_cache_dir({"XDG_CACHE_HOME": "/b"}) == Path("/b/sq")
    assert default_cache_dir({}) == Path.home() / ".cache" / "sq"


def test_environ_parameter_selects_cache(tmp_path, monkeypatch):
    monkeypatch.setitem(demo.DEMOS, "fake", lambda out: (out / "config.json").write_text("{}"))
    path = resolve_model("demo:fake", environ={"SQ_CACHE_DIR": str(tmp_path)})
    assert path == tmp_path / "demo" / "fake-v1" and (path / "config.json").is_file()


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(out: Path) -> None:
        (out / "half.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setitem(demo.DEMOS, "broken", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model("demo:broken", cache_dir=tmp_path)
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [".broken.lock"]


def test_debris_of_a_crashed_build_is_replaced(tmp_path, monkeypatch):
    calls = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")

    monkeypatch.setitem(demo.DEMOS, "fake", build)
    root = tmp_path / "demo"
    (root / ".fake-abc.tmp").mkdir(parents=True)  # a crashed build's temp folder
    (root / "fake-v1").mkdir()  # a final folder without its completion marker
    path = resolve_model("demo:fake", cache_dir=tmp_path)
    assert len(calls) == 1 and (path / "config.json").is_file() and (path / "sq-demo.json").is_file()
    assert sorted(p.name for p in root.iterdir()) == [".fake.lock", "fake-v1"]
    assert resolve_model("demo:fake", cache_dir=tmp_path) == path and len(calls) == 1  # reused


_RACER = """
import logging, pathlib, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
import sq.testing.checkpoints, transformers.models.qwen3_moe  # warm imports so both racers meet at the lock
from sq.resolve import resolve_model
ready, go, cache = map(pathlib.Path, sys.argv[1:4])
ready.touch()
while not go.exists():
    time.sleep(0.005)
sys.stdout.write(str(resolve_model("demo:tiny-moe", cache_dir=cache)))
"""


def test_concurrent_resolution_builds_once(tmp_path):
    from sq.testing.checkpoints import verify_checkpoint

    cache, go = tmp_path / "cache", tmp_path / "go"
    readies = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, str(r), str(go), str(cache)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        for r in readies
    ]
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in readies):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "racers did not start"
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    paths = {Path(out) for out, _ in outs}
    assert paths == {cache / "demo" / "tiny-moe-v1"}
    builds = sum(err.count("building demo:tiny-moe") for _, err in outs)
    assert builds == 1, [err for _, err in outs]
    (path,) = paths
    assert sorted(p.name for p in (cache / "demo").iterdir()) == [".tiny-moe.lock", "tiny-moe-v1"]
    assert json.loads((path / "sq-demo.json").read_text())["name"] == "tiny-moe"
    verify_checkpoint(path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)  # 5.24 writes num_experts as "num_local_experts"
    assert (config.model_type, config.dtype, config.num_experts) == ("qwen3_moe", torch.bfloat16, 16)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_loads_and_scores(smollm2_ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sq.calib.data import calibration_windows, load_text, tokenize_corpus
    from sq.eval import perplexity

    config = json.loads((smollm2_ckpt / "config.json").read_text())
    assert (config["model_type"], config["dtype"], config["tie_word_embeddings"]) == ("llama", "bfloat16", True)
    assert "quantization_config" not in config
    assert len(json.loads((smollm2_ckpt / "model.safetensors.index.json").read_text())["weight_map"]) == 272
    assert (smollm2_ckpt / "generation_config.json").is_file()

    tokenizer = AutoTokenizer.from_pretrained(smollm2_ckpt)
    model = AutoModelForCausalLM.from_pretrained(smollm2_ckpt, dtype=torch.float32).eval()
    tokens = tokenize_corpus(tokenizer, load_text("builtin:pydoc"))
    assert tokens.numel() > 100_000  # 113,108 with Python 3.11.7's pydoc_data
    ppl = perplexity(model, calibration_windows(tokens, 8, 512))
    # measured 14.705 (torch 2.13 CPU, transformers 5.24, Python 3.11.7): first 4,096 tokens, 9 s (40 windows:
    # 14.004 in 48 s)
    assert 14.705 * 0.97 < ppl < 14.705 * 1.03, ppl


def _build_on_rank1(rank: int, world: int, cache: str) -> list[str]:
    """rank 1 of a live process group builds the demo (transformers 5's save_pretrained writes nothing on a rank
    other than 0 unless sq tells it to); the others wait."""
    import torch.distributed as dist

    names: list[str] = []
    if rank == 1:
        names = sorted(p.name for p in demo.demo_path("demo:tiny-moe", cache_dir=Path(cache)).iterdir())
    dist.barrier()
    return names


def test_a_demo_built_by_a_rank_other_than_0_is_complete(tmp_path):
    from harness import run_ranks

    names = run_ranks(_build_on_rank1, 2, str(tmp_path), timeout=180)[1]
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names), names
