"""Managed tables against modulo hashing at the same memory, on a DLRM whose sparse
features are raw 64-bit ids with a long tail: held-out log loss, step time against the
row layout, bytes and evictions per step.

    python -m experiments.studies.managed_vocab
    python -m experiments.studies.managed_vocab --slots 250000 --distinct 2500000 --steps 400

The stream: ``--tables`` sparse features, each drawing ``--multi-hot`` ids a example from
``--distinct`` raw ids (random int64 values) with Zipf weights ``rank^-exponent``; every
id has a true weight (uniform in [-``--signal``, ``--signal``], a hash of the id), and an
example is a click with probability sigmoid(sum of its ids' weights + bias). The 13
dense features are noise. Held-out examples are drawn from the same stream after
training.

Every variant trains the same DLRM (``models.dlrm``: tables of ``--slots`` rows each,
``--dim`` wide) by ``embrace_rowwise`` with Adagrad on ``--devices`` simulated CPU
devices, on the same batches:

- ``modulo``: each id folded into the table by ``id mod slots`` (unrelated ids share
  rows), the row layout;
- ``managed-lru``, ``managed-lfu``, ``managed-lfu-K2``, ``managed-lfu-compete``: the
  managed layout (``embedding.managed``), LRU or LFU eviction, admitted at once or
  after 2 reads, or (``compete``) into a used slot only over an id read less often.

Reported per variant: held-out log loss (and the Bayes floor of the true weights), the
step time with the host's id mapping included (mean and median after ``--warmup``
steps), the bytes a worker sends per step (read from the compiled program), the fresh
rows and evictions per step, and the share of held-out reads whose id holds a slot.

Writes ``managed_vocab.json`` and ``managed_vocab.md`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from experiments.studies import harness
from sparsecomm_jax import runtime
from sparsecomm_jax.embedding.row_optimizers import DROP

VARIANTS = ("modulo", "managed-lru", "managed-lfu", "managed-lfu-K2", "managed-lfu-compete")


class Stream:
    """The long-tailed click stream (see the module doc)."""

    def __init__(self, args, seed: int = 0):
        from sparsecomm_jax.embedding import managed

        rng = np.random.default_rng(seed)
        self.values = [
            rng.integers(-(2**63), 2**63 - 1, size=args.distinct, dtype=np.int64)
            for _ in range(args.tables)
        ]
        weights = np.arange(1, args.distinct + 1, dtype=np.float64) ** -args.exponent
        self.cdf = np.cumsum(weights / weights.sum())
        self.truth = [managed.initial_rows(v, 1, args.signal)[:, 0] for v in self.values]
        self.args, self.rng = args, np.random.default_rng(seed + 1)

    def batch(self) -> tuple[dict, np.ndarray]:
        """One batch of raw ids, and its examples' true logits."""
        a, rng = self.args, self.rng
        out, logit = {}, np.full(a.batch, a.bias)
        for f, values in enumerate(self.values):
            rank = np.searchsorted(self.cdf, rng.random((a.batch, a.multi_hot)))
            rank = np.minimum(rank, values.size - 1)
            out[f"sparse_{f}"] = values[rank]
            logit += self.truth[f][rank].sum(1)
        out["dense"] = rng.normal(size=(a.batch, 13)).astype(np.float32)
        out["label"] = (rng.random(a.batch) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return out, logit


def log_loss(logits: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of ``labels`` given ``logits`` (float64)."""
    logits = logits.astype(np.float64)
    return float(np.mean(np.logaddexp(0, logits) - labels * logits))


def folded(batch: dict, slots: int) -> dict:
    """The batch with every raw id folded into ``slots`` rows by its value mod slots."""
    return {
        k: (np.mod(v, slots).astype(np.int32) if k.startswith("sparse_") else v)
        for k, v in batch.items()
    }


def build(variant: str, args):
    """``(train step, model)`` of one variant."""
    import jax
    import optax

    import sparsecomm_jax as sc
    from models import dlrm
    from sparsecomm_jax import nn
    from sparsecomm_jax.embedding import managed

    model = dlrm.DLRM((args.slots,) * args.tables, args.dim, (64,), (64,))
    sample = {f"sparse_{f}": np.zeros((2, args.multi_hot), np.int32) for f in range(args.tables)}
    params = model.lazy_init(jax.random.key(0), {**sample, "dense": np.zeros((2, 13), np.float32)})

    def loss(p, batch, emb=None):
        with nn.use_ops(emb):
            return dlrm.log_loss(model.apply(p, batch), batch["label"])

    paths = [f"params/sparse_{f}/embedding" for f in range(args.tables)]
    policies = {
        "managed-lru": managed.Policy("lru"),
        "managed-lfu": managed.Policy("lfu"),
        "managed-lfu-K2": managed.Policy("lfu", threshold=2),
        "managed-lfu-compete": managed.Policy("lfu", compete=True),
    }
    layouts = None
    if variant in policies:
        layouts = {p: managed.layout({q: policies[variant] for q in paths}) for p in paths}
    ts = sc.make_train_step(
        loss,
        optax.adagrad(args.lr, args.adagrad_init, args.adagrad_eps),
        runtime.data_mesh(args.devices),
        params,
        "embrace_rowwise",
        embedding_paths=paths,
        table_layouts=layouts,
    )
    return ts, model


def train(variant: str, stream: Stream, batches: list, args) -> dict:
    """Trains one variant on ``batches``; its numbers."""
    from sparsecomm_jax.step.host import loss_value

    ts, model = build(variant, args)
    state, times, fresh, evicted, place_s = ts.state, [], [], [], []
    vocab = ts.vocabulary

    def place(i: int):
        begin = time.perf_counter()
        raw = batches[i][0]
        placed = ts.place_batch(raw if vocab is not None else folded(raw, args.slots))
        place_s.append(time.perf_counter() - begin)
        if vocab is not None:
            fresh.append(sum(int((np.asarray(s) != DROP).sum()) for s, _ in placed.fresh.values()))
        return placed

    placed, before = place(0), 0
    for i in range(len(batches)):
        begin = time.perf_counter()
        state, loss = ts.step(state, placed)  # dispatched: the next batch is mapped meanwhile
        placed = place(i + 1) if i + 1 < len(batches) else placed
        loss_value(loss)  # waits for the step
        times.append(time.perf_counter() - begin)
        if vocab is not None:
            now = sum(vocab.evictions().values())
            evicted.append(now - before)
            before = now
        if (i + 1) % max(1, len(batches) // 10) == 0:
            print(
                f"  {variant}: step {i + 1}/{len(batches)} loss {loss_value(loss):.4f}", flush=True
            )
    sent = ts.sent_bytes(placed)
    warm = np.array(times[args.warmup :])
    return {
        "variant": variant,
        "heldout_log_loss": heldout(ts, model, state, stream, args),
        "step_ms_mean": float(warm.mean() * 1e3),
        "step_ms_median": float(np.median(warm) * 1e3),
        "place_ms_mean": float(np.mean(place_s[args.warmup :]) * 1e3),
        "sent_bytes_per_step": float(sent),
        "evictions_per_step": float(np.mean(evicted)) if evicted else 0.0,
        "fresh_rows_per_step": float(np.mean(fresh)) if fresh else 0.0,
        "held_share": held_share(ts, stream, args) if ts.vocabulary is not None else None,
    }


def heldout(ts, model, state, stream: Stream, args) -> float:
    """Log loss on ``--heldout-batches`` fresh batches (managed ids looked up, nothing
    admitted; ids without a slot read zeros)."""
    params = ts.host_params(state)
    vocab = ts.vocabulary
    if vocab is not None:  # the zero rows read zeros, as a step starts them
        for name, zero in vocab.zero_rows().items():
            first, second, leaf = name.split("/")
            params[first][second][leaf] = np.array(params[first][second][leaf])
            params[first][second][leaf][zero] = 0
    losses = []
    for batch, _ in stream.heldout:
        mapped = vocab.lookup_batch(batch) if vocab is not None else folded(batch, args.slots)
        logits = np.asarray(model.apply(params, mapped))
        losses.append(log_loss(logits, batch["label"]))
    return float(np.mean(losses))


def held_share(ts, stream: Stream, args) -> float:
    """The share of held-out reads whose id holds a slot."""
    vocab, held, total = ts.vocabulary, 0, 0
    for batch, _ in stream.heldout:
        for key, index in vocab.keys(batch).items():
            slots = vocab.vocabularies[index].slot_of(batch[key])
            held, total = held + int((slots >= 0).sum()), total + slots.size
    return held / total


def markdown(result: dict) -> str:
    """The results table."""
    a = result["args"]
    lines = [
        f"DLRM, {a['tables']} tables of {a['slots']:,} slots x {a['dim']}, "
        f"{a['distinct']:,} distinct raw ids per table (Zipf {a['exponent']}), "
        f"{a['steps']} steps of {a['batch']}, {a['devices']} simulated CPU devices, "
        f"embrace_rowwise + Adagrad. Bayes floor of held-out log loss: {result['floor']:.4f}; "
        f"distinct ids seen in training per table: {result['seen_per_table']:,.0f}.",
        "",
        "| variant | held-out log loss | step ms (mean / median) | map + place ms (beside it) "
        "| bytes/step/worker | fresh rows/step | evictions/step | held-out reads with a slot |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        share = "-" if r["held_share"] is None else f"{r['held_share']:.1%}"
        lines.append(
            f"| {r['variant']} | {r['heldout_log_loss']:.4f} | {r['step_ms_mean']:.1f} / "
            f"{r['step_ms_median']:.1f} | {r['place_ms_mean']:.1f} "
            f"| {r['sent_bytes_per_step']:,.0f} | {r['fresh_rows_per_step']:.0f} "
            f"| {r['evictions_per_step']:.0f} | {share} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.studies.managed_vocab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tables", type=int, default=4, help="sparse features (one table each)")
    p.add_argument("--slots", type=int, default=250_000, help="rows of each table")
    p.add_argument("--distinct", type=int, default=2_500_000, help="raw ids of each feature")
    p.add_argument("--exponent", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--multi-hot", type=int, default=1, help="ids per feature per example")
    p.add_argument("--dim", type=int, default=16, help="row width")
    p.add_argument("--batch", type=int, default=2048, help="examples per step")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step times")
    p.add_argument("--heldout-batches", type=int, default=10, help="held-out batches")
    p.add_argument("--signal", type=float, default=1.5, help="true weights' range")
    p.add_argument("--bias", type=float, default=-1.0, help="true logit's bias")
    p.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate")
    p.add_argument(
        "--adagrad-init",
        type=float,
        default=0.1,
        help="Adagrad's initial accumulator (optax's default 0.1; PyTorch's 0)",
    )
    p.add_argument(
        "--adagrad-eps", type=float, default=1e-7, help="Adagrad's eps (optax 1e-7, PyTorch 1e-10)"
    )
    p.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
    p.add_argument("--variants", default=",".join(VARIANTS), help="which variants, by comma")
    p.add_argument("--out-dir", default="experiments/results/managed_vocab")
    args = p.parse_args(argv)
    runtime.simulate_cpu_devices(args.devices)
    stream = Stream(args)
    batches = [stream.batch() for _ in range(args.steps)]
    stream.heldout = [stream.batch() for _ in range(args.heldout_batches)]
    floor = np.mean([log_loss(lg, b["label"]) for b, lg in stream.heldout])
    seen = np.mean(
        [
            np.unique(np.concatenate([b[f"sparse_{f}"].ravel() for b, _ in batches])).size
            for f in range(args.tables)
        ]
    )
    rows = []
    for variant in args.variants.split(","):
        print(f"{variant} ...", flush=True)
        rows.append(train(variant, stream, batches, args))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "args": vars(args),
        "floor": float(floor),
        "seen_per_table": float(seen),
        "rows": rows,
    }
    harness.write_report(args.out_dir, "managed_vocab", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
