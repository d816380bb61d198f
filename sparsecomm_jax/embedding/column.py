"""Column-wise tables (EmbRace): worker j holds columns ``[jD/P, (j+1)D/P)`` of every row.

The layout's trio, for all the column-wise tables of a step at once:

1. **plan** (host): per table, the most distinct ids any worker reads of it (its lookups
   and the shared ids together), with 1/8 headroom (``CAPACITY``);
2. **fetch**: each worker finds its *distinct* ids of each table (its lookups and the
   shared ids together), padded to the capacity, and one all-gather tells every owner
   every worker's (a table read only through shared ids, identical everywhere, sends
   none); each owner takes its columns of every worker's distinct rows, and one
   all-to-all brings every worker the P column slices of its rows (concatenated to D);
3. **back**: the gradient rows of equal ids are summed on the worker that read them,
   and one all-to-all returns each owner its columns of them.

With Zipf tokens and log-uniform negatives most ids repeat: the LSTM LM at V=100k with
16 x 32 tokens and 1,024 negatives per worker reads about 290 distinct input rows of
512 and 870 distinct output rows of 1,536. Exact: every read gets its row, every owner
the sum of its rows' gradients. The bytes per step do not grow with V.

``fetch_rows`` / ``fetch_shared_rows`` are the plain forward lookups of one read (one
all-gather of ids and one all-to-all; one tiled all-gather for shared ids), used by the
pipelined step to fetch the next batch's rows.

Example:
    >>> from sparsecomm_jax.embedding import column
    >>> column.COLUMN.name, column.COLUMN.split_dim
    ('column', 1)

References:
    Li et al., "EmbRace: Accelerating Sparse Communication for Distributed Training of
    Deep Neural Networks", ICPP 2022.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.embedding.access import LOOKUP, HostReads, Read
from sparsecomm_jax.embedding.layout import (
    FLOAT,
    CapacityPolicy,
    Fetched,
    Layout,
    Price,
    Pricing,
    TableStats,
    both_ways,
    distinct_per_worker,
    grow_by_eighth,
    padded_slots,
)

F32 = jnp.float32


# ------------------------------------------------------------------ 1. plan the ids


def distinct_reads(reads: list[HostReads], tables, workers: int) -> dict[int, int]:
    """Per table, the most distinct ids any worker reads of it in the batch (host)."""
    first = reads[0]
    return {
        t.index: int(distinct_per_worker(first, t.index).max(initial=0))
        for t in tables
        if t.index in first
    }


def distinct_bound(reads: HostReads, table, workers: int) -> int:
    """Every id a worker reads (its lookups and the shared ones) distinct: min(n, V)."""
    look, common = reads[table.index]
    return min(look.shape[1] + common.size, table.vocab)


CAPACITY = CapacityPolicy(
    distinct_reads, "distinct rows of one table on one worker", grow_by_eighth, distinct_bound
)


# --------------------------------------------------------------------- 2. fetch rows


def _distinct(reads: list[Read], i: int, vocab: int, capacity: int):
    """This worker's distinct ids of table ``i`` (its reads in call order), padded with
    ``vocab`` to ``min(capacity, m)`` slots: ``(uniq int[C], slot int[m])``; ``slot[k]``
    is read ``k``'s place in ``uniq``, ``>= C`` where the capacity had no slot for it."""
    mine = jnp.concatenate([r.ids.reshape(-1) for r in reads if r.table == i])  # int[m]
    cap = min(capacity, mine.shape[0])
    return jnp.unique(mine, size=cap, fill_value=vocab, return_inverse=True)


def _every(plans: dict, travels: set, axis: str, num: int) -> dict[int, jax.Array]:
    """Per table, every worker's distinct ids, int[P, C]: one all-gather for the tables
    some worker looks up; a table read only through shared ids (the same on every worker)
    has the same distinct ids everywhere, which do not travel."""
    moved = [i for i in plans if i in travels]
    every = {
        i: jnp.broadcast_to(u, (num, u.shape[0])) for i, (u, _) in plans.items() if i not in travels
    }
    if moved:
        gathered = jax.lax.all_gather(
            jnp.concatenate([plans[i][0] for i in moved]), axis, to="invarying"
        )  # int[P, sum C]
        off = 0
        for i in moved:
            size = plans[i][0].shape[0]
            every[i], off = gathered[:, off : off + size], off + size
    return every


