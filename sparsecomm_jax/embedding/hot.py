"""Hot rows replicated, cold rows sharded: the ``hot`` layout.

A table's H most frequent rows (``HotRows``, from a histogram of its ids: ``from_counts``)
are held by every worker; the other V - H rows are sharded by rows. The table is stored
as one leaf of ``[P (H + C), D]``, C = ceil((V - H) / P): worker w's block holds the H hot
rows (the same on every worker), then its C cold rows. The user's ids stay as they are:
the layout finds an id's row itself, and a checkpoint records the hot ids
(``Layout.config``), so it restores onto any device count.

The trio:

1. **plan** (host): per table, the most distinct cold ids one worker asks of one owner
   (``row.bucket_slots`` on the cold ids alone);
2. **fetch**: a hot id reads its row in this worker's block, with no exchange; the cold
   ids go through the row-wise exchange (``row.fetch``) of the stored leaf's rows;
3. **back**: the hot rows' gradients are scatter-added into ``float[H, D]`` and summed
   over the workers (one all-reduce for the hot tables of each width, and one of a
   count per hot row: a hot row no worker read is no row of the gradient, so a lazy
   optimizer leaves it);
   the cold ones return by the row-wise exchange. Every worker then holds the same hot
   gradient and makes the same update to its copy.

Pipelined (``PIPELINED``, by the row layout's carrier): the cold rows travel as a
row-wise table's do, by their stored rows (a hot id asks for no row: ``carried``); the
hot rows are read where they are at the start of each step (``near``; the step's update
moves them, never early), and their all-reduce goes with the late chunks (``late``).

The planner prices it (``PRICING``) from a histogram of the table's ids: ``measure``
finds the cold rows' bucket in the sample batches for each H of ``HOT_ROWS_TRIED``,
``option_price`` prices the cold rows' exchange and the hot rows' all-reduce, and
``price`` keeps the H of least modelled time, its hot ids the choice's configuration.

Where it pays, and where not: with de-duplicated ids, a row that every worker reads
costs the same bytes in the row-wise exchange (its id out, its row back, its gradient
out) as in an all-reduce. What hot rows save is on the critical path: no exchange before
the forward pass for them, so the bytes before the forward are the cold rows' alone; and
their all-reduce could run beside the backward pass (not on XLA:CPU, which runs a
program's collectives one after the other). The all-reduce is dense: a hot row no worker
reads in a step still travels, so H is worth it only while the hot rows are read almost
every step.

Example:
    >>> import numpy as np
    >>> rows = HotRows.of(np.array([7, 2]), vocab=10, workers=2)
    >>> rows.hot.tolist(), rows.cold_rows  # rows 2 and 7 on every worker; 4 cold each
    ([2, 7], 4)
    >>> rows.stored_row(np.array([2, 0, 9])).tolist()  # 2 is hot; 0 and 9 are cold
    [0, 2, 11]

References:
    Jiang et al., "EMBark", RecSys 2024, and NVIDIA HugeCTR's hybrid embedding (hot rows
    replicated by measured frequency); Sethi et al., "FlexShard", 2023.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsecomm_jax.comm import costmodel
from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.embedding import row
from sparsecomm_jax.embedding.access import HostReads, Read
from sparsecomm_jax.embedding.layout import (
    FLOAT,
    CapacityPolicy,
    Fetched,
    Layout,
    Pipelined,
    Price,
    Pricing,
    Storage,
    both_ways,
    check_storage,
    padded_slots,
)
from sparsecomm_jax.embedding.tables import table_name
from sparsecomm_jax.errors import NO_VALUE, ArgumentError

F32 = jnp.float32


class HotRows(NamedTuple):
    """Where each row of one table lives under the hot layout on P workers.

    Attributes:
      hot: the hot ids, sorted (``int[H]``): row ``k`` of every worker's block holds
        ``hot[k]``.
      vocab: V.
      workers: P.
      cold_rows: C, the cold rows of each worker's block (after its H hot rows).
    """

    hot: np.ndarray
    vocab: int
    workers: int
    cold_rows: int

    @classmethod
    def of(cls, hot: Sequence[int], vocab: int, workers: int) -> HotRows:
        """The rows of a table with ``hot`` replicated (``ValueError`` for an id outside
        [0, V) or repeated)."""
        try:
            ids = np.sort(np.asarray(hot, np.int64).reshape(-1))
        except OverflowError:  # beyond int64: outside any table
            raise ValueError(f"hot ids must lie in [0, {vocab}); got {list(hot)[:8]}") from None
        outside = ids[(ids < 0) | (ids >= vocab)]
        if outside.size:
            raise ValueError(f"hot ids must lie in [0, {vocab}); got {outside[:8].tolist()}")
        if np.any(ids[1:] == ids[:-1]):
            twice = np.unique(ids[1:][ids[1:] == ids[:-1]])
            raise ValueError(f"hot ids must be distinct; {twice[:8].tolist()} appear twice")
        return cls(ids, vocab, workers, -(-(vocab - ids.size) // workers))

    @property
    def block(self) -> int:
        """H + C: the rows of each worker's block."""
        return self.hot.size + self.cold_rows

    def stored_row(self, ids):
        """Each id's row in the stored leaf (numpy or jax): a hot id its row in worker 0's
        block (every block holds it at that offset), a cold id its owner's row."""
        xp = jnp if isinstance(ids, jax.Array) else np
        hot = xp.asarray(self.hot.astype(np.int32))
        below = xp.searchsorted(hot, ids)  # hot ids below each id (its hot row, if hot)
        cold = ids - below  # its place among the cold ids, in order
        owner, offset = cold // max(self.cold_rows, 1), cold % max(self.cold_rows, 1)
        return xp.where(self.is_hot(ids), below, owner * self.block + self.hot.size + offset)

    def is_hot(self, ids):
        """bool per id: it is one of the hot ids."""
        if not self.hot.size:
            return ids < 0  # none (ids are >= 0)
        xp = jnp if isinstance(ids, jax.Array) else np
        hot = xp.asarray(self.hot.astype(np.int32))
        at = xp.minimum(xp.searchsorted(hot, ids), self.hot.size - 1)
        return hot[at] == ids

    def cold_ids(self) -> np.ndarray:
        """The cold ids in order (``int[V - H]``)."""
        keep = np.ones(self.vocab, bool)
        keep[self.hot] = False
        return np.flatnonzero(keep)


