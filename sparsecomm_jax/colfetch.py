"""EmbRace's column-wise exchange for a whole step at once, each row travelling once.

``rowgrad.column_layout`` exchanges every lookup on its own: per lookup an all-gather of
ids and an all-to-all of rows forward, another all-to-all backward, and every token's row
travels even when the id repeats. Here all the lookups of a step share one exchange:

- one all-gather of every worker's ids (the ids of shared lookups, identical on every
  worker, do not travel);
- per table and worker, the *distinct* ids of all its lookups (tokens and shared
  negatives together), padded to a static capacity sized on the host per batch
  (``CAPACITY``);
- one all-to-all of those rows' columns forward, one of their gradients backward
  (duplicates summed before they leave).

With Zipf tokens and log-uniform negatives most ids repeat: the LSTM LM at V=100k with
16 x 32 tokens and 1,024 negatives per worker reads about 290 distinct input rows of
512 and 870 distinct output rows of 1,536. The result is exact: every token gets its
row, and every owner the sum of its rows' gradients.

Example:
    >>> import numpy as np
    >>> from sparsecomm_jax import colfetch
    >>> colfetch.grow_by_eighth(290)
    328

References:
    Li et al., "EmbRace: Accelerating Sparse Communication for Distributed Training of
    Deep Neural Networks", ICPP 2022.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsecomm_jax import embedding, rowgrad
from sparsecomm_jax.placement import CapacityPolicy
from sparsecomm_jax.rowgrad import F32, TableLayout
from sparsecomm_jax.step import Batch, StepContext

# ------------------------------------------------------------------ host: capacity


def grow_by_eighth(need: int) -> int:
    """12.5% headroom, in multiples of 8: rows are padded little, recompiles are rare."""
    return max(8, -(-int(need * 1.125) // 8) * 8)


def _distinct(ids):
    s = jnp.sort(ids)
    return 1 + jnp.sum(s[1:] != s[:-1]) if s.size else jnp.zeros((), jnp.int32)


def _counter(ctx: StepContext, batch: Batch):
    """Jitted ``batch -> int[P, T]``: distinct ids each worker reads of each table."""
    leaves, treedef = jax.tree.flatten(ctx.params)
    flags = jax.tree.leaves(ctx.table_mask)
    tables = [i for i, f in enumerate(flags) if f]
    widths = {i: int(np.shape(leaves[i])[1]) for i in tables}
    shapes = [(np.shape(x), np.asarray(x).dtype) for x in leaves]

    def one_worker(data):
        params = treedef.unflatten([jnp.zeros(s, d) for s, d in shapes])
        calls = embedding.logged_lookups(ctx.loss_fn, params, data, ctx.table_mask, widths)
        counts = []
        for i in tables:
            ids = [c[2].reshape(-1) for c in calls if c[1] == i and c[0] != "attend"]
            counts.append(_distinct(jnp.concatenate(ids)) if ids else jnp.zeros((), jnp.int32))
        return jnp.stack(counts)

    axes = {k: None if k in ctx.replicated_keys else 0 for k in batch}
    return jax.jit(jax.vmap(one_worker, in_axes=(axes,)))


_COUNTERS: list = []  # (ctx, batch keys, fn), the latest few


def distinct_reads(ctx: StepContext, batch: Batch) -> tuple[int, ...]:
    """Per table (leaf order), the most distinct ids any worker reads in ``batch``."""
    keys = tuple(sorted(batch))
    fn = next((f for c, k, f in _COUNTERS if c is ctx and k == keys), None)
    if fn is None:
        fn = _counter(ctx, batch)
        _COUNTERS[:] = [*_COUNTERS[-3:], (ctx, keys, fn)]
    num = ctx.num_workers
    data = {
        k: np.asarray(v) if k in ctx.replicated_keys else np.reshape(v, (num, -1, *v.shape[1:]))
        for k, v in batch.items()
    }
    data = jax.device_put(data, jax.local_devices()[0])
    return tuple(int(c) for c in np.asarray(fn(data)).max(axis=0))


def _need(ctx: StepContext, batch: Batch):
    return distinct_reads(ctx, batch) if ctx.table_optimizer is not None else 0


CAPACITY = CapacityPolicy(_need, "distinct rows of one table on one worker", grow_by_eighth)


# ------------------------------------------------------------- device: the exchange


def _segments(reads, gathered, num: int):
    """Per table, every worker's ids of its reads in call order: int[P, m]."""
    per_table: dict[int, list] = {}
    off = 0
    for kind, i, ids in reads:
        n = ids.size
        if kind == "lookup":  # gathered: int[P, n_all]
            seg = gathered[:, off : off + n]
            off += n
        else:  # shared ids: the same on every worker
            seg = jnp.broadcast_to(ids.reshape(1, n), (num, n))
        per_table.setdefault(i, []).append(seg)
    return {i: jnp.concatenate(s, axis=1) for i, s in per_table.items()}


