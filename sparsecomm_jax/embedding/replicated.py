"""Replicated tables with sparse gradients (Horovod, PyTorch DDP with ``sparse=True``).

Every worker holds the whole table. The layout's trio:

1. **plan**: nothing to plan (no static buffer depends on the ids);
2. **fetch**: a local ``take``, no communication;
3. **back**: every worker's (id, gradient row) pairs are all-gathered, so each replica
   receives the same pairs and applies the same update. The bytes grow with P.

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
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.embedding.access import Read
from sparsecomm_jax.embedding.layout import Fetched, Layout

F32 = jnp.float32


def fetch(shards, reads: list[Read], capacity: dict[int, int], axis: str, wire=F32) -> Fetched:
    """Local rows; the way back all-gathers every worker's pairs (typed replicated).

    Per worker (P=2): w0 reads id 3 (gradient row a), w1 id 3 (row b); after ``back``
    both hold ids [3, 3] and rows [a, b], which the update sums.
    """
    rows = [jnp.take(shards[r.table], r.ids, axis=0) for r in reads]

    def back(grads):
        out = []
        for read, g in zip(reads, grads, strict=True):
            flat = read.ids.reshape(-1)  # int[n]
            all_ids = jax.lax.all_gather(flat, axis, tiled=True, to="invarying")  # int[P*n]
            all_rows = comm_wire.gather(g.reshape(flat.shape[0], -1), axis, wire, to="invarying")
            out.append((read.table, (all_ids, all_rows)))  # the same on every worker
        return out

    return Fetched(rows, back)


REPLICATED = Layout(
    name="replicated",
    spec=lambda axis: P(),
    split_dim=None,
    capacity=None,
    fetch=fetch,
    attend=lambda table, h, axis: h @ table.T,
    sum_dense=lambda g, axis: comm_wire.psum(g, axis),
    row_specs=lambda axis: (P(), P()),
)
