"""Replicated tables with sparse gradients (Horovod, PyTorch DDP with ``sparse=True``).

Every worker holds the whole table. The layout's trio:

1. **plan**: nothing to plan (no static buffer depends on the ids);
2. **fetch**: a local ``take``, no communication;
3. **back**: every worker's (id, gradient row) pairs are all-gathered, so each replica
   receives the same pairs and applies the same update; the pairs of every read of
   every replicated table travel in one all-gather of ids and one of rows. The bytes
   grow with P.

Example:
    >>> from sparsecomm_jax.embedding import replicated
    >>> tuple(replicated.REPLICATED.spec("data"))  # every worker the whole table
    ()

References:
    Sergeev and Del Balso, "Horovod", 2018 (all-gather of sparse gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.embedding.access import Read
from sparsecomm_jax.embedding.layout import FLOAT, Fetched, Layout, Price, Pricing, TableStats

F32 = jnp.float32


def fetch(
    shards, reads: list[Read], capacity: dict[int, int], axis: str, wire=comm_wire.DEFAULT
) -> Fetched:
    """Local rows; the way back all-gathers every worker's pairs (typed replicated), the
    pairs of every read of every replicated table in one all-gather of ids and one of
    gradient rows.

    Per worker (P=2): w0 reads id 3 (gradient row a), w1 id 3 (row b); after ``back``
    both hold ids [3, 3] and rows [a, b], which the update sums.
    """
    rows = [jnp.take(shards[r.table], r.ids, axis=0) for r in reads]

    def back(grads):
        if not reads:
            return []
        sizes = [r.ids.size for r in reads]
        flat_ids = jnp.concatenate([r.ids.reshape(-1) for r in reads])  # int[sum n]
        all_ids = jax.lax.all_gather(flat_ids, axis, to="invarying")  # int[P, sum n]
        rows = [g.reshape(n, -1) for g, n in zip(grads, sizes, strict=True)]  # [n, D]
        every = comm_wire.gather_rows(rows, axis, wire.backward, to="invarying")  # [P, n, D]
        id_ends = np.cumsum([0, *sizes])
        out = []
        for k, read in enumerate(reads):  # each read's pairs, worker after worker
            ids = all_ids[:, id_ends[k] : id_ends[k + 1]].reshape(-1)  # int[P*n]
            out.append((read.table, (ids, every[k].reshape(-1, every[k].shape[-1]))))
        return out  # the same on every worker

    return Fetched(rows, back)


def price(
    stats: TableStats, workers: int, link, slots: int, wire: comm_wire.Wire = comm_wire.DEFAULT
) -> Price:
    """One replicated table, for one worker per step: its (id, gradient row) pair of
    every read to every other worker, ``(P-1) n (D b + 4)`` bytes (n = ``stats.reads``);
    memory the whole table and its optimizer state.

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> price(TableStats("t", 1000, 8, 64, 10, 4), 4, Link(0.0, 1.0), 0).bytes
        6912.0
    """
    back = comm_wire.row_bytes(stats.dim, wire.backward)  # D b, its scale for FP8
    nbytes = float((workers - 1) * stats.reads * (back + 4))
    memory = stats.vocab * stats.dim * FLOAT * (1 + slots)
    return Price(nbytes, nbytes * link.beta, memory)


# two all-gathers (ids, rows) of every replicated table's pairs
PRICING = Pricing(price, messages=lambda workers: 2 * (workers - 1))

REPLICATED = Layout(
    name="replicated",
    spec=lambda axis: P(),
    split_dim=None,
    capacity=None,
    fetch=fetch,
    attend=lambda table, h, axis: h @ table.T,
    sum_dense=lambda g, axis: comm_wire.psum(g, axis),
    row_specs=lambda axis: (P(), P()),
    pricing=PRICING,
)
