"""When each collective and compute phase ran, per step and worker: ``embrace`` (one
program per step), ``embrace_2d`` (one pipelined program per step) and ``overlap``
(``embrace_2d`` with step t's late exchange beside step t+1's compute), as a Gantt PNG.

    python -m experiments.studies.timeline --cluster --nproc 4 --per-worker --bandwidth 200mbit \\
        --vocab 100000 --steps 12 --out runs/timeline.json      # root + tc
    python -m experiments.studies.timeline --steps 8 --out runs/timeline.json   # simulated devices

Host timestamps around every dispatched program (``block_until_ready``); each rank
writes ``OUT`` with ``.rankN`` before the suffix, rank 0 also the merged JSON and the PNG
(same name, ``.png``). Programs of one step are bars on a worker's row: ``step`` (all of
embrace's step), ``fetch``, ``compute`` (no collective), ``high`` (dense all-reduce,
first chunks, next rows), ``low`` (late chunks, table update), ``fused`` (``overlap``'s
one-program form: step t-1's low beside step t's compute, then step t's high).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

STRATEGIES = ("embrace", "embrace_2d", "overlap", "overlap_fused")
COLORS = {
    "step": "tab:gray",
    "fetch": "tab:purple",
    "compute": "tab:green",
    "high": "tab:red",
    "low": "tab:blue",
    "fused": "tab:orange",
}


def _workload(args):
    from models import get_workload

    return get_workload(
        args.model,
        vocab=args.vocab,
        dim=args.dim,
        hidden=args.hidden,
        seq_len=args.seq_len,
        batch=args.batch,
        sampled_softmax=args.sampled_softmax,
        seed=0,
    )


def _run_step_strategy(w, name, params, mesh, steps, table_update="dense"):
    """``(losses, timeline)`` of a one-program-per-step strategy (after a 3-step run
    that compiles the first, middle and last steps' programs)."""
    import jax
    import optax

    import sparsecomm_jax as sc

    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.5),
        mesh,
        params,
        name,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        table_update=table_update,
        collectives_overlap=True,  # embrace_2d: the pipelined program (on CPU too)
    )
    _steps(ts, w, 3, jax.tree.map(lambda x: x.copy(), ts.state))  # the step donates
    return _steps(ts, w, steps, ts.state)


def _steps(ts, w, steps, state):
    import sparsecomm_jax as sc

    losses, timeline = [], []
    for step in range(steps):
        batch = sc.place_for_step(ts, w.batch_at, step, steps)
        start = time.perf_counter()
        state, loss = _ready(ts.step(state, batch))
        timeline.append(("step", step, start, time.perf_counter()))
        losses.append(sc.loss_value(loss))
    return losses, timeline


def _ready(x):
    import jax

    return jax.block_until_ready(x)


def _run_overlap(w, params, mesh, steps, fused=False, table_update="dense"):
    import optax

    import sparsecomm_jax as sc

    ov = sc.make_overlapped(
        w.loss,
        optax.sgd(0.5),
        mesh,
        params,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        table_update=table_update,
    )
    timeline: list = []
    ov.run(ov.state, w.batch_at, 3, fused=fused)  # compiles every program
    _, losses = ov.run(ov.state, w.batch_at, steps, timeline, fused=fused)
    return losses, timeline


def step_times(timeline: list, steps: int) -> list[float]:
    """Seconds between the ends of consecutive steps' last communicating program."""
    ends = {}
    for phase, step, _, end in timeline:
        if phase in ("step", "high", "fused"):
            ends[step] = max(ends.get(step, 0.0), end)
    return [ends[s] - ends[s - 1] for s in range(1, steps) if s in ends and s - 1 in ends]


def worker(args) -> dict:
    """Runs every strategy on this rank; returns its record."""
    import jax

    from sparsecomm_jax import distributed, runtime

    rank, _ = distributed.initialize_distributed()
    if not _launched():
        runtime.simulate_cpu_devices(args.devices)
    w = _workload(args)
    params = w.init(jax.random.key(0))
    mesh = runtime.data_mesh()
    record = {"rank": rank, "config": vars(args), "runs": {}}
    for name in args.strategies.split(","):
        if name.startswith("overlap"):
            fused = name == "overlap_fused"
            losses, timeline = _run_overlap(w, params, mesh, args.steps, fused, args.table_update)
        else:
            run = _run_step_strategy
            losses, timeline = run(w, name, params, mesh, args.steps, args.table_update)
        times = step_times(timeline, args.steps)[args.warmup :]
        record["runs"][name] = {
            "losses": losses,
            "timeline": timeline,
            "step_s": statistics.median(times) if times else None,
        }
    return record


