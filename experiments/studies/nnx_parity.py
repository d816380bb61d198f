"""The NNX path against the Linen path: one model written twice, the same strategy, the
same program up to ordering?

    python -m experiments.studies.nnx_parity --out-dir experiments/results/nnx_parity

A bag-of-words classifier with a large table (``--vocab``) and a pooled multi-hot table,
written as a flax NNX module (``nnx.Embed``, ``nnx_tables.EmbedBag``, found by the
library) and as its Linen twin (``nn.Embed``, ``nn.EmbedBag``) with the same initial
parameters, is built by ``make_train_step`` for each strategy on 8 CPU devices. For each
pair it records the bytes each worker sends a step and the collectives (read from the
compiled programs, ``comm.hlo``), the losses of the timed steps (equal, or the paths
differ), and the step time, mean and median, in ``--rounds`` alternating rounds of
``--steps`` steps each (a round's first step not counted). Writes ``nnx_parity.json``
and ``nnx_parity.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from sparsecomm_jax import runtime  # noqa: E402

runtime.simulate_cpu_devices(8)

import flax.linen as linen  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import sparsecomm_jax as sc  # noqa: E402
from sparsecomm_jax import nn, nnx_tables  # noqa: E402
from sparsecomm_jax.comm import hlo  # noqa: E402

CLASSES, TOKENS, TAGS, TAG_VOCAB = 16, 20, 4, 1000


def twins(vocab: int, dim: int) -> tuple[nnx.Module, Any, Any]:
    """The NNX model, its Linen twin's module and the twin's parameters (the same)."""

    class Nnx(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.words = nnx.Embed(vocab, dim, rngs=rngs)
            self.tags = nnx_tables.EmbedBag(TAG_VOCAB, dim, mode="mean", padding_id=0, rngs=rngs)
            self.hidden = nnx.Linear(dim, 256, rngs=rngs)
            self.out = nnx.Linear(256, CLASSES, rngs=rngs)

        def __call__(self, tokens, tags):
            h = self.words(tokens).mean(axis=1) + self.tags(tags)  # float[B, D]
            return self.out(nnx.relu(self.hidden(h)))

    class Linen(linen.Module):
        @linen.compact
        def __call__(self, tokens, tags):
            h = nn.Embed(vocab, dim, name="words")(tokens).mean(axis=1)
            h = h + nn.EmbedBag(TAG_VOCAB, dim, mode="mean", padding_id=0, name="tags")(tags)
            return linen.Dense(CLASSES, name="out")(linen.relu(linen.Dense(256, name="hidden")(h)))

    model = Nnx(nnx.Rngs(0))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return model, Linen(), {"params": pure}


def batches(vocab: int, batch: int):
    def batch_at(step: int) -> dict:
        rng = np.random.default_rng(step)
        tokens = np.minimum(rng.zipf(1.1, (batch, TOKENS)) - 1, vocab - 1)
        tags = rng.integers(0, TAG_VOCAB, (batch, TAGS)) * (rng.random((batch, TAGS)) < 0.7)
        return {
            "tokens": tokens.astype(np.int32),
            "tags": tags.astype(np.int32),
            "labels": rng.integers(0, CLASSES, batch).astype(np.int32),
        }

    return batch_at


def cross_entropy(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def build(strategy: str, vocab: int, dim: int) -> dict[str, sc.TrainStep]:
    model, twin, params = twins(vocab, dim)
    mesh, opt = runtime.data_mesh(8), optax.adagrad(0.05)
    nnx_ts = sc.make_train_step(
        lambda m, b: cross_entropy(m(b["tokens"], b["tags"]), b), opt, mesh, model, strategy
    )
    linen_ts = sc.make_train_step(
        nn.loss_with_embeddings(
            lambda p, b: cross_entropy(twin.apply(p, b["tokens"], b["tags"]), b)
        ),
        opt,
        mesh,
        params,
        strategy,
        embedding_paths=nn.embedding_paths(params),
    )
    return {"nnx": nnx_ts, "linen": linen_ts}


def timed(ts: sc.TrainStep, state, batch_at, steps: int) -> tuple[Any, list[float], list[float]]:
    """``steps`` steps: the state, each step's seconds after the first, the losses."""
    seconds, losses = [], []
    for k, batch in enumerate(sc.placed_batches(ts, batch_at, 0, steps)):
        start = time.perf_counter()
        state, loss = ts.step(state, batch)
        losses.append(sc.loss_value(loss))  # waits for the step
        if k:
            seconds.append(time.perf_counter() - start)
    return state, seconds, losses


def measure(strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    steps = build(strategy, args.vocab, args.dim)
    batch_at = batches(args.vocab, args.batch)
    row: dict[str, Any] = {"strategy": strategy}
    for path, ts in steps.items():
        colls = hlo.collectives(ts.step, ts.state, ts.place_batch(batch_at(0)))
        row[f"{path}_mb"] = hlo.total_bytes(colls) / 1e6
        row[f"{path}_collectives"] = len(colls)
    states = {path: ts.state for path, ts in steps.items()}
    seconds: dict[str, list[float]] = {path: [] for path in steps}
    for _ in range(args.rounds):
        for path, ts in steps.items():
            states[path], took, losses = timed(ts, states[path], batch_at, args.steps)
            seconds[path] += took
            row[f"{path}_losses"] = losses
    for path in steps:
        row[f"{path}_mean_ms"] = 1e3 * statistics.fmean(seconds[path])
        row[f"{path}_median_ms"] = 1e3 * statistics.median(seconds[path])
    row["loss_gap"] = float(np.max(np.abs(np.subtract(row["nnx_losses"], row["linen_losses"]))))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| strategy | MB a worker (NNX / Linen) | collectives | step mean ms (NNX / Linen) | "
        "step median ms | NNX / Linen (mean) | largest loss gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['strategy']}` | {r['nnx_mb']:.4f} / {r['linen_mb']:.4f} | "
            f"{r['nnx_collectives']} / {r['linen_collectives']} | "
            f"{r['nnx_mean_ms']:.2f} / {r['linen_mean_ms']:.2f} | "
            f"{r['nnx_median_ms']:.2f} / {r['linen_median_ms']:.2f} | "
            f"{r['nnx_mean_ms'] / r['linen_mean_ms']:.3f} | {r['loss_gap']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.studies.nnx_parity")
    parser.add_argument("--out-dir", default="runs/nnx_parity")
    parser.add_argument("--strategies", default="dense_pmap,embrace,embrace_rowwise,topk_a2a")
    parser.add_argument("--vocab", type=int, default=200_000, help="rows of the large table")
    parser.add_argument("--dim", type=int, default=64, help="D of both tables")
    parser.add_argument("--batch", type=int, default=1024, help="global batch")
    parser.add_argument("--steps", type=int, default=11, help="steps a round (first untimed)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for strategy in args.strategies.split(","):
        row = measure(strategy, args)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("losses")}), flush=True)
        (out / "nnx_parity.json").write_text(json.dumps(rows, indent=1))
    (out / "nnx_parity.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
