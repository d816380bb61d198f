"""EmbRace's 2D scheduling as a train step: ``embrace_2d``.

One pipelined step (batch t, with batches t+1..t+``LOOKAHEAD`` known): batch t's forward
reads rows fetched during step t-1; each table's gradient rows are exchanged in priority
chunks (``schedule``), position by position, the shared negatives' too: the positions
batch t+1 reads first (every table's first chunk before any later one), then those t+2
reads, t+3, ..., in late chunks sized by the alpha-beta cost model; the rows batch t+1
reads are updated from the first chunk alone and fetched for it at once; the rest of
the exchange and the full update follow. A row that did not fit in the first chunk, or
a skipped step, makes the step fetch the next rows again after the full update (exact,
slower). The dense layers go through the aggregator with no data dependency on the
table exchange. Exactly equivalent to ``embrace`` for element-wise optimizers.

References:
    Li et al., "EmbRace", ICPP 2022, section 4.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsecomm_jax import costmodel, embedding, schedule
from sparsecomm_jax.aggregators import vary
from sparsecomm_jax.placement import (
    CapacityPolicy,
    PlacedBatch,
    grow_by_quarter,
)
from sparsecomm_jax.step import (
    Batch,
    StepContext,
    TrainState,
    aggregate,
    apply_optimizer,
    finish_step,
    named_tables,
    split_tables,
)


def table_widths(ctx: StepContext) -> dict[int, int]:
    """Leaf index -> full row width D of every table (shards hold D/P columns)."""
    return {i: int(np.shape(x)[1]) for i, _, x in named_tables(ctx.params, ctx.table_mask)}


def prefetch(tables: dict[int, Any], calls: list, axis_name: str) -> list:
    """Rows for each logged access, looked up in the (column-sharded) ``tables``."""
    out = []
    for kind, i, ids in calls:
        if kind == "lookup":
            out.append(embedding.column_lookup(tables[i], ids, axis_name))
        else:
            out.append(embedding.column_lookup_shared(tables[i], ids, axis_name))
    return out


def waits_for(x, after):
    """``x``, made to wait for every array in ``after``: a real data edge ``x + (a - a)``
    with ``a`` the sum of one element of each. (XLA:CPU drops ``optimization_barrier``
    before scheduling, and does not fold ``a - a`` for floats; for finite ``a`` this
    adds exactly zero, and a non-finite ``after`` poisons the step anyway.)"""
    a = sum(leaf.reshape(-1)[0].astype(x.dtype) for leaf in jax.tree.leaves(after))
    return x + (a - a)


class Plan(NamedTuple):
    """Table ``i``'s gradient exchange in priority order (see ``schedule``)."""

    rows: Any  # float[n, D]: this worker's gradient per looked-up position
    ids: Any  # int[P, n]: every worker's ids at those positions
    order: Any  # int[P, n]: every worker's priority order
    chunks: list  # [start, end) of each chunk in that order
    shared: list  # [] or [Shared]: the lookups whose ids every worker holds
    vocab: int


class Shared(NamedTuple):
    """A lookup whose ids every worker holds (e.g. shared negatives), in priority
    chunks like the other positions: the rows batch t+1 reads first."""

    rows: Any  # float[N, D]: this worker's gradient per position
    ids: Any  # int[N]: the same on every worker
    order: Any  # int[N]: priority order (the same on every worker)
    chunks: list  # [start, end) of each chunk in that order


