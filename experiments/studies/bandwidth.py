"""Speed-up over ``dense_pmap`` against link bandwidth, per strategy, on the emulated
cluster.

    python -m experiments.studies.bandwidth --nproc 4 --bandwidths 1gbit,10gbit,25gbit \\
        --strategies dense_pmap,embrace,topk_a2a -- --model lstm_lm --steps 6

Each worker has a link of its own of each bandwidth (``cluster --per-worker``). On a
small host the fast links are bounded by the CPU that moves the bytes (gloo over TCP),
so a run also reports the practically unthrottled ``--free-bandwidth`` as the ceiling;
a strategy's step time there, subtracted from its step time at each rate, is its
measured communication, printed beside the cost model's prediction (``--alpha-us``),
and each measured step is plotted against its modelled one (the step at the free rate
plus the predicted communication: what ``compare`` prints for simulated devices).
Writes ``bandwidth.json``, ``bandwidth.csv``, ``bandwidth.png`` and
``bandwidth_modelled.png`` into ``--out-dir``.
Arguments after ``--`` go to every ``experiments.train`` run. Needs root (see cluster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.studies import harness
from sparsecomm_jax.comm import costmodel


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--nproc", type=int, default=4, help="processes (workers)")
    parser.add_argument("--bandwidths", default="1gbit,10gbit,25gbit", help="per worker")
    parser.add_argument("--free-bandwidth", default="100gbit", help="'' to leave out")
    parser.add_argument("--strategies", default="dense_pmap,embrace,topk_a2a")
    parser.add_argument("--alpha-us", type=float, default=50.0, help="model's alpha")
    return parser.parse_args(argv)


def plot(rows: list[dict], path: Path) -> None:
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    harness.plot_by_strategy(ax, rows, "gbit", "speedup")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set(
        xscale="log",
        xlabel="link bandwidth per worker (Gbit/s)",
        ylabel=f"speed-up over {harness.BASELINE}",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_modelled_steps(rows: list[dict], free: str) -> None:
    """Sets ``modelled_step_s`` = the step time at the ``free`` rate + the cost model's
    ``predicted_comm_s``, on the rows of the same strategy at the other rates."""
    ok = [r for r in rows if "error" not in r]
    base = {r["strategy"]: r["step_s"] for r in ok if r["bandwidth"] == free}
    for r in ok:
        if r["strategy"] in base and r["bandwidth"] != free:
            r["modelled_step_s"] = base[r["strategy"]] + r["predicted_comm_s"]


def plot_modelled(rows: list[dict], path: Path) -> None:
    """Measured against modelled step time, one point per strategy and rate."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    points = [r for r in rows if "modelled_step_s" in r]
    rates = list(dict.fromkeys(r["bandwidth"] for r in points))
    markers = dict(zip(rates, "osD^v<>", strict=False))  # one shape a rate
    for i, strategy in enumerate(dict.fromkeys(r["strategy"] for r in points)):
        for rate in rates:
            mine = [r for r in points if r["strategy"] == strategy and r["bandwidth"] == rate]
            ax.scatter(
                [r["modelled_step_s"] * 1e3 for r in mine],
                [r["step_s"] * 1e3 for r in mine],
                color=f"C{i}",
                marker=markers.get(rate, "o"),
                label=f"{strategy}, {rate}",
            )
    if not points:  # the free rate was left out (--free-bandwidth ''): nothing modelled
        ax.text(0.5, 0.5, "nothing modelled: no run at --free-bandwidth", ha="center")
        ax.set_axis_off()
    else:
        ends = [min(r["step_s"] for r in points) * 800, max(r["step_s"] for r in points) * 1200]
        ax.plot(ends, ends, color="gray", lw=0.5, label="measured = modelled")
        ax.set(xscale="log", yscale="log", xlabel="modelled step (ms)", ylabel="measured step (ms)")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers at 1, 2 and 5 of each decade
            axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    own, train_args = harness.split_argv(argv)
    args = parse_args(own)
    bandwidths = args.bandwidths.split(",") + ([args.free_bandwidth] if args.free_bandwidth else [])
    strategies = args.strategies.split(",")
    out = Path(args.out_dir)

    def run(bandwidth, strategy):
        run_args = ["--strategy", strategy, *train_args]
        return harness.measure(
            run_args,
            out / f"{strategy}_{bandwidth}.json",
            args.nproc,
            bandwidth,
            link=costmodel.Link.from_bandwidth(harness.gbit(bandwidth), args.alpha_us * 1e-6),
            bandwidth=bandwidth,
            gbit=harness.gbit(bandwidth),
        )

    jobs = [(b, s) for b in bandwidths for s in strategies]
    rows = harness.grid(jobs, run, "bandwidth runs")
    harness.add_speedups(rows, ("bandwidth",))
    if args.free_bandwidth:
        harness.add_measured_comm(rows, {"bandwidth": args.free_bandwidth})
        add_modelled_steps(rows, args.free_bandwidth)
    harness.save_rows(rows, out, "bandwidth", {"nproc": args.nproc})
    plot(rows, out / "bandwidth.png")
    plot_modelled(rows, out / "bandwidth_modelled.png")
    print(harness.report(rows, ("bandwidth",)))
    for r in (r for r in rows if "comm_s" in r and r["bandwidth"] != args.free_bandwidth):
        print(
            f"{r['bandwidth']:>8} {r['strategy']:>15}  comm {r['comm_s'] * 1e3:9.1f} ms, "
            f"predicted {r['predicted_comm_s'] * 1e3:9.1f} ms; step {r['step_s'] * 1e3:9.1f} "
            f"ms, modelled {r['modelled_step_s'] * 1e3:9.1f} ms"
        )
    print(f"results in {out}/bandwidth.json, bandwidth.csv, bandwidth.png")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