def _mine(reads, i):
    return jnp.concatenate([ids.reshape(-1) for _, j, ids in reads if j == i])


def column_fetch(shards, reads, caps: dict[int, int], axis: str, wire=F32):
    """Rows of every read of a step through one exchange of distinct rows.

    Use inside ``shard_map``.

    Args:
      shards: the parameter leaves (tables: float[V, D/P], this worker's columns).
      reads: ``(kind, leaf index, ids)`` per lookup, ``kind`` ``"lookup"`` (this
        worker's ids) or ``"lookup_shared"`` (ids identical on every worker).
      caps: leaf index -> C, slots for the distinct ids one worker reads of the table
        (``CAPACITY``); ids beyond it get NaN rows (never silently wrong).
      axis: the mesh axis.
      wire: the dtype rows travel in.

    Returns:
      ``(rows, back)``: ``rows[k]`` float[*ids.shape, D] for read k; ``back(grads)``
      -> list of ``(leaf index, (ids, rows))``: this worker's columns of every worker's
      distinct ids (padding ids = V) and their gradients summed per worker.
    """
    num, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    local = [ids.reshape(-1) for kind, _, ids in reads if kind == "lookup"]
    gathered = (
        jax.lax.all_gather(jnp.concatenate(local), axis, to="invarying") if local else None
    )  # int[P, n_all]: every worker's ids of every lookup
    plans = {}
    for i, every in _segments(reads, gathered, num).items():
        vocab, cap = shards[i].shape[0], min(caps[i], every.shape[1])
        uniq = jax.vmap(lambda x, v=vocab, c=cap: jnp.unique(x, size=c, fill_value=v))(every)
        mine = _mine(reads, i)  # int[m]
        at = jnp.clip(jnp.searchsorted(uniq[me], mine), 0, cap - 1)  # uniq[me]: int[C]
        plans[i] = (uniq, at, uniq[me][at] == mine)  # int[P, C], int[m], bool[m]
    cols = [
        jnp.take(shards[i], uniq, axis=0, mode="fill", fill_value=0).reshape(num, -1)
        for i, (uniq, _, _) in plans.items()
    ]  # float[P, C * D/P]: my columns of each worker's distinct rows
    got = rowgrad.a2a(jnp.concatenate(cols, axis=1), axis, wire)  # [P, sum C * D/P]
    table_rows, off = {}, 0
    for i, (uniq, at, found) in plans.items():
        width = shards[i].shape[1]
        block = got[:, off : off + uniq.shape[1] * width].reshape(num, -1, width)
        off += uniq.shape[1] * width
        full = jnp.swapaxes(block, 0, 1).reshape(uniq.shape[1], num * width)  # [C, D]
        table_rows[i] = jnp.where(found[:, None], jnp.take(full, at, axis=0), jnp.nan)
    return _per_read(reads, table_rows), _backward(shards, reads, plans, axis, wire)


def _per_read(reads, table_rows):
    out, pos = [], dict.fromkeys(table_rows, 0)
    for _, i, ids in reads:
        rows = table_rows[i][pos[i] : pos[i] + ids.size]
        pos[i] += ids.size
        out.append(rows.reshape(*ids.shape, -1))
    return out


def _backward(shards, reads, plans, axis: str, wire):
    num = jax.lax.axis_size(axis)

    def back(grads):
        blocks = []
        for i, (uniq, at, found) in plans.items():
            full_width = shards[i].shape[1] * num
            g = jnp.concatenate(
                [
                    g.reshape(-1, full_width)
                    for (_, j, _), g in zip(reads, grads, strict=True)
                    if j == i
                ]
            )  # float[m, D]
            slot = jnp.where(found, at, uniq.shape[1])  # ids beyond the capacity: dropped
            summed = jnp.zeros((uniq.shape[1], full_width), F32).at[slot].add(g, mode="drop")
            blocks.append(rowgrad.column_blocks(summed, num).reshape(num, -1))  # [P, C*D/P]
        got = rowgrad.a2a(jnp.concatenate(blocks, axis=1), axis, wire)
        out, off = [], 0
        for i, (uniq, _, _) in plans.items():
            size = uniq.shape[1] * shards[i].shape[1]
            rows = got[:, off : off + size].reshape(-1, shards[i].shape[1])  # [P*C, D/P]
            off += size
            out.append((i, (uniq.reshape(-1), rows)))
        return out

    return back


def column_layout(axis: str, caps: dict[int, int], wire=F32) -> TableLayout:
    """``rowgrad.column_layout`` whose lookups of a step share one exchange
    (``column_fetch``); ``caps``: leaf index -> slots for a worker's distinct ids."""
    base = rowgrad.column_layout(axis, wire)

    def fetch_all(leaves, reads):
        return column_fetch(leaves, reads, caps, axis, wire)

    return base._replace(fetch_all=fetch_all)
