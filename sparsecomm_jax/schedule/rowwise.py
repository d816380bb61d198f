"""EmbRace's 2D schedule for row-wise (and hot) tables: ``embrace_2d`` carries their rows.

A row-wise table's gradient goes to each id's owner (``embedding.row``). In the
pipelined step (``schedule.pipeline``) it travels in two chunks:

1. **first**: the positions whose id batch t+1 reads, summed per id and sent to the
   owners (``row.send_gradients``), with every shared lookup's gradient (summed over the
   workers; each owner keeps its ids). A row batch t+1 reads has all of its gradient
   here, so the early update of those rows is exact;
2. **late**: every other position, sent once every carried table's first chunk has
   arrived.

Batch t+1's rows are then fetched from their owners through the row-wise exchange, each
owner reading its rows with the early update added (``pipeline.patched_take``); they
are carried to step t+1, whose forward pass sends nothing for them.

A hot table's cold rows travel the same way, by their stored rows; its hot ids ask for
no row here (-1: ``pipeline.exchanged``), since every worker holds those.

Both chunks and the next fetch use one capacity per table (``two_batches``: the most
distinct ids one worker reads of one owner in batch t or t+1), so the gradient
travels in 2C slots a bucket where ``embrace`` sends C: the early chunk is paid in
bytes, as the column-wise chunks are.

Example (P=2, V=8: w0 owns rows 0-3, w1 rows 4-7; batch t+1 reads id 5)::

    w0 ids [5, 2]   first: (5, g) to w1    late: (2, g') to w0, after every first chunk
    w1 early-updates row 5; batch t+1's rows are read from the tables with that update

References:
    Li et al., "EmbRace", ICPP 2022, section 4 (2D communication scheduling);
    Mudigere et al., "High-performance, Distributed Training of Large-scale DLRMs", 2021
    (the row-wise exchange).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sparsecomm_jax.embedding import access, row
from sparsecomm_jax.embedding.access import HostReads
from sparsecomm_jax.embedding.layout import CapacityPolicy
from sparsecomm_jax.schedule import priority


def two_batches(policy: CapacityPolicy) -> CapacityPolicy:
    """A layout's plan of the ids (``policy``: the slots one batch needs) for the
    pipelined step, which sends batch t's gradients and fetches batch t+1's rows through
    one capacity: the most that either batch needs (host-side).

    Example:
        >>> from sparsecomm_jax.embedding import row
        >>> two_batches(row.CAPACITY).what
        'distinct rows from one owner (batch t or t+1)'
    """

    def need(reads: list[HostReads], tables, workers: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for now in reads[:2]:  # batch t, then t+1 (none at the last step)
            for i, slots in policy.need([now], tables, workers).items():
                out[i] = max(out.get(i, 0), slots)
        return out

    return policy._replace(need=need, what=f"{policy.what} (batch t or t+1)")


class RowPlan(NamedTuple):
    """A row-wise table's gradient exchange in the pipelined step, per worker."""

    ids: Any  # int[n]: the rows this worker looked up, one per position (-1: none)
    grads: Any  # float[n, D]: its gradient at those positions
    first: Any  # bool[n]: the positions the first chunk sends (batch t+1 reads their id)
    shared: list  # [(ids int[N], grads float[N, D])]: lookups whose ids every worker holds
    capacity: int  # C: slots per (worker, owner) bucket
    rows_per: int  # the rows of each worker's shard
    next_ids: Any  # int[m]: the rows of my shard batch t+1 reads (``rows_per``: another's)


