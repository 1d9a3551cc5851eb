#!/bin/bash
# SignRound's time by phase on the first 4 blocks of demo:smollm2 (2 ranks x 1 thread, W4A16 g64,
# 32 x 512 calibration, 10 steps, batch 8): whole-command wall/user/sys, the report's phase sums and
# each block's tuning loop split (qdq, forward, loss_sync, backward, step).  Usage:
#   bench/signround_phases.sh TAG [extra sq.ptq args...]     (results: bench/_work/sr/TAG)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=$1; shift
model=bench/_work/sr/smollm2-4l
if [ ! -e $model/config.json ]; then
  .venv/bin/python - $model <<'P'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from sq.resolve import resolve_model
src = resolve_model("demo:smollm2")
cfg = AutoConfig.from_pretrained(src); cfg.num_hidden_layers = 4
AutoModelForCausalLM.from_pretrained(src, config=cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(src).save_pretrained(sys.argv[1])
P
fi
out=bench/_work/sr/$tag; rm -rf $out
/usr/bin/time -f "wall %e s, user %U s, sys %S s" env OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run \
  --standalone --nproc-per-node 2 -m sq.ptq --model $model --output $out --algo signround --scheme W4A16 \
  --group-size 64 --nsamples 32 --seqlen 512 --iters 10 --batch-size 8 --resume never "$@" > $out.log 2>&1
tail -1 $out.log
.venv/bin/python - $out <<'P'
import json, sys
r = json.load(open(sys.argv[1] + "/sq_report.json"))
tot = {}
for b in r["ranks"][0]["blocks"]:
    for k, v in b.items():
        if k not in ("block", "rss_anon_after"):
            tot[k] = tot.get(k, 0) + v
for v in r["signround"].values():
    for k, x in v.items():
        if k.endswith("_s"):
            tot["tune." + k[:-2]] = tot.get("tune." + k[:-2], 0) + x
print("rank 0 seconds:", {k: round(v, 1) for k, v in tot.items()})
print("peak RSS MiB per rank:", [x["peak_rss_bytes"] >> 20 for x in r["ranks"]])
print("best loss per block:", [round(v["loss_best"], 5) for v in r["signround"].values()])
P
