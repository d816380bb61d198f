"""Sharded embedding tables: column-wise (EmbRace) and row-wise with de-duplication.

Planning (which id goes to which worker, capacities, slots) is in pure functions that
run on host numpy or inside jit; the collectives are thin wrappers used inside
``shard_map`` bodies with an explicit ``axis_name``. Gradients need no custom rule: the
transpose of each forward collective routes every token's gradient to the table's owner,
which receives the *sum over workers*; divide by P for the mean (see ``train``).

Layouts, for a V x D table on P workers:

========== ======================= =========================================
layout     worker j holds          global sharding
========== ======================= =========================================
column     ``table[:, jD/P:(j+1)D/P]``  ``PartitionSpec(None, axis)``
row        ``table[jV/P:(j+1)V/P, :]``  ``PartitionSpec(axis, None)``
========== ======================= =========================================

Example:
    >>> import jax, numpy as np
    >>> from sparsecomm_jax import embedding, runtime
    >>> mesh = runtime.data_mesh()
    >>> table = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    >>> sharded = embedding.shard_table(table, mesh, "column", "data")
    >>> bool((runtime.to_host(sharded) == table).all())
    True

References:
    Li et al., "EmbRace: Accelerating Sparse Communication for Distributed Training of
    Deep Neural Networks", ICPP 2022.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.aggregators import vary

LAYOUTS = ("column", "row")


class EmbeddingOps(NamedTuple):
    """How a model touches its embedding tables; strategies swap the implementation.

    Attributes:
      lookup: ``lookup(table, ids) -> rows``: rows ``[*ids.shape, D]`` of ``table``
        for this worker's ``ids``.
      attend: ``attend(table, h) -> logits``: ``h @ table.T`` (tied output softmax).
      lookup_shared: like ``lookup`` for ids that every worker holds identically
        (shared negative samples); sharded strategies exchange them more cheaply.
    """

    lookup: Callable[[jax.Array, jax.Array], jax.Array]
    attend: Callable[[jax.Array, jax.Array], jax.Array]
    lookup_shared: Callable[[jax.Array, jax.Array], jax.Array]


def _take(table, ids):
    return jnp.take(table, ids, axis=0)


DENSE_EMBEDDING = EmbeddingOps(lookup=_take, attend=lambda t, h: h @ t.T, lookup_shared=_take)


# ----------------------------------------------------------------------------- tables


def table_spec(layout: str, axis_name: str) -> P:
    """The global ``PartitionSpec`` of a table in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return P(None, axis_name) if layout == "column" else P(axis_name, None)


def check_divisible(shape: tuple[int, ...], layout: str, num_workers: int, name: str) -> None:
    """``ValueError`` unless the sharded dimension of a V x D table divides by P."""
    if len(shape) != 2:
        raise ValueError(f"embedding table {name} must be 2-D (V x D), got shape {shape}")
    dim, what = (shape[1], "D (columns)") if layout == "column" else (shape[0], "V (rows)")
    if dim % num_workers:
        raise ValueError(
            f"embedding table {name} has {what} = {dim}, not divisible by the "
            f"{num_workers} workers of the {layout}-wise layout"
        )


def shard_table(table: np.ndarray, mesh: Mesh, layout: str, axis_name: str) -> jax.Array:
    """An ordinary V x D table as a sharded global array (each worker its shard)."""
    check_divisible(np.shape(table), layout, runtime.mesh_axis_size(mesh, axis_name), "table")
    return runtime.put_global(np.asarray(table), mesh, table_spec(layout, axis_name))


# --------------------------------------------------------------------------- planning


def row_owner(ids, rows_per_shard: int):
    """Worker that owns each id in the row-wise layout: ``ids // (V/P)``."""
    return ids // rows_per_shard


