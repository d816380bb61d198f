"""Row-wise tables: worker j owns rows ``[jV/P, (j+1)V/P)`` (torchrec's row-wise; V is
rounded up to a multiple of P by zero rows nothing reads, ``layout.padded_shape``).

The layout's trio, per read:

1. **plan** (host): per table, the most *distinct* ids any worker asks of any one owner
   (``bucket_slots``), with a margin for the batches after it (``CAPACITY``:
   ``layout.grow_with_margin``);
2. **fetch**: a worker buckets its distinct ids by owner (``bucket_plan``, ``C`` slots per
   owner), one all-to-all sends each owner the ids asked of it, the owner takes those
   rows, and one all-to-all returns them; each position picks its row. The buckets of
   every lookup of every row-wise table travel side by side in those two all-to-alls
   (``fetch_many``). Ids every worker
   holds (shared negatives) are filled in by their owners and summed (``psum``);
3. **back**: the gradients of equal ids are summed before they leave, and the reverse
   all-to-all (one for every lookup) brings each owner the gradient rows of its ids.

Duplicate ids travel once, so the bytes follow the distinct ids of a batch (far fewer
than its tokens for Zipf-distributed text) and never grow with V.

**Pipelined** (``PIPELINED``, ``embrace_2d``'s carrier ``CARRIER``): a row table's
gradient goes to its owners in two chunks, the positions whose id batch t+1 reads first
(summed per id, ``send_gradients``; every shared lookup's gradient summed over the
workers), every other position once every carried table's first chunk has arrived.
Batch t+1's rows are fetched from their owners (the lookups of every such table in one
exchange), each owner reading its rows with the early update added
(``layout.patched_take``), and carried. Both chunks and the next fetch use one
capacity per table (``two_batches``: the most distinct ids one worker reads of one
owner in batch t or t+1), so the gradient travels in 2C slots a bucket where
``embrace`` sends C: the early chunk is paid in bytes, as the column chunks are.

Pipelined example (P=2, V=8: w0 owns rows 0-3, w1 rows 4-7; batch t+1 reads id 5)::

    w0 ids [5, 2]   first: (5, g) to w1    late: (2, g') to w0, after every first chunk
    w1 early-updates row 5; batch t+1's rows are read from the tables with that update

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.embedding import row
    >>> send, pos = row.bucket_plan(jnp.array([5, 1, 5, 2]), vocab=8, num_workers=2, capacity=2)
    >>> send.tolist(), pos.tolist()
    ([[1, 2], [5, -1]], [2, 0, 2, 1])

References:
    Mudigere et al., "High-performance, Distributed Training of Large-scale DLRMs", 2021;
    torchrec's row-wise sharding (``rw_sharding.py``); Li et al., "EmbRace", ICPP 2022,
    section 4 (the pipelined chunks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.comm.order import waits_for
from sparsecomm_jax.embedding import priority
from sparsecomm_jax.embedding.access import LOOKUP, HostReads, Read
from sparsecomm_jax.embedding.layout import (
    FLOAT,
    CapacityPolicy,
    Carrier,
    Carrying,
    Fetched,
    Layout,
    Pipelined,
    Price,
    Pricing,
    TableStats,
    both_ways,
    grow_with_margin,
    padded_slots,
    patched_take,
)

F32 = jnp.float32


# ------------------------------------------------------------------ 1. plan the ids


def bucket_slots(worker_ids: list[np.ndarray], vocab: int, num_workers: int) -> int:
    """Slots per (worker, owner) bucket that a batch needs: the largest number of
    *distinct* ids any worker asks of any owner (host-side, numpy).

    Example: P=2, V=8 (4 rows each); worker 0 asks [1, 1, 2, 5], worker 1 asks [6, 7, 7]:
    worker 0 needs 2 slots at owner 0 and 1 at owner 1; worker 1 needs 2 at owner 1 -> 2.
    """
    rows = -(-vocab // num_workers)  # rows per owner (a padded table: V/P rounded up)
    need = 0
    for ids in worker_ids:
        uniq = np.unique(np.asarray(ids).ravel())
        if uniq.size:
            need = max(need, int(np.bincount(uniq // rows, minlength=num_workers).max()))
    return need


def _bucket_need(reads: list[HostReads], tables, workers: int) -> dict[int, int]:
    first = reads[0]
    return {
        t.index: bucket_slots(list(first[t.index][0]), t.vocab, workers)
        for t in tables
        if t.index in first
    }


def _bucket_bound(reads: HostReads, table, workers: int) -> int:
    """Every id a worker reads distinct and owned by one worker: min(n, V/P)."""
    return min(reads[table.index][0].shape[1], -(-table.vocab // workers))


CAPACITY = CapacityPolicy(
    _bucket_need, "distinct rows from one owner", grow_with_margin, _bucket_bound
)


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
      (callers size C with ``bucket_slots`` so that none overflow).

    Example (P=2, V=8, C=2): ids [5, 1, 5, 2] -> send_ids [[1, 2], [5, -1]],
    position [2, 0, 2, 1].
    """
    n = ids.shape[0]
    rows = vocab // num_workers
    uniq, inverse = jnp.unique(ids, size=n, fill_value=vocab, return_inverse=True)
    owner = uniq // rows
    first = jnp.searchsorted(uniq, jnp.arange(num_workers) * rows)
    slot = jnp.arange(n) - first[jnp.minimum(owner, num_workers - 1)]
    fits = (uniq < vocab) & (slot < capacity)
    flat = jnp.where(fits, owner * capacity + slot, num_workers * capacity)
    send = jnp.full((num_workers * capacity,), -1, ids.dtype).at[flat].set(uniq, mode="drop")
    return send.reshape(num_workers, capacity), flat[inverse.reshape(-1)]


