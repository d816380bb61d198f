"""The measured local work of the sparse exchanges, for the cost model.

``comm.costmodel`` prices a bucket's exchange by its messages and bytes; a top-k
exchange also selects, keeps a residual and scatter-adds, on the worker itself. Here
that local work is timed at the run's bucket sizes and fitted as a line in the size
(``comm.costmodel.LocalWork``), so ``adaptive`` chooses the shortest step, not the
fewest bytes.

Example:
    >>> from sparsecomm_jax.topk import local_cost
    >>> fn = local_cost.local_work_fn("topk_a2a", 1000, 0.1, 4)  # jitted float32[1000] -> ...
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from sparsecomm_jax import runtime
from sparsecomm_jax.comm.costmodel import LocalWork, fit_line, median_seconds
from sparsecomm_jax.topk import exchanges


def local_work_fn(exchange: str, size: int, density: float, workers: int):
    """One worker's local work of ``exchange`` on a bucket (its collectives stood in
    for), as a jitted ``float32[size] -> outputs`` (``Exchange.local``); ``None`` for
    an exchange whose local work is not timed (dense: its additions are inside the
    timed all-reduce)."""
    local = exchanges.get(exchange).local
    return None if local is None else local(size, density, workers)


def measure_local_work(sizes: Sequence[int], density: float, workers: int, timer=None):
    """``LocalWork`` of adaptive's exchanges (``exchanges.menu()``), timed at each bucket
    size on this device and fitted as a line in the size; each time the mean over the
    processes
    (``runtime.agreed_mean``: every process must choose the same strategies), so call
    it on every process.

    Args:
      sizes: bucket sizes (entries), e.g. those of the run's fusion plan.
      density: fraction selected.
      workers: P.
      timer: ``(fn, x) -> seconds``; default the median of 5 timed calls after one.

    Returns:
      A ``LocalWork`` to pass as ``Link(..., local=...)``.
    """
    timer = timer or median_seconds
    rng, lines = np.random.default_rng(0), {}
    for name in exchanges.menu():
        points = []
        for size in sorted(set(sizes)):
            fn = local_work_fn(name, size, density, workers)
            if fn is not None:
                x = jnp.asarray(rng.normal(size=size).astype(np.float32))  # no ties
                points.append((size, runtime.agreed_mean(timer(fn, x))))
        if points:
            lines[name] = fit_line(points)
    return LocalWork(lines)
