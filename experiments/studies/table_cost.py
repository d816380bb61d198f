"""Cost of a table strategy's step against the vocabulary, row-sparse or dense update.

    python -m experiments.studies.table_cost --vocabs 1000 100000 --out-dir runs/table_cost

One device, LSTM LM D=H=128, 16 x 32 tokens, sampled softmax 1,024, SGD: the step time
of ``--strategy`` (``embrace``; ``embrace_2d`` pipelined, each batch placed with the
ones after it) at each vocabulary, with the row-sparse table update
(O(tokens x D)) and with the dense one (O(V x D)). The steps of every configuration
are timed in turn, a block of steps each, round after round (a busy host slows them
alike; the first step of a block, which pays for the switch, is not counted), and each
gets the median of its steps. Prints the ratio of the largest to the smallest vocabulary for
each update and writes ``table_cost.json`` into ``--out-dir``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from experiments.studies import harness
from experiments.train import build, start_devices, validate
from experiments.train.config import RunConfig
from sparsecomm_jax import place_for_step

WORKLOAD = dict(
    model="lstm_lm", dim=128, hidden=128, batch=16, seq_len=32, sampled_softmax=1024, lr=0.1
)


def placed_cycle(ts, workload, count: int) -> list:
    """Batches 0..count-1 placed for a run that cycles through them: a pipelined
    strategy's batch ``count - 1`` looks ahead to batches 0, 1, ... Placed twice, so
    every batch has the capacity the largest needs (one program)."""

    def batch_at(i: int):
        return workload.batch_at(i % count)

    steps = count + ts.lookahead + 1
    for _ in range(2):
        batches = [place_for_step(ts, batch_at, i, steps) for i in range(count)]
    return batches


def prepared(strategy: str, vocab: int, update: str, rounds: int, overlap: str = "auto"):
    """``run()`` -> seconds of one step of this configuration (compiled beforehand)."""
    import jax

    config = RunConfig(
        strategy=strategy,
        devices=1,
        vocab=vocab,
        optimizer="sgd",
        table_update=update,
        collectives_overlap=overlap,
        **WORKLOAD,
    )
    validate(config)
    workload, ts = build(config)
    batches = placed_cycle(ts, workload, rounds)
    state = ts.state
    if ts.lookahead:  # a pipelined step carries the next batch's rows: compile that form
        state, _ = ts.step(state, batches[0])
        batches = batches[1:] + batches[:1]
    step = ts.step.lower(state, batches[0]).compile()
    box = {"state": state, "i": 0, "loss": None}

    def run() -> float:
        batch = batches[box["i"] % rounds]
        t = time.perf_counter()
        box["state"], loss = step(box["state"], batch)
        jax.block_until_ready((box["state"], loss))
        box["i"] += 1
        box["loss"] = float(loss)
        return time.perf_counter() - t

    return run, box


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--strategy", default="embrace")
    parser.add_argument(
        "--collectives-overlap",
        default="auto",
        choices=("auto", "yes"),
        help="yes: embrace_2d's pipelined program (on CPU it runs as embrace by default)",
    )
    parser.add_argument("--vocabs", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--updates", nargs="+", default=["sparse", "dense"])
    parser.add_argument("--rounds", type=int, default=6, help="rounds over the configurations")
    parser.add_argument("--block", type=int, default=5, help="steps per configuration a round")
    parser.add_argument("--warmup", type=int, default=1, help="first rounds not counted")
    args = parser.parse_args(argv)
    start_devices(1)
    configs = [(v, u) for u in args.updates for v in args.vocabs]
    runs = {c: prepared(args.strategy, *c, args.block, args.collectives_overlap) for c in configs}
    times: dict = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs:  # a block of steps each; its first step is not counted
            block = [runs[c][0]() for _ in range(args.block)]
            if r >= args.warmup:
                times[c].extend(block[1:])
    rows = [
        {
            "strategy": args.strategy,
            "collectives_overlap": args.collectives_overlap,  # embrace_2d: which program
            "vocab": v,
            "table_update": u,
            "step_time_s": statistics.median(times[(v, u)]),
            "step_times_s": times[(v, u)],
            "final_loss": runs[(v, u)][1]["loss"],
        }
        for v, u in configs
    ]
    out = Path(args.out_dir)
    harness.write_result(out, "table_cost", {"workload": WORKLOAD, "rows": rows})
    for u in args.updates:
        mine = [r for r in rows if r["table_update"] == u]
        for r in mine:
            print(f"{args.strategy} {u:>6} V={r['vocab']:>7,}: {r['step_time_s'] * 1e3:7.1f} ms")
        print(
            f"{u}: V={mine[-1]['vocab']:,} / V={mine[0]['vocab']:,} = "
            f"{mine[-1]['step_time_s'] / mine[0]['step_time_s']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
