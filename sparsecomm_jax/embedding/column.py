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

**Pipelined** (``PIPELINED``, ``embrace_2d``'s carrier ``CARRIER``): a column table's
gradient travels position by position in priority chunks (``embedding.priority``): first
the positions whose id batch t+1 reads (every carried table's first chunk before any
later one), then those t+2 reads, t+3, ..., in late chunks sized by the cost model
(``priority.late_capacities``); each chunk is one all-to-all of its rows' column slices
(``column_chunk_rows``; a shared lookup's by one reduce-scatter, ``column_shared_rows``).
Batch t+1's rows are read by ``fetch_rows`` with the early update added, and carried.

Example:
    >>> from sparsecomm_jax.embedding import column
    >>> column.COLUMN.name, column.COLUMN.split_dim
    ('column', 1)

References:
    Li et al., "EmbRace: Accelerating Sparse Communication for Distributed Training of
    Deep Neural Networks", ICPP 2022.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.comm.order import waits_for
from sparsecomm_jax.embedding import priority
from sparsecomm_jax.embedding.access import LOOKUP, HostReads, Read
from sparsecomm_jax.embedding.layout import (
    FLOAT,
    CapacityPolicy,
    Carrier,
    Carrying,
    Fetched,
    Layout,
    Pipelined,
    Price,
    Pricing,
    TableStats,
    both_ways,
    distinct_per_worker,
    grow_with_margin,
    padded_slots,
    patched_take,
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
    distinct_reads, "distinct rows of one table on one worker", grow_with_margin, distinct_bound
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
    ``stats.distinct`` padded as the buffers are (``CAPACITY.grow``: its margin for the
    batches after the first, ``layout.grow_with_margin``; D padded to a multiple of P;
    ``b`` the bytes of a value in the ``wire``'s codecs, plus a scale per row of D/P for
    FP8); memory its columns, 1/P of the table and its optimizer state.

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> price(TableStats("t", 1000, 8, 64, 10, 4), 4, Link(0.0, 1.0), 0).bytes  # C = 20
        1200.0
    """
    p, padded = workers, -(-stats.dim // workers) * workers
    c = padded_slots(CAPACITY.grow, stats.distinct)
    nbytes = float((p - 1) * c * (4 + both_ways(padded // p, wire)))
    memory = stats.vocab * padded / p * FLOAT * (1 + slots)
    return Price(nbytes, nbytes * link.beta, memory)


# ------------------------------------------------- pipelined: chunks in priority order


def column_chunk_rows(grads, ids, order, bounds: tuple[int, int], axis_name: str):
    """One chunk of the column-wise gradient exchange, as (id, row) pairs at the owner.

    Per worker (P=2, D=4, chunk of 1 position; w0 sends its row for id a, w1 for id b)::

        before:     w0 g_a[0:4]                 w1 g_b[0:4]
        all_to_all: w0 [g_a[0:2], g_b[0:2]]     w1 [g_a[2:4], g_b[2:4]]
        after:      owner j holds (a, g_a[my cols]), (b, g_b[my cols])

    Args:
      grads: float[n, D], this worker's per-position gradient rows.
      ids: int[P, n], every worker's ids (known to all after the forward exchange).
      order: int[P, n], every worker's ``priority.priority_order``.
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
      order: int[N], their ``priority.priority_order`` (the same on every worker).
      bounds: ``[start, end)`` of the chunk in that order.
      axis_name: the mesh axis.

    Returns:
      ``(ids int[c], rows float[c, D/P])``.
    """
    pos = order[bounds[0] : bounds[1]]
    g = jnp.take(grads, pos, axis=0)  # float[c, D]
    return jnp.take(ids, pos), jax.lax.psum_scatter(g, axis_name, scatter_dimension=1, tiled=True)


class ChunkPlan(NamedTuple):
    """A column table's gradient exchange in priority order (``priority``)."""

    rows: Any  # float[n, D]: this worker's gradient per looked-up position
    ids: Any  # int[P, n]: every worker's ids at those positions
    order: Any  # int[P, n]: every worker's priority order
    chunks: list  # [start, end) of each chunk in that order
    shared: list  # [] or [Shared]: the lookups whose ids every worker holds
    next_ids: Any = None  # int[m]: every id batch t+1 reads of the table (all workers)


class Shared(NamedTuple):
    """A lookup whose ids every worker holds (e.g. shared negatives), in priority
    chunks like the other positions: the rows batch t+1 reads first."""

    rows: Any  # float[N, D]: this worker's gradient per position
    ids: Any  # int[N]: the same on every worker
    order: Any  # int[N]: priority order (the same on every worker)
    chunks: list  # [start, end) of each chunk in that order


def chunk_plan(where: Carrying, reads, g_rows, future, capacity: int, i: int):
    """``(ChunkPlan, spill)`` of table ``i``: its positions sorted by when their id is next
    read (batch t+1's first: the first chunk; then t+2's, ...; ``future`` the reads of
    t+1, t+2, ..., or empty at the last step); later chunks sized by the cost model.
    ``spill``: this worker holds a position batch t+1 reads that does not fit."""
    ids, rows, shared = [], [], []
    for read, g in zip(reads, g_rows, strict=True):
        if read.table == i and read.kind == LOOKUP:
            ids.append(read.ids.reshape(-1))
            rows.append(g.reshape(read.ids.size, -1))
        elif read.table == i:
            shared.append((g.reshape(read.ids.size, -1), read.ids.reshape(-1)))
    # int[P, n], the same on every worker (typed so: a row state such as a per-row step
    # count, indexed by these ids, stays replicated)
    all_ids = jax.lax.all_gather(jnp.concatenate(ids), where.axis, to="invarying")
    rows, n = jnp.concatenate(rows), all_ids.shape[1]
    if shared:  # every shared lookup of the table, as one list of positions
        shared = [
            (jnp.concatenate([g for g, _ in shared]), jnp.concatenate([s for _, s in shared]))
        ]
    if not future:  # last step: nothing to prioritise
        order = jnp.broadcast_to(jnp.arange(n), all_ids.shape)
        shared = [Shared(g, s, jnp.arange(s.size), [(0, s.size)]) for g, s in shared]
        return ChunkPlan(rows, all_ids, order, [(0, n)], shared, None), jnp.array(False)
    fut = priority.future_ids(future, i, where.batch_axes)  # every group's: any may read next
    levels = priority.next_use_levels(all_ids, fut)
    spill = priority.overflows(levels[jax.lax.axis_index(where.axis)], capacity)  # local
    sizes = priority.late_capacities(n, capacity, rows.shape[1], where.workers)
    plans = [_shared_plan(where, g, s, fut, capacity) for g, s in shared]
    spill = functools.reduce(jnp.logical_or, [s for _, s in plans], spill)
    order = priority.priority_order(levels)
    bounds, shared = priority.chunk_bounds(n, sizes), [p for p, _ in plans]
    return ChunkPlan(rows, all_ids, order, bounds, shared, fut[0]), spill


def _shared_plan(where: Carrying, g, ids, future: list, capacity: int):
    """``(Shared, spill)``: the shared positions batch t+1 reads go first (at most
    ``capacity`` of them, else ``spill``), the others late, in next-use order."""
    levels = priority.next_use_levels(ids, future)  # the same on every worker
    n = ids.shape[0]
    sizes = priority.late_capacities(n, capacity, g.shape[1], where.workers)
    plan = Shared(g, ids, priority.priority_order(levels), priority.chunk_bounds(n, sizes))
    return plan, priority.overflows(levels, capacity)


def _plans(where: Carrying, shards, reads, g_rows, future, slots):
    """``Carrier.plan``: every column table's ``ChunkPlan``; ``spill`` of any."""
    planned = {
        i: chunk_plan(where, reads, g_rows, future, slots.get(i, 0), i) for i in sorted(shards)
    }
    spill = functools.reduce(jnp.logical_or, [s for _, s in planned.values()], jnp.array(False))
    return {i: plan for i, (plan, _) in planned.items()}, spill


def first_pairs(where: Carrying, plan: ChunkPlan) -> list:
    """The first chunk and the first shared positions of a table, as (ids, rows) pairs
    of my columns from every worker (ids int[m], rows float[m, D/P])."""
    axis = where.axis
    pairs = [column_chunk_rows(plan.rows, plan.ids, plan.order, plan.chunks[0], axis)]
    for s in plan.shared:
        pairs.append(column_shared_rows(s.rows, s.ids, s.order, s.chunks[0], axis))
    return pairs


def later_pairs(where: Carrying, plan: ChunkPlan, after) -> list:
    """The remaining chunks' pairs, issued only once ``after`` (every table's first
    chunk) has arrived."""
    rows, axis = waits_for(plan.rows, after), where.axis
    out = [column_chunk_rows(rows, plan.ids, plan.order, bound, axis) for bound in plan.chunks[1:]]
    for s in plan.shared:
        g = waits_for(s.rows, after)
        out += [column_shared_rows(g, s.ids, s.order, b, axis) for b in s.chunks[1:]]
    return out


def _firsts(where: Carrying, plans: dict):
    """``Carrier.first``: every table's first chunk (its position-wise spill was the
    plan's)."""
    return {i: first_pairs(where, p) for i, p in plans.items()}, plans, jnp.array(False)


def _laters(where: Carrying, plans: dict, after):
    """``Carrier.later``: every table's late chunks (a position never misses a slot)."""
    return {i: later_pairs(where, p, after) for i, p in plans.items()}, {}


def _fetch_carried(where: Carrying, shards, reads, slots, patches=None) -> list:
    """``Carrier.fetch``: each read's rows by its own exchange (``fetch_rows``, or
    ``fetch_shared_rows`` for ids every worker holds), through ``patches``."""
    out = []
    for read in reads:
        take = None if patches is None else functools.partial(_patched, patch=patches[read.table])
        fetch = fetch_rows if read.kind == LOOKUP else fetch_shared_rows
        out.append(fetch(shards[read.table], read.ids, where.axis, take))
    return out


def _patched(shard, ids, patch):
    return patched_take(shard, patch, ids)


def shared_parts(plan: ChunkPlan) -> tuple:
    """``(rows float[N, D], ids int[N], order int[N])`` of a plan's shared positions
    (N = 0 without any)."""
    if not plan.shared:
        empty = jnp.zeros(0, jnp.int32)
        return jnp.zeros((0, plan.rows.shape[1]), plan.rows.dtype), empty, empty
    return tuple(plan.shared[0][:3])


def _hand_over(plan: ChunkPlan) -> tuple:
    """``Carrier.hand_over``: the rows, ids, order and shared parts a later program needs
    (its chunk bounds are static: ``_take_over`` recomputes them)."""
    return plan.rows, plan.ids, plan.order, shared_parts(plan)


def _hand_specs(axis: str) -> tuple:
    per, rep = P(axis), P()
    return per, rep, rep, (per, rep, rep)


def _take_over(where: Carrying, handed, capacity: int, last: bool) -> ChunkPlan:
    """``Carrier.take_over``: the ``ChunkPlan`` again (the same chunk sizes as the first
    program's)."""
    rows, ids, order, (g, shared_ids, shared_order) = handed

    def bounds(n, width):
        sizes = [n] if last else priority.late_capacities(n, capacity, width, where.workers)
        return priority.chunk_bounds(n, sizes)

    shared = []
    if shared_ids.size:
        shared = [Shared(g, shared_ids, shared_order, bounds(shared_ids.shape[0], g.shape[1]))]
    return ChunkPlan(rows, ids, order, bounds(rows.shape[0], rows.shape[1]), shared)


#: The column tables' carried exchange: positions in priority chunks, one all-to-all a
#: chunk a table, batch t+1's rows by each read's own exchange.
CARRIER = Carrier(
    _plans,
    _firsts,
    _laters,
    _fetch_carried,
    hand_over=_hand_over,
    hand_specs=_hand_specs,
    take_over=_take_over,
    empty_reads=False,  # a table's positions are planned from its reads
)

#: How ``embrace_2d`` carries a column table: its first-chunk positions planned on the
#: host (``priority.PRIORITY_CAPACITY``), by ``CARRIER``, its columns read whole.
PIPELINED = Pipelined(lambda policy: priority.PRIORITY_CAPACITY, CARRIER, unpadded=True)


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
    pipelined=PIPELINED,
)