def from_counts(counts: np.ndarray, hot_rows: int) -> np.ndarray:
    """The ``hot_rows`` ids counted most often (ties to the smaller id).

    Args:
      counts: the histogram of a table's ids, ``int[V]`` (reads per id).
      hot_rows: H, in [0, V].

    Returns:
      The hot ids, sorted.

    Example:
        >>> from_counts(np.array([5, 0, 9, 9, 1]), 2).tolist()
        [2, 3]
    """
    return np.sort(most_read(counts, hot_rows))


def most_read(counts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` ids counted most often, most counted first (ties to the smaller id):
    ``from_counts(counts, h)`` is ``sorted(most_read(counts, k)[:h])`` for any h <= k.

    Example:
        >>> most_read(np.array([5, 0, 9, 9, 1]), 3).tolist()
        [2, 3, 0]
    """
    counts = np.asarray(counts).astype(np.float64)  # unsigned counts would wrap below
    if not 0 <= k <= counts.size:
        raise ValueError(f"hot_rows must be in [0, {counts.size}], got {k}")
    return np.lexsort((np.arange(counts.size), -counts))[:k]  # most counted first, then id


# ------------------------------------------------------------------ storage


def _storage(rows: dict[int, HotRows], num_workers: int) -> Storage:
    def shape(table, workers: int) -> tuple[int, int]:
        return workers * rows[table.index].block, table.dim

    def pack(leaves: dict[int, np.ndarray], workers: int) -> dict[int, np.ndarray]:
        out = {}
        for i, x in leaves.items():
            h, x = rows[i], np.asarray(x)
            cold = np.zeros((workers * h.cold_rows, *x.shape[1:]), x.dtype)
            cold[: h.vocab - h.hot.size] = x[h.cold_ids()]
            cold = cold.reshape(workers, h.cold_rows, *x.shape[1:])
            hot = np.broadcast_to(x[h.hot], (workers, h.hot.size, *x.shape[1:]))
            out[i] = np.concatenate([hot, cold], axis=1).reshape(-1, *x.shape[1:])
        return out

    def unpack(stored: dict[int, Any], vocabs: dict[int, int]) -> dict[int, Any]:
        out = {}
        for i, x in stored.items():
            h = rows[i]
            blocks = np.asarray(x).reshape(h.workers, h.block, *np.shape(x)[1:])
            table = np.zeros((h.vocab, *np.shape(x)[1:]), blocks.dtype)
            table[h.hot] = blocks[0, : h.hot.size]
            cold = blocks[:, h.hot.size :].reshape(-1, *np.shape(x)[1:])
            table[h.cold_ids()] = cold[: h.vocab - h.hot.size]
            out[i] = table
        return out

    def check(optimizer, params, workers: int) -> None:
        small = {i: 40 + k % 3 for k, i in enumerate(sorted(rows))}  # stand-in V
        stand = {
            i: HotRows.of(np.arange(min(r.hot.size, 5)), small[i], workers) for i, r in rows.items()
        }
        check_storage(
            optimizer,
            params,
            small,
            _storage(stand, workers),
            workers,
            "this optimizer does not move hot rows held by every worker as it moves one "
            "copy: it normalises over whole parameters (clipping by global norm, lamb, "
            "lars, adafactor), which count each copy; give these tables the row layout",
        )

    return Storage(shape, pack, unpack, check)


# ------------------------------------------------------------------ 1. plan the ids


def cold_bucket(worker_ids, rows: HotRows) -> int:
    """The most distinct cold ids one worker asks of one owner (host, numpy), at least 1.

    Args:
      worker_ids: each worker's ids of the table (``int[P, ...]`` or a list of arrays).
      rows: the table's ``HotRows``.

    Example:
        >>> rows = HotRows.of([0], vocab=9, workers=2)  # cold 1-4 on worker 0, 5-8 on 1
        >>> cold_bucket([np.array([0, 0, 1, 2]), np.array([0, 5])], rows)
        2
    """
    per_worker = []
    for ids in worker_ids:
        ids = np.asarray(ids).ravel()
        ids = ids[(ids >= 0) & (ids < rows.vocab)]  # a computed id outside: no row
        per_worker.append(rows.stored_row(ids[~rows.is_hot(ids)]))
    return max(1, row.bucket_slots(per_worker, rows.workers * rows.block, rows.workers))


def _capacity(rows: dict[int, HotRows]) -> CapacityPolicy:
    def need(reads: list[HostReads], tables, workers: int) -> dict[int, int]:
        """Per table, the most distinct cold ids one worker asks of one owner."""
        first = reads[0]
        return {
            t.index: cold_bucket(first[t.index][0], rows[t.index])
            for t in tables
            if t.index in first
        }

    def bound(reads: HostReads, table, workers: int) -> int:
        return min(reads[table.index][0].shape[1], rows[table.index].block)

    return CapacityPolicy(need, "distinct cold rows from one owner", _doubling, bound)


def _doubling(need: int) -> int:
    """The next power of two from 1: a table whose reads are mostly hot asks few cold
    rows of each owner, and its buckets stay that small (``next_power_of_two`` starts
    at 8)."""
    return 1 << max(0, (need - 1).bit_length())


# ------------------------------------------------------------------ pricing

#: The numbers of hot rows the planner tries for a table (besides none), up to the ids
#: its histogram counts at all.
HOT_ROWS_TRIED = (16, 64, 256, 1024, 4096, 16384, 65536)


class Option(NamedTuple):
    """One number of hot rows for a table, as the sample batches read it.

    Attributes:
      rows: H.
      bucket: the most distinct cold ids one worker asked of one owner in a sample
        batch (``cold_bucket``), with the H most read ids hot.
    """

    rows: int
    bucket: int


class Measured(NamedTuple):
    """What the planner measures of a table for the hot layout (``measure``).

    Attributes:
      frequent: the ids most read first (``most_read``), as many as the largest H.
      options: an ``Option`` per H tried, none (H = 0) first.
    """

    frequent: np.ndarray
    options: tuple[Option, ...]


def measure(table, reads: list[HostReads], counts, workers: int) -> Measured | None:
    """The cold buckets of the sample batches ``reads`` with each H of ``HOT_ROWS_TRIED``
    (that the histogram ``counts`` has as many ids for) hot; ``None`` without counts.

    Example:
        >>> from sparsecomm_jax.embedding.tables import Table
        >>> ids = np.array([[0, 0, 1, 2, 3], [0, 1, 5, 6, 7]])  # P = 2, V = 64
        >>> got = measure(Table(0, "t", 64, 4, HOT), [{0: (ids, ids[:0, 0])}],
        ...               np.bincount(ids.ravel(), minlength=64), 2)
        >>> [(o.rows, o.bucket) for o in got.options]  # 7 ids read: all hot, or none
        [(0, 5), (7, 1)]
    """
    if counts is None:
        return None
    if np.shape(counts) != (table.vocab,):
        raise ValueError(
            f"table {table.name}: counts of shape {np.shape(counts)}; give one per row of "
            f"its {table.vocab}"
        )
    seen = int(np.count_nonzero(np.asarray(counts)))
    tried = [0, *(h for h in HOT_ROWS_TRIED if h <= min(seen, table.vocab))]
    if seen and tried[-1] < min(seen, HOT_ROWS_TRIED[0]):  # a table of few ids: all of them
        tried.append(min(seen, table.vocab))
    frequent = most_read(counts, tried[-1])
    options = []
    for h in tried:
        rows = HotRows.of(frequent[:h], table.vocab, workers)
        need = [cold_bucket(r[table.index][0], rows) for r in reads if table.index in r]
        options.append(Option(h, max(need, default=1)))
    return Measured(frequent, tuple(options))


def option_price(
    stats, option: Option, workers: int, link, slots: int, wire=comm_wire.DEFAULT
) -> Price:
    """One table with ``option.rows`` hot rows, for one worker per step: the cold rows'
    row-wise exchange, ``(P-1) C (4 + 2 D b)`` bytes with C the option's cold bucket
    padded as the buckets are (a power of two), and the all-reduce of the H hot rows'
    gradients and their counts, ``2 (P-1)/P H (D b + 4)``
    (``comm.costmodel.flat_mean_cost`` in the backward codec); memory the H hot rows and
    1/P of the V - H cold ones, and their optimizer state.

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> from sparsecomm_jax.embedding.layout import TableStats
        >>> stats = TableStats("t", 1000, 8, 64, 10, 4)
        >>> option_price(stats, Option(0, 4), 4, Link(0.0, 1.0), 0).bytes  # C = 4
        816.0
        >>> option_price(stats, Option(16, 1), 4, Link(0.0, 1.0), 0).bytes  # 204 + 768 + 96
        1068.0
    """
    p, h = workers, option.rows
    cold = (p - 1) * padded_slots(_doubling, option.bucket) * (4 + both_ways(stats.dim, wire))
    summed = costmodel.flat_mean_cost(h * stats.dim, p, wire.backward)[1] if h else 0.0
    counted = costmodel.flat_mean_cost(h, p)[1] if h else 0.0
    nbytes = float(cold + summed + counted)
    memory = (h + -(-(stats.vocab - h) // p)) * stats.dim * FLOAT * (1 + slots)
    return Price(nbytes, nbytes * link.beta, memory)


def price(stats, workers: int, link, slots: int, wire=comm_wire.DEFAULT) -> Price:
    """The table's price at the H of least modelled time (``option_price`` of each
    ``Option`` measured), the hot ids of that H its ``config``. Where that H is 0, the
    layout is the row layout with two more (empty) all-reduces, never worth choosing:
    its time is infinite, so a plan gives the table another layout.

    Raises:
      ValueError: the table was measured without a histogram (``stats.of("hot")`` is
        ``None``).
    """
    found = stats.of(HOT.name)
    if found is None:
        raise ValueError(
            f"table {stats.name}: the hot layout is priced from a histogram of the "
            "table's ids; give planner.table_stats its counts"
        )
    priced = [(option_price(stats, o, workers, link, slots, wire), o) for o in found.options]
    best, option = min(priced, key=lambda x: x[0].seconds)
    hot = sorted(int(i) for i in found.frequent[: option.rows])
    seconds = best.seconds if option.rows else math.inf
    return best._replace(seconds=seconds, config=hot, setting=f"H={option.rows}")


# The cold rows' exchange (3(P-1)) and the all-reduces of the hot rows and their
# counts (2(P-1) each).
PRICING = Pricing(
    price,
    messages=lambda workers: 7 * (workers - 1),
    serves=lambda stats: stats.of(HOT.name) is not None and not stats.attended,
    measure=measure,
)


# ------------------------------------------------------- 2. fetch rows, 3. send back


def split_ids(rows: HotRows, ids):
    """Where each id of a read is found (jit-able).

    Returns:
      ``(is_hot, hot_at, cold)``: bool per id, it is hot; its row in this worker's
      block where hot (``H`` otherwise: a row past the hot ones, for the caller to
      mask, or to drop from a ``float[H, D]`` sum); its stored row where cold, for the
      row-wise exchange (-1 where hot: no row asked; the row past the leaf for an id
      outside the table: its row NaN and missed, as the row-wise layout does).
    """
    ids = ids.astype(jnp.int32)
    inside = (ids >= 0) & (ids < rows.vocab)
    is_hot = inside & rows.is_hot(ids)
    at = rows.stored_row(jnp.where(inside, ids, 0))
    nowhere = rows.workers * rows.block
    cold = jnp.where(is_hot, -1, jnp.where(inside, at, nowhere))
    return is_hot, jnp.where(is_hot, at, rows.hot.size), cold


def hot_gradients(
    rows: dict[int, HotRows], reads: list[Read], hot_at: list, grads: list, shards, axis, codec
) -> list:
    """The hot rows' gradients of ``reads`` (at ``hot_at``, ``split_ids``; ``grads`` per
    read), summed over the workers: ``[(table index, (rows int[H], float[H, D]))]``, the
    same on every worker; a hot row no worker read is padding (past the block)."""
    mine = [i for i in sorted({r.table for r in reads}) if rows[i].hot.size]
    summed, counts = {}, {}
    for i in mine:
        width = shards[i].shape[1]
        summed[i] = jnp.zeros((rows[i].hot.size, width), F32)  # float[H, D]
        counts[i] = jnp.zeros((rows[i].hot.size,), jnp.int32)  # int[H]
        for r, at, g in zip(reads, hot_at, grads, strict=True):
            if r.table == i:
                flat = at.reshape(-1)
                summed[i] = summed[i].at[flat].add(g.reshape(-1, width).astype(F32), mode="drop")
                counts[i] = counts[i].at[flat].add(1, mode="drop")
    summed, counts = _sum_hot(summed, counts, axis, codec)
    out = []
    for i in mine:
        read = jnp.where(counts[i] > 0, jnp.arange(rows[i].hot.size), rows[i].block)
        out.append((i, (read, summed[i])))
    return out


def _fetch(rows: dict[int, HotRows]):
    def fetch(
        shards, reads: list[Read], capacity: dict[int, int], axis: str, wire=comm_wire.DEFAULT
    ):
        """Hot ids from this worker's block; the cold ones through ``row.fetch`` (a hot id
        asks it for no row; ``split_ids``)."""
        split = [split_ids(rows[r.table], r.ids) for r in reads]
        cold = [Read(r.kind, r.table, c) for r, (_, _, c) in zip(reads, split, strict=True)]
        got = row.fetch(shards, cold, capacity, axis, wire)
        out = []
        for r, (is_hot, at, _), far in zip(reads, split, got.rows, strict=True):
            near = jnp.take(shards[r.table], at, axis=0, mode="fill", fill_value=0)
            out.append(jnp.where(is_hot[..., None], near, far))  # float[*ids.shape, D]

        def back(grads):
            far = [
                jnp.where(is_hot[..., None], 0, g)
                for (is_hot, _, _), g in zip(split, grads, strict=True)
            ]
            at = [a for _, a, _ in split]
            return got.back(far) + hot_gradients(
                rows, reads, at, grads, shards, axis, wire.backward
            )

        return Fetched(out, back, got.missed)

    return fetch


def _sum_hot(summed: dict, counts: dict, axis: str, codec) -> tuple[dict, dict]:
    """Every table's hot gradients and read counts summed over the workers: the tables
    of one width in one all-reduce (in ``codec``), every count in one more."""
    out = {}
    for width in sorted({x.shape[1] for x in summed.values()}):
        alike = [i for i, x in summed.items() if x.shape[1] == width]
        total = comm_wire.psum(jnp.concatenate([summed[i] for i in alike]), axis, codec)
        ends = np.cumsum([0, *(summed[i].shape[0] for i in alike)])
        out.update({i: total[a:b] for i, a, b in zip(alike, ends[:-1], ends[1:], strict=True)})
    if not counts:
        return out, {}
    every = jax.lax.psum(jnp.concatenate(list(counts.values())), axis)  # int[sum H]
    ends = np.cumsum([0, *(c.shape[0] for c in counts.values())])
    return out, {i: every[a:b] for i, a, b in zip(counts, ends[:-1], ends[1:], strict=True)}


# ------------------------------------------------------------------- pipelined


def carried_ids(table, workers: int, ids):
    """``Pipelined.carried``: a read's ids as the row-wise exchange carries them, a cold
    id's stored row, -1 (no row asked) for a hot one (``split_ids``)."""
    return split_ids(rows_of(table, workers), ids)[2]


def near_rows(table, workers: int, ids, rows, shard):
    """``Pipelined.near``: the carried cold rows (zero where hot) with the hot rows read
    from this worker's block of ``shard``, as the step's tables hold them (a hot row is
    updated by the step's update, never early)."""
    is_hot, at, _ = split_ids(rows_of(table, workers), ids)
    near = jnp.take(shard, at, axis=0, mode="fill", fill_value=0)
    return jnp.where(is_hot[..., None], near.astype(rows.dtype), rows)


def late_hot(tables: dict, workers: int, reads, g_rows, shards, axis: str, codec) -> list:
    """``Pipelined.late``: the hot rows' gradients of ``reads``, summed over the workers
    by one all-reduce (``hot_gradients``), sent with the late chunks."""
    rows = {i: rows_of(t, workers) for i, t in tables.items()}
    at = [split_ids(rows[r.table], r.ids)[1] for r in reads]
    return hot_gradients(rows, reads, at, g_rows, shards, axis, codec)


#: How ``embrace_2d`` carries a hot table: its cold rows by the row layout's carrier,
#: its hot rows read where they are, their all-reduce with the late chunks.
PIPELINED = Pipelined(
    row.two_batches, row.CARRIER, carried=carried_ids, near=near_rows, late=late_hot
)


def _no_attend(shard, h, axis: str):
    raise ValueError(
        "a hot-rows table cannot serve a full softmax (emb.attend): give it the row or "
        "column layout"
    )


# ------------------------------------------------------------------ the layout


def layout(hot_ids: Mapping[str, Sequence[int]] | None = None) -> Layout:
    """The hot layout with ``hot_ids[table name]`` replicated for each table (a table it
    does not name has no hot rows: the row-wise layout).

    Args:
      hot_ids: table name -> its hot ids (``from_counts`` of a histogram).

    Returns:
      A ``Layout`` named ``"hot"``, for ``table_layouts``.
    """
    config = {table_name(k): _id_list(k, ids) for k, ids in (hot_ids or {}).items()}

    def bind(tables, num_workers: int) -> tuple:
        every = [t for t in tables if t.layout.configure is layout]  # hot, bound or not
        if len({repr(t.layout.config) for t in every}) > 1:
            raise ValueError(
                "the hot tables of a step share one hot layout: give all their hot ids to "
                "one hot.layout({table: ids, ...})"
            )
        mine = [t for t in every if t.layout.bind is not None]
        if not mine:
            return tuple(tables)
        if unknown := sorted(set(config) - {t.name for t in mine}):
            names = [t.name for t in mine]
            raise ValueError(f"hot ids given for {unknown}, no hot table of {names}")
        rows = {}
        for t in mine:
            try:
                rows[t.index] = HotRows.of(config.get(t.name, ()), t.vocab, num_workers)
            except ValueError as e:  # names the argument: --plan at the command line
                raise ArgumentError("table_layouts", NO_VALUE, f"(table {t.name}): {e}") from None
        bound = value._replace(
            capacity=_capacity(rows),
            fetch=_fetch(rows),
            storage=_storage(rows, num_workers),
            bind=None,
        )
        return tuple(t._replace(layout=bound) if t.index in rows else t for t in tables)

    # stored and summed as the row layout's tables (each worker its block of rows); its
    # trio bound to the tables' hot rows when a step is built
    value = row.ROW._replace(
        name="hot",
        capacity=None,
        fetch=_unbound,
        attend=_no_attend,
        bind=bind,
        pricing=PRICING,
        config=config or None,
        configure=layout,
        pipelined=PIPELINED,
    )
    return value


def is_hot_layout(value: Layout) -> bool:
    """Whether ``value`` is a value of the hot layout (``HOT`` or ``layout(...)``, bound
    to its tables or not)."""
    return value.configure is layout


def rows_of(table, workers: int) -> HotRows:
    """The ``HotRows`` of a hot table (``tables.Table`` of the hot layout) on ``workers``
    (none given for it: the row-wise layout's rows)."""
    return HotRows.of((table.layout.config or {}).get(table.name, ()), table.vocab, workers)


def _id_list(table, ids) -> list[int]:
    """A table's hot ids as sorted Python ints (``ValueError`` unless a flat sequence of
    integers: no floats, bools, strings or nested lists, which would be rounded or
    flattened silently)."""
    try:
        found = list(np.asarray(ids).reshape(-1)) if np.ndim(ids) == 1 else None
    except ValueError:  # a ragged sequence
        found = None
    integer = (int, np.integer)
    if found is None or not all(
        isinstance(v, integer) and not isinstance(v, (bool, np.bool_)) for v in found
    ):
        raise ValueError(
            f"the hot ids of table {table_name(table)} must be a list of integers, got "
            f"{str(ids)[:60]}"
        )
    return sorted(int(v) for v in found)


def _unbound(*args, **kwargs):
    raise ValueError("the hot layout is bound to its tables when a step is built")


#: The hot layout with no hot rows given (each table row-wise until ``layout(...)``).
HOT = layout()