# ------------------------------------------------------- 2. fetch rows, 3. send back


def fetch_one(shard, ids, axis: str, capacity: int, wire=comm_wire.DEFAULT):
    """Rows of a row-sharded table for this worker's ``ids`` and the way back.

    Per worker (P=2, V=8: w0 owns rows 0-3, w1 rows 4-7; C=2)::

        before:      w0 ids [5, 1, 5]            w1 ids [2, 2]
        buckets:     w0 [[1, -], [5, -]]         w1 [[2, -], [-, -]]
        all_to_all:  w0 asked [[1, -], [2, -]]   w1 asked [[5, -], [-, -]]
        local take + all_to_all back, then each position picks its row:
        after:       w0 [T5, T1, T5]             w1 [T2, T2]

    Args:
      shard: float[V/P, D], this worker's rows.
      ids: int[...] this worker's ids.
      axis: the mesh axis.
      capacity: C, slots per (worker, owner) bucket (``bucket_slots``).
      wire: the codecs rows (``forward``) and their gradients (``backward``) travel in.

    Returns:
      ``(rows float[*ids.shape, D], back)``: ``back(g)`` -> (ids in my shard int[P*C],
      summed gradient rows float[P*C, D]), padding ids = V/P.
    """
    (rows,), back, _ = fetch_many([shard], [ids], [capacity], axis, wire)
    return rows, lambda g: back([g])[0]


