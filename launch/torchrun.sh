#!/usr/bin/env bash
# sq post-training quantization on one machine without Slurm: `torchrun --standalone -m sq.ptq`.
# Rerun the same command (same OUTPUT) after a crash and `--resume auto` continues the run.
#
#   MODEL=/ckpt/Qwen3-30B-A3B OUTPUT=/out/qwen3-w4a16 EP=8 launch/torchrun.sh      (one rank per GPU)
#   MODEL=/ckpt/llama OUTPUT=/tmp/q NPROC_PER_NODE=2 ALGO=rtn launch/torchrun.sh    (CPU, gloo)
#   launch/torchrun.sh --nsamples 256 --seqlen 2048     (extra arguments go to sq.ptq as they are)
#
# Knobs are environment variables, listed with their defaults below.  Slurm: launch/slurm/*.sbatch
# and docs/slurm.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# ---- knobs: VAR="${VAR:-default}"  # meaning ------------------------------------------------------
MODEL="${MODEL:-}"                          # checkpoint folder or demo:NAME; required
OUTPUT="${OUTPUT:-}"                        # output folder; rerun with the same one to resume; required
SCHEME="${SCHEME:-W4A16}"                   # --scheme: W4A16, W4A16_ASYM, W8A16 or FP8_DYNAMIC
ALGO="${ALGO:-gptq}"                        # --algo: gptq or rtn
GROUP_SIZE="${GROUP_SIZE:-128}"             # --group-size (must divide every quantized layer's input width)
EP="${EP:-1}"                               # --ep: expert-parallel degree (divides the world size)
RESUME="${RESUME:-auto}"                    # --resume: auto continues an unfinished run in OUTPUT
EXTRA_ARGS="${EXTRA_ARGS:-}"                # more sq.ptq arguments, word-split (e.g. "--nsamples 256 --seqlen 2048")
NPROC_PER_NODE="${NPROC_PER_NODE:-}"        # ranks; empty: one per GPU (CUDA_VISIBLE_DEVICES or nvidia-smi); set it on CPU
OMP_NUM_THREADS="${OMP_NUM_THREADS:-}"      # threads per rank; empty: CPUs / NPROC_PER_NODE (at least 1)
MAX_RESTARTS="${MAX_RESTARTS:-0}"           # torchrun --max-restarts (each restart resumes from the manifests)
TORCHRUN_ARGS="${TORCHRUN_ARGS:-}"          # more torchrun arguments, word-split
VENV="${VENV:-}"                            # virtual environment with sq installed; empty: this repository's .venv if present
PYTHON="${PYTHON:-}"                        # python interpreter; empty: $VENV/bin/python, else python3 on PATH

# ---- NCCL / gloo (sane defaults; uncomment the site-specific ones) --------------------------------
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"  # a failed collective ends the run, no hang
# export NCCL_DEBUG=INFO                  # print NCCL's topology and transport choices
# export GLOO_SOCKET_IFNAME=lo            # interface gloo uses on CPU, if the default one is wrong

die() { echo "sq-torchrun: error: $*" >&2; exit 2; }

[ -n "$MODEL" ] || die "MODEL is not set (a checkpoint folder or demo:NAME)"
[ -n "$OUTPUT" ] || die "OUTPUT is not set"

if [ -z "$PYTHON" ]; then
  if [ -z "$VENV" ] && [ -x "$ROOT/.venv/bin/python" ]; then VENV="$ROOT/.venv"; fi
  if [ -n "$VENV" ]; then PYTHON="$VENV/bin/python"; else PYTHON="$(command -v python3 || true)"; fi
fi
[ -n "$PYTHON" ] && [ -x "$PYTHON" ] || die "no python interpreter (set VENV or PYTHON)"
"$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("sq") is None)' \
  || die "$PYTHON cannot import sq (set VENV or PYTHON)"

if [ -z "$NPROC_PER_NODE" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    NPROC_PER_NODE="$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    NPROC_PER_NODE="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
  fi
  [ "${NPROC_PER_NODE:-0}" -gt 0 ] 2>/dev/null || die "no GPU found: set NPROC_PER_NODE (CPU ranks use gloo)"
fi
[[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive whole number, got '$NPROC_PER_NODE'"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a whole number, got '$MAX_RESTARTS'"
if [ -z "$OMP_NUM_THREADS" ]; then
  OMP_NUM_THREADS=$(($(nproc) / NPROC_PER_NODE)); [ "$OMP_NUM_THREADS" -ge 1 ] || OMP_NUM_THREADS=1
fi
export OMP_NUM_THREADS

echo "[sq-torchrun] $NPROC_PER_NODE rank(s) x $OMP_NUM_THREADS thread(s): sq.ptq --model $MODEL --output $OUTPUT" \
  "--scheme $SCHEME --algo $ALGO --group-size $GROUP_SIZE --ep $EP --resume $RESUME $EXTRA_ARGS $*"
# shellcheck disable=SC2086  # EXTRA_ARGS / TORCHRUN_ARGS are word-split on purpose
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC_PER_NODE" \
  --max-restarts="$MAX_RESTARTS" $TORCHRUN_ARGS \
  -m sq.ptq --model "$MODEL" --output "$OUTPUT" --scheme "$SCHEME" --algo "$ALGO" \
  --group-size "$GROUP_SIZE" --ep "$EP" --resume "$RESUME" $EXTRA_ARGS "$@"
