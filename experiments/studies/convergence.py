"""Loss against step and against wall-clock time, dense vs sparse strategies.

    python -m experiments.studies.convergence --nproc 4 --bandwidth 1gbit \\
        --strategies dense_pmap,embrace,topk_allgather,topk_a2a -- --steps 100

Lossless strategies (embrace, sparse_allgather, ...) must trace the dense curve step for
step; lossy ones (top-k with error feedback) may differ per step, and the question is
how much wall-clock time they save to reach the same loss. Wall time is the sum of the
measured step times (compilation excluded). ``time_to_target_s`` is when a strategy's
moving-average loss (``--window`` steps) first reaches ``--target-loss`` (default: the
baseline's final moving average). Runs on the emulated cluster (each worker a
``--bandwidth`` link of its own), or with ``--local`` on simulated CPU devices. Writes
``convergence.json``, ``convergence.csv`` (one row per strategy and step) and
``convergence.png``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from experiments.studies import harness


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--nproc", type=int, default=4, help="workers")
    parser.add_argument("--bandwidth", default="1gbit", help="each worker's link rate")
    parser.add_argument("--local", action="store_true", help="simulated devices, no network")
    parser.add_argument("--strategies", default="dense_pmap,embrace,topk_allgather,topk_a2a")
    parser.add_argument("--window", type=int, default=5, help="moving-average steps")
    parser.add_argument(
        "--target-loss", type=float, default=None, help="default: dense_pmap's final loss"
    )
    return parser.parse_args(argv)


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values (fewer at the start)."""
    sums = [0.0, *itertools.accumulate(values)]
    return [
        (sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window)
        for i in range(len(values))
    ]


def curve(result: dict, window: int) -> list[dict]:
    """Per-step rows of one run: step, loss, its moving average, cumulative wall time."""
    smooth = moving_average(result["losses"], window)
    wall = itertools.accumulate(result["step_times_s"])
    return [
        {"strategy": result["strategy"], "step": i, "loss": loss, "smooth_loss": s, "wall_s": w}
        for i, (loss, s, w) in enumerate(zip(result["losses"], smooth, wall, strict=True))
    ]


def time_to_target(rows: list[dict], target: float) -> float | None:
    """Wall time at which the moving-average loss first reaches ``target``."""
    return next((r["wall_s"] for r in rows if r["smooth_loss"] <= target), None)


def summarize(
    curves: dict[str, list[dict]], baseline: str, target: float | None = None
) -> list[dict]:
    """Per strategy: final moving-average loss, total wall time, time to ``target``
    (default: the baseline's final moving-average loss)."""
    if target is None and baseline in curves:
        target = curves[baseline][-1]["smooth_loss"]
    return [
        {
            "strategy": s,
            "final_smooth_loss": rows[-1]["smooth_loss"],
            "wall_s": rows[-1]["wall_s"],
            "time_to_target_s": None if target is None else time_to_target(rows, target),
        }
        for s, rows in curves.items()
    ]


def reach_text(reach: float | None, target: float | str | None) -> str:
    """When a run reached ``target``, in words (``None``: there was no target)."""
    if target is None:
        return f"no target: give --target-loss, or a {harness.BASELINE} run that finishes"
    return f"never reaches {target}" if reach is None else f"reaches {target} at {reach:.2f} s"


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    plt = harness.pyplot()
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for strategy, rows in curves.items():
        by_step.plot([r["step"] for r in rows], [r["smooth_loss"] for r in rows], label=strategy)
        by_time.plot([r["wall_s"] for r in rows], [r["smooth_loss"] for r in rows], label=strategy)
    by_step.set(xlabel="step", ylabel="training loss (moving average)")
    by_time.set(xlabel="wall time (s, compilation excluded)")
    by_time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    own, train_args = harness.split_argv(argv)
    args = parse_args(own)
    bandwidth = "" if args.local else args.bandwidth
    out = Path(args.out_dir)

    def run(strategy):
        result = harness.run_config(
            ["--strategy", strategy, *train_args], out / f"{strategy}.json", args.nproc, bandwidth
        )
        return {"strategy": strategy, "curve": curve(result, args.window)}

    runs = harness.grid([(s,) for s in args.strategies.split(",")], run, "convergence runs")
    curves = {r["strategy"]: r["curve"] for r in runs if "error" not in r}
    summary = summarize(curves, harness.BASELINE, args.target_loss)
    target = args.target_loss
    if target is None and harness.BASELINE in curves:
        target = f"{harness.BASELINE}'s final loss"
    rows = [row for c in curves.values() for row in c]
    harness.save_rows(rows, out, "convergence", {"summary": summary, "bandwidth": bandwidth})
    plot(curves, out / "convergence.png")
    for s in summary:
        print(
            f"{s['strategy']:>15} final loss {s['final_smooth_loss']:.4f}  wall "
            f"{s['wall_s']:8.2f} s  {reach_text(s['time_to_target_s'], target)}"
        )
    print(f"results in {out}/convergence.json, convergence.csv, convergence.png")
    return 0 if len(curves) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
