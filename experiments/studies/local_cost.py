"""Local work of top-k, in passes over the gradient: selection alone and the whole
``topk_allgather`` aggregation (error-feedback add, selection, residual, packing,
scatter-add), one process, one device.

    python -m experiments.studies.local_cost --size 8388608 --densities 0.01,0.2

A pass is one jitted ``jnp.sum(jnp.abs(x))`` over the same float32[size] vector; every
figure is a median wall time divided by it. Writes ``local_cost.json`` into ``--out-dir``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from experiments.studies import harness
from sparsecomm_jax import aggregators, runtime
from sparsecomm_jax.comm.costmodel import median_seconds
from sparsecomm_jax.topk import selectors


def aggregation_step(density: float, selector: str):
    """jit(shard_map) of ``topk_allgather.update`` on one device: (grad, residual) ->
    (mean, new residual), one float32[d] leaf."""
    agg = aggregators.topk_allgather(density, "data", selector=selector)
    mesh = runtime.data_mesh(1)

    def body(g, r):  # g, r: float32[d]
        mean, state = agg.update({"w": g}, aggregators.ErrorFeedbackState({"w": r}))
        return mean["w"], state.residual["w"]

    spec = P("data")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))


def measure(size: int, densities, chosen, repeats: int = 5) -> dict:
    """``{"size", "pass_s", "rows": [{density, selector, pass_s, select_passes,
    aggregate_passes}]}``; each row against the pass timed just before it."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=size).astype(np.float32))
    r = jnp.asarray(0.1 * rng.normal(size=size).astype(np.float32))
    one_pass = jax.jit(lambda v: jnp.sum(jnp.abs(v)))
    passes = []
    rows = []
    for density in densities:
        k = selectors.num_selected(density, size)
        for selector in chosen:
            sel = selectors.get(selector)
            select = jax.jit(lambda v, s=sel, k=k: selectors.select(s, v, k))
            step = aggregation_step(density, selector)
            # a pass timed next to each figure: a shared host's load drifts
            passes.append(median_seconds(one_pass, x, repeats=repeats))
            rows.append(
                {
                    "density": density,
                    "selector": selector,
                    "pass_s": passes[-1],
                    "select_passes": median_seconds(select, x, repeats=repeats) / passes[-1],
                    "aggregate_passes": median_seconds(step, x, r, repeats=repeats) / passes[-1],
                }
            )
    return {"size": size, "pass_s": statistics.median(passes), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--size", type=int, default=8 * 2**20, help="vector length d")
    parser.add_argument("--densities", default="0.01,0.2", help="comma-separated")
    parser.add_argument(
        "--selectors", default="auto", help=f"comma-separated, of {','.join(selectors.SELECTORS)}"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    chosen = args.selectors.split(",")
    for s in chosen:
        selectors.get(s)  # ValueError for an unknown name
    densities = [float(v) for v in args.densities.split(",")]
    result = measure(args.size, densities, chosen, args.repeats)
    out = Path(args.out_dir)
    harness.write_result(out, "local_cost", result)
    print(f"d={args.size:,}: one pass {result['pass_s'] * 1e3:.2f} ms (median)")
    for row in result["rows"]:
        print(
            f"density {row['density']:<5} {row['selector']:>9}: selection "
            f"{row['select_passes']:7.1f} passes, topk_allgather aggregation "
            f"{row['aggregate_passes']:7.1f} passes "
            f"(pass {row['pass_s'] * 1e3:.2f} ms)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