def fetch_many(
    shards: list,
    ids: list,
    capacities: list[int],
    axis: str,
    wire=comm_wire.DEFAULT,
    take: Callable | Sequence[Callable] | None = None,
):
    """``fetch_one`` for several reads (of one or several tables) through one exchange:
    the buckets of every read side by side in one all-to-all of ids, the rows found in
    one all-to-all back, and the gradients in one all-to-all on the way back.

    Args:
      shards: per read, float[V/P, D] (this worker's rows of the table it reads; the
        widths may differ).
      ids: per read, int[...] this worker's ids; a negative id asks for no row (its
        row is zero, its gradient dropped, it takes no slot).
      capacities: per read, C (slots per (worker, owner) bucket).
      axis: the mesh axis.
      wire: the codecs rows (``forward``) and their gradients (``backward``) travel in.
      take: ``take(shard, local) -> rows``, how an owner reads the rows asked of it
        (``local`` int[P, C] in its shard, ``V/P`` for an empty slot: a zero row), or
        one per read; default ``take_rows`` (the pipelined step reads the rows with
        their early update added).

    Returns:
      ``(rows, back, missed)``: per read ``float[*ids.shape, D]``; ``back(grads)`` -> per
      read ``(ids in my shard int[P*C], summed gradient rows float[P*C, D])``; per read
      bool[]: some id found no slot (C too small; its rows are NaN).
    """
    takes = list(take) if isinstance(take, Sequence) else [take or take_rows] * len(shards)
    num, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    caps = [min(c, i.size) for c, i in zip(capacities, ids, strict=True)]
    skips = [i.reshape(-1) < 0 for i in ids]  # ids the caller does not want: no row
    plans = [
        bucket_plan(jnp.where(k, t.shape[0] * num, i.reshape(-1)), t.shape[0] * num, num, c)
        for t, i, c, k in zip(shards, ids, caps, skips, strict=True)
    ]  # per read (int[P, C], int[n])
    asked = jax.lax.all_to_all(jnp.concatenate([s for s, _ in plans], 1), axis, 0, 0)
    starts = np.cumsum([0, *caps])  # asked: int[P, sum C], the ids others want of me
    local = [
        asked_rows(a, t.shape[0], me) for t, a in zip(shards, _split(asked, starts), strict=True)
    ]  # per read int[P, C]
    found = [f(t, loc) for f, t, loc in zip(takes, shards, local, strict=True)]  # [P, C, D]
    widths = [t.shape[1] for t in shards]
    got = comm_wire.a2a_rows(found, axis, wire.forward)  # per read float[P, C, D]
    rows = [  # each in its table's dtype (tables of several dtypes travel together)
        jnp.where(k[:, None], 0, jnp.take(block.reshape(num * c, w), pos, axis=0))
        .reshape(*i.shape, w)
        .astype(t.dtype)
        for block, c, w, (_, pos), i, t, k in zip(
            got, caps, widths, plans, ids, shards, skips, strict=True
        )
    ]

    def back(grads):  # duplicates summed before the reverse exchange
        sums = [
            bucket_sums(g, pos, num, c) for g, c, (_, pos) in zip(grads, caps, plans, strict=True)
        ]
        back_got = comm_wire.a2a_rows(sums, axis, wire.backward)  # per read [P, C, D]
        return [
            (loc.reshape(-1), block.reshape(-1, w))
            for loc, block, w in zip(local, back_got, widths, strict=True)
        ]

    missed = [
        jnp.any((pos == num * c) & ~k) for (_, pos), c, k in zip(plans, caps, skips, strict=True)
    ]
    return rows, back, missed


def bucket_sums(grads, position, num_workers: int, capacity: int):
    """float32[P, C, D]: the gradient rows ``grads`` (``float[..., D]``) summed into the
    slots ``position`` gives them (``bucket_plan``; a position past the buckets sends
    nothing)."""
    width = grads.shape[-1]
    flat = jnp.zeros((num_workers * capacity, width), F32)
    flat = flat.at[position].add(grads.reshape(-1, width).astype(F32), mode="drop")
    return flat.reshape(num_workers, capacity, width)


