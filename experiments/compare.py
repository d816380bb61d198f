"""Runs every strategy on one model and prints the comparison table (the main job).

    python -m experiments.compare --model lstm_lm --devices 8 --steps 10

Columns: final loss, median and mean step time, comm bytes per worker per step (from the compiled
program), speed-up of the step time and the byte reduction against ``dense_pmap``, peak
device memory (the compiled program's memory analysis), and each strategy's *modelled*
step on a real link (``MODEL_LINKS``: 10 and 1 Gbit/s a worker, 50 us a message): the
measured step plus the compiled collectives through the alpha-beta cost model. On
simulated devices a collective is a memory copy, so the measured step alone cannot show
what fewer bytes buy; the modelled columns can, and say they are modelled. A short
recommendation drawn from the table follows it (``recommend``). Writes
``compare.json`` and ``compare.csv`` into ``--out-dir``; with ``--checkpoint-dir`` or
``--log-dir``, each strategy's checkpoints or logs go into its own subfolder.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

import jax

from experiments.studies.harness import predicted_comm_s
from experiments.train import start_devices, train_and_evaluate, write_json
from experiments.train.config import RunConfig, add_arguments, from_namespace
from experiments.train.validate import one_step_a_call
from sparsecomm_jax import parse_strategy
from sparsecomm_jax.aggregators import AGGREGATORS
from sparsecomm_jax.comm.costmodel import Link

# Defaults of the headline comparison: a large-vocabulary LM with sampled softmax,
# where both embedding tables get sparse gradients (EmbRace's setting, scaled down).
HEADLINE = dict(vocab=50_000, dim=64, hidden=64, sampled_softmax=256, batch=64, steps=10)
BASELINE = "dense_pmap"
MODEL_LINKS = {  # column label -> the link a modelled step is priced on (per worker)
    "10G": Link.from_bandwidth(10.0),
    "1G": Link.from_bandwidth(1.0),
}


def default_strategies() -> list[str]:
    """``dense_pmap`` first, then every table strategy and every top-k aggregator."""
    from sparsecomm_jax import STRATEGIES

    sparse = [name for name, kind in AGGREGATORS.items() if kind.sparse]
    return [BASELINE, *(s for s in STRATEGIES if s != BASELINE), *sparse]


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per result, with ratios against the ``dense_pmap`` row."""
    base = next((r for r in results if r["strategy"] == BASELINE), results[0])
    rows = []
    for r in results:
        row = {
            "strategy": r["strategy"],
            "final_loss": r["losses"][-1],
            "step_time_ms": r["step_time_s"] * 1e3,
            "mean_step_ms": mean_step_s(r) * 1e3,
            "comm_mb_per_step": r["comm_bytes_per_step"] / 1e6,
            "speedup_vs_dense_pmap": base["step_time_s"] / r["step_time_s"],
            "bytes_reduction_vs_dense_pmap": base["comm_bytes_per_step"]
            / max(r["comm_bytes_per_step"], 1.0),
            "peak_memory_mb": (r["peak_memory_bytes"] or 0) / 1e6,
        }
        for label, link in MODEL_LINKS.items():
            mine, theirs = modelled_step_s(r, link), modelled_step_s(base, link)
            row[f"modelled_step_ms_{label}"] = mine * 1e3
            row[f"modelled_speedup_{label}"] = theirs / mine
        rows.append(row)
    return rows


def mean_step_s(result: dict[str, Any]) -> float:
    """The mean of a run's step times after its warm-up calls, as the run recorded it
    beside its median (a median hides steps that recompile or stall; the mean does
    not); a record without it: the mean of every step it holds, or its one step time."""
    times = result.get("step_times_s") or [result["step_time_s"]]
    return result.get("step_time_mean_s") or statistics.fmean(times)


def lossy(strategy: str) -> bool:
    """Whether a strategy changes the numbers of training: a top-k aggregator sends a
    fraction of the dense gradient (its residual carries the rest to later steps)."""
    return AGGREGATORS[parse_strategy(strategy).aggregator].sparse


def recommend(rows: list[dict[str, Any]], steps: int) -> list[str]:
    """A short recommendation drawn from the table: the lossless strategy of least mean
    step here (its median beside) and of greatest modelled speed-up on each link, why
    (its bytes against ``dense_pmap``'s), the slowest and why, and what the run can say
    of the lossy ones."""
    base = next((r for r in rows if r["strategy"] == BASELINE), rows[0])
    exact = [r for r in rows if not lossy(r["strategy"])] or rows
    here = min(exact, key=lambda r: r["mean_step_ms"])
    lines = [
        f"recommended here: {here['strategy']} (lossless; mean step {here['mean_step_ms']:.1f} "
        f"ms, median {here['step_time_ms']:.1f} ms, {here['speedup_vs_dense_pmap']:.2f}x "
        f"{BASELINE}'s median; it sends {here['comm_mb_per_step']:.3f} MB a step a worker "
        f"against {base['comm_mb_per_step']:.3f} MB). On simulated devices a collective "
        "is a memory copy: the step here is mostly compute."
    ]
    for label in MODEL_LINKS:
        best = max(exact, key=lambda r: r[f"modelled_speedup_{label}"])
        fewer = best["bytes_reduction_vs_dense_pmap"]
        why = (
            f"because it sends {fewer:.1f}x fewer bytes"
            if fewer > 1.05
            else "sending as many bytes or more: its own work is less"
        )
        lines.append(
            f"on a {label}bit/s link (modelled): {best['strategy']}, "
            f"{best[f'modelled_speedup_{label}']:.2f}x {BASELINE}, {why}"
        )
    slow = min(rows, key=lambda r: r["speedup_vs_dense_pmap"])
    if slow["speedup_vs_dense_pmap"] < 1:
        saved = slow["comm_mb_per_step"] < base["comm_mb_per_step"]
        why = (
            "it sends fewer bytes, but its own work (selecting, encoding, exchanging "
            "indices) costs more than a memory-copy link saves"
            if saved
            else "it sends no fewer bytes and does more work"
        )
        lines.append(
            f"slowest here: {slow['strategy']}, {1 / slow['speedup_vs_dense_pmap']:.1f}x "
            f"{BASELINE}'s step: {why}"
        )
    if inexact := [r for r in rows if lossy(r["strategy"])]:
        gap = max(abs(r["final_loss"] - base["final_loss"]) for r in inexact)
        lines.append(
            f"lossy (top-k) strategies: after {steps} steps their loss is within {gap:.4f} of "
            f"{BASELINE}'s, which says little of what they cost in loss: that shows over "
            "hundreds of steps (--steps 300, or the convergence figures in BENCHMARKS.md)"
        )
    return lines


