#!/bin/bash
# usage: experiments/peers/side_by_side_jax.sh RATE [RATE...]   (from the project root, as root; RATE e.g. 1gbit, none)
# Back to back on the same emulated network (4 processes, one shared tbf loopback), the LM of side_by_side.sh:
# what a JAX user writes first (plain jax.jit, tables sharded by NamedSharding by rows, by columns, or
# replicated; XLA's partitioner picks the collectives) against this project's embrace in float32.
# PY: the project's python (default .venv/bin/python).
set -u
here=$(dirname "$(readlink -f "$0")")
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-12}
T=$(mktemp -d)
m="--vocab 100000 --dim 128 --hidden 128 --batch 64 --seq-len 32 --sampled 1024 --lr 0.1 --steps $STEPS --warmup 2"
o="--strategy embrace --devices 4 --vocab 100000 --dim 128 --hidden 128 --batch 64 --seq-len 32 --sampled-softmax 1024 --optimizer sgd --lr 0.1 --steps $STEPS --warmup 2"
tok() { $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(d.get('tokens_per_s') or 2048/d['step_time_s']))" "$1" 2>/dev/null || echo 0; }
for bw in "$@"; do
  for lay in row col replicated; do
    PY=$PY timeout 900 bash $here/run_gspmd_peer.sh 4 $bw $m --layout $lay --out $T/g_$lay.json >$T/g_$lay.log 2>&1
  done
  if [[ $bw == none ]]; then run=($PY -m sparsecomm_jax.launch --nproc 4 -- $PY -m experiments.train)
  else run=($PY -m experiments.cluster --nproc 4 --bandwidth $bw --); fi
  timeout 900 "${run[@]}" $o --out $T/f32.json >$T/f32.log 2>&1
  r=$(tok $T/g_row.json); c=$(tok $T/g_col.json); p=$(tok $T/g_replicated.json); f=$(tok $T/f32.json)
  best=$(( r > c ? r : c )); best=$(( best > p ? best : p )); (( best == 0 )) && best=1
  echo "$bw (load $(cut -d' ' -f1 /proc/loadavg)): tokens/s gspmd_row=$r gspmd_col=$c gspmd_replicated=$p embrace_f32=$f; ours / best: $(python3 -c "print(f'{$f/$best:.2f}x')")"
  rm -f $T/*.json
done