def fetch(
    shards, reads: list[Read], capacity: dict[int, int], axis: str, wire=comm_wire.DEFAULT
) -> Fetched:
    """Rows of every read of a step through one exchange of distinct rows.

    Use inside ``shard_map``. Each worker finds its own distinct ids of each table (one
    sort of its reads); one all-gather tells every owner every worker's distinct ids.

    Args:
      shards: table index -> float[V, D/P], this worker's columns.
      reads: the reads of these tables (``LOOKUP`` or ``SHARED``).
      capacity: table index -> C, slots for the distinct ids one worker reads of the
        table (``CAPACITY``); ids beyond it get NaN rows (never silently wrong).
      axis: the mesh axis.
      wire: the codecs rows (``forward``) and their gradients (``backward``) travel in.

    Returns:
      A ``Fetched``: its ``back(grads)`` gives, per table, this worker's columns of every
      worker's distinct ids (padding ids = V) and their gradients summed per worker.
    """
    num = jax.lax.axis_size(axis)
    order = list(dict.fromkeys(r.table for r in reads))  # tables in call order
    plans = {i: _distinct(reads, i, shards[i].shape[0], capacity[i]) for i in order}
    travels = {r.table for r in reads if r.kind == LOOKUP}
    every = _every(plans, travels, axis, num)  # table -> int[P, C]
    cols = [
        jnp.take(shards[i], every[i], axis=0, mode="fill", fill_value=0) for i in order
    ]  # per table float[P, C, D/P]: my columns of each worker's distinct rows
    got = comm_wire.a2a_rows(cols, axis, wire.forward)  # per table [P, C, D/P]
    table_rows, missed = {}, {}
    for i, block in zip(order, got, strict=True):
        (uniq, slot), width = plans[i], shards[i].shape[1]
        full = jnp.swapaxes(block, 0, 1).reshape(uniq.shape[0], num * width)  # [C, D]
        found = slot < uniq.shape[0]  # bool[m]
        rows = jnp.take(full, slot, axis=0, mode="fill", fill_value=0)  # float[m, D]
        table_rows[i] = jnp.where(found[:, None], rows, jnp.nan)
        missed[i] = ~jnp.all(found)
    plan = {i: (every[i], slot) for i, (_, slot) in plans.items()}
    return Fetched(_per_read(reads, table_rows), _backward(shards, reads, plan, axis, wire), missed)


def _per_read(reads: list[Read], table_rows: dict) -> list:
    out, pos = [], dict.fromkeys(table_rows, 0)
    for read in reads:
        i, n = read.table, read.ids.size
        out.append(table_rows[i][pos[i] : pos[i] + n].reshape(*read.ids.shape, -1))
        pos[i] += n
    return out


# ---------------------------------------------------------- 3. send row gradients back


def column_blocks(g, num: int):
    """float[n, D] -> float[P, n, D/P]: block j holds columns jD/P..(j+1)D/P."""
    return jnp.swapaxes(g.reshape(g.shape[0], num, -1), 0, 1)


def _backward(shards, reads: list[Read], plans: dict, axis: str, wire):
    num = jax.lax.axis_size(axis)

    def back(grads):
        blocks = []
        for i, (every, slot) in plans.items():
            full_width = shards[i].shape[1] * num
            g = jnp.concatenate(
                [
                    g.reshape(-1, full_width)
                    for read, g in zip(reads, grads, strict=True)
                    if read.table == i
                ]
            )  # float[m, D]
            cap = every.shape[1]  # slots >= C (ids beyond the capacity): dropped
            summed = jnp.zeros((cap, full_width), F32).at[slot].add(g, mode="drop")
            blocks.append(column_blocks(summed, num))  # float[P, C, D/P]
        got = comm_wire.a2a_rows(blocks, axis, wire.backward)  # per table [P, C, D/P]
        return [
            (i, (every.reshape(-1), rows.reshape(-1, rows.shape[-1])))  # [P*C], [P*C, D/P]
            for (i, (every, _)), rows in zip(plans.items(), got, strict=True)
        ]

    return back


# --------------------------------------------------------- plain lookups, attend


