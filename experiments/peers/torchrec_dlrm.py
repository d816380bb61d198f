"""Peer baseline: TorchRec DLRM on CPU (gloo), one process per rank.

TorchRec's home workload: torchrec.models.dlrm.DLRM (bottom MLP, dot interaction, top MLP)
over an EmbeddingBagCollection of --tables sum-pooled tables, one feature per table.
The tables are sharded by DistributedModelParallel (fused EXACT_SGD in backward, ids and
pooled embeddings moved by all-to-all) with the plan of torchrec's EmbeddingShardingPlanner
(default topology, cpu) or a hand-built one; the MLPs are data parallel (DMP wraps them in
DDP, plain SGD). --sharding ddp_dense is the plain baseline: the same model unsharded, every
table an ordinary nn.EmbeddingBag replicated, dense gradients all-reduced by DDP.
Data: synthetic Criteo-like; dense N(0, 1), ids Zipf(1) per table (hashed: a fixed random
permutation of the rows), labels from a fixed random logistic model of the features.
Env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
"""

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

p = argparse.ArgumentParser()
p.add_argument("--tables", type=int, default=8)
p.add_argument(
    "--vocabs",
    default="100k,50k,20k,10k,5k,1k,500,100",
    help="rows per table: a comma list cycled over the tables (k/m suffixes), "
    "or geom:MAX:MIN (log-spaced from MAX down to MIN)",
)
p.add_argument("--dim", type=int, default=64, help="same for all tables")
p.add_argument(
    "--ids-per-feature",
    type=int,
    default=1,
    help="ids per example per feature (>1: multi-hot bags)",
)
p.add_argument("--dense-in", type=int, default=13)
p.add_argument(
    "--bottom", default="512,256,DIM", help="bottom MLP sizes; the last must be --dim (DIM: --dim)"
)
p.add_argument("--top", default="512,256,1", help="top MLP sizes; the last must be 1")
p.add_argument("--batch", type=int, default=128, help="per rank")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--lr", type=float, default=0.1, help="SGD, tables and MLPs")
p.add_argument(
    "--sharding",
    choices=["planner", "table_wise", "column_wise", "row_wise", "data_parallel", "ddp_dense"],
    default="planner",
)
p.add_argument("--ordered-ids", action="store_true", help="no hashing: id 0 is the most frequent")
p.add_argument("--debug", action="store_true", help="print the loss of each step (rank 0)")
p.add_argument(
    "--comm-dtype",
    choices=["float32", "bfloat16"],
    default="float32",
    help="bfloat16: the tables' all-to-alls by TorchRec's QComms BF16 codecs, the MLPs' "
    "all-reduce by a bf16 hook (its FP8 codec fails on CPU for pooled tables: fbgemm's HFP8 "
    "kernel wants 2-D input)",
)
p.add_argument("--out")
p.add_argument(
    "--profile-steps",
    default="",
    help="A:B: rank 0's steps A to B-1 under torch.profiler; where they went, by part "
    "(PARTS), into --profile-out",
)
p.add_argument("--profile-out", help="the profile's JSON (default: --out with .profile.json)")
a = p.parse_args()

# The parts of a step, by the name of each operation torch.profiler records inside it
# (case-insensitive, first match wins); an operation's self CPU time counts once.
PARTS = [
    (  # TorchRec's input and output distributions ([..._dist]_[...]) included
        "collectives (all-to-alls, DDP's all-reduce, their waits, the distributions)",
        r"c10d|gloo|all_?to_?all|all2all|allreduce|all_reduce|allgather|barrier|wait|_dist\]",
    ),
    (
        "lookups, pooling, fused row update (fbgemm)",
        r"^\[lookup\]|fbgemm::|split_embedding|jagged",
    ),
    ("interaction (bmm, pair gather)", r"bmm|triu|aten::index|IndexBackward|interaction"),
    (
        "MLPs (forward, backward)",
        r"addmm|aten::mm$|MmBackward|relu|threshold|aten::linear|aten::t$|TBackward",
    ),
    ("loss", r"binary_cross_entropy|sigmoid"),
    ("dense optimizer (SGD)", r"Optimizer|sgd|_foreach"),
]
STEP = "## the timed step ##"  # a record_function around each step's timed part


