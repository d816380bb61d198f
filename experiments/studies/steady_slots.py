"""How much margin the tables' slots need so a run compiles no program after its first
batch: each batch's needs recorded over long Zipf streams, each sizing rule replayed on
them.

    python -m experiments.studies.steady_slots --out-dir experiments/results/steady_slots

For each workload and strategy and each of ``--seeds`` streams of ``--steps`` batches, the
slots every batch needs per table (its layout's ``CapacityPolicy.need``) are recorded as
``place_for_step`` sizes them; then each rule is replayed on those needs as
``capacities.grow_capacities`` applies it (grow past the current slots when a batch needs
more, never shrink): how many times the slots grew after the first batch (each a new
program, a 0.1-1 s step), and how many more slots the run ends with than the most any
batch needed ("headroom", summed over tables: the bytes it costs in proportion). Host
work only; writes ``steady_slots.json`` and ``steady_slots.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from sparsecomm_jax import runtime  # noqa: E402

runtime.simulate_cpu_devices(4)

import jax  # noqa: E402
import optax  # noqa: E402

import sparsecomm_jax as sc  # noqa: E402
from models import get_workload  # noqa: E402
from sparsecomm_jax.embedding import layout  # noqa: E402
from sparsecomm_jax.step import capacities  # noqa: E402

#: The DLRM of the comparison with TorchRec (8 tables, 128 samples a worker, 4 workers)
#: and an LM of V = 100k (D does not change the slots).
DLRM = dict(
    tables="100000,50000,20000,10000,5000,1000,500,100", dim=8, batch=512, zipf_exponent=1.0
)
LM = dict(vocab=100_000, dim=8, hidden=8, seq_len=20, batch=128, sampled_softmax=64)
CASES = (
    ("dlrm", DLRM, "embrace"),
    ("dlrm", DLRM, "embrace_rowwise"),
    ("lstm_lm", LM, "embrace"),
)


RULES = {
    "an eighth more (before)": layout.grow_by_eighth,
    "next power of two (row-wise before)": layout.next_power_of_two,
    **{
        f"margin {k} sd": functools.partial(layout.grow_with_margin, sigmas=k)
        for k in (1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
    },
}


def recorded_needs(model: str, sizes: dict, strategy: str, seed: int, steps: int) -> list:
    """Per batch, ``{table: slots needed}`` as the run's placer measures them."""
    w = get_workload(model, seed=seed, **sizes)
    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        runtime.data_mesh(4),
        w.init(jax.random.key(0)),
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        id_keys=w.id_keys,
    )
    seen: list[dict] = []
    grow = capacities.grow_capacities

    def recording(current, needs, fixed, policy):
        seen[-1].update(needs)
        return grow(current, needs, fixed, policy)

    capacities.grow_capacities = recording  # the placer's own needs, read as it sizes
    try:
        for s in range(steps):
            seen.append({})
            sc.place_for_step(ts, w.batch_at, s, steps)
    finally:
        capacities.grow_capacities = grow
    return seen


def replay(needs: list[dict], rule) -> tuple[int, float]:
    """``(growths after the first batch, headroom)`` of ``rule`` on ``needs``."""
    current: dict = {}
    growths = 0
    for s, need in enumerate(needs):
        before = dict(current)
        for table, n in need.items():
            if n > current.get(table, 0) or table not in current:
                current[table] = max(current.get(table, 0), rule(n))
        growths += s > 0 and current != before
    most = {t: max(n.get(t, 0) for n in needs) for t in current}
    return growths, sum(current.values()) / max(1, sum(most.values())) - 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.studies.steady_slots")
    parser.add_argument("--out-dir", default="runs/steady_slots")
    parser.add_argument("--seeds", type=int, default=6, help="streams per workload")
    parser.add_argument("--steps", type=int, default=200, help="batches per stream")
    parser.add_argument("--first-seed", type=int, default=0, help="the streams' first seed")
    parser.add_argument(
        "--cases", default="", help="only the workloads whose 'model strategy' holds this"
    )
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    for model, sizes, strategy in CASES:
        if args.cases not in f"{model} {strategy}":
            continue
        streams = [recorded_needs(model, sizes, strategy, s, args.steps) for s in seeds]
        for name, rule in RULES.items():
            results = [replay(needs, rule) for needs in streams]
            row = {
                "workload": f"{model} {strategy}",
                "rule": name,
                "streams": len(results),
                "streams_that_grew": sum(g > 0 for g, _ in results),
                "growths": sum(g for g, _ in results),
                "headroom_pct": 100 * sum(h for _, h in results) / len(results),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "steady_slots.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"| workload | rule | streams that grew after batch 0 (of {args.seeds}) | growths | "
        "slots over the most needed |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['workload']} | {r['rule']} | {r['streams_that_grew']} | {r['growths']} | "
        f"{r['headroom_pct']:.1f}% |"
        for r in rows
    ]
    (out / "steady_slots.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
