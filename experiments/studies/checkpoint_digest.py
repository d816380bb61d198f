"""What the checkpoint digest costs on a large DLRM's save and restore.

    python -m experiments.studies.checkpoint_digest --out-dir experiments/results/checkpoint_digest

A DLRM whose tables hold ``--rows`` rows each (``--tables`` of them, ``--dim`` wide),
trained one step by ``embrace`` with Adam on 8 simulated CPU devices (parameters and
two moments: three copies of every table), is saved and restored ``--rounds`` times
with the digest (each array's digest computed where it lives at save, recomputed and
compared at restore) and as many times without it (the digest switched off for the
round), alternating, after one unrecorded round of each. Records the state's size,
the digest's own time (one jitted pass over the state, compiled once beforehand), and
the save and restore times, mean and median of each. Writes ``checkpoint_digest.json``
and ``checkpoint_digest.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from sparsecomm_jax import runtime  # noqa: E402

runtime.simulate_cpu_devices(8)

import jax  # noqa: E402
import optax  # noqa: E402

import sparsecomm_jax as sc  # noqa: E402
from experiments.studies import harness  # noqa: E402
from models import get_workload  # noqa: E402
from sparsecomm_jax import checkpoint  # noqa: E402
from sparsecomm_jax.checkpoint import digest  # noqa: E402


def build(tables: int, rows: int, dim: int):
    """The DLRM's train step after one step (Adam's moments filled)."""
    workload = get_workload("dlrm", tables=",".join([str(rows)] * tables), dim=dim, batch=256)
    params = workload.init(jax.random.key(0))
    ts = sc.make_train_step(
        workload.loss,
        optax.adam(1e-3),
        runtime.data_mesh(8),
        params,
        "embrace",
        embedding_paths=workload.embedding_paths,
        replicated_keys=workload.replicated_keys,
    )
    state, _ = ts.step(ts.state, ts.place_batch(workload.batch_at(0)))
    return ts, state


@contextlib.contextmanager
def digest_off():
    """Saves record no digest, so restores check none: the store as it was before."""
    kept = digest.of
    digest.of = lambda tree: {}
    try:
        yield
    finally:
        digest.of = kept


def one_round(ts, state, folder: Path) -> tuple[float, float]:
    """Seconds of one save and of one restore of ``state`` into a fresh folder."""
    shutil.rmtree(folder, ignore_errors=True)
    with checkpoint.Checkpointer(folder) as ckpt:
        began = time.perf_counter()
        ckpt.save_state(1, ts, state, force=True)
        saved = time.perf_counter() - began
        began = time.perf_counter()
        restored, _ = ckpt.restore_state(ts)
        jax.block_until_ready(restored)
        return saved, time.perf_counter() - began


def summary(values: list[float]) -> dict[str, float]:
    return {"mean_s": statistics.fmean(values), "median_s": statistics.median(values)}


def run(tables: int, rows: int, dim: int, rounds: int, scratch: Path) -> dict[str, Any]:
    ts, state = build(tables, rows, dim)
    tree = checkpoint.portable(ts, state)
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    digest.of(tree)  # compiled once
    digest_times = []
    for _ in range(rounds):
        began = time.perf_counter()
        digest.of(tree)
        digest_times.append(time.perf_counter() - began)
    for kind in ("with", "without"):  # warm-up: orbax's first save, the restore's digest
        with digest_off() if kind == "without" else contextlib.nullcontext():
            one_round(ts, state, scratch / kind)
    times: dict[str, dict[str, list[float]]] = {
        k: {"save": [], "restore": []} for k in ("with", "without")
    }
    for i in range(rounds):
        for kind in ("with", "without") if i % 2 == 0 else ("without", "with"):
            with digest_off() if kind == "without" else contextlib.nullcontext():
                saved, restored = one_round(ts, state, scratch / kind)
            times[kind]["save"].append(saved)
            times[kind]["restore"].append(restored)
            print(f"round {i} {kind} digest: save {saved:.2f} s, restore {restored:.2f} s")
    return {
        "tables": tables,
        "rows": rows,
        "dim": dim,
        "state_bytes": size,
        "digest": summary(digest_times),
        **{
            f"{what}_{kind}_digest": summary(times[kind][what])
            for kind in times
            for what in ("save", "restore")
        },
    }


def markdown(result: dict[str, Any]) -> str:
    def ms(entry):
        return f"{entry['mean_s'] * 1e3:.0f} / {entry['median_s'] * 1e3:.0f}"

    return "\n".join(
        [
            f"DLRM, {result['tables']} tables of {result['rows']:,} x {result['dim']}, Adam, "
            f"embrace on 8 simulated CPU devices: state {result['state_bytes'] / 1e9:.2f} GB",
            "",
            "| ms (mean / median) | with digest | without | digest alone |",
            "|---|---|---|---|",
            f"| save | {ms(result['save_with_digest'])} | {ms(result['save_without_digest'])} "
            f"| {ms(result['digest'])} |",
            f"| restore | {ms(result['restore_with_digest'])} | "
            f"{ms(result['restore_without_digest'])} | {ms(result['digest'])} |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tables", type=int, default=4, help="tables of the DLRM")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of each table")
    parser.add_argument("--dim", type=int, default=32, help="each table's row width")
    parser.add_argument("--rounds", type=int, default=3, help="saves and restores of each kind")
    parser.add_argument("--out-dir", default="experiments/results/checkpoint_digest")
    parser.add_argument("--scratch", default="", help="checkpoint folder (default: a temp one)")
    args = parser.parse_args(argv)
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="digest_"))
    try:
        result = run(args.tables, args.rows, args.dim, args.rounds, scratch)
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    harness.write_report(args.out_dir, "checkpoint_digest", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