def exchange_plan(ctx: StepContext, calls, g_rows, future, capacity, i) -> Plan:
    """Positions of table ``i`` sorted by when their id is next read: batch t+1's
    first (the first chunk), then t+2's, ... (``future``: the logged reads of t+1,
    t+2, ..., or empty at the last step); later chunks sized by the cost model."""
    axis = ctx.axis_name
    ids, rows, shared = [], [], []
    for (kind, t, call_ids), g in zip(calls, g_rows, strict=True):
        if t == i and kind == "lookup":
            ids.append(call_ids.reshape(-1))
            rows.append(g.reshape(call_ids.size, -1))
        elif t == i:
            shared.append((g.reshape(call_ids.size, -1), call_ids.reshape(-1)))
    # int[P, n], the same on every worker (typed so: a row state such as lazy_adam's
    # step counts, indexed by these ids, stays replicated)
    all_ids = jax.lax.all_gather(jnp.concatenate(ids), axis, to="invarying")
    rows, n, vocab = jnp.concatenate(rows), all_ids.shape[1], table_vocab(ctx, i)
    if shared:  # every shared lookup of the table, as one list of positions
        shared = [
            (jnp.concatenate([g for g, _ in shared]), jnp.concatenate([s for _, s in shared]))
        ]
    if not future:  # last step: nothing to prioritise
        order = jnp.broadcast_to(jnp.arange(n), all_ids.shape)
        shared = [Shared(g, s, jnp.arange(s.size), [(0, s.size)]) for g, s in shared]
        return Plan(rows, all_ids, order, [(0, n)], shared, vocab), jnp.array(False)
    fut = _future_ids(future, i, axis)
    levels = schedule.next_use_levels(all_ids, fut)
    spill = schedule.overflows(levels[jax.lax.axis_index(axis)], capacity)  # local
    chunks = schedule.chunk_bounds(n, late_capacities(n, capacity, rows.shape[1], ctx.num_workers))
    plans = [_shared_plan(ctx, g, s, fut, capacity) for g, s in shared]
    spill = functools.reduce(jnp.logical_or, [s for _, s in plans], spill)
    shared = [p for p, _ in plans]
    return Plan(rows, all_ids, schedule.priority_order(levels), chunks, shared, vocab), spill


def _shared_plan(ctx: StepContext, g, ids, future: list, capacity: int):
    """``(Shared, spill)``: the shared positions batch t+1 reads go first (at most
    ``capacity`` of them, else ``spill``), the others late, in next-use order."""
    levels = schedule.next_use_levels(ids, future)  # the same on every worker
    n = ids.shape[0]
    sizes = late_capacities(n, capacity, g.shape[1], ctx.num_workers)
    chunks = schedule.chunk_bounds(n, sizes)
    return Shared(g, ids, schedule.priority_order(levels), chunks), schedule.overflows(
        levels, capacity
    )


def _future_ids(future: list, i: int, axis: str) -> list:
    """Per future batch, int[m]: every id its logged calls read of table ``i`` (all
    workers; one all-gather for all the batches' lookups)."""
    local = [
        [c.reshape(-1) for kind, t, c in calls if t == i and kind == "lookup"] for calls in future
    ]
    sizes = [sum(x.size for x in ids) for ids in local]
    flat = jnp.concatenate([x for ids in local for x in ids] or [jnp.zeros(0, jnp.int32)])
    every = jax.lax.all_gather(flat, axis, to="invarying")  # int[P, sum(sizes)]
    bounds = np.cumsum([0, *sizes])
    out = []
    for k, calls in enumerate(future):
        shared = [c.reshape(-1) for kind, t, c in calls if t == i and kind == "lookup_shared"]
        out.append(jnp.concatenate([every[:, bounds[k] : bounds[k + 1]].reshape(-1), *shared]))
    return out


