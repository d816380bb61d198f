"""Table-wise tables: each table whole on one worker (torchrec's table-wise).

A program over the mesh gives every worker a shard of the same shape, so a table cannot
live on one worker alone as a leaf of its own. The table-wise tables of one D are
therefore *packed*: one stored leaf (the first such table's) of ``[P * R, D]`` holds, in
worker w's block of R rows, the tables w owns one after the other; the other tables of
the pack are stored as ``[P, D]`` zeros (a row per worker, never read: an array of
no elements would be neither saved by orbax nor kept sharded by XLA). Owners are
assigned once, when the step is built (``bind``): the largest table first, each to the
worker holding the fewest rows so far, so that R (the most rows any worker holds) stays
near the pack's rows over P.

An id ``v`` of a table owned by worker ``o`` at row ``offset`` of its block is row
``o * R + offset + v`` of the pack, and the pack is read as one row-wise table whose
worker w owns rows ``[wR, (w+1)R)``: the layout's trio is the row-wise one
(``embedding.row``) on those ids:

1. **plan** (host): per pack, the most distinct ids any worker asks of any one owner,
   every lookup of the pack's tables together (``row.bucket_slots`` on the packed ids),
   rounded up to a power of two;
2. **fetch**: ids to their table's owner, its rows back: per pack one bucket plan of
   all its lookups, every pack in one exchange (``row.fetch_many``);
3. **back**: the gradient rows by the transposed exchange, summed per id at the owner.

The bytes are those of the row-wise layout when the owners' loads are even; a worker
that owns the busiest tables receives more than its share (every bucket of the exchange
is padded to the fullest owner's), so table-wise pays off with many tables of similar
traffic, where each table's optimizer state and update stay on one worker.

A full softmax (``emb.attend``) is not served: it would gather the whole table onto
every worker; give such a table the row or column layout.

Example:
    >>> from sparsecomm_jax.embedding import tables, tablewise
    >>> found = (tables.Table(0, "a", 10, 4, tablewise.TABLE),
    ...          tables.Table(1, "b", 6, 4, tablewise.TABLE),
    ...          tables.Table(2, "c", 5, 4, tablewise.TABLE))
    >>> bound = tablewise.bind(found, 2)
    >>> [bound[0].layout.storage.shape(t, 2) for t in bound]  # a, then b and c on worker 1
    [(22, 4), (2, 4), (2, 4)]

References:
    Mudigere et al., "High-performance, Distributed Training of Large-scale DLRMs", 2021
    (table-wise model parallelism); torchrec's table-wise sharding (``tw_sharding.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.embedding import row
from sparsecomm_jax.embedding.access import LOOKUP, HostReads, Read
from sparsecomm_jax.embedding.layout import (
    FLOAT,
    CapacityPolicy,
    Fetched,
    Layout,
    Price,
    Pricing,
    Storage,
    TableStats,
    both_ways,
    check_storage,
    next_power_of_two,
    padded_slots,
)
from sparsecomm_jax.embedding.tables import Table

F32 = jnp.float32


class Slot(NamedTuple):
    """Where one table-wise table is stored.

    Attributes:
      pack: the leaf index of the pack that holds it (the first table of its D).
      owner: the worker that holds it whole.
      offset: its first row in the owner's block of the pack.
    """

    pack: int
    owner: int
    offset: int


class Packing(NamedTuple):
    """The owners and packs of a step's table-wise tables.

    Attributes:
      slots: table leaf index -> its ``Slot``.
      rows: pack leaf index -> R, the rows of each worker's block.
      dims: pack leaf index -> D.
      vocabs: table leaf index -> V.
    """

    slots: dict[int, Slot]
    rows: dict[int, int]
    dims: dict[int, int]
    vocabs: dict[int, int]

    def members(self, pack: int) -> list[int]:
        """The tables stored in ``pack``, in leaf order."""
        return sorted(i for i, s in self.slots.items() if s.pack == pack)

    def packed_ids(self, table: int, ids):
        """``ids`` of ``table`` as rows of its pack (numpy or jax)."""
        s = self.slots[table]
        return ids + (s.owner * self.rows[s.pack] + s.offset)


def assign(tables, num_workers: int) -> Packing:
    """Owners and offsets: per D, the largest table first to the worker holding the
    fewest rows so far (ties to the lowest worker).

    Example:
        >>> from sparsecomm_jax.embedding.tables import Table
        >>> t = [Table(3, "a", 10, 4, None), Table(5, "b", 6, 4, None)]
        >>> assign(t, 2).slots[5], assign(t, 2).rows
        (Slot(pack=3, owner=1, offset=0), {3: 10})
    """
    slots, rows, dims = {}, {}, {}
    vocabs = {t.index: t.vocab for t in tables}
    for dim in sorted({t.dim for t in tables}):
        group = [t for t in tables if t.dim == dim]
        pack = min(t.index for t in group)
        held = [0] * num_workers
        for t in sorted(group, key=lambda t: (-t.vocab, t.index)):
            owner = min(range(num_workers), key=lambda w: (held[w], w))
            slots[t.index] = Slot(pack, owner, held[owner])
            held[owner] += t.vocab
        rows[pack], dims[pack] = max(held), dim
    return Packing(slots, rows, dims, vocabs)


# ------------------------------------------------------------------ storage


def _storage(packing: Packing) -> Storage:
    def shape(table, num_workers: int) -> tuple[int, int]:
        pack = packing.slots[table.index].pack
        return num_workers * (packing.rows[pack] if pack == table.index else 1), table.dim

    def pack(leaves: dict[int, np.ndarray], num_workers: int) -> dict[int, np.ndarray]:
        # a leaf lies like its table: rows and columns, or rows alone (a per-row count)
        out = {
            i: np.zeros((num_workers, *np.shape(x)[1:]), np.asarray(x).dtype)
            for i, x in leaves.items()
        }
        for p, rows in packing.rows.items():
            dtypes = {np.asarray(leaves[i]).dtype for i in packing.members(p)}
            if len(dtypes) > 1:
                raise ValueError(
                    f"the table-wise tables of D = {packing.dims[p]} are stored together "
                    f"and must share a dtype, got {sorted(map(str, dtypes))}"
                )
            trailing = np.shape(leaves[p])[1:]
            block = np.zeros((num_workers * rows, *trailing), dtypes.pop())
            for i in packing.members(p):
                start = packing.packed_ids(i, 0)
                block[start : start + np.shape(leaves[i])[0]] = leaves[i]
            out[p] = block
        return out

    def unpack(stored: dict[int, Any], vocabs: dict[int, int]) -> dict[int, Any]:
        out = {}
        for i, s in packing.slots.items():
            start = packing.packed_ids(i, 0)
            out[i] = stored[s.pack][start : start + vocabs[i]]
        return out

    def check(optimizer, params, num_workers: int) -> None:
        check_optimizer(optimizer, params, packing, num_workers)

    return Storage(shape, pack, unpack, check)


def check_optimizer(optimizer, params, packing: Packing, num_workers: int) -> None:
    """``ValueError`` unless ``optimizer`` moves the tables of ``packing`` stored in
    their packs as it moves them apart (``layout.check_storage``'s probe, on stand-in
    tables of 130-132 rows packed on ``num_workers`` workers).

    Per-parameter labels (``optax.partition``, ``masked``, weight decay by mask),
    per-parameter norms (``lamb``'s and ``lars``' trust ratios, ``clip_by_block_rms``)
    and statistics over a whole leaf (``adafactor``'s factored moments, from 128 rows
    and columns) would treat a pack as the first table of it: such optimizers are
    refused.
    """
    leaves = jax.tree.leaves(params)
    small = {i: 130 + k % 3 for k, i in enumerate(sorted(packing.slots))}  # stand-in V
    stand = assign(
        [Table(i, "", v, np.shape(leaves[i])[1], None) for i, v in small.items()], num_workers
    )
    check_storage(
        optimizer,
        params,
        small,
        _storage(stand),
        num_workers,
        "this optimizer does not move table-wise tables stored together (one leaf per D) "
        "as it moves them apart: it labels or normalises each parameter on its own "
        "(optax.partition or masked by path, lamb, lars, clip_by_block_rms, "
        "adafactor); give these tables the row or column layout",
    )


# ------------------------------------------------------------------ 1. plan the ids


def _capacity(packing: Packing) -> CapacityPolicy:
    def need(reads: list[HostReads], tables, workers: int) -> dict[int, int]:
        """Per pack, the most distinct ids one worker asks of one owner, every lookup of
        the pack's tables together (one bucket plan per pack); every table of the pack
        gets the pack's slots, read or not, so that they grow together (a table read
        later changes no capacity, so compiles nothing)."""
        first, out = reads[0], {}
        for p, rows in packing.rows.items():
            read = [i for i in packing.members(p) if i in first]
            if not read:
                continue
            per_worker = [
                np.concatenate(
                    [packing.packed_ids(i, first[i][0][w].ravel().astype(np.int64)) for i in read]
                )
                for w in range(workers)
            ]
            slots = row.bucket_slots(per_worker, workers * rows, workers)
            out.update(dict.fromkeys(packing.members(p), slots))  # grown together
        return out

    def bound(reads: HostReads, table, workers: int) -> int:
        """Every id a worker reads of the pack distinct and owned by one worker:
        min(the pack's lookups per worker, R)."""
        pack = packing.slots[table.index].pack
        ids = sum(reads[i][0].shape[1] for i in packing.members(pack) if i in reads)
        return min(ids, packing.rows[pack])

    return CapacityPolicy(need, "distinct rows from one owner", next_power_of_two, bound)


# ------------------------------------------------------- 2. fetch rows, 3. send back


def _fetch(packing: Packing):
    def packed(read: Read, num: int) -> Read:
        """The read as a read of its pack: its ids (as int32: a narrower type could not
        hold a pack's rows) as rows of the pack; an id outside its table (computed by the
        model: the host checks the batch's) as no row at all (``P * R``: a lookup's row
        NaN and missed, a shared read's zero), never a row of another table."""
        pack, vocab = packing.slots[read.table].pack, packing.vocabs[read.table]
        ids = read.ids.astype(jnp.int32)
        inside = (ids >= 0) & (ids < vocab)
        nowhere = num * packing.rows[pack]
        return Read(
            read.kind, pack, jnp.where(inside, packing.packed_ids(read.table, ids), nowhere)
        )

    def fetch(
        shards, reads: list[Read], capacity: dict[int, int], axis: str, wire=comm_wire.DEFAULT
    ):
        """The reads as reads of their packs through the row-wise layout's fetch
        (``row.fetch``), the lookups of each pack merged into one read (one bucket plan
        per pack, every pack in one exchange), each shared read as it is. The gradients
        come back as pairs of the packs."""
        moved = [packed(r, jax.lax.axis_size(axis)) for r in reads]
        look = [k for k, r in enumerate(moved) if r.kind == LOOKUP]
        shared = [k for k, r in enumerate(moved) if r.kind != LOOKUP]
        packs = sorted({moved[k].table for k in look})
        of_pack = {p: [k for k in look if moved[k].table == p] for p in packs}
        merged = [
            Read(LOOKUP, p, jnp.concatenate([moved[k].ids.reshape(-1) for k in of_pack[p]]))
            for p in packs
        ]  # per pack int[sum n]
        slots = {  # a pack's capacity: the most any of its tables was given
            p: max(capacity.get(i, 0) for i in packing.members(p)) for p in packing.rows
        }
        got = row.fetch(shards, merged + [moved[k] for k in shared], slots, axis, wire)
        rows = dict(zip(shared, got.rows[len(packs) :], strict=True))
        for p, block in zip(packs, got.rows, strict=False):  # block: float[sum n, D]
            ends = np.cumsum([0, *(reads[k].ids.size for k in of_pack[p])])
            for k, a, b in zip(of_pack[p], ends[:-1], ends[1:], strict=True):
                rows[k] = block[int(a) : int(b)].reshape(*reads[k].ids.shape, -1)

        def back(grads):
            cat = [
                jnp.concatenate([grads[k].reshape(-1, grads[k].shape[-1]) for k in of_pack[p]])
                for p in packs
            ]  # per pack float[sum n, D]
            return got.back(cat + [grads[k] for k in shared])

        return Fetched([rows[k] for k in range(len(reads))], back, got.missed)

    return fetch


def _no_attend(shard, h, axis: str):
    raise ValueError(
        "a table-wise table cannot serve a full softmax (emb.attend): every worker would "
        "gather the whole table; give it the row or column layout"
    )


def bind(tables, num_workers: int) -> tuple:
    """``tables`` with their table-wise layout bound to owners (``assign``): the
    layout the step reads them through. Other tables are returned as they are.

    Args:
      tables: the step's ``tables.Table`` records.
      num_workers: P.

    Returns:
      The records, the table-wise ones with one bound ``Layout`` for all of them.
    """
    mine = [t for t in tables if t.layout is TABLE]
    if not mine:
        return tuple(tables)
    packing = assign(mine, num_workers)
    bound = TABLE._replace(
        capacity=_capacity(packing),
        fetch=_fetch(packing),
        storage=_storage(packing),
        bind=None,
    )
    return tuple(t._replace(layout=bound) if t.index in packing.slots else t for t in tables)


# ------------------------------------------------------------------ pricing


def price(
    stats: TableStats, workers: int, link, slots: int, wire: comm_wire.Wire = comm_wire.DEFAULT
) -> Price:
    """One table's share of an even split over the owners, while the planner compares
    its layouts: ``(P-1) C/P (4 + 2 D b)`` bytes (C = ``stats.distinct``), memory 1/P
    of the table and its optimizer state. ``price_together`` prices the packs as
    ``assign`` places them."""
    nbytes = (workers - 1) * stats.distinct / workers * (4 + both_ways(stats.dim, wire))
    memory = stats.vocab * stats.dim * FLOAT * (1 + slots) / workers
    return Price(nbytes, nbytes * link.beta, memory)


def price_together(
    stats: list[TableStats],
    workers: int,
    link,
    slots: int,
    wire: comm_wire.Wire = comm_wire.DEFAULT,
) -> list[Price]:
    """The table-wise tables priced as they are placed (``assign``): per pack, the bytes
    of an exchange whose buckets hold C = the most distinct ids one worker asks of one
    owner (the owner's tables' ``distinct`` summed, padded as the buckets are: a power of
    two, at least 8), and R rows per worker; each table gets its share (by distinct ids,
    by rows).

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> two = [TableStats("a", 1000, 8, 64, 60, 20), TableStats("b", 900, 8, 64, 50, 20)]
        >>> found = price_together(two, 2, Link(0.0, 1.0), 1)  # an owner each: 60 -> 64
        >>> round(sum(p.bytes for p in found)) == (2 - 1) * 64 * (4 + 2 * 8 * 4)
        True
    """
    records = [Table(i, s.name, s.vocab, s.dim, None) for i, s in enumerate(stats)]
    packing = assign(records, workers)
    prices: list[Price | None] = [None] * len(stats)
    for pack, rows in packing.rows.items():
        members = packing.members(pack)
        per_owner = [0] * workers
        for i in members:
            per_owner[packing.slots[i].owner] += stats[i].distinct
        bucket = padded_slots(next_power_of_two, max(per_owner))
        nbytes = (workers - 1) * bucket * (4 + both_ways(packing.dims[pack], wire))
        memory = rows * packing.dims[pack] * FLOAT * (1 + slots)
        distinct = sum(stats[i].distinct for i in members) or 1
        vocab = sum(stats[i].vocab for i in members)
        for i in members:
            share = nbytes * stats[i].distinct / distinct
            prices[i] = Price(share, share * link.beta, memory * stats[i].vocab / vocab)
    return prices


PRICING = Pricing(
    price,
    messages=lambda workers: 3 * (workers - 1),
    together=price_together,
    serves=lambda stats: not stats.attended,  # no full softmax: see the module doc
)


def _unbound(*args, **kwargs):
    raise ValueError("the table-wise layout reads its tables once bound to owners (bind)")


TABLE = Layout(
    name="table",
    spec=lambda axis: P(axis, None),  # the pack: each worker its block of R rows
    split_dim=0,
    capacity=None,
    fetch=_unbound,
    attend=_no_attend,
    sum_dense=lambda g, axis: g,
    row_specs=lambda axis: (P(axis), P(axis, None)),  # each owner its own rows
    bind=bind,
    pricing=PRICING,
)
