#!/usr/bin/env bash
# Creates bench/_work/venv-NAME: a venv of its own for one peer (never a dependency of sq).
# torch==2.13.0 first (the CPU build), then the peer with a constraint file pinning torch, so it
# cannot pull a CUDA torch; the peer pins its own transformers / compressed-tensors inside its venv.
# Idempotent: does nothing if the venv already imports the peer's module.
# Usage: bench/peers/setup_venv.sh NAME PIP_REQUIREMENT IMPORT_NAME
#   e.g. bench/peers/setup_venv.sh llmc "llmcompressor==0.14.*" llmcompressor
set -euo pipefail
name="$1"; requirement="$2"; module="$3"
here="$(cd "$(dirname "$0")" && pwd)"
work="$here/../_work"
venv="$work/venv-$name"
show() { "$venv/bin/python" -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|compressed-tensors|${requirement%%=*}) "; }
mkdir -p "$work"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import $module" 2>/dev/null; then
    echo "venv-$name: already set up at $venv"
    show
    exit 0
fi
start=$(date +%s)
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install torch==2.13.0
"$venv/bin/python" -c "import torch; v=torch.__version__; print('torch', v); assert '+cpu' in v or not torch.version.cuda, v"
constraints="$work/$name-constraints.txt"
echo "torch==2.13.0" > "$constraints"
"$venv/bin/python" -m pip install -c "$constraints" "$requirement"
end=$(date +%s)
echo "venv-$name: install took $((end - start)) s"
echo "$((end - start))" > "$work/venv-$name.install_seconds"
show
