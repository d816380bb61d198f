"""Peer baseline: PyTorch DDP (gloo) LSTM language model, one process per rank.

Used to compare sparsecomm_jax against what a user would pick instead, on the same
emulated network. Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--vocab", type=int, default=100000)
p.add_argument("--dim", type=int, default=128)
p.add_argument("--hidden", type=int, default=128)
p.add_argument("--batch", type=int, default=16, help="per rank")
p.add_argument("--seq-len", type=int, default=32)
p.add_argument("--steps", type=int, default=8)
p.add_argument(
    "--sparse", action="store_true", help="sparse embedding gradients (DDP+gloo supports them)"
)
p.add_argument(
    "--sampled",
    type=int,
    default=0,
    help="sampled softmax with this many shared negatives (0: full softmax)",
)
p.add_argument("--out")
a = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class LM(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(a.vocab, a.dim, sparse=a.sparse)
        s.rnn = nn.LSTM(a.dim, a.hidden, batch_first=True)
        if a.sampled:
            s.out_w = nn.Embedding(a.vocab, a.hidden, sparse=a.sparse)
        else:
            s.out = nn.Linear(a.hidden, a.vocab)

    def forward(s, x, y, neg=None):
        h, _ = s.rnn(s.emb(x))
        h = h.reshape(-1, a.hidden)
        if not a.sampled:
            return nn.functional.cross_entropy(s.out(h), y.reshape(-1))
        cand = torch.cat([y.reshape(-1), neg])
        logits = h @ s.out_w(cand).T
        return nn.functional.cross_entropy(logits, torch.arange(h.shape[0]))


torch.manual_seed(0)
model = DDP(LM())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
# Zipf-like ids
ranks_ = torch.arange(1, a.vocab + 1, dtype=torch.float64)
probs = (1.0 / ranks_) / (1.0 / ranks_).sum()
times = []
for _ in range(a.steps):
    x = torch.multinomial(probs, a.batch * (a.seq_len + 1), replacement=True, generator=g).view(
        a.batch, a.seq_len + 1
    )
    dist.barrier()
    t = time.perf_counter()
    neg = torch.randint(0, a.vocab, (a.sampled,), generator=g) if a.sampled else None
    loss = model(x[:, :-1], x[:, 1:], neg)
    opt.zero_grad()
    loss.backward()
    opt.step()
    dist.barrier()
    times.append(time.perf_counter() - t)
med = sorted(times[2:])[len(times[2:]) // 2]
if rank == 0:
    r = {
        "peer": "torch_ddp",
        "sparse": a.sparse,
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
