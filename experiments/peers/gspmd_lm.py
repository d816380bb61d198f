"""The JAX user's first try: the LSTM LM under plain jax.jit, tables sharded by NamedSharding.

No shard_map, no all_to_all written by hand: XLA's SPMD partitioner decides the collectives.
Same model, data and SGD as the project's `experiments.train --model lstm_lm` (its workload
is reused for the model and the batches only; the step is plain jax). Run under the
project's launcher or cluster (one CPU device a process), e.g.
  experiments/peers/run_gspmd_peer.sh 4 1gbit --layout row --out r.json  (project root, root)
--layout row: tables P('d', None) (vocabulary sharded); col: P(None, 'd'); replicated: P().
"""

import argparse
import json
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--layout", choices=["row", "col", "replicated"], default="row")
p.add_argument("--model", choices=["lstm_lm", "dlrm"], default="lstm_lm")
p.add_argument("--tables", default="100000,50000,20000,10000,5000,1000,500,100", help="dlrm")
p.add_argument("--vocab", type=int, default=100000)
p.add_argument("--dim", type=int, default=128)
p.add_argument("--hidden", type=int, default=128)
p.add_argument("--batch", type=int, default=64, help="global batch")
p.add_argument("--seq-len", type=int, default=32)
p.add_argument("--sampled", type=int, default=1024)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--warmup", type=int, default=2)
p.add_argument(
    "--constrain",
    action="store_true",
    help="the expert's hint: looked-up rows constrained to the batch sharding",
)
p.add_argument("--out", default="")
a = p.parse_args()

from sparsecomm_jax import distributed  # noqa: E402  (job start-up only)

distributed.initialize_distributed()
import jax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models import get_workload  # noqa: E402

if a.model == "lstm_lm":
    w = get_workload(
        "lstm_lm",
        vocab=a.vocab,
        dim=a.dim,
        hidden=a.hidden,
        batch=a.batch,
        seq_len=a.seq_len,
        sampled_softmax=a.sampled,
    )
else:  # the DLRM side by side of BENCHMARKS.md
    w = get_workload(
        "dlrm",
        tables=a.tables,
        dim=a.dim,
        bottom="512,256",
        top="512,256",
        zipf_exponent=1.0,
        batch=a.batch,
    )
mesh = Mesh(np.array(jax.devices()), ("d",))
tspec = {"row": P("d", None), "col": P(None, "d"), "replicated": P()}[a.layout]
tables = {tuple(p) for p in w.embedding_paths}


def spec_of(path, leaf):
    keys = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
    return NamedSharding(mesh, tspec if keys in tables else P())


params0 = w.init(jax.random.key(0))
pshard = jax.tree_util.tree_map_with_path(spec_of, params0)
params = (
    jax.device_put(params0, pshard)
    if jax.process_count() == 1
    else jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, np.asarray(x).__getitem__),
        params0,
        pshard,
    )
)


def place(batch):
    out = {}
    for k, v in batch.items():
        s = NamedSharding(mesh, P() if k in w.replicated_keys else P("d"))
        out[k] = jax.make_array_from_callback(v.shape, s, lambda i, v=v: v[i])
    return out


bshard = jax.tree.map(lambda x: x.sharding, place(w.batch_at(0)))


from sparsecomm_jax.embedding.access import PLAIN  # noqa: E402

emb = PLAIN
if a.constrain:
    rows = NamedSharding(mesh, P("d"))
    emb = PLAIN._replace(
        lookup=lambda t, ids: jax.lax.with_sharding_constraint(PLAIN.lookup(t, ids), rows)
    )


@jax.jit
def step(params, batch):
    loss, g = jax.value_and_grad(lambda q: w.loss(q, batch, emb))(params)
    return jax.tree.map(lambda x, y: x - a.lr * y, params, g), loss


step = jax.jit(
    step,
    in_shardings=(pshard, bshard),
    out_shardings=(pshard, NamedSharding(mesh, P())),
    donate_argnums=0,
)
losses, times = [], []
for s in range(a.steps):
    b = place(w.batch_at(s))
    t0 = time.perf_counter()
    params, loss = step(params, b)
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
med = float(np.median(times[a.warmup :]))
import re  # noqa: E402

hlo_text = step.lower(params, b).compile().as_text()
KINDS = "all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute"
colls = re.findall(rf"= (\S+\[[^\]]*\])[^=]* ({KINDS})(?:-start)?\(", hlo_text)
colls = [f"{k} {s}" for s, k in colls]
rec = {
    "layout": a.layout + ("+constrain" if a.constrain else ""),
    "losses": losses,
    "step_time_s": med,
    "items_per_s": w.items_per_step / med,
    "tokens_per_s": w.items_per_step / med,
    "collectives": colls,
    "processes": jax.process_count(),
}
if jax.process_index() == 0:
    print(json.dumps({k: rec[k] for k in ("layout", "step_time_s", "tokens_per_s", "processes")}))
    print("losses", [round(x, 4) for x in losses])
    print("collectives", colls)
    if a.out:
        json.dump(rec, open(a.out, "w"))
