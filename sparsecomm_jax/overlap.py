"""EmbRace's horizontal scheduling across steps: step t's low-priority exchange and full
table update run while step t+1's forward and backward run.

XLA:CPU runs the collectives and the independent compute of one program one after the
other, and two programs that both communicate at once break the collective library's
message order. So each step is four programs, one of them collective-free:

==========  ============================================================  ===========
program     what                                                          collectives
==========  ============================================================  ===========
``fetch``   rows of batch 0 (and again after a spill of the guard)        yes
``compute`` forward + backward of batch t+1 on rows fetched early         none
``high``    dense all-reduce, first chunks, early update, fetch of t+1    yes
``low``     late chunks of step t and the full table update              yes
==========  ============================================================  ===========

``low`` of step t runs on a host thread beside ``compute`` of step t+1; ``high`` of
t+1 waits for both. ``run(..., fused=True)`` instead dispatches one program per step
(``fused_body``: step t-1's ``low`` and step t's ``compute`` with no data edge between
them, then step t's ``high``), the form for accelerators whose latency-hiding scheduler
overlaps a program's collectives with its independent compute. Parameters of the
dense layers are updated in ``high`` (batch t+1's compute needs them), the tables and
their optimizer state in ``low``: exactly ``embrace`` for element-wise optimizers,
every step (a skipped non-finite step keeps both halves and fetches batch t+1's rows
from the unchanged tables). With ``table_optimizer`` (``rowwise.sgd``, ...) the tables
are updated row-sparsely (``overlap_late``: no V x D/P array per step, as ``embrace``
with the same argument); ``fused`` needs the dense table update.

Example:
    >>> # ov = overlap.make_overlapped(loss, optax.sgd(0.1), mesh, params,
    >>> #                              embedding_paths=[("embed",)])
    >>> # state, losses = ov.run(ov.state, batch_at, steps=10)

References:
    Li et al., "EmbRace", ICPP 2022, section 4 (2D communication scheduling).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import (
    embedding,
    optsplit,
    overlap_late,
    pipeline,
    placement,
    rowwise,
    runtime,
    schedule,
)
from sparsecomm_jax.aggregators import AGGREGATORS
from sparsecomm_jax.overlap_late import Pending, low_body, low_rows_body, shared_parts
from sparsecomm_jax.rowwise import RowGrad
from sparsecomm_jax.step import (
    StepContext,
    TrainState,
    aggregate,
    named_tables,
    split_tables,
    table_mask,
)


class Overlapped(NamedTuple):
    """A built overlapped trainer.

    Attributes:
      run: ``run(state, batch_at, steps, timeline=None) -> (state, losses)``; with a
        list ``timeline``, appends ``(phase, step, start, end)`` host times (seconds).
      state: the initial ``TrainState`` on the devices.
      host_params: ``state -> params`` as numpy (tables gathered to V x D).
      ctx: the step context.
    """

    run: Callable
    state: TrainState
    host_params: Callable
    ctx: StepContext
    programs: Any = None  # the jitted fetch, compute, high, low, fused (to lower them)
    place: Callable | None = None  # place(batch, next, *later) -> PlacedBatch


def fetch_body(ctx: StepContext, widths: dict[int, int]) -> Callable:
    """Rows of every table access of ``data`` (per worker), from the tables."""

    def body(params, data):
        calls = embedding.logged_lookups(
            ctx.loss_fn, params, data, ctx.table_mask, widths, pipeline.NO_ATTEND_2D
        )
        leaves = jax.tree.leaves(params)
        return tuple(pipeline.prefetch({i: leaves[i] for i in widths}, calls, ctx.axis_name))

    return body


def compute_body(ctx: StepContext) -> Callable:
    """Forward and backward on rows fetched early: no collective. Returns the local
    loss float[1], local dense gradients (leading axis 1) and gradient rows."""

    def body(params, rows, data):
        grad = jax.value_and_grad(pipeline.loss_of_rows(ctx, data), argnums=(0, 1))
        loss, (g, g_rows) = grad(params, list(rows))
        dense = split_tables(g, ctx.table_mask)[1]
        return loss[None], jax.tree.map(lambda x: x[None], dense), tuple(g_rows)

    return body


def high_body(ctx: StepContext, widths: dict[int, int], kinds: list[int]) -> Callable:
    """Dense all-reduce and update, every table's first chunk, the early update of the
    rows batch t+1 reads and their fetch; the rest goes to ``low`` as a ``Pending``.
    With ``ctx.table_optimizer``, the first chunk stays (id, row) pairs and the early
    update patches the rows fetched for batch t+1 (no V x D/P array)."""
    num, mask, row_sparse = ctx.num_workers, ctx.table_mask, ctx.table_optimizer is not None
    first = overlap_late.first_rows if row_sparse else pipeline.first_chunk
    dense_update = overlap_late.dense_update_rows if row_sparse else optsplit.dense_update

    def body(state: TrainState, loss, g_dense, g_rows, batch):
        params, leaves = state.params, jax.tree.leaves(state.params)
        calls = embedding.logged_lookups(ctx.loss_fn, params, batch.data, mask, widths)
        mean, agg_state = aggregate(ctx, jax.tree.map(lambda x: x[0], g_dense), state.agg_state)
        ahead = [batch.next, *batch.later] if batch.next is not None else []
        future = [embedding.logged_lookups(ctx.loss_fn, params, b, mask, widths) for b in ahead]
        plans = {
            i: pipeline.exchange_plan(ctx, calls, list(g_rows), future, batch.capacity, i)
            for i in widths
        }
        spill = jnp.any(jnp.stack([s for _, s in plans.values()]))
        plans = {i: plan for i, (plan, _) in plans.items()}
        firsts = {i: first(ctx, plan) for i, plan in plans.items()}
        bad = optsplit.nonfinite(mean, agg_state, g_rows) if ctx.nonfinite != "off" else False
        # one all-reduce for the loss and both flags (each a latency on a slow link)
        flags = jnp.stack([loss[0], jnp.float32(bad), jnp.float32(spill)])  # float[3]
        flags = jax.lax.psum(flags, ctx.axis_name)
        loss, ok, spill = flags[0] / num, flags[1] == 0, flags[2] > 0
        new = dense_update(ctx, state, mean, ok)._replace(
            agg_state=optsplit.where(ok, agg_state, state.agg_state)
        )
        carry = ()
        if future and row_sparse:
            with jax.named_scope(schedule.SCOPE_NEXT):
                carry = overlap_late.next_rows_patched(ctx, state, firsts, ok, future[0])
        elif future:
            early = pipeline.early_tables(ctx, state, {i: f / num for i, f in firsts.items()})
            early = {i: jnp.where(ok, early[i], leaves[i]) for i in early}
            with jax.named_scope(schedule.SCOPE_NEXT):
                carry = tuple(pipeline.prefetch(early, future[0], ctx.axis_name))
        other = (
            []
            if kinds is None
            else [
                x
                for k, x in zip(kinds, jax.tree.leaves(state.opt_state), strict=True)
                if k == optsplit.OTHER
            ]
        )
        pending = Pending(
            firsts,
            {i: p.rows for i, p in plans.items()},
            {i: p.ids for i, p in plans.items()},
            {i: p.order for i, p in plans.items()},
            ok,
            other,
            {i: shared_parts(p) for i, p in plans.items()},
        )
        return new, carry, pending, jnp.where(ok, loss, jnp.nan), spill

    return body


class _Programs(NamedTuple):
    fetch: Callable
    compute: Callable
    high: Callable
    low: Callable
    fused: Callable  # low of step t-1 beside compute of step t, then high of step t


def fused_body(ctx: StepContext, widths, kinds, capacity: int) -> Callable:
    """One program per step (for accelerators, whose latency-hiding scheduler overlaps
    independent collectives and compute): step t-1's ``low`` and step t's ``compute``
    with no data edge between them, then step t's ``high``."""
    low, compute = low_body(ctx, widths, kinds, capacity, False), compute_body(ctx)
    high = high_body(ctx, widths, kinds)

    def body(state: TrainState, pend: Pending, rows, batch):
        with jax.named_scope(schedule.SCOPE_LOW):
            tables, opt_state = low(state.params, state.opt_state, pend)
        out = compute(state.params, rows, batch.data)
        params = _with_table_leaves(state.params, tables)
        with jax.named_scope(schedule.SCOPE_HIGH):
            return high(state._replace(params=params, opt_state=opt_state), *out, batch)

    return body


