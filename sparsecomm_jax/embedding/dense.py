"""Dense tables: a table that is no table to the step (data parallel).

Every worker holds the whole table as an ordinary parameter: its reads are plain
``take`` calls, its gradient a dense V x D array in the dense layers' all-reduce, its update
the optimizer's on the whole table. The layout has no trio of its own: a step that gives
a table this layout (``table_layouts={table: "dense"}``, or a data-parallel strategy for
every table) never calls one. It pays per step the all-reduce of the whole table and a
dense update, whatever the batch reads: worth it for small tables, and for tables most
of whose rows every step reads.

Example:
    >>> from sparsecomm_jax.embedding import dense
    >>> dense.DENSE.name, dense.DENSE.data_parallel, dense.DENSE.sharded
    ('dense', True, False)
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import costmodel
from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.embedding.layout import FLOAT, Layout, Price, Pricing, TableStats

# Seconds per table entry of a dense table's update on the host (gradient, optimizer,
# apply: about 4 passes of 0.2 ns; one jitted pass over 8M float32 takes 1.2-2 ms).
UPDATE_S = 0.8e-9


def price(
    stats: TableStats, workers: int, link, slots: int, wire: comm_wire.Wire = comm_wire.DEFAULT
) -> Price:
    """One dense table, for one worker per step: the ring all-reduce of its V x D
    gradient, ``2 (P-1)/P V D b`` bytes (``comm.costmodel.flat_mean_cost`` in the
    ``wire``'s dense codec), and its dense update; memory the whole table
    and its optimizer state. Its messages are the dense layers' all-reduce's, paid
    anyway.

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> price(TableStats("t", 1000, 8, 64, 10, 4), 4, Link(0.0, 1.0), 0).bytes
        48000.0
    """
    entries = stats.vocab * stats.dim
    nbytes = costmodel.flat_mean_cost(entries, workers, wire.dense)[1]
    memory = entries * FLOAT * (1 + slots)
    return Price(nbytes, nbytes * link.beta + entries * UPDATE_S, memory)


def _no_trio(*args, **kwargs):
    raise ValueError("a dense table is an ordinary parameter: no layout reads it")


DENSE = Layout(
    name="dense",
    spec=lambda axis: P(),
    split_dim=None,
    capacity=None,
    fetch=_no_trio,
    attend=lambda table, h, axis: h @ table.T,
    sum_dense=lambda g, axis: g,
    row_specs=lambda axis: (P(), P()),
    pricing=Pricing(price),
    data_parallel=True,
)
