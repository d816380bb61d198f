"""EmbRace's 2D communication scheduling for column-sharded tables.

Horizontal: inside step t the embedding-gradient exchange is split into chunks sent in
priority order. Token positions whose id batch t+1 reads go first; once they have
arrived, the owner updates those rows and serves the lookup of batch t+1, while the
remaining chunks are still to be exchanged. Vertical: the exchange has no data
dependency on the dense layers' all-reduce, nor that on it, so XLA may overlap them.

The split never loses a row: token positions are *sorted* by priority and cut into
fixed-size chunks, so every position is sent exactly once whatever the sizes. The size
of the first chunk only decides whether all high-priority positions fit in it: the
planner (``high_priority_capacity``, host-side) sizes it so they do, which is what makes
the early-updated rows exact.

Example (P=1 worker, 4 tokens, next batch reads ids {7, 2})::

    ids    [5, 7, 2, 5]  ->  levels [1, 0, 0, 1]  ->  order [1, 2, 0, 3]
    chunk 0 (capacity 2): positions 1, 2 (ids 7, 2)   chunk 1: positions 0, 3 (ids 5, 5)

References:
    Li et al., "EmbRace", ICPP 2022, section 4 (2D communication scheduling).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

HIGH, LOW = 0, 1
# Name scopes of the pipelined step, visible in the compiled program's op metadata.
SCOPE_HIGH, SCOPE_LOW, SCOPE_NEXT = "embrace2d_high", "embrace2d_low", "embrace2d_next_lookup"


# --------------------------------------------------------------------------- planning


def priority_levels(ids, next_ids):
    """Level of each token position: ``HIGH`` (0) when batch t+1 reads its id, else
    ``LOW`` (1). Works on numpy or jax arrays of any shape."""
    xp = jnp if isinstance(ids, jax.Array) else np
    return xp.where(xp.isin(ids, next_ids), HIGH, LOW).astype(xp.int32)


def priority_order(levels):
    """Positions sorted by level (stable): level-0 first, original order within a level.

    Any number of levels works (e.g. by how soon a row is needed, or by frequency).
    ``levels``: int[..., n] -> int[..., n] permutation along the last axis.
    """
    xp = jnp if isinstance(levels, jax.Array) else np
    return xp.argsort(levels, axis=-1, stable=True)


def chunk_bounds(n: int, capacities: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk: the given capacities, then the rest (if any)."""
    bounds, start = [], 0
    for c in capacities:
        end = min(n, start + c)
        if end > start:
            bounds.append((start, end))
        start = end
    if start < n:
        bounds.append((start, n))
    return bounds


def high_priority_capacity(worker_ids: Sequence[np.ndarray], next_ids: np.ndarray) -> int:
    """Largest number of positions any worker must send first (host-side, numpy).

    Example: worker ids [5, 7, 2, 5] and [1, 1, 9, 9], next ids {7, 2, 1} -> max(2, 2) = 2.
    """
    nxt = np.unique(np.asarray(next_ids))
    return max((int(np.isin(np.asarray(w), nxt).sum()) for w in worker_ids), default=0)


# ------------------------------------------------------------------------ collectives


def column_grad_chunk(grads, ids, order, bounds: tuple[int, int], vocab: int, axis_name: str):
    """One chunk of the column-wise gradient exchange, as this owner's dense gradient.

    Per worker (P=2, D=4, chunk of 1 position; w0 sends its row for id a, w1 for id b)::

        before:     w0 g_a[0:4]                 w1 g_b[0:4]
        all_to_all: w0 [g_a[0:2], g_b[0:2]]     w1 [g_a[2:4], g_b[2:4]]
        after:      owner j scatter-adds both into rows a, b of its columns

    Args:
      grads: float[n, D], this worker's per-position gradient rows.
      ids: int[P, n], every worker's ids (known to all after the forward exchange).
      order: int[P, n], every worker's ``priority_order``.
      bounds: ``[start, end)`` of the chunk in priority order.
      vocab: V.
      axis_name: the mesh axis.

    Returns:
      float[V, D/P]: the sum over workers of this chunk's gradient, for my columns.
    """
    num = ids.shape[0]
    start, end = bounds
    mine = jnp.take(order[jax.lax.axis_index(axis_name)], jnp.arange(start, end))
    rows = jnp.take(grads, mine, axis=0)  # float[c, D]
    cols = rows.reshape(end - start, num, -1).transpose(1, 0, 2)  # float[P, c, D/P]
    got = jax.lax.all_to_all(cols, axis_name, 0, 0)  # float[P, c, D/P]: my columns, all
    sent_ids = jnp.take_along_axis(ids, order[:, start:end], axis=1)  # int[P, c]
    out = jnp.zeros((vocab, got.shape[-1]), grads.dtype)
    return out.at[sent_ids.reshape(-1)].add(got.reshape(-1, got.shape[-1]))


def column_grad_shared(grads, ids, vocab: int, axis_name: str):
    """Gradient of a lookup whose ids every worker holds identically: one
    reduce-scatter over columns (before: w_p holds g_p[N, D]; after: owner j holds
    sum_p g_p[:, cols_j]) scattered into float[V, D/P]."""
    mine = jax.lax.psum_scatter(grads, axis_name, scatter_dimension=1, tiled=True)
    return jnp.zeros((vocab, mine.shape[-1]), grads.dtype).at[ids].add(mine)
