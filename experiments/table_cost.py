"""Cost of a table strategy's step against the vocabulary, row-sparse or dense update.

    python -m experiments.table_cost --vocabs 1000 100000 --out-dir runs/table_cost

One device, LSTM LM D=H=128, 16 x 32 tokens, sampled softmax 1,024, SGD: the step time
of ``--strategy`` (``embrace``) at each vocabulary, with the row-sparse table update
(O(tokens x D)) and with the dense one (O(V x D)). Prints the ratio of the largest to
the smallest vocabulary for each and writes ``table_cost.json`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.config import RunConfig
from experiments.train import train_and_evaluate

WORKLOAD = dict(
    model="lstm_lm", dim=128, hidden=128, batch=16, seq_len=32, sampled_softmax=1024, lr=0.1
)


def measure(strategy: str, vocab: int, update: str, steps: int, warmup: int) -> dict:
    """One run's step time (median after ``warmup``) and throughput."""
    config = RunConfig(
        strategy=strategy, devices=1, vocab=vocab, optimizer="sgd", table_update=update,
        steps=steps, warmup=warmup, **WORKLOAD,
    )  # fmt: skip
    result = train_and_evaluate(config, progress=False)
    return {
        "strategy": strategy,
        "vocab": vocab,
        "table_update": update,
        "step_time_s": result["step_time_s"],
        "tokens_per_s": result["tokens_per_s"],
        "final_loss": result["losses"][-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.table_cost", description=__doc__)
    parser.add_argument("--strategy", default="embrace")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--updates", nargs="+", default=["sparse", "dense"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out-dir", default="runs/table_cost")
    args = parser.parse_args(argv)
    rows = [
        measure(args.strategy, v, u, args.steps, args.warmup)
        for u in args.updates
        for v in args.vocabs
    ]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table_cost.json").write_text(json.dumps({"workload": WORKLOAD, "rows": rows}, indent=1))
    for u in args.updates:
        mine = [r for r in rows if r["table_update"] == u]
        for r in mine:
            print(f"{args.strategy} {u:>6} V={r['vocab']:>7,}: {r['step_time_s'] * 1e3:7.1f} ms")
        print(f"{u}: V={mine[-1]['vocab']:,} / V={mine[0]['vocab']:,} = "
              f"{mine[-1]['step_time_s'] / mine[0]['step_time_s']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
