"""TopKA2A vs TopK-AllGather vs the balanced sparse all-reduces (``topk_balanced``,
``oktopk``) vs dense (and adaptive) over density, on the emulated cluster: measured
step and communication times, the cost model's prediction, and the measured crossover
of TopKA2A against 1/(2(P-1)).

    python -m experiments.studies.density --nproc 4 --bandwidth 100mbit \\
        --densities 0.01,0.05,0.1,0.2,0.3,0.5 -- --model resnet --width 32 --blocks 2

Each configuration runs twice through ``experiments.cluster``: at ``--bandwidth`` and
practically unthrottled (``--free-bandwidth``); the difference of the median step times
is the measured communication time. Two predictions come from the cost model on the
compiled program's collectives: with the nominal link (``--bandwidth``, alpha
``--alpha-us``) and with the link calibrated on the throttled cluster
(``costmodel.calibrate``, run by the dense configuration). Writes ``density.json``,
``density.csv`` and ``density.png`` into ``--out-dir``. Needs root (see cluster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.studies import harness
from sparsecomm_jax.comm import costmodel
from sparsecomm_jax.topk import costs

STRATEGIES = ("topk_allgather", "topk_a2a", "topk_balanced", "oktopk", "adaptive")


def measured_crossover(rows: list[dict], key: str = "step_s") -> float | None:
    """Smallest density where topk_a2a's measured ``key`` (``step_s`` or ``comm_s``) is
    below topk_allgather's."""
    by = {(r["strategy"], r["density"]): r[key] for r in rows if "error" not in r}
    for d in sorted({r["density"] for r in rows if "error" not in r}):
        if by.get(("topk_a2a", d), 1e9) < by.get(("topk_allgather", d), 0):
            return d
    return None


def plot(rows, dense, formula: float, path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in STRATEGIES:
        pts = sorted(
            (r["density"], r["step_s"], r["calibrated_comm_s"] + r["free_step_s"])
            for r in rows
            if r.get("strategy") == s and "error" not in r
        )
        if not pts:
            continue
        d, m, p = zip(*pts, strict=True)
        line = ax.plot(d, m, marker="o", label=f"{s} measured")[0]
        ax.plot(d, p, ls="--", color=line.get_color(), label=f"{s} predicted (calibrated)")
    ax.axhline(dense["step_s"], color="black", label="dense measured")
    ax.axvline(formula, color="gray", ls=":", label="1/(2(P-1))")
    densities = sorted({r["density"] for r in rows if "error" not in r})
    ax.set(xscale="log", xlabel="density", ylabel="step time (s)")
    ax.set_xticks(densities, [f"{d:g}" for d in densities])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--nproc", type=int, default=4, help="processes (workers)")
    parser.add_argument("--bandwidth", default="100mbit", help="link rate, e.g. 1gbit")
    parser.add_argument("--free-bandwidth", default="100gbit", help="the 'unthrottled' rate")
    parser.add_argument("--alpha-us", type=float, default=50.0, help="nominal alpha")
    parser.add_argument("--densities", default="0.01,0.05,0.1,0.2,0.3,0.5")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    own, train_args = harness.split_argv(argv)
    args = parse_args(own)
    nominal = costmodel.Link.from_bandwidth(harness.gbit(args.bandwidth), args.alpha_us * 1e-6)
    out = Path(args.out_dir)

    def measure(strategy, density, extra=()):
        name = f"{strategy}_{density}"
        run_args = ["--strategy", strategy, "--density", str(density), *train_args, *extra]
        slow = harness.run_config(run_args, out / f"{name}.json", args.nproc, args.bandwidth)
        free = harness.run_config(
            run_args, out / f"{name}_free.json", args.nproc, args.free_bandwidth
        )
        return {
            "strategy": strategy,
            "density": density,
            "step_s": slow["step_time_s"],
            "free_step_s": free["step_time_s"],
            "comm_s": slow["step_time_s"] - free["step_time_s"],
            "predicted_comm_s": harness.predicted_comm_s(slow, nominal),
            "bytes": slow["comm_bytes_per_step"],
            "final_loss": slow["losses"][-1],
            "result": slow,
        }

    try:  # the dense run calibrates the link every prediction uses
        dense = measure("dense", 1.0, ["--calibrate"])
    except RuntimeError as e:
        print(f"density: the dense (calibration) run failed: {e}", file=sys.stderr)
        return 2
    link = costmodel.Link(dense["result"]["link"]["alpha"], dense["result"]["link"]["beta"])
    densities = [float(d) for d in args.densities.split(",")]
    jobs = [(s, d) for d in densities for s in STRATEGIES]
    rows = harness.grid(jobs, measure, "density runs")
    for r in [dense, *rows]:
        if "error" not in r:
            r["calibrated_comm_s"] = harness.predicted_comm_s(r.pop("result"), link)
    cross = {
        "measured_step": measured_crossover(rows, "step_s"),
        "measured_comm": measured_crossover(rows, "comm_s"),
        "formula": costs.crossover_density(args.nproc),
    }
    extra = {
        "dense": dense,
        "crossover": cross,
        "link": {"alpha": link.alpha, "beta": link.beta},
        "nominal_link": {"alpha": nominal.alpha, "beta": nominal.beta},
    }
    harness.save_rows(rows, out, "density", extra)
    plot(rows, dense, cross["formula"], out / "density.png")
    print(report(dense, rows, link, cross))
    return 0


def report(dense, rows, link, cross) -> str:
    lines = [
        f"calibrated link: alpha {link.alpha * 1e6:.0f} us, "
        f"{8 / link.beta / 1e9 if link.beta else float('inf'):.3f} Gbit/s"
    ]
    for r in [dense, *rows]:
        if "error" in r:
            continue
        lines.append(
            f"{r['strategy']:>15} density {r['density']:<5} step {r['step_s'] * 1e3:8.1f} ms"
            f"  comm {r['comm_s'] * 1e3:8.1f} ms  predicted {r['predicted_comm_s'] * 1e3:8.1f}"
            f" / calibrated {r['calibrated_comm_s'] * 1e3:8.1f} ms  {r['bytes'] / 1e6:.3f} MB"
        )
    lines.append(
        f"crossover: measured {cross['measured_step']} (step time), "
        f"{cross['measured_comm']} (communication); 1/(2(P-1)) = {cross['formula']:.4f}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
