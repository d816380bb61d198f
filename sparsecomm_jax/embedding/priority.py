"""EmbRace's priorities: which positions of a table's gradient go first, and in which
chunks the rest follow (the carried layouts' plans, ``Layout.pipelined``).

Horizontal: inside step t the embedding-gradient exchange is split into chunks sent in
priority order. Token positions whose id batch t+1 reads go first; once they have
arrived, the owner updates those rows and serves the lookup of batch t+1, while the
remaining chunks are still to be exchanged. Vertical: the exchange has no data
dependency on the dense layers' all-reduce, nor that on it, so XLA may overlap them
(the schedule is ``schedule.pipeline``'s).

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

from sparsecomm_jax.comm import costmodel
from sparsecomm_jax.embedding.access import LOOKUP, SHARED, HostReads, every_id
from sparsecomm_jax.embedding.layout import CapacityPolicy, grow_by_quarter

HIGH, LOW = 0, 1


# --------------------------------------------------------------------------- planning


def priority_levels(ids, next_ids):
    """Level of each token position: ``HIGH`` (0) when batch t+1 reads its id, else
    ``LOW`` (1). Works on numpy or jax arrays of any shape."""
    xp = jnp if isinstance(ids, jax.Array) else np
    return xp.where(is_in(ids, next_ids), HIGH, LOW).astype(xp.int32)


def is_in(ids, test):
    """bool per element of ``ids``: it is in ``test`` (numpy or jax). On jax arrays by
    sorting ``test`` and a binary search, O((n + m) log m): ``jnp.isin``'s default
    compares every pair, an n x m array, and the pipeline's n and m are every worker's
    ids (at P = 32 and 2,048 ids a worker, 4.3e9 comparisons a level)."""
    if isinstance(ids, jax.Array) or isinstance(test, jax.Array):
        return jnp.isin(ids, test, method="binary_search")
    return np.isin(ids, test)


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
        levels = xp.where(is_in(ids, xp.ravel(future[level])), level, levels)
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


def first_chunk_need(reads: list[HostReads], tables, workers: int) -> dict[int, int]:
    """Per table, the most positions any worker must send in its first chunk: lookup
    positions whose id batch t+1 reads (counting every read), and shared positions (the
    same on every worker) whose id it reads (host-side). ``reads``: batch t's, then
    batch t+1's (nothing to plan without it: the last step sends one chunk)."""
    if len(reads) < 2:
        return {}
    now, nxt = reads[0], every_id(reads[1])
    return {
        t.index: high_priority_capacity([*now[t.index][0], now[t.index][1]], nxt.get(t.index, []))
        for t in tables
        if t.index in now
    }


PRIORITY_CAPACITY = CapacityPolicy(
    lambda reads, tables, workers: first_chunk_need(reads, tables, workers),  # looked up late
    "high-priority positions",
    grow_by_quarter,
)


def late_capacities(n: int, first: int, width: int, workers: int) -> list[int]:
    """Chunk sizes in priority order: ``first``, then late chunks of at least
    ``late_chunk_rows`` positions under ``LINK``, at most ``MAX_LATE_CHUNKS``. (Where
    nothing can run beside a collective the pipelined step is not built at all:
    ``runtime.collectives_overlap``.)

    Example: n=1000, first=100, rows of 512 floats, 4 workers -> [100, 225, 225, 225, 225].
    """
    rest = max(0, n - first)
    link_rows = late_chunk_rows(LINK, 4 * width, workers)
    size = max(1, link_rows, -(-rest // MAX_LATE_CHUNKS))
    return [first] + [size] * (-(-rest // size))


MAX_LATE_CHUNKS = 4  # each chunk is one all-to-all per table
LINK = costmodel.Link.from_bandwidth(1.0)  # sizes the late chunks (1 Gbit/s, 50 us)


def future_ids(future: list, i: int, axis) -> list:
    """Per future batch, int[m]: every id its logged reads read of table ``i`` (all
    workers of ``axis``, with replica groups both axes: a row any group reads next goes
    first in every group; one all-gather for all the batches' lookups; inside
    ``shard_map``).

    Args:
      future: per batch t+1, t+2, ..., its ``access.Read`` s.
      i: the table's index.
      axis: the mesh axis (or axes) the batch is split over.

    Returns:
      Per batch, int[m]: every worker's lookups of the table, then its shared ids.
    """
    local = [
        [r.ids.reshape(-1) for r in reads if r.table == i and r.kind == LOOKUP] for reads in future
    ]
    sizes = [sum(x.size for x in ids) for ids in local]
    flat = jnp.concatenate([x for ids in local for x in ids] or [jnp.zeros(0, jnp.int32)])
    if flat.size:  # (a row-wise table read by bags of width 0 alone: no ids)
        every = jax.lax.all_gather(flat, axis, to="invarying")  # int[(R,) G, sum(sizes)]
        every = every.reshape(-1, flat.shape[0])  # int[P, sum(sizes)]
    else:
        every = jnp.zeros((1, 0), flat.dtype)
    bounds = np.cumsum([0, *sizes])
    out = []
    for k, reads in enumerate(future):
        shared = [r.ids.reshape(-1) for r in reads if r.table == i and r.kind == SHARED]
        out.append(jnp.concatenate([every[:, bounds[k] : bounds[k + 1]].reshape(-1), *shared]))
    return out