def profile_parts(prof) -> dict:
    """Milliseconds a step by part (``PARTS``; the rest "other operations") of the
    operations recorded inside the ``STEP`` ranges of a ``torch.profiler.profile``,
    and the steps' time outside every operation (Python, TorchRec's own code: the
    ``STEP`` ranges' own self time)."""
    import re

    events = prof.events()
    spans = [e for e in events if e.name == STEP]
    ranges = [(e.time_range.start, e.time_range.end) for e in spans]

    def inside(e) -> bool:
        return any(lo <= e.time_range.start and e.time_range.end <= hi for lo, hi in ranges)

    parts = {name: 0.0 for name, _ in PARTS}
    parts["other operations"] = 0.0
    ops: dict[str, float] = {}
    n = len(spans)
    for e in events:
        if e.name == STEP or not inside(e):
            continue
        ms = e.self_cpu_time_total / 1e3 / n
        part = next(
            (p for p, pat in PARTS if re.search(pat, e.name, re.IGNORECASE)), "other operations"
        )
        parts[part] += ms
        ops[e.name] = ops.get(e.name, 0.0) + ms
    parts["outside operations (Python, framework)"] = (
        sum(e.self_cpu_time_total for e in spans) / 1e3 / n
    )
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:30])
    step_ms = sum(hi - lo for lo, hi in ranges) / 1e3 / n
    return {"steps_profiled": n, "step_ms": step_ms, "parts_ms": parts, "top_ops_ms": top}


def vocab_sizes(s, n):
    if s.startswith("geom:"):
        hi, lo = (float(v) for v in s[5:].split(":"))
        return [max(1, round(hi * (lo / hi) ** (i / max(1, n - 1)))) for i in range(n)]
    v = [
        int(float(x[:-1]) * {"k": 1e3, "m": 1e6}[x[-1].lower()])
        if x[-1].lower() in "km"
        else int(x)
        for x in s.split(",")
    ]
    return [v[i % len(v)] for i in range(n)]


vocabs = vocab_sizes(a.vocabs, a.tables)
a.bottom = a.bottom.replace("DIM", str(a.dim))
bottom, top = [int(x) for x in a.bottom.split(",")], [int(x) for x in a.top.split(",")]
assert bottom[-1] == a.dim and top[-1] == 1, (
    "needs the last --bottom size == --dim and the last --top size == 1"
)
T, B, L = a.tables, a.batch, a.ids_per_feature
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

tables = [
    EmbeddingBagConfig(
        name=f"t{i}",
        num_embeddings=v,
        embedding_dim=a.dim,
        feature_names=[f"f{i}"],
        pooling=PoolingType.SUM,
    )
    for i, v in enumerate(vocabs)
]  # torchrec's init U(+-1/sqrt(rows))
dense_baseline = a.sharding == "ddp_dense"
ebc = EmbeddingBagCollection(
    tables=tables, device=torch.device("cpu" if dense_baseline else "meta")
)
torch.manual_seed(0)  # the same MLPs in every mode
train = DLRMTrain(
    DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=a.dense_in,
        dense_arch_layer_sizes=bottom,
        over_arch_layer_sizes=top,
    )
)  # BCE with logits
if dense_baseline:
    ebc.reset_parameters()  # the same init as the sharded tables (nn.EmbeddingBag's own is N(0, 1))
    model = DDP(train)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    chosen = {t.name: "ddp_dense" for t in tables}
else:
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": a.lr})  # fused EXACT_SGD
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
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomms)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    if a.sharding == "planner":
        topology = TopologyFactory.create_topology(
            TrainerConfig(world_size=world), kernel_config=KernelConfig(compute_device="cpu")
        )  # torchrec's defaults for world ranks on cpu
        plan = EmbeddingShardingPlanner(topology=topology, batch_size=B).collective_plan(
            train, [sharder], dist.group.WORLD
        )
    else:
        shard = {
            "column_wise": lambda t: column_wise(ranks=list(range(world))),
            "table_wise": lambda t: table_wise(rank=t % world),
            "row_wise": lambda t: row_wise(),
            "data_parallel": lambda t: data_parallel(),
        }[a.sharding]
        plan = ShardingPlan(
            {
                "model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                    ebc,
                    {t.name: shard(i) for i, t in enumerate(tables)},
                    local_size=world,
                    world_size=world,
                    device_type="cpu",
                )
            }
        )
    mplan = plan.plan["model.sparse_arch.embedding_bag_collection"]
    chosen = {t.name: mplan[t.name].sharding_type for t in tables}
    if rank == 0 and a.sharding == "planner":
        for t in tables:
            s = mplan[t.name]
            print(
                f"plan {t.name} ({t.num_embeddings} x {t.embedding_dim}): {s.sharding_type} "
                f"ranks {s.ranks} kernel {s.compute_kernel}",
                flush=True,
            )
    model = DistributedModelParallel(
        train, env=env, device=torch.device("cpu"), plan=plan, sharders=[sharder]
    )
    if a.comm_dtype != "float32":

        def bf16_hook(_, bucket):  # torch's own bf16 hook refuses CPU; the same steps, over gloo
            t = bucket.buffer().to(torch.bfloat16).div_(world)

            def back(fut):
                return bucket.buffer().copy_(fut.value()[0])

            return dist.all_reduce(t, async_op=True).get_future().then(back)

        model._dmp_wrapped_module.register_comm_hook(None, bf16_hook)
    opt = torch.optim.SGD(
        [q for _, q in in_backward_optimizer_filter(model.named_parameters())], lr=a.lr
    )

