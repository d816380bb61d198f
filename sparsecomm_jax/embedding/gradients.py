"""The loss and its gradients when tables are read through their layouts.

Inside a step (``shard_map``), ``table_gradients`` runs a layout's trio for every table:
the loss's reads are learnt from a program traced once (``access.traced_reads``), each layout
fetches the rows of its tables' reads, the loss is differentiated with respect to the
parameters *and those rows* (the tables themselves are read outside autodiff), and each
layout's ``back`` sends the rows' gradients to their owners. The result per table is a
list of ``(ids, rows)`` pairs at the owner; ``embedding.update`` turns them into the
optimizer's gradient (a dense shard, or the rows alone). A full softmax (``emb.attend``)
is differentiated through the layout's ``attend``; that dense part joins the pairs as
every row of the shard. A table stored padded (``layout.padded_shape``) is read as its
V x D: the rows cut to D, the logits of a full softmax to V; the padding's gradient is
zero.

Example:
    >>> # inside shard_map, per worker:
    >>> # loss, grads, pairs, missed = table_gradients(loss_fn, params, batch, tables, mask,
    >>> #                                      capacity, "data", jnp.float32)
    >>> # pairs[i]: [(ids int[m], rows float[m, D/P]), ...] for table leaf i

References:
    Li et al., "EmbRace", ICPP 2022 (column-wise exchange); Mudigere et al.,
    "High-performance, Distributed Training of Large-scale DLRMs", 2021 (row-sparse
    table gradients).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.comm.vma import vary
from sparsecomm_jax.embedding import access
from sparsecomm_jax.embedding.access import ATTEND
from sparsecomm_jax.embedding.layout import padded_shape

F32 = jnp.float32


def layout_attend(tables, axis: str):
    """``attend(table, h)`` of each table's layout, picked by the table's identity: ``h``
    padded to the stored width, the logits cut to the table's V (``padded_shape``)."""
    by_index = {t.index: t for t in tables}

    def attend_for(params):
        leaves = jax.tree.leaves(params)
        table_of = {id(leaves[i]): t for i, t in by_index.items()}

        def attend(shard, h):
            t = table_of[id(shard)]
            width = padded_shape(t, jax.lax.axis_size(axis))[1]
            try:
                logits = t.layout.attend(shard, pad_last(h, width), axis)  # [..., V padded]
            except ValueError as e:  # a layout that cannot serve it: say which table
                raise ValueError(f"table {t.name}: {e}") from e
            return logits[..., : t.vocab]

        return attend

    return attend_for


def pad_last(x, width: int):
    """``x`` with zeros appended to its last dimension up to ``width`` (``x`` itself
    when it has that width)."""
    extra = width - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def table_gradients(
    loss_fn,
    params,
    batch,
    tables,
    mask,
    capacity: dict[int, int],
    axis: str,
    wire=comm_wire.DEFAULT,
    batch_axes: str | tuple[str, ...] | None = None,
):
    """Loss, gradient of the non-table leaves, and each table's gradient as pairs.

    Use inside ``shard_map``. Nothing is reduced over the workers except what the
    layouts' exchanges sum at the owners: the caller averages the other leaves (an
    aggregator) and divides the tables' sums by P.

    Args:
      loss_fn: ``loss_fn(params, batch, emb) -> scalar``.
      params: parameters (tables as this worker holds them).
      batch: this worker's batch.
      tables: the ``tables.Table`` records (each with its layout).
      mask: bool per leaf of ``params``: is it a table?
      capacity: table index -> slots of its layout's static buffers.
      axis: the mesh axis the tables are sharded over.
      wire: the codecs rows (``forward``) and their gradients (``backward``) travel in.
      batch_axes: the mesh axes the batch is split over (default ``axis``; a 2-D mesh:
        the replica axis too), over which each worker's gradient is its own.

    Returns:
      ``(loss, grads, pairs, missed)``: this worker's loss; ``grads`` shaped like
      ``params`` (the tables' entries hold only their ``attend`` part: ignore them);
      ``pairs`` table index -> list of ``(ids, rows)`` at the owner, summed over the
      workers; ``missed`` table index -> bool[], this worker read an id its capacity had
      no slot for (``Fetched.missed``).
    """
    leaves = jax.tree.leaves(params)
    attend_for = layout_attend(tables, axis)
    widths = {t.index: t.dim for t in tables}
    vocabs = {t.index: t.vocab for t in tables}
    reads = access.traced_reads(loss_fn, params, batch, mask, widths, vocabs)
    rows_in, back, missed = fetch_all(tables, leaves, reads, capacity, axis, wire)

    def loss_of_rows(p, rows):
        answered = access.answered_loss(loss_fn, mask, attend=attend_for(p))
        return answered(p, batch, rows)

    varying = vary((params, rows_in), batch_axes or axis)  # each worker's own gradient
    loss, (grads, g_rows) = jax.value_and_grad(loss_of_rows, argnums=(0, 1))(*varying)
    pairs: dict[int, list] = {t.index: [] for t in tables}
    for i, pair in back(g_rows):
        pairs[i].append(pair)
    g_leaves = jax.tree.leaves(grads)
    layouts = {t.index: t.layout for t in tables}
    for i in sorted({r.table for r in reads if r.kind == ATTEND}):
        dense = layouts[i].sum_dense(g_leaves[i], axis).astype(F32)
        pairs[i].append((jnp.arange(leaves[i].shape[0]), dense))
    return loss, grads, pairs, missed


