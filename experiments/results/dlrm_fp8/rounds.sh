#!/bin/bash
# One round of the FP8 comparison of 2026-12-08 (BENCHMARKS.md, "DLRM against TorchRec"):
# `embrace` FP8 at the commit before the FP8 rounding on the bits (a worktree of f709020
# in $BEFORE), then at 91b59b7, `embrace` bfloat16, and TorchRec's DLRM with bfloat16
# comms, each 4 processes on one rate-limited link. usage: rounds.sh RATE ROUND OUT BEFORE
RATE=$1; R=$2; OUT=$3; BEFORE=$4; HERE=$(pwd)
A="--model dlrm --tables 100000,50000,20000,10000,5000,1000,500,100 --dim 64 --bottom 512,256
   --top 512,256 --zipf-exponent 1.0 --batch 512 --optimizer sgd --lr 0.1 --steps 30 --warmup 2
   --devices 4 --strategy embrace"
(cd "$BEFORE" && JAX_PLATFORMS=cpu "$HERE/.venv/bin/python" -m experiments.cluster --nproc 4 \
  --bandwidth "$RATE" -- $A --comm-dtype float8_e4m3fn --out "$OUT/before_fp8_${RATE}_$R.json")
for dt in float8_e4m3fn bfloat16; do
  JAX_PLATFORMS=cpu .venv/bin/python -m experiments.cluster --nproc 4 --bandwidth "$RATE" -- \
    $A --comm-dtype $dt --out "$OUT/ours_${dt}_${RATE}_$R.json"
done
experiments/peers/run_torchrec_dlrm.sh 4 "$RATE" --tables 8 --dim 64 --batch 128 --steps 30 \
  --comm-dtype bfloat16 --out "$OUT/tr_bf16_${RATE}_$R.json"
