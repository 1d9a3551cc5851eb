#!/usr/bin/env bash
# Issue 17, one command: sq's RTN output vs llm-compressor 0.14's, tensor for tensor, for every preset.
#   bench/peers/check_presets.sh                       # every preset, demo:smollm2 and the tiny llama fixture
#   bench/peers/check_presets.sh NVFP4,FP8_BLOCK       # some presets
#   MODELS=llama SQ_SRC=bench/_work/sq-head/src bench/peers/check_presets.sh
# Sets up bench/_work/venv-llmc if missing (~70 s), builds any missing reference (kept under
# bench/_work/ref/<model>-<PRESET>; FP8 / NVFP4 calibrate on 128 x 512 pydoc tokens, minutes on
# SmolLM2), runs `python -m sq.ptq --scheme P --algo rtn --group-size 64` for each preset into
# bench/_work/sq/<model>-<PRESET>, compares with bench/peers/compare.py (per-preset reports:
# bench/_work/ref/logs/compare-<model>-<PRESET>.txt) and prints the table.
# Exit 0 when every preset sq accepts writes tensors identical to the reference -- weights bit for bit;
# static activation scales (FP8 input_scale, NVFP4 input_global_scale) within RTOL relative (default
# 0.0625 = 8 bf16 ulps: both tools calibrate in the model's dtype and a bf16 chain moves the maxima by
# 1-5 ulps, docs/benchmarks.md "Presets vs llm-compressor"); presets sq refuses (exit 2 naming the
# scheme) are listed as "refused by sq" and do not fail the check.
set -euo pipefail
cd "$(dirname "$0")/../.."
PRESETS="${1:-W4A16,W4A16_ASYM,W3A16,W2A16,W8A16,FP8_DYNAMIC,FP8_BLOCK,FP8,NVFP4A16,NVFP4,MXFP4A16,MXFP4,MXFP8A16,MXFP8,W8A8,W4AFP8,W4A8}"
MODELS="${MODELS:-smollm2,llama}"
PY=.venv/bin/python
bench/peers/setup_llmc.sh > /dev/null
$PY bench/peers/presets.py ref --models "$MODELS" --presets "$PRESETS"
rc=0
$PY bench/peers/presets.py sq --models "$MODELS" --presets "$PRESETS" --rtol "${RTOL:-0.0625}" ${SQ_SRC:+--sq-src "$SQ_SRC"} || rc=$?
$PY bench/peers/presets.py table --models "$MODELS" --presets "$PRESETS"
exit $rc
