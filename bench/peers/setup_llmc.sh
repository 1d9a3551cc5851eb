#!/usr/bin/env bash
# Creates bench/_work/venv-llmc: a venv of its own for llm-compressor 0.14 (the reference of issue 17).
# torch==2.13.0 first (the CPU build, served from /opt/wheels through pip's find-links), then
# llmcompressor==0.14.* with a constraint file pinning torch, so it cannot pull a CUDA torch.
# llm-compressor pins its own transformers / compressed-tensors; they stay inside this venv.
# Never a dependency of sq. Idempotent: does nothing if the venv already imports llmcompressor.
# Usage: bench/peers/setup_llmc.sh            (from the repository root or anywhere)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$here/../_work"
venv="$work/venv-llmc"
mkdir -p "$work"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llmcompressor" 2>/dev/null; then
    echo "venv-llmc: already set up at $venv"
    "$venv/bin/python" -m pip list 2>/dev/null | grep -i -E "^(torch|llmcompressor|transformers|compressed-tensors) "
    exit 0
fi
start=$(date +%s)
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install torch==2.13.0
"$venv/bin/python" -c "import torch; v=torch.__version__; print('torch', v); assert '+cpu' in v or not torch.version.cuda, v"
constraints="$work/llmc-constraints.txt"
echo "torch==2.13.0" > "$constraints"
"$venv/bin/python" -m pip install -c "$constraints" "llmcompressor==0.14.*"
end=$(date +%s)
echo "venv-llmc: install took $((end - start)) s"
echo "$((end - start))" > "$work/venv-llmc.install_seconds"
"$venv/bin/python" -m pip list 2>/dev/null | grep -i -E "^(torch|llmcompressor|transformers|compressed-tensors) "