def _programs(ctx: StepContext, specs: TrainState, kinds: list[int]) -> _Programs:
    """The four jitted ``shard_map`` programs (specs follow the batch's structure)."""
    axis, widths = ctx.axis_name, pipeline.table_widths(ctx)
    col, rep, per = P(None, axis), P(), P(axis)
    no_carry = specs._replace(carry=())
    row_sparse = ctx.table_optimizer is not None
    firsts = {i: RowGrad(rep, col) for i in widths} if row_sparse else col
    pending = Pending(firsts, per, rep, rep, rep, rep, {i: (per, rep, rep) for i in widths})

    def smap(body, ins, outs):
        return jax.shard_map(body, mesh=ctx.mesh, in_specs=ins, out_specs=outs, check_vma=False)

    def bspecs(batch):
        return placement.placed_specs(batch, axis, ctx.replicated_keys)

    def data_specs(data):
        return placement.batch_specs(data, axis, ctx.replicated_keys)

    def fetch(params, data):
        return smap(fetch_body(ctx, widths), (specs.params, data_specs(data)), per)(params, data)

    def compute(params, rows, data):
        fn = smap(compute_body(ctx), (specs.params, per, data_specs(data)), (per, per, per))
        return fn(params, rows, data)

    def high(state, loss, g_dense, g_rows, batch):
        ins = (no_carry, per, per, per, bspecs(batch))
        fn = smap(high_body(ctx, widths, kinds), ins, (no_carry, per, pending, rep, rep))
        return fn(state, loss, g_dense, g_rows, batch)

    def low(params, opt_state, pend, capacity, last):
        if row_sparse:
            body = low_rows_body(ctx, widths, capacity, last)
        else:
            body = low_body(ctx, widths, kinds, capacity, last)
        return smap(body, (specs.params, specs.opt_state, pending), (col, specs.opt_state))(
            params, opt_state, pend
        )

    def fused(state, pend, rows, batch, capacity):
        body = fused_body(ctx, widths, kinds, capacity)
        ins = (no_carry, pending, per, bspecs(batch))
        return smap(body, ins, (no_carry, per, pending, rep, rep))(state, pend, rows, batch)

    jit = jax.jit
    return _Programs(
        jit(fetch),
        jit(compute),
        jit(high),
        jit(low, static_argnums=(3, 4)),
        jit(fused, static_argnums=4),
    )