def plan(
    reads: list,
    g_rows: list,
    future_ids: jax.Array | None,
    capacity: int,
    shard: jax.Array,
    axis: str,
) -> RowPlan:
    """One table's gradient exchange in the pipelined step (inside ``shard_map``).

    Args:
      reads: the table's reads of batch t (``access.Read``; a hot table's ids as their
        stored rows, -1 where hot).
      g_rows: per read, its gradient rows ``float[*ids.shape, D]``.
      future_ids: int[m], every row batch t+1 reads of the table, on every worker (of
        every replica group); ``None`` at the last step (one chunk, the late one).
      capacity: C, slots per (worker, owner) bucket (``two_batches``).
      shard: float[V/P, D], this worker's rows of the table.
      axis: the mesh axis the table is sharded over.

    Returns:
      The ``RowPlan``: which positions go first, and the rows of my shard batch t+1
      reads (the early update's ``next_ids``).
    """
    ids, grads, shared = [], [], []
    for read, g in zip(reads, g_rows, strict=True):
        flat = (read.ids.reshape(-1), g.reshape(read.ids.size, -1))
        (ids if read.kind == access.LOOKUP else shared).append(flat)
    ids, grads = jnp.concatenate([i for i, _ in ids]), jnp.concatenate([g for _, g in ids])
    rows_per = shard.shape[0]
    if future_ids is None:  # the last step: every position in the late chunk alone
        first, next_ids = jnp.zeros(ids.shape, bool), None
    else:
        first = priority.is_in(ids, future_ids) & (ids >= 0)  # -1: no row (a hot id)
        next_ids = row.owned_rows(future_ids, rows_per, axis)
    return RowPlan(ids, grads, first, shared, capacity, rows_per, next_ids)


def first_pairs(rp: RowPlan, axis: str) -> tuple[list, jax.Array]:
    """The first chunk, at the owners (inside ``shard_map``).

    Args:
      rp: the table's ``RowPlan``.
      axis: the mesh axis.

    Returns:
      ``(pairs, sent)``: ``[(ids in my shard int[k], rows float32[k, D])]``, the
      positions batch t+1 reads and every shared lookup (summed over the workers);
      ``sent`` bool[n], the positions it carried (a first position that found no slot
      goes late). At the last step (nothing read next) the shared lookups alone.
    """
    pairs, sent = [], jnp.zeros(rp.ids.shape, bool)
    if rp.next_ids is not None:
        (pair, missed) = row.send_gradients(
            jnp.where(rp.first, rp.ids, -1), rp.grads, rp.capacity, axis, rp.rows_per
        )
        pairs, sent = [pair], rp.first & ~missed
    for ids, g in rp.shared:  # the same ids everywhere: every worker's sum, at the owner
        pairs.append((row.owned_rows(ids, rp.rows_per, axis), jax.lax.psum(g, axis)))
    return pairs, sent


def later_pairs(rp: RowPlan, sent: jax.Array, axis: str) -> tuple[list, jax.Array]:
    """The late chunk, at the owners (inside ``shard_map``): every position the first
    chunk did not carry (``sent``, from ``first_pairs``).

    Returns:
      ``([(ids in my shard int[P*C], rows float32[P*C, D])], missed)``; ``missed``
      bool[], a position found no slot (the step's rows did not all arrive: it is
      marked so).
    """
    (pair, missed) = row.send_gradients(
        jnp.where(sent, -1, rp.ids), rp.grads, rp.capacity, axis, rp.rows_per
    )
    return [pair], jnp.any(missed)


def spill(rp: RowPlan, sent: jax.Array) -> jax.Array:
    """bool[]: a position batch t+1 reads missed the first chunk (its row's early update
    lacks that gradient: the step fetches the next rows again)."""
    return jnp.any(rp.first & ~sent)


def fetch(
    shard: jax.Array, read, capacity: int, axis: str, take: Callable | None = None
) -> jax.Array:
    """Rows of one read of a row-wise table (inside ``shard_map``): ``row.fetch_many``,
    or ``row.fetch_shared_one`` for ids every worker holds.

    Args:
      shard: float[V/P, D], this worker's rows.
      read: an ``access.Read`` (a negative id reads a zero row).
      capacity: C, slots per (worker, owner) bucket.
      axis: the mesh axis.
      take: how an owner reads the rows asked of it (``row.fetch_many``; the pipelined
        step's reads add the early update); default the shard as it is.

    Returns:
      ``float[*read.ids.shape, D]``.
    """
    if read.kind == access.LOOKUP:
        (rows,), _, _ = row.fetch_many([shard], [read.ids], [capacity], axis, take=take)
        return rows
    rows, _ = row.fetch_shared_one(shard, read.ids, axis, take=take)
    return rows
