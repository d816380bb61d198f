"""EmbRace's 2D scheduling as a train step: ``embrace_2d``.

One pipelined step (batch t, with batches t+1..t+``LOOKAHEAD`` known), for column-wise
tables (row-wise ones below):

1. **exchange** (one ``shard_map``): batch t's forward and backward read rows fetched
   during step t-1 (or now, at the first step); the dense layers go through the
   aggregator; each table's gradient rows travel in priority chunks, position by
   position (the shared negatives' too): first the positions batch t+1 reads (every
   table's first chunk before any later one), then those t+2 reads, t+3, ..., in late
   chunks sized by the alpha-beta cost model (``priority.late_capacities``);
2. **early update**: the optimizer on the row view of the first chunk alone gives the
   update of the rows batch t+1 reads (exact for optimizers that treat rows
   independently: all of those rows' gradient is in the first chunk);
3. **next rows** (one ``shard_map``): batch t+1's rows, read from the tables with that
   update added (``patched_take``), never a copy of a table;
4. **the update** of every parameter, as ``embrace`` makes it (dense or row-sparse);
5. **the guard** (one ``shard_map``): a row batch t+1 reads that missed the first chunk,
   or a skipped step, makes the step fetch the next rows again from the final tables
   (exact, slower).

Row-wise and hot tables (``table_layouts``) are pipelined too (``schedule.rowwise``):
their gradient travels to the owners in two chunks, the positions batch t+1 reads first
and the rest once every first chunk has arrived (the lookups of every such table in
one exchange), and batch t+1's rows are fetched from the owners with the early update
added, then carried. A hot table's cold rows travel so; its hot rows are read where
they are at the start of each step (the step's update moves them, never early), and
their all-reduce goes with the late chunks. Table-wise and replicated tables run beside
the pipelined ones: their rows are fetched in step t's exchange, before the forward
pass, through their layout, and their gradients return after every first chunk, as
``embrace`` reads them (``carried_tables``).

With replica groups (``replicas=R``) each group exchanges its chunks within itself;
the priorities are those of every group's next batches (a row any group reads next
goes first everywhere), and each table's first chunks, then its later ones, are summed
across the groups (``replicas.sum_tables``), so the early update sees the whole gradient
of the rows it moves.

Equal to ``embrace`` with the same table update. The dense layers have no data
dependency on the table exchange, so an accelerator's scheduler may overlap them.

The schedule pays only by hiding communication behind compute. Where a program's
collectives cannot run beside its compute (``StepContext.overlap`` false: XLA:CPU runs
a program's thunks one after the other), the early chunk, the early update and the
second fetch can only add time, so ``make_train_step`` does not build this program
there: ``embrace``'s step runs, every row in one exchange after the backward pass,
under this strategy's rules (``registry.Strategy.serial``; ``collectives_overlap=True``
builds this program anyway).

References:
    Li et al., "EmbRace", ICPP 2022, section 4.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm.vma import vary
from sparsecomm_jax.embedding import access, column, hot, replicas, row
from sparsecomm_jax.embedding.gradients import fetch_all, outside
from sparsecomm_jax.embedding.layout import CapacityPolicy
from sparsecomm_jax.embedding.row_optimizers import RowGrad, row_updates, treats_rows_alone
from sparsecomm_jax.embedding.tables import split_tables
from sparsecomm_jax.embedding.update import row_gradient
from sparsecomm_jax.schedule import chunks, priority, rowwise
from sparsecomm_jax.step import finish, placement
from sparsecomm_jax.step.finish import Gradients, aggregate, apply_gradients
from sparsecomm_jax.step.placement import PlacedBatch
from sparsecomm_jax.step.state import StepContext, TrainState

NO_ATTEND_2D = (
    "embrace_2d needs tables that are read by lookups only; a full softmax over a table "
    "(emb.attend) needs the whole updated table before the next step: use a sampled "
    "softmax (models: --sampled-softmax N)"
)


def waits_for(x, after, same_over: str | None = None):
    """``x``, made to wait for every array in ``after``: a real data edge ``x + (a - a)``
    with ``a`` the sum of one element of each (``edge``). (XLA:CPU drops
    ``optimization_barrier`` before scheduling, and does not fold ``a - a`` for floats;
    ``a`` is made finite, so this adds exactly zero: a NaN row of the next batch, such
    as an id outside its table reads, leaves this step's values alone.)"""
    a = edge(after, same_over)
    return x + (a - a).astype(x.dtype)


def edge(after, same_over: str | None = None) -> jax.Array:
    """float32[]: the sum of one element of every array in ``after`` (0 where that is not
    finite), for ``waits_for``.

    ``same_over``: a mesh axis the waiting values are the same over while ``after`` is
    not (the replica groups): the sum is reduced over it (a scalar all-reduce), so
    they stay typed the same over it."""
    leaves = [leaf for leaf in jax.tree.leaves(after) if leaf.size]  # an empty one: nothing
    firsts = [leaf.reshape(-1)[0].astype(jnp.float32) for leaf in leaves]
    a = sum(firsts, jnp.zeros((), jnp.float32))
    a = jnp.where(jnp.isfinite(a), a, 0.0)  # a NaN row read next must not reach this step
    return jax.lax.pmax(a, same_over) if same_over is not None else a


def pipelined_reads(ctx: StepContext, params, data, attend_error: str = "") -> list:
    """``ctx.reads``, refusing a read of no ids (a bag of width 0) of a column-wise table
    the pipeline carries: it plans each such table's positions from its reads and has
    none to plan (``embrace`` takes it, as do the row-wise and hot tables, which send
    nothing for it, and the tables read within the step)."""
    reads = ctx.reads(params, data, attend_error)
    columns = carried_tables(ctx) - row_wise(ctx)
    tables = {t.index: t.name for t in ctx.tables if t.index in columns}
    if empty := sorted({tables[r.table] for r in reads if r.ids.size == 0 and r.table in tables}):
        raise ValueError(
            f"tables {empty} are read with no ids (a bag of width 0): the pipelined step "
            "(embrace_2d, make_overlapped) cannot plan such a read; use embrace"
        )
    return reads


def first_chunk(layout_policy) -> CapacityPolicy:
    """A column-wise table's plan of the ids in the pipeline: its first chunk's
    positions (``priority.PRIORITY_CAPACITY``, in place of the layout's)."""
    del layout_policy
    return priority.PRIORITY_CAPACITY


#: The layouts whose tables the pipeline carries across steps, each with its plan of
#: their ids (capacity), made from the layout's own: a column-wise table's first chunk
#: (``priority``), a row-wise or hot table's buckets for two batches (``rowwise``; a
#: hot table's cold rows).
CARRIED_CAPACITY = {
    column.COLUMN.name: first_chunk,
    row.ROW.name: rowwise.two_batches,
    hot.HOT.name: rowwise.two_batches,
}


def carried_tables(ctx: StepContext) -> set[int]:
    """The tables whose rows the pipeline carries across steps: the column-wise,
    row-wise and hot ones (``CARRIED_CAPACITY``; a hot table's cold rows). The others
    (table-wise, replicated) are read through their layouts within the step
    (``step_rows``)."""
    return {t.index for t in ctx.tables if t.layout.name in CARRIED_CAPACITY}


def row_wise(ctx: StepContext) -> set[int]:
    """The carried tables exchanged row-wise (``schedule.rowwise``): the row-wise and
    hot ones; the others are column-wise."""
    return {t.index for t in ctx.tables if t.layout.name in (row.ROW.name, hot.HOT.name)}


def hot_tables(ctx: StepContext) -> dict[int, hot.HotRows]:
    """The carried hot tables' ``HotRows`` (where each id lives, on a group's devices)."""
    return {
        t.index: hot.rows_of(t, ctx.group_size) for t in ctx.tables if t.layout.name == hot.HOT.name
    }


def exchanged(ctx: StepContext, read):
    """``read`` as the row-wise exchange sees it: a hot table's ids as their stored rows
    where cold, -1 (no row asked) where hot (``hot.split_ids``); another table's as it is."""
    rows_of = hot_tables(ctx)
    if read.table not in rows_of:
        return read
    return read._replace(ids=hot.split_ids(rows_of[read.table], read.ids)[2])


def with_hot_rows(ctx: StepContext, read, got, shard):
    """A hot table's rows for ``read``: the carried cold rows (zero where hot) with the hot
    rows read from this worker's block of ``shard``, as the step's tables hold them (a
    hot row is updated by the step's update, never early); another table's ``got``."""
    rows_of = hot_tables(ctx)
    if read.table not in rows_of:
        return got
    is_hot, at, _ = hot.split_ids(rows_of[read.table], read.ids)
    near = jnp.take(shard, at, axis=0, mode="fill", fill_value=0)
    return jnp.where(is_hot[..., None], near.astype(got.dtype), got)


def carried_reads(ctx: StepContext, reads: list) -> list:
    """The reads of ``reads`` whose rows the pipeline carries (``carried_tables``)."""
    carried = carried_tables(ctx)
    return [r for r in reads if r.table in carried]


def step_rows(ctx: StepContext, carry, reads: list, leaves: list, slots: dict[int, int]):
    """Every read's rows for the step's forward pass: a carried table's (column-wise,
    row-wise, hot) carried from step t-1 (or fetched now, at the first step; a hot
    table's hot rows read here), another layout's fetched now through that layout
    (``gradients.fetch_all``).

    Returns:
      ``(rows, back, missed)``: per read ``float[*ids.shape, D]``; ``back(g_rows)`` ->
      ``[(table index, (ids, rows)), ...]``, the other layouts' gradients at their
      owners (``g_rows`` every read's); table index -> ``missed`` flag (the other
      layouts' ``Fetched.missed``, and a carried table's id outside it).
    """
    carried = carried_tables(ctx)
    mine = [k for k, r in enumerate(reads) if r.table in carried]
    others = [k for k, r in enumerate(reads) if r.table not in carried]
    if carry != ():
        got = list(carry)
    else:
        tables = {i: leaves[i] for i in carried}
        got = prefetch(ctx, tables, [reads[k] for k in mine], slots)
    got = [
        with_hot_rows(ctx, reads[k], g, leaves[reads[k].table])
        for k, g in zip(mine, got, strict=True)
    ]
    rows = dict(zip(mine, got, strict=True))
    back, missed = (lambda g_rows: []), {}
    if others:
        tables = tuple(t for t in ctx.tables if t.index not in carried)
        read = [reads[k] for k in others]
        got, back_of, missed = fetch_all(tables, leaves, read, slots, ctx.axis_name, ctx.wire)
        rows.update(zip(others, got, strict=True))

        def back(g_rows):
            return back_of([g_rows[k] for k in others])

    # an id the model computes outside a carried table (the host checks the batch's):
    # the step is marked, as the layouts' own fetch marks it
    missed = or_flags(missed, outside(ctx.tables, [reads[k] for k in mine]))
    return [rows[k] for k in range(len(reads))], back, missed


def or_flags(flags: dict, more: dict) -> dict:
    """Table index -> bool[]: ``flags`` or'ed with ``more``, table by table."""
    out = dict(flags)
    for i, flag in more.items():
        out[i] = out[i] | flag if i in out else flag
    return out


def prefetch(
    ctx: StepContext, tables: dict[int, Any], reads: list, slots: dict[int, int], patches=None
) -> list:
    """Rows for each logged read of a carried table, from ``tables``: a column-wise
    table's by its exchange, the row-wise and hot tables' lookups by one exchange for
    all of them (``rowwise.fetch``; ``slots`` their capacities; a hot table's cold rows,
    zero where hot: ``with_hot_rows`` reads those in the step). With ``patches`` (table
    index -> ``RowGrad``) each row is read with its early update added
    (``patched_take``). Typed as varying over the batch axes, as the carry is."""
    axis, by_rows = ctx.axis_name, row_wise(ctx)
    out: list = [None] * len(reads)
    for k, read in enumerate(reads):
        if read.table in by_rows:
            continue
        take = (
            None if patches is None else functools.partial(_take_patched, patch=patches[read.table])
        )
        fetch = column.fetch_rows if read.kind == access.LOOKUP else column.fetch_shared_rows
        out[k] = fetch(tables[read.table], read.ids, axis, take)
    mine = [k for k, r in enumerate(reads) if r.table in by_rows]
    if mine:
        takes = None
        if patches is not None:
            takes = {i: functools.partial(_take_patched_rows, patch=patches[i]) for i in by_rows}
        exchange = [exchanged(ctx, reads[k]) for k in mine]
        got = rowwise.fetch(tables, exchange, slots, axis, takes)
        for k, rows in zip(mine, got, strict=True):
            out[k] = rows
    return vary(out, ctx.batch_axes)  # a sum over the workers (shared ids) is typed the same


# ----------------------------------------------------------- 1. the exchange


class Plan(NamedTuple):
    """Table ``i``'s gradient exchange in priority order (``priority``)."""

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


def exchange_plan(ctx: StepContext, reads, g_rows, future, capacity: int, i: int):
    """``(Plan, spill)`` of table ``i``: its positions sorted by when their id is next
    read (batch t+1's first: the first chunk; then t+2's, ...; ``future`` the logged
    reads of t+1, t+2, ..., or empty at the last step); later chunks sized by the cost
    model. ``spill``: this worker holds a position batch t+1 reads that does not fit."""
    axis = ctx.axis_name
    ids, rows, shared = [], [], []
    for read, g in zip(reads, g_rows, strict=True):
        if read.table == i and read.kind == access.LOOKUP:
            ids.append(read.ids.reshape(-1))
            rows.append(g.reshape(read.ids.size, -1))
        elif read.table == i:
            shared.append((g.reshape(read.ids.size, -1), read.ids.reshape(-1)))
    # int[P, n], the same on every worker (typed so: a row state such as a per-row step
    # count, indexed by these ids, stays replicated)
    all_ids = jax.lax.all_gather(jnp.concatenate(ids), axis, to="invarying")
    rows, n = jnp.concatenate(rows), all_ids.shape[1]
    if shared:  # every shared lookup of the table, as one list of positions
        shared = [
            (jnp.concatenate([g for g, _ in shared]), jnp.concatenate([s for _, s in shared]))
        ]
    if not future:  # last step: nothing to prioritise
        order = jnp.broadcast_to(jnp.arange(n), all_ids.shape)
        shared = [Shared(g, s, jnp.arange(s.size), [(0, s.size)]) for g, s in shared]
        return Plan(rows, all_ids, order, [(0, n)], shared, None), jnp.array(False)
    fut = _future_ids(future, i, ctx.batch_axes)  # every group's: any may read a row next
    levels = priority.next_use_levels(all_ids, fut)
    spill = priority.overflows(levels[jax.lax.axis_index(axis)], capacity)  # local
    sizes = priority.late_capacities(n, capacity, rows.shape[1], ctx.num_workers)
    plans = [_shared_plan(ctx, g, s, fut, capacity) for g, s in shared]
    spill = functools.reduce(jnp.logical_or, [s for _, s in plans], spill)
    order = priority.priority_order(levels)
    bounds, shared = priority.chunk_bounds(n, sizes), [p for p, _ in plans]
    return Plan(rows, all_ids, order, bounds, shared, fut[0]), spill


def _shared_plan(ctx: StepContext, g, ids, future: list, capacity: int):
    """``(Shared, spill)``: the shared positions batch t+1 reads go first (at most
    ``capacity`` of them, else ``spill``), the others late, in next-use order."""
    levels = priority.next_use_levels(ids, future)  # the same on every worker
    n = ids.shape[0]
    sizes = priority.late_capacities(n, capacity, g.shape[1], ctx.num_workers)
    chunk_bounds = priority.chunk_bounds(n, sizes)
    plan = Shared(g, ids, priority.priority_order(levels), chunk_bounds)
    return plan, priority.overflows(levels, capacity)


def _future_ids(future: list, i: int, axis) -> list:
    """Per future batch, int[m]: every id its logged reads read of table ``i`` (all
    workers of ``axis``, with replica groups both axes: a row any group reads next goes
    first in every group; one all-gather for all the batches' lookups)."""
    local = [
        [r.ids.reshape(-1) for r in reads if r.table == i and r.kind == access.LOOKUP]
        for reads in future
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
        shared = [r.ids.reshape(-1) for r in reads if r.table == i and r.kind == access.SHARED]
        out.append(jnp.concatenate([every[:, bounds[k] : bounds[k + 1]].reshape(-1), *shared]))
    return out


def row_plan(ctx: StepContext, reads, g_rows, future, capacity: int, i: int, shard):
    """``rowwise.RowPlan`` of row-wise table ``i``: its reads of batch t and their
    gradients, and every id batch t+1 reads of it on every worker (every group's)."""
    mine = [k for k, r in enumerate(reads) if r.table == i]
    fut = _future_ids(future[:1], i, ctx.batch_axes)[0] if future else None  # t+1 alone
    rows_of = hot_tables(ctx)
    if fut is not None and i in rows_of:  # batch t+1's cold rows, as stored
        fut = hot.split_ids(rows_of[i], fut)[2]
    got = [exchanged(ctx, reads[k]) for k in mine], [g_rows[k] for k in mine]
    return rowwise.plan(*got, fut, capacity, shard.shape[0], ctx.axis_name)


def first_pairs(ctx: StepContext, plan: Plan) -> list:
    """The first chunk and the first shared positions of a table, as (ids, rows) pairs
    of my columns from every worker (ids int[m], rows float[m, D/P])."""
    axis = ctx.axis_name
    pairs = [chunks.column_chunk_rows(plan.rows, plan.ids, plan.order, plan.chunks[0], axis)]
    for s in plan.shared:
        pairs.append(chunks.column_shared_rows(s.rows, s.ids, s.order, s.chunks[0], axis))
    return pairs


def later_pairs(ctx: StepContext, plan: Plan, after) -> list:
    """The remaining chunks' pairs, issued only once ``after`` (every table's first
    chunk) has arrived."""
    rows, axis = waits_for(plan.rows, after), ctx.axis_name
    out = [
        chunks.column_chunk_rows(rows, plan.ids, plan.order, bound, axis)
        for bound in plan.chunks[1:]
    ]
    for s in plan.shared:
        g = waits_for(s.rows, after)
        out += [chunks.column_shared_rows(g, s.ids, s.order, b, axis) for b in s.chunks[1:]]
    return out


def across_groups(ctx: StepContext, pairs: dict[int, list], tables: dict) -> dict[int, list]:
    """With replica groups, each table's pairs summed over the groups
    (``replicas.sum_tables``: the first chunks in one exchange, the later ones in
    another); without, ``pairs``. A group's first chunk holds every row any group reads
    next (``_future_ids``), so their sum is the whole gradient of those rows."""
    if not ctx.replica_axis:
        return pairs
    rows = {i: tables[i].shape[0] for i in pairs}
    return replicas.sum_tables(pairs, rows, ctx.replica_axis, ctx.replica_sync)


def hot_pairs(ctx: StepContext, reads, g_rows, tables, after, later: dict) -> dict[int, list]:
    """The carried hot tables' late pairs (``later``) with their hot rows' gradients
    added: summed over the workers (``hot.hot_gradients``, one all-reduce), sent once
    ``after`` (every first chunk) has arrived."""
    rows_of, out = hot_tables(ctx), {}
    mine = [k for k, r in enumerate(reads) if r.table in rows_of]
    if not mine:
        return out
    at = [hot.split_ids(rows_of[reads[k].table], reads[k].ids)[1] for k in mine]
    grads = [waits_for(g_rows[k], after) for k in mine]
    summed = hot.hot_gradients(
        rows_of, [reads[k] for k in mine], at, grads, tables, ctx.axis_name, ctx.wire.backward
    )
    for i, pair in summed:
        out[i] = [*later[i], pair]
    return out


def in_step_pairs(back, g_rows: list, after) -> dict[int, list]:
    """The gradients of the tables read within the step (``step_rows``) at their
    owners, table index -> pairs, sent once ``after`` (every carried table's first
    chunk) has arrived."""
    pairs: dict[int, list] = {}
    for i, pair in back([waits_for(g, after) for g in g_rows]):
        pairs.setdefault(i, []).append(pair)
    return pairs


def carried_plans(ctx: StepContext, reads, g_rows, future, slots, tables) -> tuple[dict, Any]:
    """Every carried table's plan: ``(table index -> Plan or rowwise.RowPlan, spill)``;
    ``spill`` bool[], a column-wise table's position batch t+1 reads did not fit its
    first chunk."""
    by_rows = row_wise(ctx)
    planned = {
        i: exchange_plan(ctx, reads, g_rows, future, slots.get(i, 0), i)
        for i in sorted(carried_tables(ctx) - by_rows)
    }
    rows = {
        i: row_plan(ctx, reads, g_rows, future, slots[i], i, tables[i]) for i in sorted(by_rows)
    }
    spill = functools.reduce(jnp.logical_or, [s for _, s in planned.values()], jnp.array(False))
    return {i: plan for i, (plan, _) in planned.items()} | rows, spill


def chunks_of(ctx: StepContext, plans: dict, spill, tables) -> tuple[dict, dict, dict, Any]:
    """Every carried table's chunks at the owners (summed across replica groups): the
    first chunks (column-wise tables' by position, the row-wise and hot ones' in one
    exchange), then the late ones, which wait for every first chunk.

    Returns:
      ``(firsts, later, missed, spill)``: table index -> first-chunk pairs, -> late pairs
      (before the groups' sum: the caller adds the other tables'), -> bool[] a late
      position found no slot; ``spill`` with the row-wise first chunks' misses added.
    """
    by_rows = {i: p for i, p in plans.items() if isinstance(p, rowwise.RowPlan)}
    columns = {i: p for i, p in plans.items() if i not in by_rows}
    with jax.named_scope(priority.SCOPE_HIGH):
        firsts = {i: first_pairs(ctx, p) for i, p in columns.items()}
        row_firsts, sent = rowwise.first_pairs(by_rows, ctx.axis_name)
        firsts = across_groups(ctx, firsts | row_firsts, tables)
    flags = [rowwise.spill(p, sent[i]) for i, p in by_rows.items()]
    spill = functools.reduce(jnp.logical_or, flags, spill)
    with jax.named_scope(priority.SCOPE_LOW):
        after = tuple(rows for pairs in firsts.values() for _, rows in pairs)
        later = {i: later_pairs(ctx, p, after) for i, p in columns.items()}
        late = {  # ids and rows wait for every first chunk
            i: p._replace(ids=waits_for(p.ids, after), grads=waits_for(p.grads, after))
            for i, p in by_rows.items()
        }
        row_later, missed = rowwise.later_pairs(late, sent, ctx.axis_name)
    return firsts, later | row_later, missed, spill


class Exchanged(NamedTuple):
    """What the exchange program hands on (global arrays once out of ``shard_map``)."""

    grads: Gradients  # loss, finite flag, the step's mean gradient, agg_state, missed
    firsts: dict  # carried table index -> RowGrad: the first chunk's mean gradient
    spill: jax.Array  # on every worker: a row batch t+1 reads missed the first chunk


def exchange_body(ctx: StepContext):
    """Step 1 per worker: forward/backward on the carried rows (and the rows of the
    tables read within the step), the dense layers' aggregation, every carried table's
    first chunk (column-wise by position, row-wise and hot in one exchange), then the
    late chunks, the hot rows' all-reduce and the other tables' gradients."""
    widths, mask = ctx.widths, ctx.table_mask
    loss_of_rows = access.answered_loss(ctx.loss_fn, mask, attend_error=NO_ATTEND_2D)

    def body(state: TrainState, batch: PlacedBatch) -> Exchanged:
        params, leaves = state.params, jax.tree.leaves(state.params)
        reads = pipelined_reads(ctx, params, batch.data, NO_ATTEND_2D)
        tables, slots = {i: leaves[i] for i in widths}, batch.slots(ctx.tables)
        with jax.named_scope(priority.SCOPE_ROWS):  # nothing for carried rows after step 0
            rows, back, missed = step_rows(ctx, state.carry, reads, leaves, slots)
        varying = vary((params, rows), ctx.batch_axes)  # each worker's own gradient
        grad_fn = jax.value_and_grad(lambda p, r: loss_of_rows(p, batch.data, r), argnums=(0, 1))
        loss, (g_params, g_rows) = grad_fn(*varying)
        with jax.named_scope(priority.SCOPE_DENSE):
            rest, agg_state = aggregate(ctx, split_tables(g_params, mask)[1], state.agg_state)
        ahead = [batch.next, *batch.later] if batch.next is not None else []
        future = [pipelined_reads(ctx, params, b) for b in ahead]
        plans, spill = carried_plans(ctx, reads, g_rows, future, slots, tables)
        firsts, later, lost, spill = chunks_of(ctx, plans, spill, tables)
        missed = or_flags(missed, lost)
        with jax.named_scope(priority.SCOPE_LOW):
            after = tuple(rows for pairs in firsts.values() for _, rows in pairs)
            later |= hot_pairs(ctx, reads, g_rows, tables, after, later)
            later = across_groups(ctx, later | in_step_pairs(back, g_rows, after), tables)
        num = ctx.num_workers
        fulls = {
            i: ctx.table_update.gradient(firsts.get(i, []) + later.get(i, []), tables[i], num)
            for i in widths
        }
        grads = finish.with_tables(ctx, rest, fulls)
        grads, spill = finish.gradients_and_flags(ctx, loss, grads, agg_state, missed, spill)
        firsts = {i: early_rows(ctx, pairs, plans[i], tables[i]) for i, pairs in firsts.items()}
        return Exchanged(grads, firsts, spill)

    return body


# ------------------------------------------------- 2. early update, 3. next rows


def early_rows(ctx: StepContext, pairs: list, plan: Plan, shard) -> RowGrad:
    """The rows batch t+1 reads that the step moves, with their first-chunk gradient
    (``TableUpdate.early_rows``); at the last step the first chunk alone."""
    if plan.next_ids is None:
        return row_gradient(pairs, shard, ctx.num_workers)
    return ctx.table_update.early_rows(pairs, plan.next_ids, shard, ctx.num_workers)


def early_patches(ctx: StepContext, state: TrainState, firsts: dict[int, RowGrad]) -> dict:
    """Table index -> ``RowGrad(ids, update rows)``: the optimizer's step on the row view
    of the first chunk alone (zero gradient for every other leaf, so nothing here waits
    for the dense all-reduce, and the tables read within the step are left to the
    update: their updates here are unused); its new state is dropped (the update
    recomputes it)."""
    view = finish.row_view(ctx, state.opt_state)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads = finish.with_tables(ctx, zeros, firsts)
    updates = row_updates(
        ctx.optimizer, state.params, state.opt_state, grads, view.roles, view.take
    )
    leaves = jax.tree.leaves(updates)
    return {i: RowGrad(g.ids, leaves[i]) for i, g in firsts.items()}


def patched_take(shard: jax.Array, patch: RowGrad, ids: jax.Array) -> jax.Array:
    """``shard[ids]`` with ``patch.rows`` added to the rows at ``patch.ids``: the rows
    the early update gives, read without writing a table.

    Args:
      shard: float[V, D/P] (a column-wise shard), or float[V/P, D] (a row-wise one).
      patch: ascending ids int[m] (padding, the shard's rows, last) and their update
        rows.
      ids: int[...] rows to read, in [0, rows); an id outside reads NaN (``jnp.take``),
        as the layout's own fetch does.

    Returns:
      ``float[*ids.shape, D/P]`` (``[*ids.shape, D]`` row-wise).
    """
    rows = jnp.take(shard, ids, axis=0)
    pos = jnp.clip(jnp.searchsorted(patch.ids, ids), 0, patch.ids.shape[0] - 1)
    hit = jnp.take(patch.ids, pos) == ids
    delta = jnp.take(patch.rows, pos, axis=0).astype(shard.dtype)
    return rows + jnp.where(hit[..., None], delta, 0)


def next_rows_body(ctx: StepContext, slots: dict[int, int] | None = None):
    """Step 3 per worker: batch t+1's rows from the tables with the early update added;
    the carried tables' full gradient made to wait for those reads (the update then
    writes those tables in place). ``slots``: the row-wise tables' capacities."""
    widths = ctx.widths

    def body(params, patches, data, fulls):
        leaves = jax.tree.leaves(params)
        reads = carried_reads(ctx, pipelined_reads(ctx, params, data))
        tables = {i: leaves[i] for i in widths}
        with jax.named_scope(priority.SCOPE_NEXT):
            rows = prefetch(ctx, tables, reads, slots or {}, patches)
        read = edge(rows, ctx.replica_axis)  # once for every leaf
        # the carried tables' gradients only: they are read here (a table read within
        # the step is not, and one typed replicated, such as a replicated table's,
        # must not take this worker's edge)
        carried = carried_tables(ctx)
        fulls = {
            i: jax.tree.map(lambda g: waits_for(g, read) if _is_float(g) else g, f)
            if i in carried
            else f
            for i, f in fulls.items()
        }
        return tuple(rows), fulls

    return body


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _take_patched(shard, ids, patch):
    return patched_take(shard, patch, ids)


def _take_patched_rows(shard, local, patch):
    """``patched_take`` for an owner of the row-wise exchange: an empty slot of a bucket
    (``local`` = the shard's rows) reads a zero row."""
    rows = patched_take(shard, patch, local)
    return jnp.where((local < shard.shape[0])[..., None], rows, 0)


# ----------------------------------------------------------------- 5. the guard


def fetch_body(ctx: StepContext, slots: dict[int, int] | None = None):
    """Rows of every read of ``data`` the pipeline carries (per worker), from the
    tables (``slots``: the row-wise tables' capacities)."""

    def body(params, data):
        reads = carried_reads(ctx, pipelined_reads(ctx, params, data, NO_ATTEND_2D))
        leaves = jax.tree.leaves(params)
        return tuple(prefetch(ctx, {i: leaves[i] for i in ctx.widths}, reads, slots or {}))

    return body


def guard_body(ctx: StepContext, slots: dict[int, int] | None = None):
    """Step 5 per worker: the carried rows, or (when they may be stale) the same rows
    fetched again from the step's final tables: when a row batch t+1 reads did not fit
    in the first chunk (the device-side guard), or when the step was skipped (its early
    update may hold NaN/Inf; the tables were kept). Every worker takes the same branch
    (both flags are reduced over the axis). ``slots``: the row-wise tables' capacities."""
    widths = ctx.widths

    def body(params, carry, stale, data):
        leaves = jax.tree.leaves(params)
        reads = carried_reads(ctx, pipelined_reads(ctx, params, data))
        tables = {i: leaves[i] for i in widths}

        def refetch():
            with jax.named_scope(priority.SCOPE_REFETCH):
                return tuple(prefetch(ctx, tables, reads, slots or {}))

        return jax.lax.cond(stale, refetch, lambda: carry)

    return body


# ------------------------------------------------------------------ the step


def pipelined_step(ctx: StepContext, specs: TrainState):
    """``step(state, batch) -> (state, loss)`` of ``embrace_2d`` (see the module doc):
    three ``shard_map`` programs and two optimizer steps on global arrays, one jitted
    program in all. An optimizer that couples rows (clipping by global norm, a trust
    ratio: ``row_optimizers.treats_rows_alone`` is false) cannot update the next batch's
    rows from the first chunk alone: its step fetches them after the update (exact, the
    schedule's gain lost)."""
    axis = ctx.axis_name
    early = treats_rows_alone(ctx.optimizer, ctx.params)
    per = P(ctx.batch_axes)  # each worker's own (rows carried, batches)
    grad_specs = finish.gradient_specs(ctx, specs.params, missed=True)
    carried = carried_tables(ctx)
    first_specs = {
        t.index: RowGrad(*t.layout.row_specs(axis)) for t in ctx.tables if t.index in carried
    }
    table_specs = finish.table_leaves(ctx, grad_specs.grads)

    def smap(body, ins, outs):
        return jax.shard_map(body, mesh=ctx.mesh, in_specs=ins, out_specs=outs)

    def step(state: TrainState, batch: PlacedBatch):
        batch_specs = placement.placed_specs(batch, ctx.batch_axes, ctx.replicated_keys)
        slots = batch.slots(ctx.tables)  # the row-wise tables' fetch of batch t+1
        state_in = specs._replace(carry=per if state.carry != () else ())
        out = Exchanged(grad_specs, first_specs, P())
        ex = smap(exchange_body(ctx), (state_in, batch_specs), out)(state, batch)
        grads, carry = ex.grads, ()
        if batch.next is not None and early:
            patches = early_patches(ctx, state, ex.firsts)
            fulls = finish.table_leaves(ctx, grads.grads)
            carry, fulls = smap(
                next_rows_body(ctx, slots),
                (specs.params, first_specs, batch_specs.next, table_specs),
                (per, table_specs),
            )(state.params, patches, batch.next, fulls)
            grads = grads._replace(grads=finish.with_tables(ctx, grads.grads, fulls))
        new, loss = apply_gradients(ctx, state, grads._replace(carry=carry))
        loss = finish.mark_missed(grads.missed, loss)
        if batch.next is None:
            return new, loss
        if not early:  # the next rows from the updated tables
            fetch = smap(fetch_body(ctx, slots), (specs.params, batch_specs.next), per)
            return new._replace(carry=fetch(new.params, batch.next)), loss
        stale = ex.spill | ~grads.ok if ctx.nonfinite != "off" else ex.spill
        guard = smap(guard_body(ctx, slots), (specs.params, per, P(), batch_specs.next), per)
        return new._replace(carry=guard(new.params, carry, stale, batch.next)), loss

    return step
