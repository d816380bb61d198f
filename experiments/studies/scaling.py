"""Throughput against the number of workers, per strategy and model (EmbRace's main
figure), on the emulated cluster.

    python -m experiments.studies.scaling --nproc 1,2,4 --bandwidth 1gbit \\
        --models lstm_lm,bert --strategies dense_pmap,embrace,topk_a2a -- --steps 6

Weak scaling: every worker keeps ``--batch-per-worker`` examples, so the global batch is
``workers x batch-per-worker``. Each worker has a ``--bandwidth`` link of its own
(``cluster --per-worker``); ``--local`` runs on simulated CPU devices instead (no network,
no root). Writes ``scaling.json``, ``scaling.csv`` and ``scaling.png`` into ``--out-dir``.
Arguments after ``--`` go to every ``experiments.train`` run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.studies import harness


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--nproc", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--bandwidth", default="1gbit", help="each worker's link rate")
    parser.add_argument("--local", action="store_true", help="simulated devices, no network")
    parser.add_argument("--models", default="lstm_lm", help="models, comma-separated")
    parser.add_argument("--strategies", default="dense_pmap,embrace,topk_a2a")
    parser.add_argument("--batch-per-worker", type=int, default=16)
    return parser.parse_args(argv)


def plot(rows: list[dict], models: list[str], path: Path) -> None:
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        ok = [r for r in rows if "error" not in r and r["model"] == model]
        harness.plot_by_strategy(ax, ok, "workers", "throughput")
        unit = ok[0]["unit"].replace("_per_s", "/s") if ok else ""
        ax.set(title=model, xlabel="workers", ylabel=unit)
        ax.set_xticks(sorted({r["workers"] for r in ok}))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    own, train_args = harness.split_argv(argv)
    args = parse_args(own)
    bandwidth = "" if args.local else args.bandwidth
    models, strategies = args.models.split(","), args.strategies.split(",")
    workers = [int(n) for n in args.nproc.split(",")]
    out = Path(args.out_dir)

    def run(model, n, strategy):
        run_args = [
            "--model",
            model,
            "--strategy",
            strategy,
            "--batch",
            str(n * args.batch_per_worker),
            *train_args,
        ]
        return harness.measure(
            run_args, out / f"{model}_{strategy}_{n}.json", n, bandwidth, model=model, workers=n
        )

    jobs = [(m, n, s) for m in models for n in workers for s in strategies]
    rows = harness.grid(jobs, run, "scaling runs")
    harness.add_speedups(rows, ("model", "workers"))
    harness.save_rows(rows, out, "scaling", {"bandwidth": bandwidth or "local"})
    plot(rows, models, out / "scaling.png")
    print(harness.report(rows, ("model", "workers")))
    print(f"results in {out}/scaling.json, scaling.csv, scaling.png")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
