"""Cost of top-k selection (every selector, and TopKA2A's per-shard selection) against a
model step. ``experiments.studies.local_cost`` reports selection and the whole
aggregation in passes.

    python -m experiments.studies.selection_cost --size 25000000 --model resnet

Times each selector, jitted, on a float32[size] vector and on a vector as long as the
model's gradient, next to one single-device train step of the model. Writes
``selection_cost.json`` into ``--out-dir``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import optax

from experiments.studies import harness
from models import get_workload
from sparsecomm_jax.comm.costmodel import median_seconds
from sparsecomm_jax.topk import selectors, shards


def selector_times(size: int, density: float, num_shards: int) -> dict[str, float]:
    """Seconds of each selector of ``selectors.SELECTORS`` on a float32[size] vector at
    ``density``, and of TopKA2A's selection over ``num_shards`` shards with each exact
    selector (``shards.shard_select``, residual included)."""
    x = jax.numpy.asarray(np.random.default_rng(0).normal(size=size).astype(np.float32))
    k = selectors.num_selected(density, size)
    times = {
        name: median_seconds(jax.jit(lambda v, s=sel: selectors.select(s, v, k)), x)
        for name, sel in selectors.SELECTORS.items()
    }
    for name, sel in selectors.SELECTORS.items():
        if sel.exact:
            per_shard = jax.jit(lambda v, s=sel: shards.shard_select(s, v, k, num_shards))
            times[f"per_shard_{name}"] = median_seconds(per_shard, x)
    return times


def model_step(model: str, **overrides) -> tuple[int, float]:
    """(gradient length, seconds of one single-device SGD step) of ``model``."""
    w = get_workload(model, **overrides)
    params = w.init(jax.random.key(0))
    opt = optax.sgd(0.1)

    @jax.jit
    def step(p, s, batch):
        g = jax.grad(w.loss)(p, batch)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    size = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    return size, median_seconds(step, params, opt.init(params), w.batch_at(0))


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--size", type=int, default=25_000_000, help="vector length d")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--shards", type=int, default=8, help="P for per-shard selection")
    parser.add_argument("--model", default="resnet")
    parser.add_argument("--width", type=int, default=32, help="vision models: first-stage width")
    parser.add_argument("--blocks", type=int, default=2, help="vision models: blocks per stage")
    parser.add_argument("--batch", type=int, default=32, help="examples in the timed step")
    args = parser.parse_args(argv)
    grad_size, step_s = model_step(
        args.model, width=args.width, blocks=args.blocks, batch=args.batch
    )
    result = {
        "density": args.density,
        "shards": args.shards,
        "model": args.model,
        "width": args.width,
        "blocks": args.blocks,
        "batch": args.batch,
        "model_grad_size": grad_size,
        "model_step_s": step_s,
        "at_model_size": selector_times(grad_size, args.density, args.shards),
        "at_size": {"size": args.size, **selector_times(args.size, args.density, args.shards)},
    }
    out = Path(args.out_dir)
    harness.write_result(out, "selection_cost", result)
    print(f"{args.model}: {grad_size:,} parameters, single-device step {step_s * 1e3:.1f} ms")
    for name in result["at_size"]:
        if name == "size":
            continue
        t_model = result["at_model_size"][name]
        t_big = result["at_size"][name]
        ratio = t_model / step_s
        print(
            f"{name:>10}: {t_model * 1e3:8.2f} ms at d={grad_size:,} ({ratio:.2f} x step), "
            f"{t_big * 1e3:9.1f} ms at d={args.size:,}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