def modelled_step_s(result: dict[str, Any], link: Link) -> float:
    """A run's step on ``link``, modelled: its measured step plus its compiled
    collectives through the alpha-beta cost model (``comm.costmodel.program_time``)."""
    return result["step_time_s"] + predicted_comm_s(result, link)


def format_table(rows: list[dict[str, Any]]) -> str:
    modelled = [f"{label} model" for label in MODEL_LINKS]
    header = ["strategy", "final loss", "step ms", "mean ms", "comm MB/step", "speed-up"]
    header += ["bytes x"]
    header += ["peak MB", *modelled]
    lines = [" | ".join(f"{h:>14}" for h in header)]
    for r in rows:
        cells = [
            r["strategy"],
            f"{r['final_loss']:.4f}",
            f"{r['step_time_ms']:.1f}",
            f"{r['mean_step_ms']:.1f}",
            f"{r['comm_mb_per_step']:.3f}",
            f"{r['speedup_vs_dense_pmap']:.2f}x",
            f"{r['bytes_reduction_vs_dense_pmap']:.1f}x",
            f"{r['peak_memory_mb']:.1f}",
            *(f"{r[f'modelled_speedup_{label}']:.2f}x" for label in MODEL_LINKS),
        ]
        lines.append(" | ".join(f"{c:>14}" for c in cells))
    lines.append(
        "speed-up and bytes x: measured on simulated devices, against dense_pmap; "
        + ", ".join(modelled)
        + ": MODELLED speed-up on a link of 10 and 1 Gbit/s a worker, 50 us a message "
        "(the measured step plus the compiled collectives through the cost model)"
    )
    return "\n".join(lines)


def run_of(config: RunConfig, strategy: str) -> RunConfig:
    """``config`` for one strategy: its checkpoints and logs in a subfolder of their own
    (``--checkpoint-dir D`` -> ``D/<strategy>``), so that no run finds another's;
    ``--steps-per-call`` for the strategies that can run several steps a call (a
    ``jax.pmap`` step runs one)."""

    def own(folder: str) -> str:
        return str(Path(folder) / strategy) if folder else folder

    mine = dataclasses.replace(config, strategy=strategy)
    one_a_call = one_step_a_call(mine, jax.devices()[0].platform)
    return dataclasses.replace(
        mine,
        out="",
        checkpoint_dir=own(config.checkpoint_dir),
        log_dir=own(config.log_dir),
        steps_per_call=1 if one_a_call else config.steps_per_call,
    )


def compare(config: RunConfig, strategies: list[str]) -> list[dict[str, Any]]:
    """Runs ``config`` once per strategy (``run_of``); returns the result records."""
    return [train_and_evaluate(run_of(config, strategy)) for strategy in strategies]


def write_outputs(results, rows, out_dir: str) -> None:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    write_json({"results": results, "table": rows}, str(path / "compare.json"))
    with open(path / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def make_parser() -> argparse.ArgumentParser:
    """The comparison's flags: every flag of ``experiments.train`` but ``--strategy``
    and ``--out``, defaulting to the headline comparison (``HEADLINE``), and its own."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.compare", description=__doc__, allow_abbrev=False
    )  # no abbreviations: --out would be taken for --out-dir
    add_arguments(parser, skip=("strategy", "out"))
    parser.set_defaults(**HEADLINE)
    parser.add_argument(
        "--strategies", default="", help="comma list of strategies (default: all of them)"
    )
    parser.add_argument(
        "--out-dir", default="runs/compare", help="where compare.json and compare.csv go"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    config = from_namespace(args)
    try:
        rank = start_devices(config.devices)
        strategies = args.strategies.split(",") if args.strategies else default_strategies()
        results = compare(config, strategies)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        rows = summarize(results)
        print(format_table(rows))
        for r in results:
            runs_as = r.get("runs_as", r["strategy"])
            if runs_as != str(parse_strategy(r["strategy"])):
                print(
                    f"{r['strategy']} ran as {runs_as}: this platform cannot overlap a "
                    "program's collectives with its compute, so its pipelined schedule "
                    "could only lose (--collectives-overlap yes builds it anyway)"
                )
        print("\n".join(recommend(rows, config.steps)))
        write_outputs(results, rows, args.out_dir)
        print(f"results in {args.out_dir}/compare.json and compare.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