def send_gradients(
    ids: list,
    grads: list,
    capacities: list[int],
    axis: str,
    rows_per: list[int],
    codec=comm_wire.FLOAT32,
) -> list:
    """Gradient rows summed per id and sent to the ids' owners, for several tables at
    once: the way back of ``fetch_many`` on its own (one all-to-all of every table's
    ids, one of their rows), for a step that sends the gradients in chunks
    (``CARRIER``).

    Per worker (P=2, V=8: w0 owns rows 0-3, w1 rows 4-7; C=1; one table)::

        before:      w0 ids [5, 5, -1] grads [a, b, c]    w1 ids [1] grads [d]
        buckets:     w0 [[-], [5: a+b]]                   w1 [[1: d], [-]]
        all_to_all:  w0 holds (1, d)                      w1 holds (5 - 4, a+b)

    Args:
      ids: per table, int[n] rows (< P * its ``rows_per``); a negative id sends nothing.
      grads: per table, float[n, D] the gradient at each position (the widths may
        differ).
      capacities: per table, C, slots per (worker, owner) bucket.
      axis: the mesh axis.
      rows_per: per table, the rows of each worker's shard.
      codec: the codec the rows travel in.

    Returns:
      Per table ``((ids in my shard int[P*C], rows float32[P*C, D]), missed)``: the
      pairs at this owner (``rows_per`` in an empty slot); ``missed`` bool[n], a
      position whose id found no slot (its gradient was not sent).
    """
    num, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    caps = [min(c, i.shape[0]) for c, i in zip(capacities, ids, strict=True)]
    out = [  # a table with no slot (no position, or C = 0) sends nothing
        ((jnp.zeros((0,), jnp.int32), jnp.zeros((0, g.shape[-1]), F32)), i >= 0)
        for i, g in zip(ids, grads, strict=True)
    ]
    live = [k for k, c in enumerate(caps) if c]
    if not live:
        return out
    plans = {
        k: bucket_plan(
            jnp.where(ids[k] < 0, rows_per[k] * num, ids[k]), rows_per[k] * num, num, caps[k]
        )
        for k in live
    }  # per table (int[P, C], int[n])
    asked = jax.lax.all_to_all(jnp.concatenate([plans[k][0] for k in live], 1), axis, 0, 0)
    sums = [bucket_sums(grads[k], plans[k][1], num, caps[k]) for k in live]
    got = comm_wire.a2a_rows(sums, axis, codec)  # per table float32[P, C, D]
    bounds = np.cumsum([0, *(caps[k] for k in live)])
    for k, block, got_ids in zip(live, got, _split(asked, bounds), strict=True):
        local = asked_rows(got_ids, rows_per[k], me)
        missed = (plans[k][1] == num * caps[k]) & (ids[k] >= 0)
        out[k] = ((local.reshape(-1), block.reshape(num * caps[k], -1)), missed)
    return out


def asked_rows(asked, rows_per: int, me):
    """The rows of my shard that the ids asked of me (``bucket_plan``'s ``send_ids``
    after the all-to-all) name; ``rows_per`` (no row) in an empty slot (-1)."""
    return jnp.where(asked >= 0, asked - me * rows_per, rows_per)


