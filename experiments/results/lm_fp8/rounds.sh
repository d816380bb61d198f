#!/bin/bash
# One round of the LM comparison of 2026-12-08 (BENCHMARKS.md, "The wire"): TorchRec with
# bfloat16 comms, then embrace bfloat16 and FP8, 4 processes on one link. usage: rounds.sh RATE ROUND [OUT]
RATE=$1; R=$2; OUT=${3:-.}
cd "$(git rev-parse --show-toplevel)"
experiments/peers/run_torchrec_peer.sh 4 $RATE --vocab 100000 --dim 128 --hidden 128 --batch 16 --seq-len 32 --steps 30 --sampled 1024 --comm-dtype bfloat16 --out $OUT/tr_bf16_${RATE}_$R.json > $OUT/tr_bf16_${RATE}_$R.log 2>&1
for dt in bfloat16 float8_e4m3fn; do
JAX_PLATFORMS=cpu .venv/bin/python -m experiments.cluster --nproc 4 --bandwidth $RATE -- --strategy embrace --devices 4 --vocab 100000 --dim 128 --hidden 128 --batch 64 --seq-len 32 --sampled-softmax 1024 --optimizer sgd --lr 0.1 --steps 30 --warmup 2 --comm-dtype $dt --out $OUT/ours_${dt}_${RATE}_$R.json > $OUT/ours_${dt}_${RATE}_$R.log 2>&1
done
