"""Tables replicated across replica groups (2-D sparse parallelism): each step's row
gradients summed across the groups, so that every replica makes the same update.

A 2-D mesh of R replica groups x G devices shards each table over the G devices of a
group, by any layout, and replicates it across the R groups: the lookups' exchanges
span a group (G workers), never the whole cluster. At the end of a step each owner
holds its group's sum of its rows' gradients as ``(ids, rows)`` pairs (the layout's
``back``). ``sum_across`` adds the other groups' sums, by one of two exchanges over the
replica axis, per table whichever moves fewer bytes (``choose``):

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


def sum_across(pairs: list[Pairs], shard_rows: int, axis: str, how: str = AUTO) -> list[Pairs]:
    """A group's pairs at their owner, summed over the replica groups.

    Use inside ``shard_map``, on a mesh whose ``axis`` holds the replica groups.

    Args:
      pairs: ``[(ids int[m_k], rows float[m_k, w]), ...]``: this owner's gradient rows,
        summed over its group (ids outside ``[0, shard_rows)`` are padding).
      shard_rows: S, the rows of the owner's shard.
      axis: the replica axis.
      how: ``ROWS``, ``SHARD`` or ``AUTO`` (``choose``).

    Returns:
      One pair ``(ids, rows)`` with every group's sum of each id, the same on every
      replica (typed replicated over ``axis``); ``[]`` for no pairs.
    """
    if not pairs:
        return []
    ids = jnp.concatenate([i.astype(jnp.int32) for i, _ in pairs])  # int[m]
    rows = jnp.concatenate([r.astype(F32) for _, r in pairs])  # float[m, w]
    if how == AUTO:
        how = choose(ids.shape[0], shard_rows, jax.lax.axis_size(axis))
    if how == ROWS:
        every_id = jax.lax.all_gather(ids, axis, tiled=True, to="invarying")  # int[R m]
        every_row = jax.lax.all_gather(rows, axis, tiled=True, to="invarying")  # [R m, w]
        return [(every_id, every_row)]
    dense = jnp.zeros((shard_rows, rows.shape[1]), F32).at[ids].add(rows, mode="drop")
    count = jnp.zeros((shard_rows,), jnp.int32).at[ids].add(1, mode="drop")
    dense, count = jax.lax.psum((dense, count), axis)  # float[S, w], int[S]
    touched = jnp.where(count > 0, jnp.arange(shard_rows), shard_rows)  # untouched: padding
    return [(touched, dense)]