def late_capacities(n: int, first: int, width: int, workers: int) -> list[int]:
    """Chunk sizes in priority order: ``first``, then late chunks of at least
    ``schedule.late_chunk_rows`` positions under ``LINK``, at most ``MAX_LATE_CHUNKS``.

    Example: n=1000, first=100, rows of 512 floats, 4 workers -> [100, 225, 225, 225, 225].
    """
    rest = max(0, n - first)
    link_rows = schedule.late_chunk_rows(LINK, 4 * width, workers)
    size = max(1, link_rows, -(-rest // MAX_LATE_CHUNKS))
    return [first] + [size] * (-(-rest // size))


def first_chunk(ctx: StepContext, plan: Plan):
    """float[V, D/P]: the first chunk and the shared lookups, summed over workers."""
    axis = ctx.axis_name
    out = schedule.column_grad_chunk(
        plan.rows, plan.ids, plan.order, plan.chunks[0], plan.vocab, axis
    )
    for s in plan.shared:  # ids every worker holds: those batch t+1 reads
        out = out + schedule.column_grad_shared(
            s.rows, s.ids, s.order, s.chunks[0], plan.vocab, axis
        )
    return out


def later_chunks(ctx: StepContext, plan: Plan, after):
    """float[V, D/P] (or 0.0): the remaining chunks, issued only once ``after`` (every
    table's first chunk) has arrived."""
    rows, out = waits_for(plan.rows, after), 0.0
    for bound in plan.chunks[1:]:
        out = out + schedule.column_grad_chunk(
            rows, plan.ids, plan.order, bound, plan.vocab, ctx.axis_name
        )
    for s in plan.shared:
        g = waits_for(s.rows, after)
        for bound in s.chunks[1:]:
            out = out + schedule.column_grad_shared(
                g, s.ids, s.order, bound, plan.vocab, ctx.axis_name
            )
    return out


def loss_of_rows(ctx: StepContext, data) -> Callable:
    """``loss(params, rows)``: the model's loss on ``data`` with its table lookups
    answered, in call order, by ``rows`` (rows fetched before the step, so the loss is
    differentiated with respect to them, not the tables)."""

    def loss(p, rows):
        pending = iter(rows)
        ops = embedding.recording_ops(p, ctx.table_mask, [], lambda *_: next(pending), NO_ATTEND_2D)
        return ctx.loss_fn(p, data, ops)

    return loss


def table_vocab(ctx: StepContext, i: int) -> int:
    """V of table leaf ``i``."""
    return int(np.shape(jax.tree.leaves(ctx.params)[i])[0])


LOOKAHEAD = 3  # batches t+1..t+3 order the late rows (those t+1 reads go first)
MAX_LATE_CHUNKS = 4  # each chunk is one all-to-all per table
LINK = costmodel.Link.from_bandwidth(1.0)  # sizes the late chunks (1 Gbit/s, 50 us)

NO_ATTEND_2D = (
    "embrace_2d needs tables that are read by lookups only; a full softmax over a table "
    "(emb.attend) needs the whole updated table before the next step: use sampled softmax"
)


class Front(NamedTuple):
    """What a pipelined step computes before its table exchange (either table update)."""

    loss: Any  # this worker's loss
    g_params: Any  # gradient of every leaf (zero at the tables: lookups read rows)
    rest: Any  # the aggregated gradient of the other leaves (None at the tables)
    agg_state: Any
    nxt: list | None  # the logged reads of batch t+1 (None at the last step)
    plans: dict  # table index -> Plan
    spill: Any  # bool, on every worker: a row batch t+1 reads missed the first chunk


def front(ctx: StepContext, widths: dict[int, int], state: TrainState, batch: PlacedBatch):
    """Forward and backward of batch t on the rows fetched during step t-1 (or now, at
    the first step), the dense layers' aggregation, and each table's ``Plan``."""
    params, mask = state.params, ctx.table_mask
    calls = embedding.logged_lookups(ctx.loss_fn, params, batch.data, mask, widths, NO_ATTEND_2D)
    tables = dict(zip(widths, [jax.tree.leaves(params)[i] for i in widths], strict=True))
    rows = list(state.carry) if state.carry != () else prefetch(tables, calls, ctx.axis_name)
    varying = vary((params, rows), ctx.axis_name)  # each worker's own gradient
    grad_fn = jax.value_and_grad(loss_of_rows(ctx, batch.data), argnums=(0, 1))
    loss, (g_params, g_rows) = grad_fn(*varying)
    rest, agg_state = aggregate(ctx, split_tables(g_params, mask)[1], state.agg_state)
    ahead = [batch.next, *batch.later] if batch.next is not None else []
    future = [embedding.logged_lookups(ctx.loss_fn, params, b, mask, widths) for b in ahead]
    plans = {i: exchange_plan(ctx, calls, g_rows, future, batch.capacity, i) for i in widths}
    spill = jnp.any(jnp.stack([s for _, s in plans.values()])).astype(jnp.int32)
    spill = jax.lax.pmax(spill, ctx.axis_name) > 0
    plans = {i: plan for i, (plan, _) in plans.items()}
    return Front(loss, g_params, rest, agg_state, future[0] if future else None, plans, spill)


def embrace_2d_body(ctx: StepContext) -> Callable:
    """EmbRace with 2D scheduling, one pipelined step: batch t's forward reads rows
    fetched during step t-1; its table gradients travel in priority chunks; the rows
    batch t+1 needs are updated from the first chunk alone and fetched for it right
    away; the rest of the exchange and the full update follow. Exactly equivalent to
    ``embrace`` for element-wise optimizers (SGD, momentum, Adam, ...). Dense table
    update (a V x D/P gradient per table); the row-sparse form is ``pipeline_rows``."""
    widths = table_widths(ctx)
    num = ctx.num_workers

    def body(state: TrainState, batch: PlacedBatch):
        f = front(ctx, widths, state, batch)
        with jax.named_scope(schedule.SCOPE_HIGH):
            firsts = {i: first_chunk(ctx, plan) for i, plan in f.plans.items()}
        with jax.named_scope(schedule.SCOPE_LOW):
            after = tuple(firsts.values())
            later = {i: later_chunks(ctx, plan, after) for i, plan in f.plans.items()}
        fulls = {i: (firsts[i] + later[i]) / num for i in widths}
        firsts = {i: g / num for i, g in firsts.items()}
        carry = ()
        if f.nxt is not None:
            with jax.named_scope(schedule.SCOPE_NEXT):
                early = early_tables(ctx, state, firsts)
                carry = tuple(prefetch(early, f.nxt, ctx.axis_name))
        grads = with_tables(f.g_params, ctx.table_mask, fulls, f.rest)
        new, loss = finish_step(ctx, state, grads, f.loss, f.agg_state, carry)
        if f.nxt is None:
            return new, loss
        return new._replace(carry=checked_carry(ctx, new, f.nxt, f.spill, loss)), loss

    return body


def with_tables(like, mask, tables: dict[int, Any], rest=None):
    """A gradient tree: ``tables[i]`` at table leaves, ``rest`` (or zeros) elsewhere."""
    leaves, treedef = jax.tree.flatten(like)
    others = iter(jax.tree.leaves(rest))  # rest has None at the tables
    flags = jax.tree.leaves(mask)
    out = [
        tables[i] if f else (jnp.zeros_like(x) if rest is None else next(others))
        for i, (x, f) in enumerate(zip(leaves, flags, strict=True))
    ]
    return jax.tree.unflatten(treedef, out)


def checked_carry(ctx: StepContext, new: TrainState, nxt: list, spill, loss):
    """The carried rows, or (when they may be stale) the same rows fetched again from
    the step's final tables: when a row batch t+1 reads did not fit in the first chunk
    (``spill``, the device-side guard), or when the step was skipped (``nonfinite``:
    the early update may hold NaN/Inf, the tables were kept). Every worker takes the
    same branch (both flags are reduced over the axis). The fetch again is exact in
    every case; it only costs a lookup exchange when it runs."""
    stale = spill | (jnp.isnan(loss) if ctx.nonfinite != "off" else False)
    leaves = jax.tree.leaves(new.params)
    tables = {i: leaves[i] for i in table_widths(ctx)}

    def refetch():
        with jax.named_scope(schedule.SCOPE_REFETCH):
            return tuple(prefetch(tables, nxt, ctx.axis_name))

    return jax.lax.cond(stale, refetch, lambda: new.carry)


def early_tables(ctx: StepContext, state: TrainState, firsts: dict[int, Any]) -> dict[int, Any]:
    """The tables after an optimizer step on the first chunk alone (zero gradient for
    every other leaf, so nothing here waits for the dense all-reduce). Exact for the
    rows batch t+1 reads: all of their gradient is in the first chunk."""
    grads = with_tables(state.params, ctx.table_mask, firsts)
    params, _ = apply_optimizer(ctx.optimizer, grads, state.opt_state, state.params)
    leaves = jax.tree.leaves(params)
    return {i: leaves[i] for i in firsts}


def priority_need(ctx: StepContext, batch: Batch, next_batch: Batch) -> int:
    """Lookup positions of one worker's batch that batch t+1 reads, counting every read
    of a table (a tied table is read by the inputs and by the targets), or shared
    positions (ids every worker holds, e.g. negatives) that it reads, if more."""
    reads = _reads_fn(ctx)
    return schedule.first_chunk_need(reads(batch), reads(next_batch))


def _reads_fn(ctx: StepContext):
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), ctx.params)
    leaves, treedef = jax.tree.flatten(shapes)
    flags = tuple(bool(f) for f in jax.tree.leaves(ctx.table_mask))
    return _cached_reads_fn(
        ctx.loss_fn, treedef, tuple(leaves), flags, ctx.replicated_keys, ctx.num_workers
    )


@functools.lru_cache(maxsize=16)
def _cached_reads_fn(loss_fn, treedef, leaves, flags, replicated_keys, workers):
    shapes = jax.tree.unflatten(treedef, leaves)
    mask = jax.tree.unflatten(treedef, flags)
    return schedule.table_reads_fn(loss_fn, shapes, mask, replicated_keys, workers)


PRIORITY_CAPACITY = CapacityPolicy(priority_need, "high-priority positions", grow_by_quarter)