# fixed random logistic model (the same on every rank):
# logit = 1.5 (x.w + sum_t mean_bag(u_t) / sqrt(T))
gt = torch.Generator().manual_seed(1234)
w = torch.randn(a.dense_in, generator=gt) / math.sqrt(a.dense_in)
u = [torch.randn(v, generator=gt) for v in vocabs]
perm = [torch.arange(v) if a.ordered_ids else torch.randperm(v, generator=gt) for v in vocabs]
probs = [
    1.0 / torch.arange(1, v + 1, dtype=torch.float64) for v in vocabs
]  # Zipf-like ids (multinomial normalises)
g = torch.Generator().manual_seed(rank)
lengths = torch.full((T * B,), L)
times = []
first, last = (int(x) for x in a.profile_steps.split(":")) if a.profile_steps else (-1, -1)
if a.profile_steps and not 0 <= first < last <= a.steps:
    p.error(f"--profile-steps {a.profile_steps}: give A:B with 0 <= A < B <= --steps ({a.steps})")
prof = None
for step in range(a.steps):
    if step == first and rank == 0:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    x = torch.randn(B, a.dense_in, generator=g)
    ids = [
        pm[torch.multinomial(pr, B * L, replacement=True, generator=g)]
        for pr, pm in zip(probs, perm, strict=True)
    ]
    bags = sum(ut[i].view(B, L).mean(1) for ut, i in zip(u, ids, strict=True))
    logit = 1.5 * (x @ w + bags / math.sqrt(T))
    y = torch.bernoulli(torch.sigmoid(logit), generator=g)
    dist.barrier()
    t = time.perf_counter()
    timed = torch.profiler.record_function(STEP) if prof is not None else contextlib.nullcontext()
    timed.__enter__()
    kjt = KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(T)], lengths=lengths, values=torch.cat(ids)
    )
    loss, _ = model(Batch(dense_features=x, sparse_features=kjt, labels=y))
    opt.zero_grad()
    loss.backward()
    opt.step()
    dist.barrier()
    timed.__exit__(None, None, None)
    times.append(time.perf_counter() - t)
    if prof is not None and step == last - 1:
        prof.__exit__(None, None, None)
        profiled = profile_parts(prof)
        where = a.profile_out or str(
            Path(a.out or "torchrec_dlrm.json").with_suffix(".profile.json")
        )
        json.dump(
            {"steps": [first, last], "config": vars(a), **profiled}, open(where, "w"), indent=1
        )
        prof = None
    if a.debug and rank == 0:
        print(f"step {step} loss {loss.item():.4f} time {times[-1]:.3f}s", flush=True)
med = sorted(times[2:])[len(times[2:]) // 2]
if rank == 0:
    r = {
        "peer": "torchrec_dlrm",
        "sharding": a.sharding,
        "comm_dtype": a.comm_dtype,
        "optimizer": "SGD (dense, DDP)"
        if dense_baseline
        else "EXACT_SGD (fused)"
        + (
            "; data_parallel tables: SGD after the DDP all-reduce"
            if "data_parallel" in chosen.values()
            else ""
        ),
        "plan": chosen,
        "world": world,
        "step_time_s": med,
        "step_time_mean_s": sum(times[2:]) / max(len(times[2:]), 1),
        "samples_per_s": world * B / med,
        "config": dict(vars(a), vocabs=vocabs),
    }
    print(json.dumps(r))
    if a.out:
        json.dump(r, open(a.out, "w"))
dist.destroy_process_group()