def outside(tables, reads) -> dict[int, jax.Array]:
    """Table index -> bool[]: some id this worker reads of it lies outside [0, V). The
    host checks a batch's ids before a step; this catches the ids a model computes
    (an offset added, a hash taken), which it cannot see: the step is marked as one
    whose rows did not all arrive (``Fetched.missed``), so it is skipped, never
    answered with a clamped or zero row."""
    vocabs = {t.index: t.vocab for t in tables}
    out: dict[int, jax.Array] = {}
    for read in reads:
        if read.ids.size:
            bad = ~jnp.all((read.ids >= 0) & (read.ids < vocabs[read.table]))
            out[read.table] = out[read.table] | bad if read.table in out else bad
    return out


def fetch_all(
    tables, leaves: list, reads: list, capacity: dict[int, int], axis: str, wire
) -> tuple[list, Any, dict]:
    """Each layout's ``fetch`` on the reads of its tables; the rows back in read order
    (a full softmax's read left out: ``table_gradients`` differentiates it through
    ``attend``), one ``back`` for all of them and every layout's ``missed``. A read of no
    ids (a bag of width 0) gets its empty rows here: no layout sees it.

    ``reads`` are reads of ``tables`` alone; ``leaves`` every leaf of the parameters (a
    table-wise pack is stored in another table's leaf); ``capacity`` as
    ``table_gradients`` takes it."""
    order = [k for k, r in enumerate(reads) if r.kind != ATTEND]
    dims = {t.index: t.dim for t in tables}
    groups: dict[str, tuple[Any, list[int]]] = {}
    rows: dict[int, Any] = {}
    for k in order:
        if reads[k].ids.size == 0:  # nothing to exchange, and no gradient to send back
            table = reads[k].table
            rows[k] = jnp.zeros((*reads[k].ids.shape, dims[table]), leaves[table].dtype)
            continue
        layout = next(t.layout for t in tables if t.index == reads[k].table)
        groups.setdefault(layout.name, (layout, []))[1].append(k)
    backs, missed = [], outside(tables, [reads[k] for k in order])
    shards = {t.index: leaves[t.index] for t in tables}  # a pack: another table's leaf
    for layout, ks in groups.values():
        fetched = layout.fetch(shards, [reads[k] for k in ks], capacity, axis, wire)
        rows.update(zip(ks, fetched.rows, strict=True))
        backs.append((ks, fetched.back))
        for i, flag in fetched.missed.items():
            missed[i] = missed[i] | flag if i in missed else flag
    stored = {k: rows[k].shape[-1] for k in order}  # a padded table's rows are wider

    def back(grads):
        by_read = {k: pad_last(g, stored[k]) for k, g in zip(order, grads, strict=True)}
        return [pair for ks, b in backs for pair in b([by_read[k] for k in ks])]

    return [rows[k][..., : dims[reads[k].table]] for k in order], back, missed
