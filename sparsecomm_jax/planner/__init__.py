"""A layout for each embedding table, chosen on the alpha-beta model of the link.

Planning is apart from the collectives: ``table_stats`` measures what the tables see
(V, D, and from sample batches, the ids each worker reads per step), ``plan_tables``
picks each table's layout to minimise the modelled step time within the memory of a
worker, and the plan's ``layouts()`` (a ``layouts.TablePlan``) go to
``make_train_step(table_layouts=...)``.

The model proposes, a measurement decides: ``candidate_plans`` gives the best modelled
plan of each set of sharded exchanges and each layout for every table, and
``choose_measured`` keeps the one whose step is fastest when timed (``--plan auto``
times real steps on the cluster that will train; ``--plan model`` trusts the model
alone). The model prices bytes and messages; the layouts also differ in local work
(finding distinct ids, bucketing, scattering rows), which it does not see, so its own
choice can rank plans that a step orders otherwise.

The planner names no layout: it asks each registered layout (``layouts.LAYOUTS``) what
a table costs under it (``Layout.pricing``: each layout's file holds its formula, its
messages and which tables it serves), so a layout registered from a user's own file is
priced like the library's. The library's layouts cost one worker per step (b = 4 bytes
a float, P workers, n ids read per worker, C the slots the layout's exchange is padded
to, ``s`` optimizer slots per parameter):

=========== ================================ ================= ===================
layout      bytes per step                   messages          memory
=========== ================================ ================= ===================
dense       2(P-1)/P V D b (the all-reduce   (shared)          V D b (1 + s)
            of the dense layers) + a dense
            V x D update
replicated  (P-1) n (D b + 4) (all-gather of 2(P-1) per step   V D b (1 + s)
            the ids and gradient rows)
column      (P-1) C (4 + 2 D b / P)          3(P-1) per step   V D b (1 + s) / P
row         (P-1) C (4 + 2 D b)              3(P-1) per step   V D b (1 + s) / P
table       (P-1) C (4 + 2 D b) per pack     3(P-1) per step   R D b (1 + s) per pack
hot         (P-1) C_H (4 + 2 D b) + 2(P-1)/P 7(P-1) per step   (H + (V-H)/P) D b
            H (D b + 4) (cold rows row-wise,                   (1 + s)
            the H hot rows' all-reduce)
=========== ================================ ================= ===================

The hot layout is priced from a histogram of the table's ids (``table_stats(...,
counts=...)``; ``Pricing.measure`` keeps C_H, the cold rows' bucket in the sample
batches, for each H of ``embedding.hot.HOT_ROWS_TRIED``) and takes the H of least
modelled time, its hot ids the choice's ``config``. Where no H pays, its best is H = 0,
the row layout's bytes with more messages, and the plan gives the table another layout.

The tables of one layout share its exchange (``embedding.column.fetch``,
``embedding.row.fetch_many``, ``embedding.replicated.fetch``), so a layout's messages
are paid once per step whatever number of tables it holds; the search therefore tries
every set of sharded layouts and gives each table its cheapest layout within the set. A
table whose D (column) or V (row) does not divide by P is priced at its padded size.
Layouts whose tables are placed together (table-wise packs) are priced together
(``Pricing.together``); while the search compares one table's layouts it takes the
table's share of an even split (C = distinct / P).

Example:
    >>> from sparsecomm_jax import planner
    >>> from sparsecomm_jax.comm.costmodel import Link
    >>> stats = [planner.TableStats("big", 100_000, 64, 512, 400, 60),
    ...          planner.TableStats("tiny", 16, 64, 512, 16, 4)]
    >>> plan = planner.plan_tables(stats, 4, Link.from_bandwidth(1.0))
    >>> plan.layouts().names()  # tiny: the whole table costs less than 8 padded slots
    {'big': 'row', 'tiny': 'dense'}
    >>> slow = Link.from_bandwidth(1.0)
    >>> planner.plan_tables(stats, 4, slow, memory_bytes=1e6)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: no layout of the tables fits 1000000.0 bytes per worker; ...

References:
    Ivchenko et al., "TorchRec: a PyTorch Domain Library for Recommendation Systems",
    RecSys 2022 (the sharding planner); Li et al., "EmbRace", ICPP 2022.
"""

from sparsecomm_jax.embedding.layout import TableStats
from sparsecomm_jax.planner.measured import choose_measured
from sparsecomm_jax.planner.pricing import Choice, group_seconds, layout_cost, priced, serves
from sparsecomm_jax.planner.proposal import (
    May,
    Plan,
    candidate_plans,
    describe,
    plan_tables,
    save,
    unpadded,
)
from sparsecomm_jax.planner.stats import table_stats

__all__ = [
    "Choice",
    "May",
    "Plan",
    "TableStats",
    "candidate_plans",
    "choose_measured",
    "describe",
    "group_seconds",
    "layout_cost",
    "plan_tables",
    "priced",
    "save",
    "serves",
    "table_stats",
    "unpadded",
]
