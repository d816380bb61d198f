"""TopKA2A vs TopK-AllGather vs dense (and adaptive) over density, on the emulated
cluster: measured step and communication times, the cost model's prediction, and the
measured crossover against 1/(2(P-1)).

    python -m experiments.density --nproc 4 --bandwidth 100mbit \\
        --densities 0.01,0.05,0.1,0.2,0.3,0.5 -- --model resnet --width 32 --blocks 2

Each configuration runs twice through ``experiments.cluster``: at ``--bandwidth`` and
practically unthrottled (``--free-bandwidth``); the difference of the median step times
is the measured communication time. The prediction is the cost model on the compiled
program's collectives with a link of ``--bandwidth`` (alpha ``--alpha-us``). Writes
``density.json`` and ``density.png`` into ``--out-dir``. Needs root (see cluster).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from sparsecomm_jax import costmodel, hlo

STRATEGIES = ("topk_allgather", "topk_a2a", "adaptive")


def gbit(rate: str) -> float:
    """``"100mbit"`` -> 0.1 (Gbit/s)."""
    units = {"gbit": 1.0, "mbit": 1e-3, "kbit": 1e-6, "bit": 1e-9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"bandwidth must end in bit/kbit/mbit/gbit, got {rate!r}")


def run(nproc: int, bandwidth: str, strategy: str, density: float, train_args, out: Path):
    cmd = [sys.executable, "-m", "experiments.cluster", "--nproc", str(nproc), "--bandwidth",
           bandwidth, "--", "--strategy", strategy, "--density", str(density), "--devices",
           str(nproc), "--out", str(out), *train_args]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def predicted_comm_s(result: dict, link: costmodel.Link) -> float:
    colls = [hlo.Collective(c["kind"], c["name"], (), c["group_size"], c["result_bytes"],
                            c["bytes_sent"]) for c in result["collectives"]]  # fmt: skip
    return costmodel.program_time(colls, link)


def measured_crossover(rows: list[dict]) -> float | None:
    """Smallest density where topk_a2a's measured step time beats topk_allgather's."""
    by = {(r["strategy"], r["density"]): r["step_s"] for r in rows}
    for d in sorted({r["density"] for r in rows}):
        if by.get(("topk_a2a", d), 1e9) < by.get(("topk_allgather", d), 0):
            return d
    return None


def plot(rows, dense, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in STRATEGIES:
        pts = sorted((r["density"], r["step_s"], r["predicted_comm_s"] + r["free_step_s"])
                     for r in rows if r["strategy"] == s)  # fmt: skip
        d, m, p = zip(*pts, strict=True)
        line = ax.plot(d, m, marker="o", label=f"{s} measured")[0]
        ax.plot(d, p, ls="--", color=line.get_color(), label=f"{s} predicted")
    ax.axhline(dense["step_s"], color="black", label="dense measured")
    ax.set(xscale="log", xlabel="density", ylabel="step time (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m experiments.density", description=__doc__)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--free-bandwidth", default="100gbit")
    parser.add_argument("--alpha-us", type=float, default=50.0)
    parser.add_argument("--densities", default="0.01,0.05,0.1,0.2,0.3,0.5")
    parser.add_argument("--out-dir", default="runs/density")
    args = parser.parse_args(argv[:split])
    train_args = argv[split + 1 :]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    link = costmodel.Link(args.alpha_us * 1e-6, 8 / (gbit(args.bandwidth) * 1e9))
    from tqdm import tqdm

    def measure(strategy, density):
        slow = run(args.nproc, args.bandwidth, strategy, density, train_args,
                   out / f"{strategy}_{density}.json")  # fmt: skip
        free = run(args.nproc, args.free_bandwidth, strategy, density, train_args,
                   out / f"{strategy}_{density}_free.json")  # fmt: skip
        return {"strategy": strategy, "density": density, "step_s": slow["step_time_s"],
                "free_step_s": free["step_time_s"],
                "comm_s": slow["step_time_s"] - free["step_time_s"],
                "predicted_comm_s": predicted_comm_s(slow, link),
                "bytes": slow["comm_bytes_per_step"], "final_loss": slow["losses"][-1]}  # fmt: skip

    densities = [float(d) for d in args.densities.split(",")]
    dense = measure("dense", 1.0)
    jobs = [(s, d) for d in densities for s in STRATEGIES]
    rows = [measure(s, d) for s, d in tqdm(jobs, desc="density runs")]
    cross = {"measured": measured_crossover(rows),
             "formula": costmodel.crossover_density(args.nproc)}  # fmt: skip
    (out / "density.json").write_text(json.dumps({"dense": dense, "rows": rows,
                                                  "crossover": cross}, indent=1))  # fmt: skip
    plot(rows, dense, out / "density.png")
    print(f"dense: step {dense['step_s'] * 1e3:.1f} ms, comm {dense['comm_s'] * 1e3:.1f} ms "
          f"(predicted {dense['predicted_comm_s'] * 1e3:.1f} ms)")  # fmt: skip
    for r in rows:
        print(f"{r['strategy']:>15} density {r['density']:<5} step {r['step_s'] * 1e3:8.1f} ms"
              f"  comm {r['comm_s'] * 1e3:8.1f} ms  predicted {r['predicted_comm_s'] * 1e3:8.1f}"
              f" ms  {r['bytes'] / 1e6:.3f} MB")  # fmt: skip
    print(f"crossover: measured {cross['measured']}, formula 1/(2(P-1)) = {cross['formula']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
