"""``embrace_2d`` with row-sparse table updates: the pipelined step, O(tokens x D).

The step is ``pipeline``'s (the same priority chunks, lookahead and guard), but no
table gradient is ever a V x D/P array. Each owner keeps what a chunk brings as
(id, gradient row) pairs of its columns (``schedule.column_chunk_rows``):

1. the first chunk's pairs, summed per id (``rowwise.segment_rows``), give the early
   update of the rows batch t+1 reads: ``ctx.table_optimizer`` on those rows, added to
   them as they are fetched for batch t+1 (``patched_take``), never to a copy of the
   table. Exact: every position of a row batch t+1 reads is in the first chunk (else
   the guard fetches the rows again after the full update);
2. every chunk's pairs, summed per id, are the step's ``rowwise.RowGrad`` per table:
   the non-finite check looks at these rows, and ``ctx.table_optimizer`` updates these
   rows only (``step.finish_step``).

Equal to ``embrace`` with the same row update, hence to single-device training for
``rowwise.sgd`` and ``rowwise.adagrad``.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax import pipeline_rows, rowwise
    >>> patch = rowwise.RowGrad(jnp.array([1, 3, 4]), jnp.ones((3, 2)))  # 4: padding (V=4)
    >>> pipeline_rows.patched_take(jnp.zeros((4, 2)), patch, jnp.array([3, 2]))[:, 0].tolist()
    [1.0, 0.0]

References:
    Li et al., "EmbRace", ICPP 2022, section 4; Mudigere et al., "High-performance,
    Distributed Training of Large-scale DLRMs", 2021 (row-wise sparse updates).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from sparsecomm_jax import pipeline, schedule
from sparsecomm_jax.pipeline import Plan
from sparsecomm_jax.placement import PlacedBatch
from sparsecomm_jax.rowwise import RowGrad, segment_rows
from sparsecomm_jax.step import StepContext, TrainState, finish_step


def first_pairs(ctx: StepContext, plan: Plan) -> list:
    """The first chunk and the shared lookups of a table, as (ids, rows) pairs of my
    columns from every worker (ids int[m], rows float[m, D/P])."""
    axis = ctx.axis_name
    pairs = [schedule.column_chunk_rows(plan.rows, plan.ids, plan.order, plan.chunks[0], axis)]
    return pairs + [
        schedule.column_shared_rows(s.rows, s.ids, s.order, s.chunks[0], axis) for s in plan.shared
    ]


def later_pairs(ctx: StepContext, plan: Plan, after) -> list:
    """The remaining chunks' pairs, issued only once ``after`` (every table's first
    chunk) has arrived."""
    rows, axis = pipeline.waits_for(plan.rows, after), ctx.axis_name
    out = [
        schedule.column_chunk_rows(rows, plan.ids, plan.order, bound, axis)
        for bound in plan.chunks[1:]
    ]
    for s in plan.shared:
        g = pipeline.waits_for(s.rows, after)
        out += [schedule.column_shared_rows(g, s.ids, s.order, b, axis) for b in s.chunks[1:]]
    return out


def summed(pairs: list, vocab: int) -> RowGrad:
    """``pairs`` summed per id: distinct ids ascending, then padding (id ``vocab``)."""
    ids = jnp.concatenate([i.astype(jnp.int32) for i, _ in pairs])
    return segment_rows(ids, jnp.concatenate([r for _, r in pairs]), vocab)


def scaled(grad: RowGrad, num: int) -> RowGrad:
    """The mean over workers of a gradient summed over them."""
    return RowGrad(grad.ids, grad.rows / num)


def patched_take(shard: jax.Array, patch: RowGrad, ids: jax.Array) -> jax.Array:
    """``shard[ids]`` with ``patch.rows`` added to the rows at ``patch.ids``: the rows
    ``rowwise.apply_rows`` would give, read without writing a table.

    Args:
      shard: float[V, D/P].
      patch: ascending ids int[m] (padding ``V`` last) and their update rows float[m, D/P].
      ids: int[...] rows to read, in [0, V).

    Returns:
      float[*ids.shape, D/P].
    """
    rows = jnp.take(shard, ids, axis=0)
    pos = jnp.clip(jnp.searchsorted(patch.ids, ids), 0, patch.ids.shape[0] - 1)
    hit = jnp.take(patch.ids, pos) == ids
    delta = jnp.take(patch.rows, pos, axis=0).astype(shard.dtype)
    return rows + jnp.where(hit[..., None], delta, 0)


def patched_prefetch(tables: dict, patches: dict, calls: list, axis: str) -> list:
    """``pipeline.prefetch`` from the tables with ``patches`` added: the column-sharded
    lookup of ``embedding.column_lookup`` (ids all-gathered, my columns taken, one
    all-to-all) and of ``embedding.column_lookup_shared`` (one tiled all-gather)."""
    out = []
    for kind, i, ids in calls:
        if kind == "lookup":
            flat = ids.reshape(-1)  # int[n]
            all_ids = jax.lax.all_gather(flat, axis)  # int[P, n]
            cols = patched_take(tables[i], patches[i], all_ids)  # float[P, n, D/P]
            mine = jax.lax.all_to_all(cols, axis, 0, 0)  # float[P, n, D/P]: my tokens
            rows = jnp.moveaxis(mine, 0, 1).reshape(flat.shape[0], -1)  # float[n, D]
            out.append(rows.reshape(*ids.shape, rows.shape[-1]))
        else:
            cols = patched_take(tables[i], patches[i], ids)  # float[*ids, D/P]
            out.append(jax.lax.all_gather(cols, axis, axis=cols.ndim - 1, tiled=True))
    return out


def early_patches(ctx: StepContext, state: TrainState, firsts: dict[int, RowGrad]) -> dict:
    """Table index -> the update rows of ``ctx.table_optimizer`` on the first chunk's
    mean gradient (the state it returns is dropped: the full update recomputes it)."""
    leaves = jax.tree.leaves(state.params)
    out = {}
    for k, i in enumerate(sorted(firsts)):  # row states are in leaf order
        update, _ = ctx.table_optimizer.update(firsts[i], state.opt_state.rows[k], leaves[i])
        out[i] = RowGrad(firsts[i].ids, update)
    return out


def embrace_2d_rows_body(ctx: StepContext) -> Callable:
    """The pipelined EmbRace step with row-sparse table updates (see the module)."""
    widths = pipeline.table_widths(ctx)
    num, axis = ctx.num_workers, ctx.axis_name

    def body(state: TrainState, batch: PlacedBatch):
        f = pipeline.front(ctx, widths, state, batch)
        with jax.named_scope(schedule.SCOPE_HIGH):
            firsts = {i: summed(first_pairs(ctx, p), p.vocab) for i, p in f.plans.items()}
        with jax.named_scope(schedule.SCOPE_LOW):
            after = tuple(g.rows for g in firsts.values())
            later = {i: later_pairs(ctx, p, after) for i, p in f.plans.items()}
        fulls = [
            scaled(summed([firsts[i], *later[i]], f.plans[i].vocab) if later[i] else firsts[i], num)
            for i in sorted(widths)
        ]
        carry = ()
        if f.nxt is not None:
            with jax.named_scope(schedule.SCOPE_NEXT):
                patches = early_patches(ctx, state, {i: scaled(g, num) for i, g in firsts.items()})
                leaves = jax.tree.leaves(state.params)
                tables = {i: leaves[i] for i in widths}
                carry = tuple(patched_prefetch(tables, patches, f.nxt, axis))
            # the full update writes the tables in place once those reads are done
            fulls = [RowGrad(g.ids, pipeline.waits_for(g.rows, carry)) for g in fulls]
        new, loss = finish_step(ctx, state, f.rest, f.loss, f.agg_state, carry, rows=fulls)
        if f.nxt is None:
            return new, loss
        return new._replace(carry=pipeline.checked_carry(ctx, new, f.nxt, f.spill, loss)), loss

    return body
