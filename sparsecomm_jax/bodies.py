"""Step bodies: what one worker does in one training step, per table strategy.

Each ``*_body(ctx, ...)`` returns ``body(state, batch) -> (state, loss)``, run once per
worker inside ``jax.shard_map`` (or ``jax.pmap`` for ``dense_pmap``) with ``batch`` a
``placement.PlacedBatch`` holding this worker's slice. The pipelined ``embrace_2d`` body
lives in ``pipeline`` (dense table update) and ``pipeline_rows`` (row-sparse).

Example:
    >>> import jax.numpy as jnp, optax
    >>> from sparsecomm_jax import runtime, train
    >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> ts = train.make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(),
    ...                            {"w": jnp.ones((3, 1))}, "dense")  # data_parallel_body
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from sparsecomm_jax import colfetch, embedding, pipeline, pipeline_rows, rowgrad
from sparsecomm_jax.aggregators import vary
from sparsecomm_jax.embedding import DENSE_EMBEDDING, EmbeddingOps
from sparsecomm_jax.placement import PlacedBatch
from sparsecomm_jax.rowgrad import TableLayout
from sparsecomm_jax.step import (
    StepContext,
    TrainState,
    aggregate,
    finish_step,
    merge_tables,
    split_tables,
)

Body = Callable[[TrainState, PlacedBatch], tuple[TrainState, jax.Array]]


def data_parallel_body(ctx: StepContext) -> Body:
    """Every parameter replicated: local gradients, all of them reduced by the
    aggregator (``pmean`` for ``dense``/``dense_pmap``, top-k with error feedback for
    ``topk_a2a`` and the other sparse aggregators)."""

    def body(state: TrainState, batch: PlacedBatch):
        params = vary(state.params, ctx.axis_name)  # each worker's own gradient
        loss, grads = jax.value_and_grad(ctx.loss_fn)(params, batch.data, DENSE_EMBEDDING)
        mean, agg_state = aggregate(ctx, grads, state.agg_state)
        return finish_step(ctx, state, mean, loss, agg_state)

    return body


def sharded_table_body(ctx: StepContext, ops: Callable[[StepContext, int], EmbeddingOps]) -> Body:
    """EmbRace step: tables sharded (their lookups exchange rows by all-to-all), dense
    layers data-parallel through the aggregator (``pmean``, or top-k).

    Autodiff through the lookup's collectives already brings each owner the *sum* over
    workers of its shard's gradient; dividing by P gives the mean, as ``pmean`` does for
    the dense layers. (Never ``psum`` the loss before ``grad``: that multiplies by P.)

    Args:
      ctx: the step context.
      ops: ``ops(ctx, capacity) -> EmbeddingOps`` for the sharded tables (``capacity``
        from the batch: row-wise buckets' slots, 0 when unused).

    References:
      Li et al., "EmbRace: Accelerating Sparse Communication for Distributed Training
      of Deep Neural Networks", ICPP 2022.
    """

    def body(state: TrainState, batch: PlacedBatch):
        emb = ops(ctx, batch.capacity)
        params = vary(state.params, ctx.axis_name)
        loss, grads = jax.value_and_grad(ctx.loss_fn)(params, batch.data, emb)
        tables, rest = split_tables(grads, ctx.table_mask)
        tables = jax.tree.map(lambda g: g / ctx.num_workers, tables)
        rest, agg_state = aggregate(ctx, rest, state.agg_state)
        grads = merge_tables(tables, rest, ctx.table_mask)
        return finish_step(ctx, state, grads, loss, agg_state)

    return body


def row_update_body(ctx: StepContext, layout: Callable[[StepContext, int], TableLayout]) -> Body:
    """Tables updated row-sparsely: lookups outside autodiff, the loss differentiated
    w.r.t. the looked-up rows, the row gradients returned to their owners and summed
    per id (``rowgrad``), ``ctx.table_optimizer`` on those rows only; the other leaves
    through the aggregator. A step costs O(tokens x D), not O(V x D).

    Args:
      ctx: the step context (``ctx.table_optimizer`` set).
      layout: ``layout(ctx, capacity) -> TableLayout`` of the strategy's tables.
    """
    flags, leaves = jax.tree.leaves(ctx.table_mask), jax.tree.leaves(ctx.params)
    widths = {
        i: int(np.shape(x)[1]) for i, (x, f) in enumerate(zip(leaves, flags, strict=True)) if f
    }

    def body(state: TrainState, batch: PlacedBatch):
        loss, grads, rows = rowgrad.table_row_grads(
            ctx.loss_fn,
            state.params,
            batch.data,
            ctx.table_mask,
            layout(ctx, batch.capacity),
            widths,
        )
        rest, agg_state = aggregate(ctx, split_tables(grads, ctx.table_mask)[1], state.agg_state)
        rows = [rows[i] for i in sorted(rows)]  # leaf order
        return finish_step(ctx, state, rest, loss, agg_state, rows=rows)

    return body


def _wire(ctx: StepContext):
    return rowgrad.wire_dtype(ctx.comm_dtype)


DEDUP = colfetch.CAPACITY  # ``embrace``: slots per table for its distinct rows


def column_layout(ctx: StepContext, capacity) -> TableLayout:
    """``embrace`` with row updates: column-sharded tables; with ``capacity`` (slots per
    table, ``colfetch.CAPACITY``) a step's lookups share one exchange of distinct rows."""
    if not isinstance(capacity, tuple):
        return rowgrad.column_layout(ctx.axis_name, _wire(ctx))
    tables = [i for i, f in enumerate(jax.tree.leaves(ctx.table_mask)) if f]
    caps = dict(zip(tables, capacity, strict=True))
    return colfetch.column_layout(ctx.axis_name, caps, _wire(ctx))


def row_layout(ctx: StepContext, capacity: int) -> TableLayout:
    """``embrace_rowwise`` with row updates: row-sharded tables, ``capacity`` slots."""
    return rowgrad.row_layout(ctx.axis_name, capacity, _wire(ctx))


def replicated_layout(ctx: StepContext, capacity: int) -> TableLayout:
    """``sparse_allgather`` with row updates: replicated tables, all-gathered pairs."""
    return rowgrad.replicated_layout(ctx.axis_name, _wire(ctx))


def column_ops(ctx: StepContext, capacity: int) -> EmbeddingOps:
    """``embrace``: tables sharded by columns (no capacity needed)."""
    del capacity
    return embedding.column_ops(ctx.axis_name)


def row_ops(ctx: StepContext, capacity: int) -> EmbeddingOps:
    """``embrace_rowwise``: tables sharded by rows, ``capacity`` slots per bucket."""
    return embedding.row_ops(ctx.axis_name, capacity)


def sparse_allgather_body(ctx: StepContext) -> Body:
    """Replicated tables, sparse gradients: all-gather (id, row) pairs, scatter-add
    (Horovod / PyTorch DDP with sparse embedding gradients)."""

    if ctx.table_optimizer is not None:
        return row_update_body(ctx, replicated_layout)

    def body(state: TrainState, batch: PlacedBatch):
        loss, grads = embedding.sparse_table_grads(
            ctx.loss_fn, state.params, batch.data, ctx.table_mask, ctx.axis_name
        )
        return finish_step(ctx, state, grads, loss)

    return body


def embrace_2d_body(ctx: StepContext) -> Body:
    """``embrace_2d``: the row-sparse pipelined step when ``ctx.table_optimizer`` is set,
    else the dense table update (exact for any optax optimizer). A narrow
    ``comm_dtype`` is refused (``ValueError``): this step sends float32."""
    if ctx.comm_dtype != "float32":
        raise ValueError(
            f"comm_dtype={ctx.comm_dtype!r} is not available for embrace_2d; "
            "use comm_dtype='float32' or strategy 'embrace'"
        )
    if ctx.table_optimizer is not None:
        return pipeline_rows.embrace_2d_rows_body(ctx)
    return pipeline.embrace_2d_body(ctx)
