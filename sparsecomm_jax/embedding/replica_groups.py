"""Tables replicated across replica groups (2-D sparse parallelism): each step's row
gradients summed across the groups, so that every replica makes the same update.

A 2-D mesh of R replica groups x G devices shards each table over the G devices of a
group, by any layout, and replicates it across the R groups: the lookups' exchanges
span a group (G workers), never the whole cluster. At the end of a step each owner
holds its group's sum of its rows' gradients as ``(ids, rows)`` pairs (the layout's
``back``). ``sum_tables`` adds the other groups' sums, by one of two exchanges over the
replica axis, per table whichever moves fewer bytes (``choose``); the tables summed
alike share one collective (``sum_tables``):

- ``ROWS``, the touched rows: an all-gather of the pairs, ``int[m]`` ids and
  ``float[m, w]`` rows; each worker receives ``(R - 1) m (4 w + 4)`` bytes;
- ``SHARD``, the whole shard: the pairs scatter-added into a dense ``float[S, w]``
  gradient, with a count per row of the groups that touched it, all-reduced; about
  ``2 (R - 1) / R x S (4 w + 4)`` bytes (a ring all-reduce).

Both give every replica the sum over all P = R x G workers, in float32, exactly: the
tables stay equal across the groups (``check_vma`` holds the result replicated over
the replica axis, or the step does not build). A row any group touched is touched for
every replica, so a lazy optimizer (lazy Adam) moves it everywhere.

TorchRec's ``DMPCollection`` keeps its replicas together otherwise: every few steps it
averages the replicas' weights and optimizer state in a dense all-reduce of the whole
shard. That equals summing the gradients only for plain SGD applied every step; here
the gradients are summed every step, for any optimizer.

Example:
    >>> choose(touched=100, shard_rows=10_000, replicas=2)  # a few rows of a big shard
    'rows'
    >>> choose(touched=9_000, shard_rows=10_000, replicas=4)  # most of a small one
    'shard'

References:
    TorchRec ``DMPCollection`` (2-D sparse parallelism, 2024); Mudigere et al.,
    "High-performance, Distributed Training of Large-scale DLRMs", 2021.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsecomm_jax.comm.vma import varying_axes
from sparsecomm_jax.embedding.layout import Pairs

ROWS = "rows"  # all-gather the touched rows
SHARD = "shard"  # all-reduce the dense shard
AUTO = "auto"  # per table, whichever moves fewer bytes
SYNCS = (AUTO, ROWS, SHARD)
F32 = jnp.float32


def choose(touched: int, shard_rows: int, replicas: int) -> str:
    """The cheaper exchange for a table: ``ROWS`` when the rows a group sends
    (``touched``, padding included: the static size) cost fewer bytes than an
    all-reduce of the ``shard_rows`` rows of the shard, else ``SHARD``.

    Args:
      touched: rows of the owner's pairs (their static count).
      shard_rows: rows of the owner's shard.
      replicas: R.

    Returns:
      ``ROWS`` or ``SHARD``.
    """
    rows = (replicas - 1) * touched
    shard = 2 * (replicas - 1) / replicas * shard_rows
    return ROWS if rows < shard else SHARD


def sum_tables(
    pairs: dict[int, list[Pairs]], shard_rows: dict[int, int], axis: str, how: str = AUTO
) -> dict[int, list[Pairs]]:
    """Every table's pairs at their owner, summed over the replica groups: the tables
    summed by ``ROWS`` share two all-gathers (their ids, their rows), those by
    ``SHARD`` two all-reduces (their dense gradients, their counts per row), per kind
    of typing (``_kinds``): a step pays a few collectives across the groups, whatever
    its number of tables.

    Use inside ``shard_map``, on a mesh whose ``axis`` holds the replica groups.

    Args:
      pairs: table index -> its pairs at this owner: ``[(ids int[m_k], rows float[m_k,
        w]), ...]``, its gradient rows summed over this owner's group (ids outside
        ``[0, S)`` are padding).
      shard_rows: table index -> S, the rows of its shard here.
      axis: the replica axis.
      how: ``ROWS``, ``SHARD`` or ``AUTO`` (per table, ``choose``).

    Returns:
      Table index -> ``[(ids, rows)]``: every group's sum of each id, the same on every
      replica (typed replicated over ``axis``); ``[]`` for a table with no pairs.
    """
    replicas = jax.lax.axis_size(axis)
    joined = {i: _joined(p) for i, p in pairs.items() if p}
    ways = {
        i: how if how != AUTO else choose(ids.shape[0], shard_rows[i], replicas)
        for i, (ids, _) in joined.items()
    }
    out: dict[int, list[Pairs]] = {i: [] for i in pairs}
    for (way, _), tables in _kinds(joined, ways).items():
        if way == ROWS:
            out.update(_gather_rows(tables, axis, replicas))
        else:
            out.update(_reduce_shards(tables, shard_rows, axis))
    return out


def _kinds(joined: dict[int, Pairs], ways: dict[int, str]) -> dict[tuple, dict[int, Pairs]]:
    """The tables that can share one collective: the same exchange, and the same mesh
    axes their pairs vary over (a column-wise table's ids are the same on every worker
    of a group, a row-wise table's are not: one buffer would type both as varying)."""
    kinds: dict[tuple, dict[int, Pairs]] = {}
    for i, (ids, rows) in joined.items():
        typed = (varying_axes(ids), varying_axes(rows))
        kinds.setdefault((ways[i], typed), {})[i] = (ids, rows)
    return kinds


def _joined(pairs: list[Pairs]) -> Pairs:
    ids = jnp.concatenate([i.astype(jnp.int32) for i, _ in pairs])  # int[m]
    return ids, jnp.concatenate([r.astype(F32) for _, r in pairs])  # float[m, w]


def _gather_rows(tables: dict[int, Pairs], axis: str, replicas: int) -> dict[int, list[Pairs]]:
    """Every table's (ids, rows) by two all-gathers: one of their ids, one of their rows
    (kept apart: a column-wise table's ids are the same across its group, its rows are
    not)."""
    ids = jnp.concatenate([i for i, _ in tables.values()])  # int[sum m]
    flat = jnp.concatenate([r.reshape(-1) for _, r in tables.values()])  # float[sum m w]
    every_id = jax.lax.all_gather(ids, axis, to="invarying")  # int[R, sum m]
    every_row = jax.lax.all_gather(flat, axis, to="invarying")  # float[R, sum m w]
    out, at, start = {}, 0, 0
    for i, (_, rows) in tables.items():
        m, w = rows.shape
        got_ids = every_id[:, at : at + m].reshape(replicas * m)
        got_rows = every_row[:, start : start + m * w].reshape(replicas * m, w)
        out[i] = [(got_ids, got_rows)]
        at, start = at + m, start + m * w
    return out


def _reduce_shards(
    tables: dict[int, Pairs], shard_rows: dict[int, int], axis: str
) -> dict[int, list[Pairs]]:
    """Every table's dense shard gradient by one all-reduce, and its count per row by
    another (typed as its ids: a column-wise table's touched rows are the same across
    its group)."""
    dense, counts = [], []
    for i, (ids, rows) in tables.items():
        size = shard_rows[i]
        grad = jnp.zeros((size, rows.shape[1]), F32).at[ids].add(rows, mode="drop")
        dense.append(grad.reshape(-1))  # float[S w]
        counts.append(jnp.zeros((size,), jnp.int32).at[ids].add(1, mode="drop"))  # int[S]
    dense = jax.lax.psum(jnp.concatenate(dense), axis)  # float[sum S w]
    counts = jax.lax.psum(jnp.concatenate(counts), axis)  # int[sum S]
    out, at, start = {}, 0, 0
    for i, (_, rows) in tables.items():
        size, w = shard_rows[i], rows.shape[1]
        grad = dense[start : start + size * w].reshape(size, w)  # float[S, w]
        count = counts[at : at + size]  # int[S]
        touched = jnp.where(count > 0, jnp.arange(size), size)  # untouched: padding
        out[i] = [(touched, grad)]
        at, start = at + size, start + size * w
    return out
