"""The late half of the overlapped step (``overlap``): what step t's ``high`` program
hands over (``Pending``), and the ``low`` program that finishes step t's exchange and
updates the tables, with the dense table update (``low_body``: a V x D/P gradient per
table) or the row-sparse one (``low_rows_body``: ``ctx.table_optimizer`` on the rows
the step touched, O(tokens x D)); plus the row-sparse pieces of ``high``.

Example:
    >>> # pend = Pending(...) from overlap.high_body; low_rows_body(ctx, widths, 64, False)
    >>> # -> (tables, opt_state) with every late chunk summed into the rows it updates

References:
    Li et al., "EmbRace", ICPP 2022, section 4 (2D communication scheduling);
    Mudigere et al., "High-performance, Distributed Training of Large-scale DLRMs", 2021.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sparsecomm_jax import optsplit, pipeline, pipeline_rows, rowwise, schedule
from sparsecomm_jax.rowwise import RowGrad
from sparsecomm_jax.step import (
    StepContext,
    TrainState,
    apply_optimizer,
    merge_tables,
    split_tables,
)


class Pending(NamedTuple):
    """Step t's late exchange, handed from ``high`` to ``low`` (per table index)."""

    firsts: dict  # float[V, D/P] (or a RowGrad of my columns): the first chunk, summed
    rows: dict  # float[n, D]: this worker's gradient rows, every position
    ids: dict  # int[P, n]: every worker's ids
    order: dict  # int[P, n]: every worker's priority order
    ok: Any  # bool: no worker had a NaN/Inf gradient
    other: list  # the optimizer state's non-parameter leaves before step t
    shared: dict  # (rows float[N, D], ids int[N], order int[N]) of the shared positions


def shared_parts(plan: pipeline.Plan) -> tuple:
    """``(rows float[N, D], ids int[N], order int[N])`` of a plan's shared positions
    (N = 0 without any)."""
    if not plan.shared:
        empty = jnp.zeros(0, jnp.int32)
        return jnp.zeros((0, plan.rows.shape[1]), plan.rows.dtype), empty, empty
    return tuple(plan.shared[0][:3])


def late_plan(ctx: StepContext, pending: Pending, i: int, capacity: int, last: bool):
    """Table ``i``'s ``pipeline.Plan`` again, from what ``high`` handed over (the chunk
    bounds are static: the same sizes as ``high``'s)."""
    num = ctx.num_workers

    def bounds(n, width):
        sizes = [n] if last else pipeline.late_capacities(n, capacity, width, num)
        return schedule.chunk_bounds(n, sizes)

    rows = pending.rows[i]  # float[n, D]
    g, ids, order = pending.shared[i]
    shared = [pipeline.Shared(g, ids, order, bounds(ids.shape[0], g.shape[1]))] if ids.size else []
    vocab = pipeline.table_vocab(ctx, i)
    return pipeline.Plan(
        rows, pending.ids[i], pending.order[i], bounds(rows.shape[0], rows.shape[1]), shared, vocab
    )


def low_body(ctx: StepContext, widths, kinds, capacity: int, last: bool) -> Callable:
    """Step t's late chunks and the full update of the tables and their optimizer state
    (from the state before step t: the dense half was updated by ``high``)."""
    num = ctx.num_workers

    def body(params, opt_state, pending: Pending):
        fulls = {}
        for i in widths:
            plan = late_plan(ctx, pending, i, capacity, last)
            fulls[i] = (pending.firsts[i] + pipeline.later_chunks(ctx, plan, ())) / num
        grads = pipeline.with_tables(params, ctx.table_mask, fulls)
        opt_in = optsplit.with_other(kinds, opt_state, pending.other)
        new_p, new_opt = apply_optimizer(ctx.optimizer, grads, opt_in, params)
        new_leaves, old_leaves = jax.tree.leaves(new_p), jax.tree.leaves(params)
        tables = {i: jnp.where(pending.ok, new_leaves[i], old_leaves[i]) for i in widths}
        return tables, optsplit.where(
            pending.ok, optsplit.pick(kinds, (optsplit.TABLE,), new_opt, opt_state), opt_state
        )

    return body


def low_rows_body(ctx: StepContext, widths, capacity: int, last: bool) -> Callable:
    """``low_body`` with the row-sparse table update: every chunk's (id, row) pairs
    summed per id, ``ctx.table_optimizer`` on those rows only (none when not ``ok``)."""
    num = ctx.num_workers

    def body(params, opt_state: rowwise.TableOptState, pending: Pending):
        leaves, tables, states = jax.tree.leaves(params), {}, []
        for k, i in enumerate(sorted(widths)):  # row states are in leaf order
            plan = late_plan(ctx, pending, i, capacity, last)
            later = pipeline_rows.later_pairs(ctx, plan, ())
            full = pipeline_rows.summed([pending.firsts[i], *later], plan.vocab)
            grad = RowGrad(jnp.where(pending.ok, full.ids, plan.vocab), full.rows / num)
            tables[i], state = rowwise.apply_rows(
                ctx.table_optimizer, grad, opt_state.rows[k], leaves[i]
            )
            states.append(state)
        return tables, opt_state._replace(rows=tuple(states))

    return body


def first_rows(ctx: StepContext, plan: pipeline.Plan) -> RowGrad:
    """The first chunk and the first shared positions, summed per id (my columns)."""
    return pipeline_rows.summed(pipeline_rows.first_pairs(ctx, plan), plan.vocab)


def dense_update_rows(ctx: StepContext, state: TrainState, mean, ok) -> TrainState:
    """``optsplit.dense_update`` for a ``rowwise.TableOptState``: the optax step of the
    non-table leaves; the tables and their row states untouched."""
    tables, dense = split_tables(state.params, ctx.table_mask)
    new_dense, new_opt = apply_optimizer(ctx.optimizer, mean, state.opt_state.dense, dense)
    params = merge_tables(tables, optsplit.where(ok, new_dense, dense), ctx.table_mask)
    opt = state.opt_state._replace(dense=optsplit.where(ok, new_opt, state.opt_state.dense))
    return TrainState(params, opt, state.agg_state)


def next_rows_patched(ctx: StepContext, state: TrainState, firsts: dict, ok, calls) -> tuple:
    """Batch t+1's rows: read from the tables before step t with the early update of
    the first chunk added (``pipeline_rows.patched_prefetch``); no patch unless ``ok``."""
    num, leaves = ctx.num_workers, jax.tree.leaves(state.params)
    patches = pipeline_rows.early_patches(
        ctx, state, {i: pipeline_rows.scaled(g, num) for i, g in firsts.items()}
    )
    patches = {
        i: RowGrad(jnp.where(ok, p.ids, leaves[i].shape[0]), p.rows) for i, p in patches.items()
    }
    tables = {i: leaves[i] for i in firsts}
    return tuple(pipeline_rows.patched_prefetch(tables, patches, calls, ctx.axis_name))