def _timed(timeline, phase: str, step: int, fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    if timeline is not None:
        timeline.append((phase, step, start, time.perf_counter()))
    return out


def _with_table_leaves(params, tables: dict):
    leaves, treedef = jax.tree.flatten(params)
    return jax.tree.unflatten(treedef, [tables.get(i, x) for i, x in enumerate(leaves)])


def _runner(ctx: StepContext, progs: _Programs, place: Callable) -> Callable:
    def placed(batch_at, step, steps):
        if step + 1 == steps:
            return place(batch_at(step))
        ahead = [min(s, steps - 1) for s in range(step + 1, step + 1 + pipeline.LOOKAHEAD)]
        return place(batch_at(step), *(batch_at(s) for s in ahead))

    def run(state: TrainState, batch_at, steps: int, timeline=None, fused: bool = False):
        if fused and ctx.table_optimizer is not None:
            raise ValueError("run(fused=True) needs the dense table update: table_optimizer=None")
        if fused:
            return run_fused(state, batch_at, steps, timeline)
        state, losses = state._replace(carry=()), []
        batch = placed(batch_at, 0, steps)
        rows = _timed(timeline, "fetch", 0, progs.fetch, state.params, batch.data)
        out = _timed(timeline, "compute", 0, progs.compute, state.params, rows, batch.data)
        with ThreadPoolExecutor(1) as pool:
            for t in range(steps):
                state, rows, pend, loss, spill = _timed(
                    timeline, "high", t, progs.high, state, *out, batch
                )
                losses.append(loss)
                last = t + 1 == steps
                late = pool.submit(
                    _timed,
                    timeline,
                    "low",
                    t,
                    progs.low,
                    state.params,
                    state.opt_state,
                    pend,
                    batch.capacity,
                    last,
                )
                if not last:
                    batch = placed(batch_at, t + 1, steps)
                    out = _timed(
                        timeline, "compute", t + 1, progs.compute, state.params, rows, batch.data
                    )
                tables, opt_state = late.result()
                state = state._replace(
                    params=_with_table_leaves(state.params, tables), opt_state=opt_state
                )
                if not last and bool(spill):  # guard: fetch after the full update, recompute
                    rows = _timed(timeline, "fetch", t + 1, progs.fetch, state.params, batch.data)
                    out = _timed(
                        timeline, "compute", t + 1, progs.compute, state.params, rows, batch.data
                    )
        return state, [float(np.asarray(x)) for x in losses]

    def run_fused(state: TrainState, batch_at, steps: int, timeline=None):
        state, losses = state._replace(carry=()), []
        batch = placed(batch_at, 0, steps)
        rows = _timed(timeline, "fetch", 0, progs.fetch, state.params, batch.data)
        out = _timed(timeline, "compute", 0, progs.compute, state.params, rows, batch.data)
        state, rows, pend, loss, spill = _timed(timeline, "high", 0, progs.high, state, *out, batch)
        losses.append(loss)
        for t in range(1, steps):
            capacity, batch = batch.capacity, placed(batch_at, t, steps)
            if bool(spill):  # guard: step t-1's update now, rows again, a no-op pending
                state, pend = _late(timeline, t - 1, state, pend, capacity), pend._replace(ok=False)
                rows = _timed(timeline, "fetch", t, progs.fetch, state.params, batch.data)
            state, rows, pend, loss, spill = _timed(
                timeline, "fused", t, progs.fused, state, pend, rows, batch, capacity
            )
            losses.append(loss)
        return _late(timeline, steps - 1, state, pend, batch.capacity, True), [
            float(np.asarray(x)) for x in losses
        ]

    def _late(timeline, t, state, pend, capacity, last=False):
        tables, opt_state = _timed(
            timeline, "low", t, progs.low, state.params, state.opt_state, pend, capacity, last
        )
        return state._replace(params=_with_table_leaves(state.params, tables), opt_state=opt_state)

    return run


def make_overlapped(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    mesh,
    params,
    *,
    axis_name: str = "data",
    replicated_keys: Sequence[str] = (),
    embedding_paths: Any = (),
    id_keys: Sequence[str] | None = None,
    nonfinite: str = "skip",
    table_optimizer: rowwise.RowTransform | None = None,
) -> Overlapped:
    """``embrace_2d`` with step t's late exchange beside step t+1's compute (see the
    module doc). Arguments as ``train.make_train_step``; the dense layers are reduced
    by ``pmean``. With ``table_optimizer`` (e.g. ``rowwise.sgd(lr)``) the tables are
    updated row-sparsely, as ``embrace``'s with the same argument.

    Returns:
      An ``Overlapped``: ``state, losses = ov.run(ov.state, batch_at, steps)``.
    """
    mask = table_mask(params, embedding_paths)
    vocabs = tuple(sorted({int(np.shape(t)[0]) for _, _, t in named_tables(params, mask)}))
    if not vocabs:
        raise ValueError("make_overlapped needs embedding tables: pass embedding_paths")
    ctx = StepContext(
        loss_fn,
        optimizer,
        mesh,
        params,
        axis_name,
        tuple(replicated_keys),
        mask,
        vocabs,
        None if id_keys is None else tuple(id_keys),
        None,
        AGGREGATORS["dense"](1.0, axis_name),
        nonfinite,
        table_optimizer,
    )
    if table_optimizer is not None:
        rowwise.check_transform(table_optimizer)
    state, specs = placement.place_state(ctx, "column")
    kinds = None if table_optimizer is not None else optsplit.opt_kinds(ctx, state.opt_state)
    progs = _programs(ctx, specs, kinds)
    place = placement.batch_placer(ctx, pipeline.PRIORITY_CAPACITY, pipeline.LOOKAHEAD)
    return Overlapped(
        run=_runner(ctx, progs, place),
        state=state,
        host_params=lambda s: jax.tree.map(runtime.to_host, s.params),
        ctx=ctx,
        programs=progs,
        place=place,
    )
