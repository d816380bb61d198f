"""Table gradients as rows: O(tokens x D) per step, never a dense V x D gradient.

The table lookups run outside the differentiated function; the loss is differentiated
with respect to the looked-up rows, and each lookup's row gradients travel back to the
rows' owners by the transpose of its forward exchange. The owner ends with ``(id, row)``
pairs that ``rowwise.segment_rows`` sums per id, ready for a ``rowwise.RowTransform``.

Every exchange of rows can travel in a narrower ``wire`` dtype (``bfloat16``: half the
bytes); rows are cast back to float32 on arrival and summed in float32 there. A tied
full softmax (``emb.attend``) gathers its table in float32.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax import rowgrad
    >>> rowgrad.wire_dtype("bfloat16") == jnp.bfloat16
    True

References:
    Li et al., "EmbRace", ICPP 2022 (the column-wise exchange); Mudigere et al.,
    "High-performance, Distributed Training of Large-scale DLRMs", 2021 (row-wise
    sparse updates, quantized embedding communication).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsecomm_jax import embedding, fusion
from sparsecomm_jax.aggregators import Aggregator, EmptyState, vary
from sparsecomm_jax.rowwise import RowGrad, segment_rows

COMM_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
F32 = jnp.float32


def wire_dtype(name: str):
    """The dtype called ``name`` in ``COMM_DTYPES``; one-line ``ValueError`` otherwise."""
    if name not in COMM_DTYPES:
        raise ValueError(f"unknown comm_dtype {name!r}; choose one of {sorted(COMM_DTYPES)}")
    return COMM_DTYPES[name]


class Fetched(NamedTuple):
    """One lookup's rows and the way back for their gradient.

    Attributes:
      rows: float[*ids.shape, D] the looked-up rows.
      back: ``back(g) -> (ids, rows)``: the gradient ``g`` of ``rows`` as (row index in
        this worker's shard, gradient row) pairs; indices outside the shard are padding.
    """

    rows: jax.Array
    back: Callable[[jax.Array], tuple[jax.Array, jax.Array]]


class TableLayout(NamedTuple):
    """How a strategy reads its tables and returns row gradients to their owners.

    Attributes:
      axis: the mesh axis the tables are sharded (or replicated) over.
      lookup: ``lookup(shard, ids) -> Fetched`` for this worker's ids.
      lookup_shared: the same for ids every worker holds identically.
      attend: ``attend(shard, h) -> logits`` (tied full softmax; autodiff'd, dense).
      sum_dense: sums the (dense) ``attend`` gradient of a shard over workers.
      fetch_all: ``fetch_all(leaves, reads) -> (rows, back)``: every read of a step at
        once (``colfetch``); ``back(grads)`` -> ``[(leaf index, (ids, rows)), ...]``.
        ``None``: each read through ``lookup`` / ``lookup_shared`` on its own.
    """

    axis: str
    lookup: Callable[[jax.Array, jax.Array], Fetched]
    lookup_shared: Callable[[jax.Array, jax.Array], Fetched]
    attend: Callable[[jax.Array, jax.Array], jax.Array]
    sum_dense: Callable[[jax.Array], jax.Array]
    fetch_all: Callable | None = None


def _send(x, wire):
    """``x`` as it travels: float32, or ``wire`` bits as uint16 (data movement only, so
    no backend widens the collective back to float32)."""
    if wire == F32:
        return x.astype(F32)
    return jax.lax.bitcast_convert_type(x.astype(wire), jnp.uint16)


def _receive(x, wire):
    return x if wire == F32 else jax.lax.bitcast_convert_type(x, wire).astype(F32)


def a2a(x, axis: str, wire=F32):
    """``all_to_all`` over the leading axis in ``wire``, back in float32."""
    return _receive(jax.lax.all_to_all(_send(x, wire), axis, 0, 0), wire)


def _gather(x, axis: str, wire, dim: int = 0, to: str = "varying"):
    """Tiled ``all_gather`` along ``dim`` in ``wire``, back in float32 (``to``:
    ``"invarying"`` types the result replicated, for ``check_vma``)."""
    gathered = jax.lax.all_gather(_send(x, wire), axis, axis=dim, tiled=True, to=to)
    return _receive(gathered, wire)


def wire_psum(x, axis: str, wire=F32, scatter: bool = False):
    """``psum`` of ``x``; in a narrow ``wire`` (or with ``scatter``) it is an all-to-all
    (each worker gets every worker's copy of one 1/P slice), a float32 sum, and an
    all-gather of the sums: the bytes of a ring all-reduce in ``wire``, summed in
    float32, in two collectives of one operand each."""
    if wire == F32 and not scatter:
        return jax.lax.psum(x, axis)
    num, flat = jax.lax.axis_size(axis), x.reshape(-1)  # x: float[d]
    flat = jnp.pad(flat, (0, fusion.padded_size(flat.shape[0], num) - flat.shape[0]))
    mine = a2a(flat.reshape(num, -1), axis, wire).sum(axis=0)  # float[d/P]
    return _gather(mine, axis, wire, to="invarying")[: x.size].reshape(x.shape)


def column_blocks(g, num: int):
    """float[n, D] -> float[P, n, D/P]: block j holds columns jD/P..(j+1)D/P."""
    return jnp.swapaxes(g.reshape(g.shape[0], num, -1), 0, 1)


def column_layout(axis: str, wire=F32) -> TableLayout:
    """Column-sharded tables (``embrace``): see ``embedding.column_lookup``."""

    def lookup(shard, ids):
        num, flat = jax.lax.axis_size(axis), ids.reshape(-1)  # ids: int[n]
        all_ids = jax.lax.all_gather(flat, axis, to="invarying")  # int[P, n], on all workers
        mine = a2a(jnp.take(shard, all_ids, axis=0), axis, wire)  # float[P, n, D/P]
        rows = jnp.swapaxes(mine, 0, 1).reshape(*ids.shape, -1)  # float[*ids, D]

        def back(g):  # g: float[*ids, D] -> my columns of every worker's tokens
            got = a2a(column_blocks(g.reshape(flat.shape[0], -1), num), axis, wire)
            return all_ids.reshape(-1), got.reshape(-1, shard.shape[1])  # [P*n], [P*n, D/P]

        return Fetched(rows, back)

    def lookup_shared(shard, ids):
        num, flat = jax.lax.axis_size(axis), ids.reshape(-1)  # ids: int[N]
        cols = jnp.take(shard, flat, axis=0)  # float[N, D/P]
        rows = _gather(cols, axis, wire, dim=1)  # float[N, D]

        def back(g):  # every worker's gradient of my columns, summed here in float32
            got = a2a(column_blocks(g.reshape(flat.shape[0], -1), num), axis, wire)
            return flat, got.sum(axis=0)  # int[N], float[N, D/P]

        return Fetched(rows.reshape(*ids.shape, -1), back)

    return TableLayout(axis, lookup, lookup_shared, _gathered_attend(axis, 1), lambda g: g)


def row_layout(axis: str, capacity: int, wire=F32) -> TableLayout:
    """Row-sharded tables with de-duplication (``embrace_rowwise``): see
    ``embedding.row_lookup``; ``capacity`` slots per (worker, owner) bucket."""

    def lookup(shard, ids):
        num, (rows_per, width) = jax.lax.axis_size(axis), shard.shape
        flat = ids.reshape(-1)  # int[n]
        cap = min(capacity, flat.shape[0])
        send, pos = embedding.bucket_plan(flat, rows_per * num, num, cap)  # int[P, C], [n]
        asked = jax.lax.all_to_all(send, axis, 0, 0)  # int[P, C]: ids others want of me
        local = jnp.where(asked >= 0, asked - jax.lax.axis_index(axis) * rows_per, rows_per)
        found = jnp.take(shard, local, axis=0, mode="fill", fill_value=0)  # float[P, C, D]
        got = a2a(found, axis, wire).reshape(num * cap, width)  # float[P*C, D]
        rows = jnp.take(got, pos, axis=0).reshape(*ids.shape, width)

        def back(g):  # duplicates summed before the reverse exchange
            g_got = jnp.zeros((num * cap, width), F32).at[pos].add(g.reshape(-1, width))
            g_found = a2a(g_got.reshape(num, cap, width), axis, wire)  # float[P, C, D]
            return local.reshape(-1), g_found.reshape(-1, width)

        return Fetched(rows, back)

    def lookup_shared(shard, ids):
        rows_per = shard.shape[0]
        local = ids - jax.lax.axis_index(axis) * rows_per
        owned = (local >= 0) & (local < rows_per)
        mine = jnp.take(shard, jnp.where(owned, local, rows_per), axis=0, mode="fill", fill_value=0)
        rows = wire_psum(mine, axis, wire)  # one owner per id

        def back(g):  # every worker's gradient, summed
            total = wire_psum(g, axis, wire)
            return jnp.where(owned, local, rows_per).reshape(-1), total.reshape(ids.size, -1)

        return Fetched(rows, back)

    return TableLayout(axis, lookup, lookup_shared, _gathered_attend(axis, 0), lambda g: g)


def replicated_layout(axis: str, wire=F32) -> TableLayout:
    """Replicated tables (``sparse_allgather``): local lookups; the (id, row) pairs of
    every worker are all-gathered, so each replica applies the same update."""

    def lookup(table, ids):
        def back(g):
            flat = ids.reshape(-1)  # int[n]
            all_ids = jax.lax.all_gather(flat, axis, tiled=True, to="invarying")  # int[P*n]
            rows = _gather(g.reshape(flat.shape[0], -1), axis, wire, to="invarying")
            return all_ids, rows  # int[P*n], float[P*n, D]: the same on every worker

        return Fetched(jnp.take(table, ids, axis=0), back)

    return TableLayout(
        axis, lookup, lookup, lambda t, h: h @ t.T, lambda g: wire_psum(g, axis, wire)
    )


def _gathered_attend(axis: str, dim: int):
    """``h @ table.T`` on the gathered table (float32: the tied full softmax is
    differentiated through this gather, whose transpose is a reduce-scatter)."""
    return lambda shard, h: h @ jax.lax.all_gather(shard, axis, axis=dim, tiled=True).T


def table_row_grads(loss_fn, params, batch, mask, layout: TableLayout, widths: dict[int, int]):
    """Loss, gradient of the non-table leaves, and each table's gradient as rows.

    Use inside ``shard_map``. The table rows are the mean over workers (the sum that
    reaches the owner divided by P), like ``pmean`` for the other leaves, which this
    does not reduce.

    Args:
      loss_fn: ``loss_fn(params, batch, emb) -> scalar``.
      params: parameters (tables as this worker holds them).
      batch: this worker's batch.
      mask: bool per leaf of ``params``: is it a table?
      layout: the strategy's ``TableLayout``.
      widths: leaf index -> full row width D of each table.

    Returns:
      ``(loss, grads, rows)``: ``grads`` shaped like ``params`` (tables' entries hold
      only their dense ``attend`` part; ignore them), ``rows`` leaf index -> ``RowGrad``.
    """
    leaves = jax.tree.leaves(params)
    calls = embedding.logged_lookups(loss_fn, params, batch, mask, widths, attend=layout.attend)
    reads = [c for c in calls if c[0] != "attend"]
    rows_in, back = (layout.fetch_all or _each_read(layout))(leaves, reads)

    def loss_of_rows(p, rows):
        pending = iter(rows)
        ops = embedding.recording_ops(p, mask, [], lambda *_: next(pending), attend=layout.attend)
        return loss_fn(p, batch, ops)

    varying = vary((params, rows_in), layout.axis)  # each worker's own gradient
    loss, (grads, g_rows) = jax.value_and_grad(loss_of_rows, argnums=(0, 1))(*varying)
    pairs: dict[int, list] = {i: [] for i in widths}
    for i, pair in back(g_rows):
        pairs[i].append(pair)
    g_leaves = jax.tree.leaves(grads)
    for i in {i for kind, i, _ in calls if kind == "attend"}:
        num_rows = leaves[i].shape[0]
        pairs[i].append((jnp.arange(num_rows), layout.sum_dense(g_leaves[i]).astype(F32)))
    num = jax.lax.axis_size(layout.axis)
    return loss, grads, {i: _mean_rows(pairs[i], leaves[i], num) for i in pairs}


def _each_read(layout: TableLayout):
    """``fetch_all`` from a layout's per-read ``lookup`` and ``lookup_shared``."""

    def fetch_all(leaves, reads):
        fetched = [
            (layout.lookup if kind == "lookup" else layout.lookup_shared)(leaves[i], ids)
            for kind, i, ids in reads
        ]

        def back(grads):
            return [(i, f.back(g)) for (_, i, _), f, g in zip(reads, fetched, grads, strict=True)]

        return [f.rows for f in fetched], back

    return fetch_all


def _mean_rows(pairs: list, shard: jax.Array, num: int) -> RowGrad:
    if not pairs:
        return RowGrad(jnp.zeros((0,), jnp.int32), jnp.zeros((0, shard.shape[1]), F32))
    ids = jnp.concatenate([a.astype(jnp.int32) for a, _ in pairs])
    grad = segment_rows(ids, jnp.concatenate([b for _, b in pairs]), shard.shape[0])
    return RowGrad(grad.ids, grad.rows / num)


def wire_mean(axis: str, wire=jnp.bfloat16) -> Aggregator:
    """``pmean`` of every gradient leaf, fused into one ``wire_psum`` (all-to-all, sum,
    all-gather of one flat buffer): half the bytes of the float32 all-reduce in
    ``bfloat16``, summed in float32 at each receiver. In float32 it sends the bytes of
    ``pmean``, but as two one-operand collectives: over gloo (CPU) an all-reduce of many
    leaves runs one ring per leaf, each paying the link's round trips."""

    def update(grads, state):
        leaves, treedef = jax.tree.flatten(grads)
        if not leaves:
            return grads, state
        bucket = list(range(len(leaves)))
        flat = fusion.pack([x.astype(F32) for x in leaves], bucket)  # float[d]
        mean = wire_psum(flat, axis, wire, scatter=True) / jax.lax.axis_size(axis)
        out = fusion.unpack(mean, leaves, bucket)
        return treedef.unflatten([out[i] for i in bucket]), state

    return Aggregator(init=lambda params: EmptyState(), update=update)
