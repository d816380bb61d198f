"""The chunks of EmbRace's 2D schedule: one all-to-all of a slice of a table's gradient
rows, in priority order, arriving at the owners as (id, row) pairs of their columns.

``column_chunk_rows`` sends a chunk of the positions a worker looked up (every worker's
ids are known to all after the forward exchange); ``column_shared_rows`` a chunk of a
lookup whose ids every worker holds (shared negatives), by one reduce-scatter. Each is
checked against a list-of-blocks reference in the tests.

Example (P=2, D=4, a chunk of one position; w0 sends its row for id a, w1 for id b)::

    before:     w0 g_a[0:4]                 w1 g_b[0:4]
    all_to_all: w0 [g_a[0:2], g_b[0:2]]     w1 [g_a[2:4], g_b[2:4]]
    after:      owner j holds (a, g_a[my cols]), (b, g_b[my cols])

References:
    Li et al., "EmbRace", ICPP 2022, section 4 (2D communication scheduling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def column_chunk_rows(grads, ids, order, bounds: tuple[int, int], axis_name: str):
    """One chunk of the column-wise gradient exchange, as (id, row) pairs at the owner.

    Per worker (P=2, D=4, chunk of 1 position; w0 sends its row for id a, w1 for id b)::

        before:     w0 g_a[0:4]                 w1 g_b[0:4]
        all_to_all: w0 [g_a[0:2], g_b[0:2]]     w1 [g_a[2:4], g_b[2:4]]
        after:      owner j holds (a, g_a[my cols]), (b, g_b[my cols])

    Args:
      grads: float[n, D], this worker's per-position gradient rows.
      ids: int[P, n], every worker's ids (known to all after the forward exchange).
      order: int[P, n], every worker's ``priority_order``.
      bounds: ``[start, end)`` of the chunk in priority order.
      axis_name: the mesh axis.

    Returns:
      ``(ids int[P*c], rows float[P*c, D/P])``: every worker's chunk, my columns (the
      same ids on every worker; an id may repeat).
    """
    num = ids.shape[0]
    start, end = bounds
    mine = jnp.take(order[jax.lax.axis_index(axis_name)], jnp.arange(start, end))
    rows = jnp.take(grads, mine, axis=0)  # float[c, D]
    cols = rows.reshape(end - start, num, -1).transpose(1, 0, 2)  # float[P, c, D/P]
    got = jax.lax.all_to_all(cols, axis_name, 0, 0)  # float[P, c, D/P]: my columns, all
    sent_ids = jnp.take_along_axis(ids, order[:, start:end], axis=1)  # int[P, c]
    return sent_ids.reshape(-1), got.reshape(-1, got.shape[-1])


def column_shared_rows(grads, ids, order, bounds: tuple[int, int], axis_name: str):
    """One chunk of the gradient of a lookup whose ids every worker holds identically
    (e.g. shared negatives), as (id, row) pairs: one reduce-scatter over columns
    (before: w_p holds g_p[c, D]; after: owner j holds sum_p g_p[:, cols_j]).

    Args:
      grads: float[N, D], this worker's gradient per shared position.
      ids: int[N], the same on every worker.
      order: int[N], their ``priority_order`` (the same on every worker).
      bounds: ``[start, end)`` of the chunk in that order.
      axis_name: the mesh axis.

    Returns:
      ``(ids int[c], rows float[c, D/P])``.
    """
    pos = order[bounds[0] : bounds[1]]
    g = jnp.take(grads, pos, axis=0)  # float[c, D]
    return jnp.take(ids, pos), jax.lax.psum_scatter(g, axis_name, scatter_dimension=1, tiled=True)
