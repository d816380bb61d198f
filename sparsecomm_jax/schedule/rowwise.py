"""EmbRace's 2D schedule for row-wise tables: ``embrace_2d`` carries their rows too.

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
    one capacity: the most that either batch needs (host-side)."""

    def need(reads: list[HostReads], tables, workers: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for now in reads[:2]:  # batch t, then t+1 (none at the last step)
            for i, slots in policy.need([now], tables, workers).items():
                out[i] = max(out.get(i, 0), slots)
        return out

    return policy._replace(need=need, what=f"{policy.what} (batch t or t+1)")


class RowPlan(NamedTuple):
    """A row-wise table's gradient exchange in the pipelined step, per worker."""

    ids: Any  # int[n]: the rows this worker looked up, one per position
    grads: Any  # float[n, D]: its gradient at those positions
    first: Any  # bool[n]: the positions the first chunk sends (batch t+1 reads their id)
    shared: list  # [(ids int[N], grads float[N, D])]: lookups whose ids every worker holds
    capacity: int  # C: slots per (worker, owner) bucket
    rows_per: int  # the rows of each worker's shard
    next_ids: Any  # int[m]: the rows of my shard batch t+1 reads (``rows_per``: another's)


def plan(reads: list, g_rows: list, future_ids, capacity: int, shard, axis: str) -> RowPlan:
    """``RowPlan`` of one table from its ``reads`` of batch t and their gradients
    ``g_rows`` (the table's reads only); ``future_ids``: every id batch t+1 reads of it,
    on every worker (``None`` at the last step: one chunk)."""
    ids, grads, shared = [], [], []
    for read, g in zip(reads, g_rows, strict=True):
        flat = (read.ids.reshape(-1), g.reshape(read.ids.size, -1))
        (ids if read.kind == access.LOOKUP else shared).append(flat)
    ids, grads = jnp.concatenate([i for i, _ in ids]), jnp.concatenate([g for _, g in ids])
    rows_per = shard.shape[0]
    if future_ids is None:  # the last step: every position in the late chunk alone
        first, next_ids = jnp.zeros(ids.shape, bool), None
    else:
        first = priority.is_in(ids, future_ids)
        next_ids = row.owned_rows(future_ids, rows_per, axis)
    return RowPlan(ids, grads, first, shared, capacity, rows_per, next_ids)


def first_pairs(rp: RowPlan, axis: str) -> tuple[list, jax.Array]:
    """The first chunk at the owners: ``(pairs, sent)``, ``pairs`` ``[(ids in my shard,
    rows)]`` (the positions batch t+1 reads, and every shared lookup), ``sent`` bool[n]
    the positions it carried (a first position that found no slot goes late). At the
    last step (nothing read next) it sends the shared lookups alone."""
    pairs, sent = [], jnp.zeros(rp.ids.shape, bool)
    if rp.next_ids is not None:
        (pair, missed) = row.send_gradients(
            jnp.where(rp.first, rp.ids, -1), rp.grads, rp.capacity, axis, rp.rows_per
        )
        pairs, sent = [pair], rp.first & ~missed
    for ids, g in rp.shared:  # the same ids everywhere: every worker's sum, at the owner
        pairs.append((row.owned_rows(ids, rp.rows_per, axis), jax.lax.psum(g, axis)))
    return pairs, sent


def later_pairs(rp: RowPlan, sent, axis: str) -> tuple[list, jax.Array]:
    """The late chunk at the owners: ``([(ids in my shard, rows)], missed)``, every
    position the first chunk did not carry; ``missed`` bool[]: one found no slot (the
    step's rows did not all arrive: it is marked so)."""
    (pair, missed) = row.send_gradients(
        jnp.where(sent, -1, rp.ids), rp.grads, rp.capacity, axis, rp.rows_per
    )
    return [pair], jnp.any(missed)


def spill(rp: RowPlan, sent) -> jax.Array:
    """bool[]: a position batch t+1 reads missed the first chunk (its row's early update
    lacks that gradient: the step fetches the next rows again)."""
    return jnp.any(rp.first & ~sent)


def fetch(shard, read, capacity: int, axis: str, take=None):
    """Rows of one read of a row-wise table (``row.fetch_many``, or ``row.fetch_shared_one``
    for ids every worker holds), each owner reading through ``take`` (default: the
    shard as it is)."""
    if read.kind == access.LOOKUP:
        (rows,), _, _ = row.fetch_many([shard], [read.ids], [capacity], axis, take=take)
        return rows
    rows, _ = row.fetch_shared_one(shard, read.ids, axis, take=take)
    return rows
