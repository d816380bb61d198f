"""What the tables see: V, D and, from sample batches, the ids each worker reads a
step (``table_stats``), with what each layout's price measures beyond them; a table of
raw ids measured on the rows a managed table's mapping gives them (``raw_mapped``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from sparsecomm_jax.embedding import access, managed, row
from sparsecomm_jax.embedding.dense import DENSE
from sparsecomm_jax.embedding.layout import (
    TableStats,
    distinct_per_worker,
)
from sparsecomm_jax.embedding.tables import find_tables, table_mask
from sparsecomm_jax.planner.pricing import priced


def table_stats(
    loss_fn: Callable,
    params: Any,
    embedding_paths: Any,
    batches: Sequence[dict],
    workers: int,
    replicated_keys: Sequence[str] = (),
    counts: Mapping[str, np.ndarray] | None = None,
) -> list[TableStats]:
    """Each table's ``TableStats`` from sample ``batches`` (host-side, the model on
    zeros, as the steps plan their buffers; the largest need over the sample).

    Args:
      loss_fn: ``loss_fn(params, batch, emb)``.
      params: the parameters. embedding_paths: as ``make_train_step``.
      batches: a few global batches.
      workers: P.
      replicated_keys: batch keys every worker sees whole.
      counts: table name -> the histogram of its ids (``int[V]``, reads per id, e.g.
        over the first batches of the run): what the layouts priced from a histogram
        (the hot rows) measure with (``Pricing.measure``); a table without counts is
        not offered those layouts.

    Returns:
      One ``TableStats`` per table, in the order of the parameters' leaves.
    """
    mask = table_mask(params, embedding_paths)
    tables = find_tables(params, mask, DENSE)
    batches, raw = raw_mapped(loss_fn, params, mask, tables, batches, workers)
    reads_of = access.host_reads(loss_fn, params, mask, replicated_keys, workers)
    samples = [reads_of(b) for b in batches]
    lookups, attended = _reads_per_table(loss_fn, params, batches[0], mask)
    measuring = [x for x in priced() if x.pricing.measure is not None]
    if stray := sorted(set(counts or {}) - {t.name for t in tables}):
        raise ValueError(
            f"counts given for {stray[:4]}, no table of {[t.name for t in tables][:4]}"
        )
    stats = []
    for t in tables:
        seen = [s for s in samples if t.index in s]
        if not seen:
            stats.append(TableStats(t.name, t.vocab, t.dim, 0, 0, 0, 0, t.index in attended))
            continue
        reads = max(s[t.index][0].shape[1] + s[t.index][1].size for s in seen)
        distinct = max(int(distinct_per_worker(s, t.index).max(initial=0)) for s in seen)
        bucket = max(row.bucket_slots(list(s[t.index][0]), t.vocab, workers) for s in seen)
        count = lookups.get(t.index, 1)
        table_counts = (counts or {}).get(t.name)
        mine = measuring if t.index not in raw else []  # a raw table: managed alone serves it
        measured = {x.name: x.pricing.measure(t, seen, table_counts, workers) for x in mine}
        measured = {k: v for k, v in measured.items() if v is not None}
        stats.append(
            TableStats(
                t.name,
                t.vocab,
                t.dim,
                reads,
                distinct,
                bucket,
                count,
                t.index in attended,
                measured or None,
                t.index in raw,
            )
        )
    return stats


def raw_mapped(
    loss_fn: Callable,
    params: Any,
    mask: Any,
    tables: Sequence,
    batches: Sequence[dict],
    workers: int,
) -> tuple[list[dict], set[int]]:
    """The sample ``batches`` with the ids of every table of raw ids mapped to its rows
    as a fresh managed table of V slots maps them, batch after batch
    (``embedding.managed.Vocabularies``, its default policy), and those tables' indices.

    A table reads raw ids where a batch key that feeds it directly (its values are the
    ids, ``access.key_tables``) holds an id outside ``[0, V)`` in some sample batch
    (a fixed vocabulary's step refuses such ids: they can only be raw). Found from the
    sample alone: a table of raw ids whose sample ids all lie in ``[0, V)`` is not found
    (give it the managed layout by ``table_layouts`` or ``--plan``), and an id of V in a
    fixed vocabulary (an off-by-one in the data) makes its table raw.

    Args:
      loss_fn: ``loss_fn(params, batch, emb)``.
      params: the parameters. mask: their tables flagged (``tables.table_mask``).
      tables: ``tables.find_tables(params, mask, ...)``.
      batches: the sample batches.
      workers: P, the workers a managed table's slots are sharded over.

    Returns:
      ``(batches, raw)``: ``batches`` themselves where no table reads raw ids.

    Raises:
      ValueError: no sample batch; a table of raw ids whose V slots cannot be split
        into P blocks, or whose ids a managed table cannot take (a key that also feeds
        another table, ids the loss computes, ids that are no integers).
    """
    if not batches:
        raise ValueError("the planner measures the tables on sample batches: give at least one")

    def reads(batch: dict, direct: bool) -> dict:
        return access.key_tables(loss_fn, params, batch, mask, direct)

    vocab = {t.index: t.vocab for t in tables}
    direct = reads({k: managed.traceable(v) for k, v in batches[0].items()}, True)
    raw = {
        i
        for key, fed in direct.items()
        for i in fed
        if any(_outside(np.asarray(b[key]), vocab[i]) for b in batches)
    }
    if not raw:
        return list(batches), raw
    try:
        mapping = managed.Vocabularies([t for t in tables if t.index in raw], workers, reads)
        return [mapping.map_batch(b)[0] for b in batches], raw
    except ValueError as e:
        raise ValueError(f"a table of raw ids takes the managed layout: {e}") from None


def _outside(ids: np.ndarray, vocab: int) -> bool:
    """Whether some of ``ids`` lies outside ``[0, vocab)``."""
    return bool(ids.size) and (ids.min() < 0 or ids.max() >= vocab)


def _reads_per_table(loss_fn, params, batch, mask) -> tuple[dict[int, int], set[int]]:
    """Table leaf index -> how many reads of it the loss makes; the tables it reads by a
    full softmax."""
    pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(mask), strict=True))
    widths = {i: np.shape(x)[1] for i, (x, f) in enumerate(pairs) if f}
    vocabs = {i: np.shape(x)[0] for i, (x, f) in enumerate(pairs) if f}
    reads = access.traced_reads(loss_fn, params, batch, mask, widths, vocabs)
    counts: dict[int, int] = {}
    for r in reads:
        counts[r.table] = counts.get(r.table, 0) + 1
    return counts, {r.table for r in reads if r.kind == access.ATTEND}
