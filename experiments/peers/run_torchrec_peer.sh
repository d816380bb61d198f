#!/bin/bash
# usage: run_torchrec_peer.sh NPROC BANDWIDTH(e.g. 1gbit|none) [torchrec_lm.py args...]
# Runs the TorchRec peer in a private network namespace with a rate-limited loopback.
set -u
N=$1; BW=$2; shift 2
PY=${PEER_PY:-.venv/bin/python}  # with the peers extra: torch 2.13 (CPU), fbgemm-gpu-cpu 1.8, torchrec 1.8
here=$(dirname "$(readlink -f "$0")")
ns=trpeer$$
ip netns add $ns; trap 'ip netns del $ns 2>/dev/null' EXIT
ip netns exec $ns ip link set lo up
[[ $BW != none ]] && ip netns exec $ns tc qdisc add dev lo root tbf rate $BW burst 1mb latency 100ms
pids=()
for ((r=1; r<N; r++)); do
  ip netns exec $ns env RANK=$r WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 $PY $here/torchrec_lm.py "$@" >/dev/null 2>&1 &
  pids+=($!)
done
ip netns exec $ns env RANK=0 WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 $PY $here/torchrec_lm.py "$@"
rc=$?
for p in "${pids[@]}"; do wait $p; done
exit $rc
