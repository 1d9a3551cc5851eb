#!/usr/bin/env bash
# Creates bench/_work/venv-autoround: a venv of its own for auto-round 0.16 (the SignRound peer of issue 20).
# torch==2.13.0 first (the CPU build, served from /opt/wheels through pip's find-links), then
# auto-round==0.16.* with a constraint file pinning torch, so it cannot pull a CUDA torch.
# auto-round pins its own transformers / compressed-tensors; they stay inside this venv.
# Never a dependency of sq. Idempotent: does nothing if the venv already imports auto_round.
# Usage: bench/peers/setup_autoround.sh            (from the repository root or anywhere)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$here/../_work"
venv="$work/venv-autoround"
mkdir -p "$work"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import auto_round" 2>/dev/null; then
    echo "venv-autoround: already set up at $venv"
    "$venv/bin/python" -m pip list 2>/dev/null | grep -i -E "^(torch|auto-round|transformers) "
    exit 0
fi
start=$(date +%s)
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install torch==2.13.0
"$venv/bin/python" -c "import torch; v=torch.__version__; print('torch', v); assert '+cpu' in v or not torch.version.cuda, v"
constraints="$work/autoround-constraints.txt"
echo "torch==2.13.0" > "$constraints"
"$venv/bin/python" -m pip install -c "$constraints" "auto-round==0.16.*"
end=$(date +%s)
echo "venv-autoround: install took $((end - start)) s"
echo "$((end - start))" > "$work/venv-autoround.install_seconds"
"$venv/bin/python" -m pip list 2>/dev/null | grep -i -E "^(torch|auto-round|transformers) "
