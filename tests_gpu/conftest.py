"""GPU tests: skipped without CUDA. Same fixtures and harness as tests/, with NCCL."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from sq.testing.checkpoints import CheckpointFactory  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("checkpoints"))
