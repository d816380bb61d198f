"""The papers' workloads at their sizes, compiled for 8 and 16 H100s that are not there:
memory per GPU against 80 GB, bytes each GPU sends, and a step's communication modelled.

    python -m experiments.studies.gpu_scale --out-dir experiments/results/gpu_scale

Each workload and strategy is built by ``make_train_step`` on a compile-only mesh
(``sparsecomm_jax.compile_only``: one host of 8 GPUs, and two hosts of 8) and compiled;
from the program come its peak memory per GPU (``memory_analysis``) and the bytes each
GPU sends per step (``comm.hlo``, as every other figure here). The step's communication
time is **modelled**, not measured: the compiled collectives priced one after the other
by the alpha-beta model (``costmodel.program_time``) on the links of an H100 node, NVLink
4 inside a node (450 GB/s a direction, the H100 datasheet; 3 us a message, assumed) and
one 400 Gb/s InfiniBand NDR port a GPU between nodes (50 GB/s, the DGX H100 datasheet; 8
us a message, assumed); two hosts are priced at the slower link. Writes
``gpu_scale.json`` and ``gpu_scale.md`` (the table).

The workloads: EmbRace's LSTM language model (One Billion Words: V = 793,471, D = 512, a
2,048-wide LSTM, 128 x 20 tokens a GPU, a sampled softmax of 8,192), TopKA2A's BERT-base
(V = 30,522, D = 768, 12 layers, 32 sequences of 128 a GPU) and a DLRM of Criteo's 26
sparse features at D = 128 (TorchRec's recipe; each table's rows capped at 1M so the
initial parameters fit this 24 GB host, 6.9M rows in all), 2,048 samples a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: compile-only GPUs

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import sparsecomm_jax as sc  # noqa: E402
from models import get_workload  # noqa: E402
from sparsecomm_jax import compile_only  # noqa: E402
from sparsecomm_jax.comm import costmodel  # noqa: E402

#: Criteo 1TB's 26 sparse features (rows per feature, as MLPerf's DLRM caps them at 40M).
CRITEO = (
    45833188,
    36746,
    17245,
    7413,
    20243,
    3,
    7114,
    1441,
    62,
    29275261,
    1572176,
    345138,
    10,
    2209,
    11267,
    128,
    4,
    974,
    14,
    48937457,
    11316796,
    40094537,
    452104,
    12606,
    104,
    35,
)
CAP = 1_000_000  # rows a table here (the initial parameters are made on this host)

#: name -> (model, its sizes with the batch a GPU as ``per_gpu``, strategies)
WORKLOADS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "LSTM LM (EmbRace)": (
        "lstm_lm",
        dict(vocab=793_471, dim=512, hidden=2048, seq_len=20, per_gpu=128, sampled_softmax=8192),
        ("dense", "embrace", "embrace_rowwise", "embrace_2d"),
    ),
    "BERT-base (TopKA2A)": (
        "bert",
        dict(vocab=30_522, dim=768, heads=12, layers=12, seq_len=128, per_gpu=32, masked=20),
        ("dense", "topk_a2a", "oktopk", "embrace+topk_a2a"),
    ),
    "DLRM (TorchRec, Criteo)": (
        "dlrm",
        dict(
            tables=",".join(str(min(v, CAP)) for v in CRITEO),
            dim=128,
            bottom="512,256",
            top="1024,1024,512,256",
            per_gpu=2048,
        ),
        ("dense", "embrace", "embrace_rowwise"),
    ),
}
LINKS = {  # per GPU, one direction
    "nvlink": costmodel.Link(alpha=3e-6, beta=1 / 450e9),
    "infiniband": costmodel.Link(alpha=8e-6, beta=1 / 50e9),
}
HBM = 80 * 10**9  # an H100 SXM's memory, bytes


def measure(model: str, sizes: dict[str, Any], strategy: str, hosts: int) -> dict[str, Any]:
    """One workload and strategy compiled for ``hosts`` x 8 H100s."""
    gpus = 8 * hosts
    sizes = dict(sizes)
    sizes["batch"] = sizes.pop("per_gpu") * gpus
    w = get_workload(model, seed=0, **sizes)
    params = w.init(jax.random.key(0))
    start = time.perf_counter()
    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        compile_only.gpu_mesh("h100", hosts=hosts),
        params,
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        id_keys=w.id_keys,
    )
    batch = sc.place_for_step(ts, w.batch_at, 1, 4)
    program, _ = compile_only.compile_step(ts.step, ts.state, batch)
    report = compile_only.report(program)
    link = LINKS["nvlink" if hosts == 1 else "infiniband"]
    return {
        "gpus": gpus,
        "strategy": strategy,
        "runs_as": ts.runs_as,
        "peak_gb": report.memory["peak_memory_in_bytes"] / 1e9,
        "fits": report.memory["peak_memory_in_bytes"] <= HBM,
        "mb_a_gpu": report.bytes_per_device / 1e6,
        "collectives": len(report.collectives),
        "comm_ms": 1e3 * costmodel.program_time(report.collectives, link),
        "link": "NVLink" if hosts == 1 else "InfiniBand",
        "compile_s": time.perf_counter() - start,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | GPUs | strategy | peak GB a GPU (of 80) | MB a GPU a step | "
        "collectives | modelled communication (link) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fits = "" if r["fits"] else " (does not fit)"
        lines.append(
            f"| {r['workload']} | {r['gpus']} | `{r['strategy']}` | {r['peak_gb']:.2f}{fits} | "
            f"{r['mb_a_gpu']:.2f} | {r['collectives']} | {r['comm_ms']:.3f} ms ({r['link']}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.studies.gpu_scale")
    parser.add_argument("--out-dir", default="runs/gpu_scale")
    parser.add_argument("--hosts", default="1,2", help="hosts of 8 H100s, comma-separated")
    parser.add_argument(
        "--models", default="lstm_lm,bert,dlrm", help="the workloads by model, comma-separated"
    )
    parser.add_argument("--strategies", default="", help="only these (default: each workload's)")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    models = args.models.split(",")
    if unknown := set(models) - {model for model, _, _ in WORKLOADS.values()}:
        parser.error(f"--models: no workload of {sorted(unknown)}")
    for name, (model, sizes, strategies) in WORKLOADS.items():
        if model not in models:
            continue
        for hosts in (int(h) for h in args.hosts.split(",")):
            for strategy in strategies:
                if args.strategies and strategy not in args.strategies.split(","):
                    continue
                row = {"workload": name, **measure(model, sizes, strategy, hosts)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                (out / "gpu_scale.json").write_text(json.dumps(rows, indent=1))
    (out / "gpu_scale.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
