"""TorchRec's managed collisions (MCH) on the stream of ``experiments.studies.managed_vocab``:
the same raw-id DLRM batches, the same table slots, Adagrad, held-out log loss, in one
CPU process (no sharding: MCH's quality, not its speed).

    python experiments/peers/torchrec_mch.py --slots 50000 --steps 600 --lr 0.2

The model mirrors ``models.dlrm``: a bottom MLP (13 -> 64 -> D), one sum-pooled table per
feature behind a ``ManagedCollisionEmbeddingBagCollection`` (``MCHManagedCollisionModule``
of ``--slots`` slots, LRU or LFU eviction every batch), the
pairwise dot interaction and a top MLP (-> 64 -> 1). MCH takes ids in [0, 2^63 - 1):
a raw id's sign bit is dropped (two raw ids collide only if they differ in it alone).
Ids MCH has no slot for read its last slot, which it trains as a shared row.

Unsharded, TorchRec 1.8 does not reset an evicted slot: its
``mc_embedding_modules.evict`` is a stub ("TODO: write function"), so a new id takes
over the evicted id's trained row and its Adagrad sum. ``--reset-evicted`` resets them
as the ``managed`` layout does, before the batch's lookup: the row drawn again from the
table's initialisation, the Adagrad sum zero.

``--policies modulo`` runs the same PyTorch model on a plain ``EmbeddingBagCollection``
reading ``id mod --slots`` (the study's ``modulo`` variant): how far this
implementation's DLRM alone moves the loss, apart from the managed collisions.

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

POLICIES = {"lru": LRU_EvictionPolicy, "lfu": LFU_EvictionPolicy}  # or "modulo": no MCH


def mlp(widths: list[int], last_relu: bool) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i + 2 < len(widths) or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class MchDLRM(nn.Module):
    def __init__(self, tables: int, slots: int, dim: int, policy: str, reset: bool = False):
        super().__init__()
        self.reset, self.optimizer = reset, None  # the optimizer: set by ``run``
        self.evicted = 0  # slots MCH evicted (and reset with ``reset``) so far
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
        self.slots = slots
        self.bottom = mlp([13, 64, dim], last_relu=True)
        pairs = (tables + 1) * tables // 2
        self.top = mlp([dim + pairs, 64, 1], last_relu=False)
        self.keys = [f"sparse_{f}" for f in range(tables)]
        if policy == "modulo":  # no managed collisions: every id folded into the table
            self.tables, self.fold = ebc, True
            return
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
        self.fold = False

    def forward(self, batch: dict) -> torch.Tensor:
        x = self.bottom(torch.as_tensor(batch["dense"]))
        raw = [batch[k].reshape(-1) for k in self.keys]
        if self.fold:  # the study's modulo variant: id mod slots, in [0, slots)
            ids = [torch.as_tensor(np.mod(r, self.slots)) for r in raw]
        else:  # MCH takes ids in [0, 2^63 - 1)
            ids = [torch.as_tensor(r & np.int64(2**63 - 1)) for r in raw]
        n = batch["dense"].shape[0]
        lengths = torch.ones(n * len(self.keys), dtype=torch.int64) * batch[self.keys[0]].shape[1]
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.cat(ids), lengths=lengths)
        pooled = self.tables(kjt) if self.fold else self._look_up(kjt)
        z = torch.stack([x, *(pooled[k] for k in self.keys)], dim=1)  # [B, F+1, D]
        dots = torch.einsum("bfd,bgd->bfg", z, z)
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1))[:, 0]

    def _look_up(self, kjt: KeyedJaggedTensor):
        """MC-EBC's forward (remap, then look up; its ``evict`` is a stub), the evicted
        slots counted and, with ``reset`` (``--reset-evicted``), reset between the
        remapping and the lookup: each evicted row drawn again from its table's
        initialisation, its Adagrad sum zero."""
        mcc, ebc = self.tables._managed_collision_collection, self.tables._embedding_module
        features = mcc(kjt, mutate_miss_lengths=True)
        for table, slots in mcc.evict().items():
            if slots is None or not self.training:
                continue
            self.evicted += len(slots)
            if not self.reset:
                continue
            weight = ebc.embedding_bags[table].weight
            with torch.no_grad():
                fresh = torch.empty(len(slots), weight.shape[1])
                bound = 1 / np.sqrt(weight.shape[0])  # EmbeddingBagConfig's default init
                weight[slots] = fresh.uniform_(-bound, bound)
                state = self.optimizer.state.get(weight)
                if state and "sum" in state:
                    state["sum"][slots] = 0.0
        return ebc(features)


def run(args, policy: str, stream: Stream, batches: list) -> dict:
    torch.manual_seed(0)
    model = MchDLRM(args.tables, args.slots, args.dim, policy, args.reset_evicted)
    opt = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    model.optimizer = opt
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
        "variant": "torchrec-modulo"
        if policy == "modulo"
        else f"torchrec-mch-{policy}" + ("-reset" if args.reset_evicted else ""),
        "heldout_log_loss": float(np.mean(held)),
        "step_ms_mean": float(warm.mean() * 1e3),
        "step_ms_median": float(np.median(warm) * 1e3),
        "evictions_per_step": model.evicted / len(batches),
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
    p.add_argument("--policies", default="lru,lfu", help="lru, lfu, modulo (no MCH), by comma")
    p.add_argument(
        "--reset-evicted",
        action="store_true",
        help="reset an evicted slot's row and Adagrad sum before the lookup (as managed does)",
    )
    p.add_argument("--out-dir", default="experiments/results/managed_vocab")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    stream = Stream(args)  # the study's stream, batch for batch
    batches = [stream.batch() for _ in range(args.steps)]
    stream.heldout = [stream.batch() for _ in range(args.heldout_batches)]
    rows = [run(args, policy, stream, batches) for policy in args.policies.split(",")]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "torchrec_mch" if args.policies == "lru,lfu" else f"torchrec_mch_{args.policies}"
    name += "_reset" if args.reset_evicted else ""
    (out / f"{name.replace(',', '_')}.json").write_text(
        json.dumps({"args": vars(args), "rows": rows}, indent=1)
    )
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