def rowwise_capacity(worker_ids: list[np.ndarray], vocab: int, num_workers: int) -> int:
    """Slots per (worker, owner) bucket that a batch needs: the largest number of
    *distinct* ids any worker asks of any owner (host-side, numpy).

    Example: P=2, V=8 (4 rows each); worker 0 asks [1, 1, 2, 5], worker 1 asks [6, 7, 7]:
    worker 0 needs 2 slots at owner 0 and 1 at owner 1; worker 1 needs 2 at owner 1 -> 2.
    """
    rows = vocab // num_workers
    need = 0
    for ids in worker_ids:
        uniq = np.unique(np.asarray(ids).ravel())
        if uniq.size:
            need = max(need, int(np.bincount(uniq // rows, minlength=num_workers).max()))
    return need


def bucket_plan(ids, vocab: int, num_workers: int, capacity: int):
    """Per-owner buckets of the distinct ids in ``ids`` (pure, jit-able).

    Args:
      ids: int[n] ids of one worker, in [0, vocab).
      vocab: V; owner of id v is ``v // (V/P)``.
      num_workers: P.
      capacity: C, slots per owner.

    Returns:
      ``(send_ids, position)``: ``send_ids`` int[P, C] holds, in row o, the distinct ids
      owned by worker o (-1 in unused slots); ``position`` int[n] is where each id's row
      lands in the flattened [P * C] reply. Ids that do not fit get position P * C
      (callers must size C with ``rowwise_capacity`` so that none overflow).

    Example (P=2, V=8, C=2): ids [5, 1, 5, 2] -> send_ids [[1, 2], [5, -1]],
    position [2, 0, 2, 1].
    """
    n = ids.shape[0]
    rows = vocab // num_workers
    uniq, inverse = jnp.unique(ids, size=n, fill_value=vocab, return_inverse=True)
    owner = row_owner(uniq, rows)
    first = jnp.searchsorted(uniq, jnp.arange(num_workers) * rows)
    slot = jnp.arange(n) - first[jnp.minimum(owner, num_workers - 1)]
    fits = (uniq < vocab) & (slot < capacity)
    flat = jnp.where(fits, owner * capacity + slot, num_workers * capacity)
    send = jnp.full((num_workers * capacity,), -1, ids.dtype).at[flat].set(uniq, mode="drop")
    return send.reshape(num_workers, capacity), flat[inverse.reshape(-1)]


# ------------------------------------------------------------------------ collectives


def column_lookup(shard, ids, axis_name: str):
    """Rows of a column-sharded table for this worker's ``ids`` (inside ``shard_map``).

    Per worker (P=2, D=4, worker j holds columns 2j..2j+1; ids a on w0, b on w1)::

        before: w0 ids [a], shard T[:, 0:2]     w1 ids [b], shard T[:, 2:4]
        all_gather ids:   both see [[a], [b]]
        local take:       w0 [[T[a,0:2]], [T[b,0:2]]]   w1 [[T[a,2:4]], [T[b,2:4]]]
        all_to_all:       w0 [[T[a,0:2]], [T[a,2:4]]]   w1 [[T[b,0:2]], [T[b,2:4]]]
        after (concat):   w0 [T[a, :]]                  w1 [T[b, :]]

    The backward pass is the same exchange reversed: owner j receives the gradient of
    its columns for every worker's tokens and scatter-adds it into its shard.

    Args:
      shard: float[V, D/P], this worker's columns.
      ids: int[...] this worker's token ids.
      axis_name: the mesh axis the table is sharded over.

    Returns:
      float[*ids.shape, D].
    """
    flat = ids.reshape(-1)  # ids: int[n]
    all_ids = jax.lax.all_gather(flat, axis_name)  # int[P, n]
    cols = jnp.take(shard, all_ids, axis=0)  # float[P, n, D/P]: my columns, every worker
    mine = jax.lax.all_to_all(cols, axis_name, 0, 0)  # float[P, n, D/P]: my tokens, P slices
    rows = jnp.moveaxis(mine, 0, 1).reshape(flat.shape[0], -1)  # float[n, D]
    return rows.reshape(*ids.shape, rows.shape[-1])


def column_lookup_shared(shard, ids, axis_name: str):
    """Rows for ids that every worker holds identically (e.g. shared negatives).

    No id exchange is needed: each worker takes its columns and one tiled all-gather
    concatenates them (before: w_j holds ``T[ids, cols_j]``; after: all hold
    ``T[ids, :]``). Backward: a reduce-scatter sums every worker's gradient per owner.
    """
    cols = jnp.take(shard, ids, axis=0)  # float[*ids, D/P]
    return jax.lax.all_gather(cols, axis_name, axis=cols.ndim - 1, tiled=True)


def row_lookup(shard, ids, axis_name: str, capacity: int):
    """Rows of a row-sharded table for this worker's distinct ``ids``.

    Per worker (P=2, V=8: w0 owns rows 0-3, w1 rows 4-7; C=2)::

        before:      w0 ids [5, 1, 5]            w1 ids [2, 2]
        buckets:     w0 [[1, -], [5, -]]         w1 [[2, -], [-, -]]
        all_to_all:  w0 asked [[1, -], [2, -]]   w1 asked [[5, -], [-, -]]
        local take + all_to_all back, then each token picks its row:
        after:       w0 [T5, T1, T5]             w1 [T2, T2]

    Duplicate ids travel once; their gradients are summed locally before the reverse
    exchange. ``capacity`` must cover the batch (``rowwise_capacity``).

    Args:
      shard: float[V/P, D], this worker's rows.
      ids: int[...] this worker's token ids.
      axis_name: the mesh axis.
      capacity: C, slots per (worker, owner) bucket.

    Returns:
      float[*ids.shape, D].
    """
    num = jax.lax.axis_size(axis_name)
    rows_per, width = shard.shape
    flat = ids.reshape(-1)  # int[n]
    cap = min(capacity, flat.shape[0])
    send, pos = bucket_plan(flat, rows_per * num, num, cap)  # int[P, C], int[n]
    asked = jax.lax.all_to_all(send, axis_name, 0, 0)  # int[P, C]: ids others want of me
    local = asked - jax.lax.axis_index(axis_name) * rows_per
    found = jnp.take(shard, jnp.clip(local, 0, rows_per - 1), axis=0)  # float[P, C, D]
    found = jnp.where((asked >= 0)[..., None], found, 0.0)
    got = jax.lax.all_to_all(found, axis_name, 0, 0).reshape(num * cap, width)  # [P*C, D]
    return jnp.take(got, pos, axis=0).reshape(*ids.shape, width)


def row_lookup_shared(shard, ids, axis_name: str):
    """Rows for ids that every worker holds identically: owners fill theirs, one psum."""
    rows_per = shard.shape[0]
    local = ids - jax.lax.axis_index(axis_name) * rows_per
    owned = (local >= 0) & (local < rows_per)
    rows = jnp.take(shard, jnp.clip(local, 0, rows_per - 1), axis=0)
    return jax.lax.psum(jnp.where(owned[..., None], rows, 0.0), axis_name)


def gathered_attend(shard, h, axis_name: str, layout: str):
    """``h @ table.T`` for a tied output softmax: gathers the table (its gradient, a
    dense V x D, returns to the owners by reduce-scatter)."""
    axis = 1 if layout == "column" else 0
    return h @ jax.lax.all_gather(shard, axis_name, axis=axis, tiled=True).T


def column_ops(axis_name: str) -> EmbeddingOps:
    """``EmbeddingOps`` for column-sharded tables (EmbRace)."""
    return EmbeddingOps(
        lookup=lambda t, ids: column_lookup(t, ids, axis_name),
        attend=lambda t, h: gathered_attend(t, h, axis_name, "column"),
        lookup_shared=lambda t, ids: column_lookup_shared(t, ids, axis_name),
    )


def row_ops(axis_name: str, capacity: int) -> EmbeddingOps:
    """``EmbeddingOps`` for row-sharded tables with de-duplication."""
    return EmbeddingOps(
        lookup=lambda t, ids: row_lookup(t, ids, axis_name, capacity),
        attend=lambda t, h: gathered_attend(t, h, axis_name, "row"),
        lookup_shared=lambda t, ids: row_lookup_shared(t, ids, axis_name),
    )


def allgather_sparse_grad(ids, rows, vocab: int, axis_name: str):
    """Sum over workers of sparse (id, gradient row) pairs as a dense V x D gradient.

    As Horovod and PyTorch DDP do: all-gather every worker's pairs (grows with P), add.

    Args:
      ids: int[n] this worker's ids.
      rows: float[n, D] their gradient rows.
      vocab: V.
      axis_name: the mesh axis.

    Returns:
      float[V, D], identical on every worker (and typed so, for ``check_vma``).
    """
    all_ids = jax.lax.all_gather(ids, axis_name, tiled=True, to="invarying")  # int[P*n]
    all_rows = jax.lax.all_gather(rows, axis_name, tiled=True, to="invarying")  # float[P*n, D]
    return jnp.zeros((vocab, rows.shape[-1]), rows.dtype).at[all_ids].add(all_rows)


# ------------------------------------------------- sparse gradients of replicated tables


def recording_ops(
    params, mask, log: list, supply, attend_error: str = "", attend: Callable | None = None
) -> EmbeddingOps:
    """``EmbeddingOps`` that log every table access as ``(kind, table index, ids)`` and
    return ``supply(kind, index, table, ids)`` as the rows.

    ``kind`` is ``"lookup"``, ``"lookup_shared"`` or ``"attend"`` (ids ``None``; attend
    computes ``attend(table, h)``, by default ``h @ table.T``). Tables are recognised by
    identity among the leaves of ``params`` flagged in ``mask``. With ``attend_error``,
    ``attend`` raises ``ValueError(attend_error)`` (strategies that cannot serve it).
    """
    attend_fn = attend or (lambda t, h: h @ t.T)
    leaves, flags = jax.tree.leaves(params), jax.tree.leaves(mask)
    index = {id(x): i for i, (x, f) in enumerate(zip(leaves, flags, strict=True)) if f}

    def which(table) -> int:
        if id(table) not in index:
            raise ValueError(
                "a lookup read an array that is not one of the embedding tables: pass the "
                "table parameter itself to emb.lookup / emb.attend"
            )
        return index[id(table)]

    def access(kind):
        def fn(table, ids):
            i = which(table)
            log.append((kind, i, ids))
            return supply(kind, i, table, ids)

        return fn

    def attend_logged(table, h):
        if attend_error:
            raise ValueError(attend_error)
        log.append(("attend", which(table), None))
        return attend_fn(table, h)

    return EmbeddingOps(
        lookup=access("lookup"), attend=attend_logged, lookup_shared=access("lookup_shared")
    )


def logged_lookups(
    loss_fn, params, batch, mask, widths: dict[int, int], attend_error="", attend=None
) -> list:
    """The table accesses ``loss_fn`` makes on ``batch``, with their (traced) ids.

    The loss itself is computed on zero rows and discarded (XLA removes it); only the
    ids remain. ``widths``: table index -> full row width D; ``attend``: as in
    ``recording_ops`` (sharded tables need theirs).
    """
    log: list = []

    def zeros(kind, i, table, ids):
        return jnp.zeros((*ids.shape, widths[i]), table.dtype)

    loss_fn(params, batch, recording_ops(params, mask, log, zeros, attend_error, attend))
    return log


def sparse_table_grads(loss_fn, params, batch, mask, axis_name: str):
    """Loss and mean gradient when tables are replicated but their gradients travel as
    (id, row) pairs (``allgather_sparse_grad``); other leaves are ``pmean``-ed.

    Use inside ``shard_map``. Tables read through ``emb.attend`` (tied full softmax) also
    get that dense part of their gradient by ``pmean``.

    Returns:
      ``(loss, grads)`` with ``grads`` shaped like ``params``.
    """
    widths = {i: x.shape[1] for i, x in enumerate(jax.tree.leaves(params)) if x.ndim == 2}
    accesses: list = []  # (table index, ids shape) of every lookup, in call order

    def record(p):
        log = logged_lookups(loss_fn, p, batch, mask, widths)
        accesses.extend((i, ids.shape) for kind, i, ids in log if kind != "attend")

    jax.eval_shape(record, params)
    deltas = [jnp.zeros((*shape, widths[i]), jnp.float32) for i, shape in accesses]
    params, deltas = vary((params, deltas), axis_name)  # each worker's own gradient

    def with_deltas(p, d):
        log: list = []
        pending = iter(d)

        def take_plus_delta(kind, i, table, ids):
            return jnp.take(jax.lax.stop_gradient(table), ids, axis=0) + next(pending)

        return loss_fn(p, batch, recording_ops(p, mask, log, take_plus_delta)), log

    (loss, log), (g_params, g_deltas) = jax.value_and_grad(
        with_deltas, argnums=(0, 1), has_aux=True
    )(params, deltas)
    num = jax.lax.axis_size(axis_name)
    grads, treedef = jax.tree.flatten(g_params)
    flags = jax.tree.leaves(mask)
    attended = {i for kind, i, _ in log if kind == "attend"}
    dense = [i for i, f in enumerate(flags) if not f or i in attended]
    for i, g in zip(dense, jax.lax.pmean([grads[i] for i in dense], axis_name), strict=True):
        grads[i] = g
    rows = iter(g_deltas)
    pairs: dict[int, list] = {}
    for kind, i, ids in log:
        if kind != "attend":
            pairs.setdefault(i, []).append((ids.reshape(-1), next(rows).reshape(ids.size, -1)))
    for i, items in pairs.items():
        ids = jnp.concatenate([a for a, _ in items])
        g_rows = jnp.concatenate([b for _, b in items])
        sparse = allgather_sparse_grad(ids, g_rows, grads[i].shape[0], axis_name) / num
        grads[i] = sparse + (grads[i] if i in attended else 0.0)
    return loss, jax.tree.unflatten(treedef, grads)
