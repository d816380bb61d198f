"""TorchRec's managed collisions (MCH) on the stream of ``experiments.studies.managed_vocab``:
the same raw-id DLRM batches, the same table slots, Adagrad, held-out log loss, in one
CPU process (no sharding: MCH's quality, not its speed).

    python experiments/peers/torchrec_mch.py --slots 50000 --steps 600 --lr 0.2

The model mirrors ``models.dlrm``: a bottom MLP (13 -> 64 -> D), one sum-pooled table per
feature behind a ``ManagedCollisionEmbeddingBagCollection`` (``MCHManagedCollisionModule``
of ``--slots`` slots, LRU or LFU eviction every batch, evicted rows reset in place), the
pairwise dot interaction and a top MLP (-> 64 -> 1). MCH takes ids in [0, 2^63 - 1):
a raw id's sign bit is dropped (two raw ids collide only if they differ in it alone).
Ids MCH has no slot for read its last slot, which it trains as a shared row.

Writes ``torchrec_mch.json`` into ``--out-dir`` (default
``experiments/results/managed_vocab``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.studies.managed_vocab import Stream, log_loss  # noqa: E402

POLICIES = {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy}


def mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i + 2 < len(widths) or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class MchDLRM(nn.Module):
    def __init__(self, tables: int, slots: int, dim: int, policy: str):
        super().__init__()
        configs = [
            EmbeddingBagConfig(
                name=f"t{f}",
                num_embeddings=slots,
                embedding_dim=dim,
                feature_names=[f"sparse_{f}"],
                pooling=PoolingType.SUM,
            )
            for f in range(tables)
        ]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        modules = {
            f"t{f}": MCHManagedCollisionModule(
                zch_size=slots,
                device=torch.device("cpu"),
                eviction_policy=POLICIES[policy](),
                eviction_interval=1,
            )
            for f in range(tables)
        }
        mcc = ManagedCollisionCollection(modules, embedding_configs=configs)
        self.tables = ManagedCollisionEmbeddingBagCollection(
            ebc, mcc, allow_in_place_embed_weight_update=True
        )
        self.bottom = mlp([13, 64, dim], last_relu=True)
        pairs = (tables + 1) * tables // 2
        self.top = mlp([dim + pairs, 64, 1], last_relu=False)
        self.keys = [f"sparse_{f}" for f in range(tables)]

    def forward(self, batch: dict) -> torch.Tensor:
        x = self.bottom(torch.as_tensor(batch["dense"]))
        ids = [torch.as_tensor(batch[k].reshape(-1) & np.int64(2**63 - 1)) for k in self.keys]
        n = batch["dense"].shape[0]
        lengths = torch.ones(n * len(self.keys), dtype=torch.int64) * batch[self.keys[0]].shape[1]
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.cat(ids), lengths=lengths)
        out = self.tables(kjt)
        pooled = out[0] if isinstance(out, tuple) else out
        z = torch.stack([x, *(pooled[k] for k in self.keys)], dim=1)  # [B, F+1, D]
        dots = torch.einsum("bfd,bgd->bfg", z, z)
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1))[:, 0]


def run(args, policy: str, stream: Stream, batches: list) -> dict:
    torch.manual_seed(0)
    model = MchDLRM(args.tables, args.slots, args.dim, policy)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    bce = nn.BCEWithLogitsLoss()
    times = []
    for i, (batch, _) in enumerate(batches):
        begin = time.perf_counter()
        loss = bce(model(batch), torch.as_tensor(batch["label"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - begin)
        if (i + 1) % max(1, len(batches) // 10) == 0:
            print(f"  torchrec-mch-{policy}: step {i + 1} loss {loss.item():.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        held = [log_loss(model(b).numpy(), np.asarray(b["label"])) for b, _ in stream.heldout]
    warm = np.array(times[args.warmup :])
    return {
        "variant": f"torchrec-mch-{policy}",
        "heldout_log_loss": float(np.mean(held)),
        "step_ms_mean": float(warm.mean() * 1e3),
        "step_ms_median": float(np.median(warm) * 1e3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--slots", type=int, default=250_000)
    p.add_argument("--distinct", type=int, default=2_500_000)
    p.add_argument("--exponent", type=float, default=1.05)
    p.add_argument("--multi-hot", type=int, default=1)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--heldout-batches", type=int, default=10)
    p.add_argument("--signal", type=float, default=1.5)
    p.add_argument("--bias", type=float, default=-1.0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--policies", default="lru,lfu")
    p.add_argument("--out-dir", default="experiments/results/managed_vocab")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    stream = Stream(args)  # the study's stream, batch for batch
    batches = [stream.batch() for _ in range(args.steps)]
    stream.heldout = [stream.batch() for _ in range(args.heldout_batches)]
    rows = [run(args, policy, stream, batches) for policy in args.policies.split(",")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "torchrec_mch.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
