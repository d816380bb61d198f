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
    rows_per: int,
    axis: str,
) -> RowPlan:
    """One table's gradient exchange in the pipelined step (inside ``shard_map``).

    Args:
      reads: the table's reads of batch t (``access.Read``; a hot table's ids as their
        stored rows, -1 where hot); a read of no ids (a bag of width 0) sends nothing.
      g_rows: per read, its gradient rows ``float[*ids.shape, D]``.
      future_ids: int[m], every row batch t+1 reads of the table, on every worker (of
        every replica group); ``None`` at the last step (one chunk, the late one).
      capacity: C, slots per (worker, owner) bucket (``two_batches``).
      rows_per: the rows of each worker's shard of the table.
      axis: the mesh axis the table is sharded over.

    Returns:
      The ``RowPlan``: which positions go first, and the rows of my shard batch t+1
      reads (the early update's ``next_ids``).
    """
    width = g_rows[0].shape[-1]
    looked = [
        (r.ids.reshape(-1), g.reshape(r.ids.size, width))
        for r, g in zip(reads, g_rows, strict=True)
        if r.kind == access.LOOKUP
    ]
    shared = [
        (r.ids.reshape(-1), g.reshape(r.ids.size, width))
        for r, g in zip(reads, g_rows, strict=True)
        if r.kind != access.LOOKUP and r.ids.size
    ]
    ids = jnp.concatenate([i for i, _ in looked] or [jnp.zeros((0,), jnp.int32)])
    grads = jnp.concatenate([g for _, g in looked] or [jnp.zeros((0, width), g_rows[0].dtype)])
    if future_ids is None:  # the last step: every position in the late chunk alone
        first, next_ids = jnp.zeros(ids.shape, bool), None
    else:
        first = priority.is_in(ids, future_ids) & (ids >= 0)  # -1: no row (a hot id)
        next_ids = row.owned_rows(future_ids, rows_per, axis)
    return RowPlan(ids, grads, first, shared, capacity, rows_per, next_ids)


def _send(plans: dict[int, RowPlan], which: dict, axis: str) -> dict:
    """Table index -> ``((ids, rows), missed)``: each table's positions where ``which``
    is true, sent to their owners by one exchange for every table (none: no table)."""
    if not plans:
        return {}
    got = row.send_gradients(
        [jnp.where(which[i], p.ids, -1) for i, p in plans.items()],
        [p.grads for p in plans.values()],
        [p.capacity for p in plans.values()],
        axis,
        [p.rows_per for p in plans.values()],
    )
    return dict(zip(plans, got, strict=True))


def first_pairs(plans: dict[int, RowPlan], axis: str) -> tuple[dict, dict]:
    """The first chunk of every row-wise table, at the owners (inside ``shard_map``): one
    exchange for all of them (``row.send_gradients``).

    Args:
      plans: table index -> its ``RowPlan``.
      axis: the mesh axis.

    Returns:
      ``(pairs, sent)``: table index -> ``[(ids in my shard int[k], rows float32[k,
      D])]``, the positions batch t+1 reads and every shared lookup (summed over the
      workers); table index -> bool[n], the positions the chunk carried (a first
      position that found no slot goes late). At the last step (nothing read next)
      the shared lookups alone.
    """
    pairs = {i: [] for i in plans}
    sent = {i: jnp.zeros(p.ids.shape, bool) for i, p in plans.items()}
    ahead = {i: p for i, p in plans.items() if p.next_ids is not None}
    if ahead:
        for i, (pair, missed) in _send(ahead, {i: p.first for i, p in ahead.items()}, axis).items():
            pairs[i], sent[i] = [pair], ahead[i].first & ~missed
    for i, p in plans.items():  # the same ids everywhere: every worker's sum, at the owner
        for ids, g in p.shared:
            pairs[i].append((row.owned_rows(ids, p.rows_per, axis), jax.lax.psum(g, axis)))
    return pairs, sent


def later_pairs(plans: dict[int, RowPlan], sent: dict, axis: str) -> tuple[dict, dict]:
    """The late chunk of every row-wise table, at the owners (inside ``shard_map``): every
    position the first chunk did not carry (``sent``, from ``first_pairs``), one
    exchange for all of them.

    Returns:
      ``(pairs, missed)``: table index -> ``[(ids in my shard int[P*C], rows float32[P*C,
      D])]``; table index -> bool[], a position found no slot (the step's rows did not
      all arrive: it is marked so).
    """
    got = _send(plans, {i: ~sent[i] for i in plans}, axis)
    return {i: [pair] for i, (pair, _) in got.items()}, {
        i: jnp.any(missed) for i, (_, missed) in got.items()
    }


def spill(rp: RowPlan, sent: jax.Array) -> jax.Array:
    """bool[]: a position batch t+1 reads missed the first chunk (its row's early update
    lacks that gradient: the step fetches the next rows again)."""
    return jnp.any(rp.first & ~sent)


def fetch(
    shards: dict, reads: list, capacity: dict[int, int], axis: str, take: dict | None = None
) -> list:
    """Rows of reads of row-wise tables (inside ``shard_map``), through the row layout's
    own fetch (``row.fetch``: the lookups of every table in one exchange); a read of no
    ids (a bag of width 0) reads nothing.

    Args:
      shards: table index -> float[V/P, D], this worker's rows of the table.
      reads: ``access.Read`` s (a negative id reads a zero row).
      capacity: table index -> C, slots per (worker, owner) bucket.
      axis: the mesh axis.
      take: table index -> how its owners read the rows asked of them (the pipelined
        step's reads add the early update); default the shards as they are.

    Returns:
      Per read ``float[*ids.shape, D]``.
    """
    out = [
        jnp.zeros((*r.ids.shape, shards[r.table].shape[1]), shards[r.table].dtype) for r in reads
    ]
    live = [k for k, r in enumerate(reads) if r.ids.size]
    if live:
        got = row.fetch(shards, [reads[k] for k in live], capacity, axis, take=take).rows
        for k, rows in zip(live, got, strict=True):
            out[k] = rows
    return out
