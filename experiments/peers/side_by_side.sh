#!/bin/bash
# usage: experiments/peers/side_by_side.sh RATE [RATE...]   (from the project root, as root; RATE e.g. 1gbit, 100mbit, none)
# Back to back on the same emulated network (4 processes, one shared tbf loopback): PyTorch DDP with
# sparse gradients, TorchRec column-wise (fused EXACT_SGD) in float32 and in bfloat16 (QComms codecs
# for the tables, a bf16 all-reduce hook for the LSTM), and this project's embrace in float32 and
# bfloat16. LSTM LM V=100k D=H=128, sampled softmax 1,024, 16 x 32 tokens per worker, SGD 0.1.
# PY: the project's python (default .venv/bin/python); PEER_PY: a python with the peers' packages.
set -u
here=$(dirname "$(readlink -f "$0")")
PY=${PY:-.venv/bin/python}
export PEER_PY=${PEER_PY:-$PY}
STEPS=${STEPS:-12}
T=$(mktemp -d)
m="--vocab 100000 --dim 128 --hidden 128 --batch 16 --seq-len 32 --steps $STEPS --sampled 1024"
o="--strategy embrace --devices 4 --vocab 100000 --dim 128 --hidden 128 --batch 64 --seq-len 32 --sampled-softmax 1024 --optimizer sgd --lr 0.1 --steps $STEPS --warmup 2"
tok() { $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(d.get('tokens_per_s') or 2048/d['step_time_s']))" "$1" 2>/dev/null || echo 0; }
for bw in "$@"; do
  timeout 600 bash $here/run_peer.sh 4 $bw $m --sparse --out $T/ddp.json >$T/ddp.log 2>&1
  timeout 600 bash $here/run_torchrec_peer.sh 4 $bw $m --out $T/tr.json >$T/tr.log 2>&1
  timeout 600 bash $here/run_torchrec_peer.sh 4 $bw $m --comm-dtype bfloat16 --out $T/trh.json >$T/trh.log 2>&1
  if [[ $bw == none ]]; then run=($PY -m sparsecomm_jax.launch --nproc 4 -- $PY -m experiments.train)
  else run=($PY -m experiments.cluster --nproc 4 --bandwidth $bw --); fi
  timeout 900 "${run[@]}" $o --out $T/f32.json >$T/f32.log 2>&1
  timeout 900 "${run[@]}" $o --comm-dtype bfloat16 --out $T/bf16.json >$T/bf16.log 2>&1
  d=$(tok $T/ddp.json); r=$(tok $T/tr.json); rh=$(tok $T/trh.json); f=$(tok $T/f32.json); h=$(tok $T/bf16.json)
  best=$(( d > r ? d : r )); (( best == 0 )) && best=1
  echo "$bw (load $(cut -d' ' -f1 /proc/loadavg)): tokens/s ddp_sparse=$d torchrec_cw=$r torchrec_cw_bf16=$rh embrace_f32=$f embrace_bf16=$h; ours / best float32 peer: $(python3 -c "print(f'{$f/$best:.2f}x f32')"); bf16 / TorchRec bf16: $(python3 -c "print(f'{$h/max($rh,1):.2f}x')")"
  rm -f $T/*.json
done
