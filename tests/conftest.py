"""Shared pytest fixtures: tiny random checkpoints (built once per session) and the real model."""

from __future__ import annotations

from pathlib import Path

import pytest

from sq.testing.checkpoints import CheckpointFactory

_SLOW = Path(__file__).with_name("slow.txt")


def pytest_collection_modifyitems(config, items):
    """The fast tier (``-m "not slow"``): every test or file ``tests/slow.txt`` lists is marked ``slow``
    (``bench/test_tiers.py`` regenerates the list from a timed run)."""
    listed = {ln.strip() for ln in _SLOW.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    files = {n for n in listed if "::" not in n}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if item.nodeid in listed or path in files or f"tests/{path}" in files or f"tests/{item.nodeid}" in listed:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def llama_ckpt(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="session")
def qwen3_moe_ckpt(checkpoints) -> Path:
    return checkpoints["qwen3_moe"]


@pytest.fixture(scope="session")
def qwen3_moe_fused_ckpt(checkpoints) -> Path:
    return checkpoints["qwen3_moe_fused"]


@pytest.fixture(scope="session")
def mixtral_ckpt(checkpoints) -> Path:
    return checkpoints["mixtral"]


@pytest.fixture(scope="session")
def deepseek_v3_ckpt(checkpoints) -> Path:
    return checkpoints["deepseek_v3"]


@pytest.fixture(scope="session")
def vlm_ckpt(checkpoints) -> Path:
    return checkpoints["vlm"]


@pytest.fixture(scope="session")
def smollm2_ckpt() -> Path:
    """SmolLM2-135M as bf16 safetensors, converted from the packaged GGUF on first use (~40 s).

    Uses the user cache (``$SQ_CACHE_DIR`` or ``~/.cache/sq``) so it is converted once per
    machine, not once per session.
    """
    from sq.resolve import resolve_model

    return resolve_model("demo:smollm2")
