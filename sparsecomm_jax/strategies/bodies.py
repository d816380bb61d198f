"""Step bodies: what one worker does in one step, per kind of strategy.

A body runs once per worker inside ``jax.shard_map`` (``jax.pmap`` for ``dense_pmap``),
with ``batch`` a ``step.batches.PlacedBatch`` holding this worker's slice, and
returns the step's ``step.apply.Gradients``; ``shard_map_step`` wraps a body into a
whole step (the body, then the optimizer on global arrays). Two bodies serve every
non-pipelined strategy:

- ``data_parallel_body``: every parameter replicated; all gradients through the
  aggregator (``dense``, and the top-k strategies ``topk_a2a``, ...);
- ``table_body``: the tables read through their layouts (``embedding.gradients``), their
  gradients returned to the owners, the dense layers through the aggregator (``embrace``,
  ``embrace_rowwise``, ``sparse_allgather``: column-wise, row-wise and replicated
  tables).

Example:
    >>> import jax.numpy as jnp, optax
    >>> from sparsecomm_jax import make_train_step, runtime
    >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> ts = make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(),
    ...                      {"w": jnp.ones((3, 1))}, "dense")  # data_parallel_body

References:
    Li et al., "EmbRace: Accelerating Sparse Communication for Distributed Training of
    Deep Neural Networks", ICPP 2022.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from sparsecomm_jax.comm.vma import vary
from sparsecomm_jax.embedding import gradients as table_gradients
from sparsecomm_jax.embedding.access import PLAIN
from sparsecomm_jax.embedding.tables import split_tables
from sparsecomm_jax.step import apply, batches
from sparsecomm_jax.step.apply import Gradients, aggregate, apply_gradients
from sparsecomm_jax.step.batches import PlacedBatch
from sparsecomm_jax.step.state import StepContext, TrainState

Body = Callable[[TrainState, PlacedBatch], Gradients]


def data_parallel_body(ctx: StepContext) -> Body:
    """Every parameter replicated: local gradients, all of them reduced by the
    aggregator (``pmean`` for ``dense``, top-k with error feedback for ``topk_a2a`` and
    the other sparse aggregators)."""

    def body(state: TrainState, batch: PlacedBatch) -> Gradients:
        params = vary(state.params, ctx.batch_axes)  # each worker's own gradient
        loss, grads = jax.value_and_grad(ctx.loss_fn)(params, batch.data, PLAIN)
        return apply.reduced(ctx, loss, grads, {}, state.agg_state)

    return body


def table_body(ctx: StepContext) -> Body:
    """Tables read through their layouts: the rows of a step's reads fetched, the loss
    differentiated with respect to them, their gradients sent back to the owners and
    made the ``TableUpdate``'s gradient (a dense shard or the rows alone); the dense
    layers through the aggregator. Each owner's sum over workers divided by P gives the
    mean, as ``pmean`` does for the dense layers.

    References:
      Li et al., "EmbRace", ICPP 2022 (column-wise); Mudigere et al., 2021 (row-wise).
    """

    def body(state: TrainState, batch: PlacedBatch) -> Gradients:
        loss, grads, pairs, missed = table_gradients.table_gradients(
            ctx.loss_fn,
            state.params,
            batch.data,
            ctx.tables,
            ctx.table_mask,
            batch.slots(ctx.tables),
            ctx.axis_name,
            ctx.wire,
            ctx.batch_axes,
        )
        dense = split_tables(grads, ctx.table_mask)[1]
        tables = apply.table_grads(ctx, pairs, state.params)
        return apply.reduced(ctx, loss, dense, tables, state.agg_state, missed)

    return body


def lookups_only(body_fn: Callable[[StepContext], Body], error: str):
    """``body_fn`` that refuses, with ``error``, a loss reading a whole table
    (``emb.attend``): a strategy standing in for one that cannot serve such a read
    keeps its rules (``embrace`` as ``embrace_2d``'s one-chunk form)."""

    def build(ctx: StepContext) -> Body:
        body = body_fn(ctx)

        def checked(state: TrainState, batch: PlacedBatch) -> Gradients:
            ctx.reads(state.params, batch.data, error)  # raises on a full-table read
            return body(state, batch)

        return checked

    return build


def shard_map_step(body_fn: Callable[[StepContext], Body]):
    """A strategy's ``step(ctx, specs)`` from a body: ``jax.shard_map`` of the body (its
    ``Gradients`` out), then the optimizer on global arrays (``apply_gradients``)."""

    def build(ctx: StepContext, specs: TrainState):
        body = body_fn(ctx)
        out_specs = apply.gradient_specs(ctx, specs.params, missed=True)

        def step(state: TrainState, batch: PlacedBatch):
            batch_specs = batches.placed_specs(batch, ctx.batch_axes, ctx.replicated_keys)
            grads = jax.shard_map(
                body,
                mesh=ctx.mesh,
                in_specs=(specs._replace(carry=()), batch_specs),
                out_specs=out_specs,
            )(state, batch)
            state, loss = apply_gradients(ctx, state, grads)
            return state, apply.mark_missed(grads.missed, loss)

        return step

    return build


def pmap_body(ctx: StepContext):
    """``dense_pmap``'s whole step inside ``jax.pmap``: local gradients, ``pmean``, the
    optimizer on each device's replica."""

    def body(state: TrainState, batch: PlacedBatch):
        loss, grads = jax.value_and_grad(ctx.loss_fn)(state.params, batch.data, PLAIN)
        mean, agg_state = aggregate(ctx, grads, state.agg_state)
        return apply.apply_in_place(ctx, state, loss, mean, agg_state)

    return body
