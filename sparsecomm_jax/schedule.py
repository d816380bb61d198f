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

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsecomm_jax import costmodel, embedding

HIGH, LOW = 0, 1
# Name scopes of the pipelined step, visible in the compiled program's op metadata.
SCOPE_HIGH, SCOPE_LOW, SCOPE_NEXT = "embrace2d_high", "embrace2d_low", "embrace2d_next_lookup"
SCOPE_REFETCH = "embrace2d_refetch"  # the guard's fetch after the full update (rare)


# --------------------------------------------------------------------------- planning


def priority_levels(ids, next_ids):
    """Level of each token position: ``HIGH`` (0) when batch t+1 reads its id, else
    ``LOW`` (1). Works on numpy or jax arrays of any shape."""
    xp = jnp if isinstance(ids, jax.Array) else np
    return xp.where(xp.isin(ids, next_ids), HIGH, LOW).astype(xp.int32)


def next_use_levels(ids, future: Sequence[Any]):
    """Level of each position by when its id is next read: 0 when batch t+1 reads it,
    1 when t+2 does (and t+1 does not), ..., ``len(future)`` when no batch of the
    lookahead reads it (numpy or jax).

    Example: ids [5, 7, 2, 5], future [{7}, {5, 7}] -> levels [1, 0, 2, 1].

    Args:
      ids: int[..., n] ids of the positions.
      future: the ids batches t+1, t+2, ... read (any shapes), soonest first.

    Returns:
      int32[..., n].
    """
    xp = jnp if isinstance(ids, jax.Array) else np
    levels = xp.full(ids.shape, len(future), xp.int32)
    for level in reversed(range(len(future))):  # the soonest read wins
        levels = xp.where(xp.isin(ids, xp.ravel(future[level])), level, levels)
    return levels


def overflows(levels, capacity: int):
    """Device-side guard, this worker's part: True when it holds more ``HIGH``
    positions than the first chunk's ``capacity`` (the rows would travel late);
    callers reduce it over the workers (``jax.lax.pmax``) with their other flags."""
    return jnp.sum(levels == HIGH) > capacity


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


def late_chunk_rows(link: costmodel.Link, row_bytes: int, workers: int, overhead=0.1) -> int:
    """Positions per late chunk: the fewest whose all-to-all spends at most ``overhead``
    of its time on message latency under the alpha-beta ``link`` (more, smaller
    chunks let the rows needed soonest arrive sooner; each costs (P-1) messages).

    Example: 50 us per message, 1 Gbit/s, 512-float rows on 4 workers -> 110 positions.
    """
    per_row = (workers - 1) / workers * row_bytes * link.beta  # seconds per position
    latency = (workers - 1) * link.alpha
    return max(1, math.ceil(latency * (1 - overhead) / (overhead * max(per_row, 1e-30))))


def high_priority_capacity(worker_ids: Sequence[np.ndarray], next_ids: np.ndarray) -> int:
    """Largest number of positions any worker must send first (host-side, numpy).

    Example: worker ids [5, 7, 2, 5] and [1, 1, 9, 9], next ids {7, 2, 1} -> max(2, 2) = 2.
    """
    nxt = np.unique(np.asarray(next_ids))
    return max((int(np.isin(np.asarray(w), nxt).sum()) for w in worker_ids), default=0)


# ------------------------------------------------------------------------ collectives


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


def column_grad_chunk(grads, ids, order, bounds: tuple[int, int], vocab: int, axis_name: str):
    """``column_chunk_rows`` scattered into this owner's dense gradient float[V, D/P]:
    the sum over workers of the chunk's gradient, for my columns."""
    sent, got = column_chunk_rows(grads, ids, order, bounds, axis_name)
    return jnp.zeros((vocab, got.shape[-1]), grads.dtype).at[sent].add(got)


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


def column_grad_shared(grads, ids, order, bounds, vocab: int, axis_name: str):
    """``column_shared_rows`` scattered into float[V, D/P]."""
    flat, mine = column_shared_rows(grads, ids, order, bounds, axis_name)
    return jnp.zeros((vocab, mine.shape[-1]), grads.dtype).at[flat].add(mine)


# ------------------------------------------------------------------ host-side reads


def table_reads_fn(loss_fn, params, mask, replicated_keys: Sequence[str], workers: int):
    """A host function ``batch -> {table index: (lookup ids int[P, n], shared ids
    int[m])}``: every read of every table by each worker's slice of ``batch`` (a tied
    table read by inputs, targets and negatives counts each read), from one jitted
    program where the model runs on zeros (XLA keeps only the ids).

    Example: a tied LM with tokens int[B, T+1] reads ``embed`` 2 * B/P * T times per
    worker by lookup, plus the negatives once (shared).
    """
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    flags = zip(jax.tree.leaves(shapes), jax.tree.leaves(mask), strict=True)
    widths = {i: s.shape[1] for i, (s, f) in enumerate(flags) if f}

    def one_worker(batch):
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        found: dict[int, tuple[list, list]] = {}
        for kind, i, ids in embedding.logged_lookups(loss_fn, zeros, batch, mask, widths):
            if kind != "attend":
                found.setdefault(i, ([], []))[kind == "lookup_shared"].append(ids.reshape(-1))
        return {i: tuple(_cat(x) for x in pair) for i, pair in found.items()}

    @jax.jit
    def reads(batch):
        axes = {k: None if k in replicated_keys else 0 for k in batch}
        split = {
            k: v if k in replicated_keys else v.reshape(workers, -1, *v.shape[1:])
            for k, v in batch.items()
        }
        out = jax.vmap(one_worker, in_axes=(axes,))(split)
        return {i: (look, shared[0]) for i, (look, shared) in out.items()}

    return lambda batch: jax.tree.map(np.asarray, reads(batch))


def _cat(parts: list):
    return jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.int32)


def next_ids(reads: dict) -> dict:
    """Table index -> every id a batch reads (all workers, shared ids too)."""
    return {
        i: np.concatenate([look.ravel(), shared.ravel()]) for i, (look, shared) in reads.items()
    }


def first_chunk_need(reads: dict, next_reads: dict) -> int:
    """Largest number of positions any worker must send in a table's first chunk:
    lookup positions whose id batch t+1 reads (counting every read), and shared
    positions (the same on every worker) whose id it reads (host-side)."""
    nxt = next_ids(next_reads)
    need = 0
    for i, (look, shared) in reads.items():
        ids = nxt.get(i, np.zeros(0))
        need = max(need, high_priority_capacity([*look, shared], ids))
    return need