def fetch_rows(shard, ids, axis: str, take=None):
    """Rows of a column-sharded table for this worker's ``ids`` (inside ``shard_map``).

    Per worker (P=2, D=4, worker j holds columns 2j..2j+1; ids a on w0, b on w1)::

        before: w0 ids [a], shard T[:, 0:2]     w1 ids [b], shard T[:, 2:4]
        all_gather ids:   both see [[a], [b]]
        local take:       w0 [[T[a,0:2]], [T[b,0:2]]]   w1 [[T[a,2:4]], [T[b,2:4]]]
        all_to_all:       w0 [[T[a,0:2]], [T[a,2:4]]]   w1 [[T[b,0:2]], [T[b,2:4]]]
        after (concat):   w0 [T[a, :]]                  w1 [T[b, :]]

    Args:
      shard: float[V, D/P], this worker's columns.
      ids: int[...] this worker's ids.
      axis: the mesh axis.
      take: ``take(shard, ids) -> rows`` (default ``jnp.take``; the pipelined step reads
        through a patch of early updates).

    Returns:
      ``float[*ids.shape, D]``.
    """
    take = take or (lambda t, i: jnp.take(t, i, axis=0))
    flat = ids.reshape(-1)  # ids: int[n]
    all_ids = jax.lax.all_gather(flat, axis)  # int[P, n]
    cols = take(shard, all_ids)  # float[P, n, D/P]: my columns, every worker
    mine = jax.lax.all_to_all(cols, axis, 0, 0)  # float[P, n, D/P]: my tokens, P slices
    rows = jnp.moveaxis(mine, 0, 1).reshape(flat.shape[0], -1)  # float[n, D]
    return rows.reshape(*ids.shape, rows.shape[-1])


def fetch_shared_rows(shard, ids, axis: str, take=None):
    """Rows for ids that every worker holds identically (e.g. shared negatives).

    No id exchange is needed: each worker takes its columns and one tiled all-gather
    concatenates them (before: w_j holds ``T[ids, cols_j]``; after: all hold
    ``T[ids, :]``).
    """
    take = take or (lambda t, i: jnp.take(t, i, axis=0))
    cols = take(shard, ids)  # float[*ids, D/P]
    return jax.lax.all_gather(cols, axis, axis=cols.ndim - 1, tiled=True)


def attend(shard, h, axis: str):
    """``h @ table.T`` on the gathered table (float32: a full softmax is differentiated
    through this gather, whose transpose is a reduce-scatter to the owners)."""
    return h @ jax.lax.all_gather(shard, axis, axis=1, tiled=True).T


def price(
    stats: TableStats, workers: int, link, slots: int, wire: comm_wire.Wire = comm_wire.DEFAULT
) -> Price:
    """One table column-wise, for one worker per step: its C ids to every owner (4 bytes
    each) and C rows of D/P columns each way, ``(P-1) C (4 + 2 D b / P)`` bytes, C =
    ``stats.distinct`` padded as the buffers are (``CAPACITY.grow``: 12.5% more, a
    multiple of 8; D padded to a multiple of P; ``b`` the bytes of a value in the
    ``wire``'s codecs, plus a scale per row of D/P for FP8); memory its columns, 1/P of
    the table and its optimizer state.

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> price(TableStats("t", 1000, 8, 64, 10, 4), 4, Link(0.0, 1.0), 0).bytes  # C = 16
        960.0
    """
    p, padded = workers, -(-stats.dim // workers) * workers
    c = padded_slots(CAPACITY.grow, stats.distinct)
    nbytes = float((p - 1) * c * (4 + both_ways(padded // p, wire)))
    memory = stats.vocab * padded / p * FLOAT * (1 + slots)
    return Price(nbytes, nbytes * link.beta, memory)


PRICING = Pricing(price, messages=lambda workers: 3 * (workers - 1))

COLUMN = Layout(
    name="column",
    spec=lambda axis: P(None, axis),
    split_dim=1,
    capacity=CAPACITY,
    fetch=fetch,
    attend=attend,
    sum_dense=lambda g, axis: g,  # the gather's transpose already summed it
    row_specs=lambda axis: (P(), P(None, axis)),  # every worker's distinct ids, my columns
    pricing=PRICING,
)
