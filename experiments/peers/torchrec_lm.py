"""Peer baseline: TorchRec LSTM language model on CPU (gloo), one process per rank.

Same model, data and timing as torch_ddp_lm.py (sampled softmax), but both tables
(input embedding, output table) live in one torchrec EmbeddingCollection sharded by
DistributedModelParallel (fused EXACT_SGD in backward, ids and embeddings moved by
all-to-all); the LSTM is data parallel (DMP wraps it in DDP).
Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import argparse
import json
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

p = argparse.ArgumentParser()
p.add_argument("--vocab", type=int, default=100000)
p.add_argument("--dim", type=int, default=128)
p.add_argument("--hidden", type=int, default=128)
p.add_argument("--batch", type=int, default=16, help="per rank")
p.add_argument("--seq-len", type=int, default=32)
p.add_argument("--steps", type=int, default=8)
p.add_argument(
    "--sampled", type=int, default=1024, help="shared negatives of the sampled softmax (>0)"
)
p.add_argument(
    "--sharding", choices=["column_wise", "table_wise", "row_wise"], default="column_wise"
)
p.add_argument("--optimizer", choices=["sgd"], default="sgd")
p.add_argument("--debug", action="store_true", help="print the loss of each step (rank 0)")
p.add_argument(
    "--comm-dtype",
    choices=["float32", "bfloat16"],
    default="float32",
    help="bfloat16: the tables' all-to-alls by TorchRec's QComms BF16 codecs, the LSTM's "
    "all-reduce by a bf16 hook (its FP8 codec fails on CPU: fbgemm's HFP8 kernel wants 2-D "
    "input)",
)
p.add_argument("--out")
a = p.parse_args()
# an EmbeddingCollection needs one dim for all its tables; full softmax has no table lookup
assert a.dim == a.hidden and a.sampled > 0, "needs --dim == --hidden and --sampled > 0"
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class LM(nn.Module):
    def __init__(s):
        super().__init__()
        u = math.sqrt(3)  # uniform with variance 1, like nn.Embedding's N(0, 1)
        s.ec = EmbeddingCollection(
            device=torch.device("meta"),
            tables=[
                EmbeddingConfig(
                    name="emb",
                    num_embeddings=a.vocab,
                    embedding_dim=a.dim,
                    feature_names=["x"],
                    weight_init_min=-u,
                    weight_init_max=u,
                ),
                EmbeddingConfig(
                    name="out_w",
                    num_embeddings=a.vocab,
                    embedding_dim=a.hidden,
                    feature_names=["cand"],
                    weight_init_min=-u,
                    weight_init_max=u,
                ),
            ],
        )
        s.rnn = nn.LSTM(a.dim, a.hidden, batch_first=True)

    def forward(s, kjt):
        e = s.ec(kjt)
        h, _ = s.rnn(e["x"].values().view(a.batch, a.seq_len, a.dim))
        h = h.reshape(-1, a.hidden)
        logits = h @ e["cand"].values().T  # candidates: the batch's targets, then the negatives
        return nn.functional.cross_entropy(logits, torch.arange(h.shape[0]))


torch.manual_seed(0)
lm = LM()
apply_optimizer_in_backward(torch.optim.SGD, lm.ec.parameters(), {"lr": 0.1})  # fused EXACT_SGD
shard = {
    "column_wise": lambda t: column_wise(ranks=list(range(world))),
    "table_wise": lambda t: table_wise(rank=t % world),
    "row_wise": lambda t: row_wise(),
}[a.sharding]
plan = ShardingPlan(
    {
        "ec": construct_module_sharding_plan(
            lm.ec,
            {"emb": shard(0), "out_w": shard(1)},
            local_size=world,
            world_size=world,
            device_type="cpu",
        )
    }
)
qcomms = None
if a.comm_dtype != "float32":
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )

    qcomms = get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=CommType.BF16, backward_precision=CommType.BF16)
    )
model = DistributedModelParallel(
    lm,
    env=ShardingEnv.from_process_group(dist.group.WORLD),
    device=torch.device("cpu"),
    plan=plan,
    sharders=[EmbeddingCollectionSharder(qcomm_codecs_registry=qcomms)],
)
if a.comm_dtype != "float32":

    def bf16_hook(_, bucket):  # torch's own bf16 hook refuses CPU; the same steps, over gloo
        t = bucket.buffer().to(torch.bfloat16).div_(world)

        def back(fut):
            return bucket.buffer().copy_(fut.value()[0])

        return dist.all_reduce(t, async_op=True).get_future().then(back)

    model._dmp_wrapped_module.register_comm_hook(None, bf16_hook)
opt = torch.optim.SGD(
    [q for _, q in in_backward_optimizer_filter(model.named_parameters())], lr=0.1
)
g = torch.Generator().manual_seed(rank)
# Zipf-like ids
ranks_ = torch.arange(1, a.vocab + 1, dtype=torch.float64)
probs = (1.0 / ranks_) / (1.0 / ranks_).sum()
lengths = torch.full(
    (2 * a.batch,), a.seq_len
)  # per example: T input ids; T targets (+ negatives on the last)
lengths[-1] += a.sampled
times = []
for step in range(a.steps):
    x = torch.multinomial(probs, a.batch * (a.seq_len + 1), replacement=True, generator=g).view(
        a.batch, a.seq_len + 1
    )
    dist.barrier()
    t = time.perf_counter()
    neg = torch.randint(0, a.vocab, (a.sampled,), generator=g)
    kjt = KeyedJaggedTensor(
        keys=["x", "cand"],
        lengths=lengths,
        values=torch.cat([x[:, :-1].reshape(-1), x[:, 1:].reshape(-1), neg]),
    )
    loss = model(kjt)
    opt.zero_grad()
    loss.backward()
    opt.step()
    dist.barrier()
    times.append(time.perf_counter() - t)
    if a.debug and rank == 0:
        print(f"step {step} loss {loss.item():.4f} time {times[-1]:.3f}s", flush=True)
med = sorted(times[2:])[len(times[2:]) // 2]
if rank == 0:
    r = {
        "peer": "torchrec",
        "sharding": a.sharding,
        "comm_dtype": a.comm_dtype,
        "optimizer": "EXACT_SGD (fused)",
        "world": world,
        "step_time_s": med,
        "step_time_mean_s": sum(times[2:]) / max(len(times[2:]), 1),
        "tokens_per_s": world * a.batch * a.seq_len / med,
        "config": vars(a),
    }
    print(json.dumps(r))
    if a.out:
        json.dump(r, open(a.out, "w"))
dist.destroy_process_group()
