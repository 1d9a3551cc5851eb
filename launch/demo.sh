#!/usr/bin/env bash
# The main job on a fresh clone (after ./setup.sh), offline, on 2 CPU ranks:
#   1. perplexity of the full-precision demo model (demo:smollm2 = SmolLM2-135M, bf16 weights);
#   2. W4A16 (symmetric int4, group 64) GPTQ with torchrun on 2 ranks (one thread each);
#   3. perplexity of the quantized checkpoint on the same windows.
# Perplexity is scored on the LAST 10 windows of 512 tokens of the embedded corpus
# (builtin:pydoc) to keep it short; the standard benchmark uses 40 (docs/benchmarks.md), so
# these numbers are not the benchmark's.  Calibration: the first NSAMPLES windows of 512.
# Exits non-zero as soon as a step fails.
#
# Knobs (environment): NSAMPLES (default 32), NWINDOWS (10), VENV (default: .venv of this repo),
# OUT (default: out/demo-smollm2-w4a16-gptq in the repo, git-ignored; a previous demo output
# there, recognised by its sq_report.json, is replaced).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
TORCHRUN="$VENV/bin/torchrun"
NSAMPLES="${NSAMPLES:-32}"
NWINDOWS="${NWINDOWS:-10}"
MODEL=demo:smollm2

for exe in "$PY" "$TORCHRUN"; do
  [ -x "$exe" ] || { echo "demo: $exe not found; run ./setup.sh first" >&2; exit 1; }
done
if [ -z "${OUT:-}" ]; then
  OUT="$ROOT/out/demo-smollm2-w4a16-gptq"
  if [ -f "$OUT/sq_report.json" ]; then rm -rf "$OUT"; fi
fi

t0=$SECONDS
step() { echo; echo "== [$((SECONDS - t0))s] $*"; }

step "full-precision perplexity of $MODEL (last $NWINDOWS windows of 512, builtin:pydoc)"
"$PY" -m sq.eval --model "$MODEL" --nwindows "$NWINDOWS" --seqlen 512

step "W4A16 GPTQ, group 64, $NSAMPLES calibration windows of 512, 2 ranks -> $OUT"
OMP_NUM_THREADS=1 "$TORCHRUN" --standalone --nproc-per-node 2 -m sq.ptq --model "$MODEL" --output "$OUT" \
  --scheme W4A16 --algo gptq --group-size 64 --nsamples "$NSAMPLES" --seqlen 512

step "quantized perplexity (same windows)"
"$PY" -m sq.eval --model "$OUT" --nwindows "$NWINDOWS" --seqlen 512

step "done: $OUT ($(du -sh "$OUT" | cut -f1); report $OUT/sq_report.json)"