def _split(x, bounds) -> list:
    """The column blocks ``x[:, bounds[k]:bounds[k + 1]]``."""
    return [x[:, int(a) : int(b)] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def take_rows(shard, local):
    """``shard[local]`` along the rows; a row past the shard (an empty slot) reads zeros."""
    return jnp.take(shard, local, axis=0, mode="fill", fill_value=0)


def owned_rows(ids, rows_per: int, axis: str):
    """Each id's row in this worker's shard of ``rows_per`` rows; ``rows_per`` (no row)
    for an id another worker owns."""
    local = ids - jax.lax.axis_index(axis) * rows_per
    return jnp.where((local >= 0) & (local < rows_per), local, rows_per)


def fetch_shared_one(shard, ids, axis: str, wire=comm_wire.DEFAULT, take: Callable | None = None):
    """Rows for ids every worker holds identically: owners fill theirs, one sum; the
    gradient is every worker's, summed (one sum). ``take`` as ``fetch_many`` takes it."""
    at = owned_rows(ids, shard.shape[0], axis)
    mine = (take or take_rows)(shard, at)
    rows = comm_wire.psum(mine, axis, wire.forward)  # one owner per id

    def back(g):
        total = comm_wire.psum(g, axis, wire.backward)
        return at.reshape(-1), total.reshape(ids.size, -1)

    return rows, back


def fetch(
    shards,
    reads: list[Read],
    capacity: dict[int, int],
    axis: str,
    wire=comm_wire.DEFAULT,
    take: Mapping[int, Callable] | None = None,
) -> Fetched:
    """Every read of the row-wise tables: the lookups of every table through one exchange
    (``fetch_many``), each shared read through its own sum. ``take``: table index -> how
    its owners read the rows asked of them (``fetch_many``; default ``take_rows``)."""
    take = take or {}
    look = [k for k, r in enumerate(reads) if r.kind == LOOKUP]
    shared = [k for k, r in enumerate(reads) if r.kind != LOOKUP]
    rows: dict[int, jax.Array] = {}
    look_back, missed = None, {}
    if look:
        got, look_back, miss = fetch_many(
            [shards[reads[k].table] for k in look],
            [reads[k].ids for k in look],
            [capacity[reads[k].table] for k in look],
            axis,
            wire,
            [take.get(reads[k].table, take_rows) for k in look],
        )
        rows.update(zip(look, got, strict=True))
        for k, m in zip(look, miss, strict=True):
            i = reads[k].table
            missed[i] = m if i not in missed else missed[i] | m
    shared_backs = {}
    for k in shared:
        rows[k], shared_backs[k] = fetch_shared_one(
            shards[reads[k].table], reads[k].ids, axis, wire, take.get(reads[k].table)
        )

    def back(grads):
        pairs = dict(zip(look, look_back([grads[k] for k in look]), strict=True)) if look else {}
        pairs.update({k: b(grads[k]) for k, b in shared_backs.items()})
        return [(reads[k].table, pairs[k]) for k in range(len(reads))]

    return Fetched([rows[k] for k in range(len(reads))], back, missed)


def attend(shard, h, axis: str):
    """``h @ table.T`` on the gathered table (its gradient returns by reduce-scatter)."""
    return h @ jax.lax.all_gather(shard, axis, axis=0, tiled=True).T


def price(
    stats: TableStats, workers: int, link, slots: int, wire: comm_wire.Wire = comm_wire.DEFAULT
) -> Price:
    """One table row-wise, for one worker per step: buckets of C ids to every owner (4
    bytes each) and C whole rows each way, ``(P-1) C (4 + 2 D b)`` bytes, C =
    ``stats.bucket`` padded as the buckets are (``CAPACITY.grow``: its margin, at
    least 8; ``b`` as the ``wire`` sends a value, plus a scale per row for FP8); memory
    its rows, 1/P of the table (V padded to a multiple of P) and their optimizer state.

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> price(TableStats("t", 1000, 8, 64, 10, 4), 4, Link(0.0, 1.0), 0).bytes  # C = 10
        2040.0
    """
    p, padded = workers, -(-stats.vocab // workers) * workers
    c = padded_slots(CAPACITY.grow, stats.bucket)
    nbytes = float((p - 1) * c * (4 + both_ways(stats.dim, wire)))
    memory = padded / p * stats.dim * FLOAT * (1 + slots)
    return Price(nbytes, nbytes * link.beta, memory)


# -------------------------------------------------- pipelined: two chunks, rows carried


def two_batches(policy: CapacityPolicy) -> CapacityPolicy:
    """A layout's plan of the ids (``policy``: the slots one batch needs) for the
    pipelined step, which sends batch t's gradients and fetches batch t+1's rows through
    one capacity: the most that either batch needs (host-side).

    Example:
        >>> two_batches(CAPACITY).what
        'distinct rows from one owner (batch t or t+1)'
    """

    def need(reads: list[HostReads], tables, workers: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for now in reads[:2]:  # batch t, then t+1 (none at the last step)
            for i, slots in policy.need([now], tables, workers).items():
                out[i] = max(out.get(i, 0), slots)
        return out

    return policy._replace(need=need, what=f"{policy.what} (batch t or t+1)")


class RowPlan(NamedTuple):
    """A row-wise table's gradient exchange in the pipelined step, per worker."""

    ids: Any  # int[n]: the rows this worker looked up, one per position (-1: none)
    grads: Any  # float[n, D]: its gradient at those positions
    first: Any  # bool[n]: the positions the first chunk sends (batch t+1 reads their id)
    shared: list  # [(ids int[N], grads float[N, D])]: lookups whose ids every worker holds
    capacity: int  # C: slots per (worker, owner) bucket
    rows_per: int  # the rows of each worker's shard
    next_ids: Any  # int[m]: the rows of my shard batch t+1 reads (``rows_per``: another's)
    sent: Any = None  # bool[n]: the positions the first chunk carried (``first_pairs``)


def plan(
    reads: list,
    g_rows: list,
    future_ids: jax.Array | None,
    capacity: int,
    rows_per: int,
    axis: str,
) -> RowPlan:
    """One table's gradient exchange in the pipelined step (inside ``shard_map``).

    Args:
      reads: the table's reads of batch t (``access.Read``; a hot table's ids as their
        stored rows, -1 where hot); a read of no ids (a bag of width 0) sends nothing.
      g_rows: per read, its gradient rows ``float[*ids.shape, D]``.
      future_ids: int[m], every row batch t+1 reads of the table, on every worker (of
        every replica group); ``None`` at the last step (one chunk, the late one).
      capacity: C, slots per (worker, owner) bucket (``two_batches``).
      rows_per: the rows of each worker's shard of the table.
      axis: the mesh axis the table is sharded over.

    Returns:
      The ``RowPlan``: which positions go first, and the rows of my shard batch t+1
      reads (the early update's ``next_ids``).
    """
    width = g_rows[0].shape[-1]
    looked = [
        (r.ids.reshape(-1), g.reshape(r.ids.size, width))
        for r, g in zip(reads, g_rows, strict=True)
        if r.kind == LOOKUP
    ]
    shared = [
        (r.ids.reshape(-1), g.reshape(r.ids.size, width))
        for r, g in zip(reads, g_rows, strict=True)
        if r.kind != LOOKUP and r.ids.size
    ]
    ids = jnp.concatenate([i for i, _ in looked] or [jnp.zeros((0,), jnp.int32)])
    grads = jnp.concatenate([g for _, g in looked] or [jnp.zeros((0, width), g_rows[0].dtype)])
    if future_ids is None:  # the last step: every position in the late chunk alone
        first, next_ids = jnp.zeros(ids.shape, bool), None
    else:
        first = priority.is_in(ids, future_ids) & (ids >= 0)  # -1: no row (a hot id)
        next_ids = owned_rows(future_ids, rows_per, axis)
    return RowPlan(ids, grads, first, shared, capacity, rows_per, next_ids)


def _plans(where: Carrying, shards, reads, g_rows, future, slots):
    """``Carrier.plan``: every row table's ``RowPlan`` (batch t+1's ids, every group's,
    decide the first chunk); no spill yet (``first_pairs`` finds it)."""
    plans = {}
    for i in sorted(shards):
        mine = [k for k, r in enumerate(reads) if r.table == i]
        fut = priority.future_ids(future[:1], i, where.batch_axes)[0] if future else None
        got = [reads[k] for k in mine], [g_rows[k] for k in mine]
        plans[i] = plan(*got, fut, slots[i], shards[i].shape[0], where.axis)
    return plans, jnp.array(False)


def _send(plans: dict[int, RowPlan], which: dict, axis: str) -> dict:
    """Table index -> ``((ids, rows), missed)``: each table's positions where ``which``
    is true, sent to their owners by one exchange for every table (none: no table)."""
    if not plans:
        return {}
    got = send_gradients(
        [jnp.where(which[i], p.ids, -1) for i, p in plans.items()],
        [p.grads for p in plans.values()],
        [p.capacity for p in plans.values()],
        axis,
        [p.rows_per for p in plans.values()],
    )
    return dict(zip(plans, got, strict=True))


def first_pairs(plans: dict[int, RowPlan], axis: str) -> tuple[dict, dict]:
    """The first chunk of every row-wise table, at the owners (inside ``shard_map``): one
    exchange for all of them (``send_gradients``).

    Args:
      plans: table index -> its ``RowPlan``.
      axis: the mesh axis.

    Returns:
      ``(pairs, sent)``: table index -> ``[(ids in my shard int[k], rows float32[k,
      D])]``, the positions batch t+1 reads and every shared lookup (summed over the
      workers); table index -> bool[n], the positions the chunk carried (a first
      position that found no slot goes late). At the last step (nothing read next)
      the shared lookups alone.
    """
    pairs = {i: [] for i in plans}
    sent = {i: jnp.zeros(p.ids.shape, bool) for i, p in plans.items()}
    ahead = {i: p for i, p in plans.items() if p.next_ids is not None}
    if ahead:
        for i, (pair, missed) in _send(ahead, {i: p.first for i, p in ahead.items()}, axis).items():
            pairs[i], sent[i] = [pair], ahead[i].first & ~missed
    for i, p in plans.items():  # the same ids everywhere: every worker's sum, at the owner
        for ids, g in p.shared:
            pairs[i].append((owned_rows(ids, p.rows_per, axis), jax.lax.psum(g, axis)))
    return pairs, sent


def later_pairs(plans: dict[int, RowPlan], sent: dict, axis: str) -> tuple[dict, dict]:
    """The late chunk of every row-wise table, at the owners (inside ``shard_map``): every
    position the first chunk did not carry (``sent``, from ``first_pairs``), one
    exchange for all of them.

    Returns:
      ``(pairs, missed)``: table index -> ``[(ids in my shard int[P*C], rows float32[P*C,
      D])]``; table index -> bool[], a position found no slot (the step's rows did not
      all arrive: it is marked so).
    """
    got = _send(plans, {i: ~sent[i] for i in plans}, axis)
    return {i: [pair] for i, (pair, _) in got.items()}, {
        i: jnp.any(missed) for i, (_, missed) in got.items()
    }


def spill(rp: RowPlan, sent: jax.Array) -> jax.Array:
    """bool[]: a position batch t+1 reads missed the first chunk (its row's early update
    lacks that gradient: the step fetches the next rows again)."""
    return jnp.any(rp.first & ~sent)


def _firsts(where: Carrying, plans: dict):
    """``Carrier.first``: every row table's first chunk in one exchange; the plans
    record what it carried, ``spill`` where a position batch t+1 reads missed it."""
    pairs, sent = first_pairs(plans, where.axis)
    flags = [spill(p, sent[i]) for i, p in plans.items()]
    plans = {i: p._replace(sent=sent[i]) for i, p in plans.items()}
    return pairs, plans, functools.reduce(jnp.logical_or, flags, jnp.array(False))


def _laters(where: Carrying, plans: dict, after):
    """``Carrier.later``: every other position in one exchange, its ids and rows made to
    wait for ``after``."""
    late = {
        i: p._replace(ids=waits_for(p.ids, after), grads=waits_for(p.grads, after))
        for i, p in plans.items()
    }
    return later_pairs(late, {i: p.sent for i, p in plans.items()}, where.axis)


def _patched_rows(shard, local, patch):
    """``patched_take`` for an owner of the row-wise exchange: an empty slot of a bucket
    (``local`` = the shard's rows) reads a zero row."""
    rows = patched_take(shard, patch, local)
    return jnp.where((local < shard.shape[0])[..., None], rows, 0)


def fetch_carried(
    shards: dict, reads: list, capacity: dict[int, int], axis: str, take: dict | None = None
) -> list:
    """Rows of reads of row-wise tables (inside ``shard_map``), through the layout's own
    fetch (``fetch``: the lookups of every table in one exchange); a read of no ids (a
    bag of width 0) reads nothing.

    Args:
      shards: table index -> float[V/P, D], this worker's rows of the table.
      reads: ``access.Read`` s (a negative id reads a zero row).
      capacity: table index -> C, slots per (worker, owner) bucket.
      axis: the mesh axis.
      take: table index -> how its owners read the rows asked of them (the pipelined
        step's reads add the early update); default the shards as they are.

    Returns:
      Per read ``float[*ids.shape, D]``.
    """
    out = [
        jnp.zeros((*r.ids.shape, shards[r.table].shape[1]), shards[r.table].dtype) for r in reads
    ]
    live = [k for k, r in enumerate(reads) if r.ids.size]
    if live:
        got = fetch(shards, [reads[k] for k in live], capacity, axis, take=take).rows
        for k, rows in zip(live, got, strict=True):
            out[k] = rows
    return out


def _fetch_carried(where: Carrying, shards, reads, slots, patches=None) -> list:
    """``Carrier.fetch``: ``fetch_carried``, the owners reading through ``patches``."""
    takes = None
    if patches is not None:
        takes = {i: functools.partial(_patched_rows, patch=patches[i]) for i in shards}
    return fetch_carried(shards, reads, slots, where.axis, takes)


#: The row tables' carried exchange: two chunks to the owners, one exchange each for
#: every table; batch t+1's rows by one fetch for every table.
CARRIER = Carrier(_plans, _firsts, _laters, _fetch_carried)

#: How ``embrace_2d`` carries a row table: buckets for batch t or t+1, by ``CARRIER``.
PIPELINED = Pipelined(two_batches, CARRIER)


PRICING = Pricing(price, messages=lambda workers: 3 * (workers - 1))

ROW = Layout(
    name="row",
    spec=lambda axis: P(axis, None),
    split_dim=0,
    capacity=CAPACITY,
    fetch=fetch,
    attend=attend,
    sum_dense=lambda g, axis: g,
    row_specs=lambda axis: (P(axis), P(axis, None)),  # each owner its own rows
    pricing=PRICING,
    pipelined=PIPELINED,
)