def _rank_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def plot(records: list[dict], png: Path) -> None:
    """One panel per strategy; a row per worker; a bar per program run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(records[0]["runs"])
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.4 + 0.9 * len(records) * len(names)))
    axes = [axes] if len(names) == 1 else axes
    for ax, name in zip(axes, names, strict=True):
        t0 = min(r["runs"][name]["timeline"][0][2] for r in records)
        for rec in records:
            for phase, _, start, end in rec["runs"][name]["timeline"]:
                lane = rec["rank"] + (0.4 if phase == "low" else 0.0)
                ax.barh(lane, end - start, left=start - t0, height=0.35, color=COLORS[phase])
        step_s = records[0]["runs"][name]["step_s"]
        ax.set_title(f"{name}: median step {step_s:.3f} s" if step_s else name)
        ax.set_yticks([r["rank"] for r in records], [f"worker {r['rank']}" for r in records])
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper right", ncol=len(COLORS))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(png, dpi=110)


def _merge(out: Path, nproc: int) -> None:
    records = [json.loads(_rank_path(out, r).read_text()) for r in range(nproc)]
    out.write_text(json.dumps(records))
    plot(records, out.with_suffix(".png"))


def run_cluster(args, worker_argv: list[str]) -> int:
    """This script's worker mode as ``--nproc`` ranks on the emulated cluster."""
    from experiments import cluster

    rate = cluster.loopback_rate(args.bandwidth, args.nproc, args.per_worker)
    cluster.check_environment()
    launcher = [
        sys.executable,
        "-m",
        "sparsecomm_jax.launch",
        "--nproc",
        str(args.nproc),
        "--",
        sys.executable,
        "-m",
        "experiments.studies.timeline",
        *worker_argv,
    ]
    with cluster.Namespace(rate, "") as ns:
        code = subprocess.run(ns.command(launcher)).returncode
    if code == 0:
        _merge(Path(args.out), args.nproc)
    return code


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.studies.timeline", description=__doc__)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--model", default="lstm_lm")
    for flag, default in (
        ("vocab", 1000),
        ("dim", 32),
        ("hidden", 32),
        ("seq_len", 16),
        ("batch", 16),
        ("sampled_softmax", 64),
        ("steps", 8),
        ("warmup", 2),
    ):
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=default)
    p.add_argument("--devices", type=int, default=4, help="simulated devices (--local)")
    p.add_argument(
        "--table-update",
        choices=("rows", "dense"),
        default="rows",
        help="the tables' update: only the rows a step reads (SGD on them) or dense",
    )
    p.add_argument("--out", required=True, help="JSON path (rank files next to it)")
    p.add_argument("--cluster", action="store_true", help="run on the emulated cluster")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--bandwidth", default="200mbit")
    p.add_argument("--per-worker", action="store_true")
    p.add_argument("--merge", type=int, default=0, help="merge N rank files and plot")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    for name in args.strategies.split(","):
        if name not in STRATEGIES:
            raise SystemExit(f"--strategies: unknown {name!r}; choose from {STRATEGIES}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        _merge(out, args.merge)
        return 0
    if args.cluster:
        skip = {"--cluster", "--per-worker"}
        rest = [a for a in argv if a not in skip]
        for flag in ("--nproc", "--bandwidth"):
            if flag in rest:
                i = rest.index(flag)
                del rest[i : i + 2]
        return run_cluster(args, rest)
    record = worker(args)
    path = _rank_path(out, record["rank"]) if _launched() else out
    path.write_text(json.dumps(record))
    if not _launched():
        out.write_text(json.dumps([record]))
        plot([record], out.with_suffix(".png"))
    for name, run in record["runs"].items():
        print(f"{name}: median step {run['step_s']} s, losses {run['losses'][-3:]}")
    return 0


def _launched() -> bool:
    from sparsecomm_jax import distributed

    return distributed.distributed_args() is not None


if __name__ == "__main__":
    sys.exit(main())
