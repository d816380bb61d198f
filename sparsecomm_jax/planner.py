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

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.comm.costmodel import Link
from sparsecomm_jax.embedding import access, row
from sparsecomm_jax.embedding import layouts as registry
from sparsecomm_jax.embedding.dense import DENSE
from sparsecomm_jax.embedding.layout import (
    Layout,
    Price,
    TableStats,
    distinct_per_worker,
    split_size,
)
from sparsecomm_jax.embedding.layouts import TablePlan
from sparsecomm_jax.embedding.tables import find_tables, table_mask

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


class Choice(NamedTuple):
    """One table's layout and what it costs one worker per step; ``config`` and
    ``setting`` the layout's configuration of the table where it has one (``Price``)."""

    table: str
    layout: str
    bytes: float
    seconds: float
    memory: float
    config: Any = None
    setting: str = ""


class Plan(NamedTuple):
    """A layout per table; ``seconds`` the modelled step time of the tables."""

    choices: tuple[Choice, ...]
    seconds: float
    memory: float
    workers: int

    def layouts(self) -> TablePlan:
        """The plan's layouts, for ``make_train_step(table_layouts=...)``: a layout
        configured per table (the hot rows) as one value of it, ``Layout.configure`` of
        its tables' configurations."""
        configs: dict[str, dict[str, Any]] = {}
        for c in self.choices:
            if c.config is not None:
                configs.setdefault(c.layout, {})[c.table] = c.config
        made = {name: registry.get(name).configure(x) for name, x in configs.items()}
        return TablePlan({c.table: made.get(c.layout, c.layout) for c in self.choices})

    def table(self) -> str:
        """The plan as a text table (one line per table, then the total)."""
        lines = [f"{'table':<32} {'layout':<14} {'MB/step':>9} {'ms/step':>8} {'memory MB':>10}"]
        for c in self.choices:
            layout = f"{c.layout} {c.setting}".strip()
            lines.append(
                f"{c.table:<32} {layout:<14} {c.bytes / 1e6:>9.3f} {c.seconds * 1e3:>8.3f} "
                f"{c.memory / 1e6:>10.2f}"
            )
        lines.append(
            f"{'(one worker of ' + str(self.workers) + ')':<47} {'':>9} "
            f"{self.seconds * 1e3:>8.3f} {self.memory / 1e6:>10.2f}"
        )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "seconds": self.seconds,
            "memory": self.memory,
            "tables": [c._asdict() for c in self.choices],
        }


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
        measured = {x.name: x.pricing.measure(t, seen, table_counts, workers) for x in measuring}
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
            )
        )
    return stats


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


def priced() -> list[Layout]:
    """The registered layouts the planner can price (those with ``pricing``)."""
    return [x for x in registry.LAYOUTS.values() if x.pricing is not None]


def _choice(stats: TableStats, layout: Layout, price: Price) -> Choice:
    return Choice(
        stats.name,
        layout.name,
        price.bytes,
        price.seconds,
        price.memory,
        price.config,
        price.setting,
    )


def layout_cost(
    stats: TableStats,
    layout: str | Layout,
    workers: int,
    link: Link,
    optimizer_slots: int = 1,
    wire: comm_wire.Wire = comm_wire.DEFAULT,
) -> Choice:
    """What ``layout`` costs one worker per step for this table alone
    (``Layout.pricing.table``; a sharded layout at the table's padded size; its rows
    in ``wire``'s codecs).

    Raises:
      ValueError: an unknown layout, or one the planner cannot price.
    """
    layout = registry.get(layout)
    if layout.pricing is None:
        raise ValueError(f"layout {layout.name!r} has no pricing: the planner cannot price it")
    return _choice(stats, layout, layout.pricing.table(stats, workers, link, optimizer_slots, wire))


def group_seconds(used: Iterable[str | Layout], workers: int, link: Link) -> float:
    """The messages of the layouts' shared exchanges, once each per step
    (``Pricing.messages``: 3(P-1) for a sharded layout's, 2(P-1) for the replicated
    tables' two all-gathers)."""
    return sum(registry.get(x).pricing.messages(workers) * link.alpha for x in set(used))


def serves(stats: TableStats, layout: str | Layout) -> bool:
    """Whether ``layout`` can serve the table's reads (table-wise: no full softmax)."""
    return registry.get(layout).pricing.serves(stats)


#: ``may(stats, layout)``: whether a table may take a layout in the plans the planner
#: makes (beside ``serves``): a constraint of the step that will run the plan.
May = Callable[[TableStats, Layout], bool]


def unpadded(workers: int) -> May:
    """A ``may`` for a step that stores its carried tables unpadded (``embrace_2d``: a
    layout whose carrier reads the stored rows whole, ``Pipelined.unpadded``, the
    column layout's): a table takes such a layout only where the dimension it splits
    divides by ``workers``.

    Example:
        >>> from sparsecomm_jax.embedding.column import COLUMN
        >>> from sparsecomm_jax.embedding.row import ROW
        >>> may = unpadded(4)
        >>> a, b = TableStats("a", 100, 8, 16, 10, 4), TableStats("b", 101, 6, 16, 10, 4)
        >>> may(a, COLUMN), may(b, COLUMN), may(b, ROW)  # D = 6 does not divide by 4
        (True, False, True)
    """

    def may(stats: TableStats, layout: Layout) -> bool:
        kept = layout.pipelined is not None and layout.pipelined.unpadded
        size = split_size(layout, stats.vocab, stats.dim)
        return not kept or size is None or size % workers == 0

    return may


def _options(stats: TableStats, layouts: Iterable[Layout], may: May | None) -> list[Layout]:
    """The layouts of ``layouts`` that serve the table and that it may take."""
    return [x for x in layouts if x.pricing.serves(stats) and (may is None or may(stats, x))]


def plan_tables(
    stats: Sequence[TableStats],
    workers: int,
    link: Link,
    memory_bytes: float | None = None,
    optimizer_slots: int = 1,
    layouts: Sequence[str | Layout] | None = None,
    wire: comm_wire.Wire = comm_wire.DEFAULT,
    may: May | None = None,
) -> Plan:
    """Each table's layout, minimising the modelled step time within ``memory_bytes``
    of tables (and their optimizer state) per worker.

    Args:
      stats: ``table_stats(...)``.
      workers: P.
      link: the alpha-beta model (``costmodel.calibrate`` or ``Link.from_bandwidth``).
      memory_bytes: the tables' memory per worker (``None``: no limit).
      optimizer_slots: optimizer state per parameter entry (SGD 0, Adagrad 1, Adam 2).
      layouts: the layouts to choose from (``None``: every one the planner can price,
        ``priced()``).
      wire: the codecs rows and their gradients travel in (``comm.wire.parse``).
      may: which layouts a table may take (``None``: any that serves it; ``unpadded``
        for a step that does not pad its own layout's tables).

    Returns:
      The ``Plan`` of least modelled time (the first of ``candidate_plans``).

    Raises:
      ValueError: no assignment fits ``memory_bytes``, or no layout may serve a table.
    """
    plans = candidate_plans(
        stats, workers, link, memory_bytes, optimizer_slots, layouts, wire=wire, may=may
    )
    return plans[0]


def candidate_plans(
    stats: Sequence[TableStats],
    workers: int,
    link: Link,
    memory_bytes: float | None = None,
    optimizer_slots: int = 1,
    layouts: Sequence[str | Layout] | None = None,
    within: float = 10.0,
    wire: comm_wire.Wire = comm_wire.DEFAULT,
    may: May | None = None,
) -> list[Plan]:
    """The plans worth timing (``choose_measured``), least modelled time first: the best
    modelled plan of each set of sharded exchanges (none, column, row, table-wise and
    their combinations) and each layout for every table, within ``memory_bytes``;
    distinct plans only, none modelled slower than ``within`` times the best.

    Within one set of exchanges the model ranks tables by bytes, where it is reliable;
    between layouts it misses the local work that differs by layout (the column-wise
    exchange finds the distinct ids of every worker's reads, the replicated one scatters
    every worker's gradient rows), which only a step can measure. One layout for every
    table is a candidate of its own because the model's mixes pay every such cost.

    Args:
      stats: ``table_stats(...)``.
      workers: P.
      link: the alpha-beta model.
      memory_bytes: the tables' memory per worker (``None``: no limit).
      optimizer_slots: optimizer state per parameter entry.
      layouts: the layouts to choose from (``None``: ``priced()``).
      within: candidates modelled slower than this many times the best are left out
        (a 1M-row table data parallel is not worth a compile).
      wire: the codecs rows and their gradients travel in.
      may: which layouts a table may take (``None``: any that serves it): a table goes
        to its best layout among those it may take, in every candidate.

    Returns:
      One ``Plan`` or more.

    Raises:
      ValueError: no assignment fits ``memory_bytes``, or no layout may serve a table.

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> stats = [TableStats("big", 100_000, 64, 512, 400, 60)]
        >>> [p.layouts()["big"].name for p in candidate_plans(stats, 4, Link.from_bandwidth(1.0))]
        ['row', 'column', 'replicated', 'table']
    """
    chosen = priced() if layouts is None else [_layouts_get(x) for x in layouts]
    local = [x for x in chosen if not x.sharded]
    sharded = [x for x in chosen if x.sharded]
    groups = [g for k in range(len(sharded) + 1) for g in itertools.combinations(sharded, k)]
    allowed = [([*local, *g], g) for g in groups]
    allowed += [([x], (x,) if x.sharded else ()) for x in chosen]  # one layout alone
    found: dict[str, Plan] = {}
    for names, group in allowed:
        plan = _plan_within(stats, workers, link, optimizer_slots, wire, names, may)
        if plan is not None:
            plan = _fit_memory(
                plan, stats, workers, link, optimizer_slots, wire, group, memory_bytes, may
            )
        if plan is None:
            continue
        key = json.dumps({c.table: [c.layout, c.setting] for c in plan.choices}, sort_keys=True)
        if key not in found or plan.seconds < found[key].seconds:
            found[key] = plan
    if not found and memory_bytes is None:
        unserved = [s.name for s in stats if not _options(s, chosen, may)]
        where = "" if may is None else " where it may go (may)"
        raise ValueError(
            f"no layout of {[x.name for x in chosen]} serves table {unserved[0]}{where}; "
            "allow another layout"
        )
    if not found:
        raise ValueError(
            f"no layout of the tables fits {memory_bytes} bytes per worker; give more "
            "memory or more workers"
        )
    ranked = sorted(found.values(), key=lambda p: p.seconds)
    return [p for p in ranked if p.seconds <= within * ranked[0].seconds]


def _layouts_get(layout: str | Layout) -> Layout:
    found = registry.get(layout)
    if found.pricing is None:
        raise ValueError(f"layout {found.name!r} has no pricing: the planner cannot price it")
    return found


def choose_measured(
    candidates: Sequence[Plan], time_plans: Callable[[Sequence[Plan]], Sequence[float]]
) -> tuple[Plan, list[float]]:
    """The candidate of least measured step time.

    Args:
      candidates: ``candidate_plans(...)``.
      time_plans: ``plans -> seconds of a step under each`` (timed on the cluster that
        will train; ``experiments.train.startup.choose_plan`` runs real steps of every plan in
        turns, so that a change of load on the host falls on all of them). Not called
        when there is one candidate.

    Returns:
      ``(plan, seconds per candidate)`` (an empty list when nothing was timed).

    Example:
        >>> plans = [Plan((), 1.0, 0.0, 4), Plan((), 2.0, 0.0, 4)]
        >>> choose_measured(plans, lambda ps: [3.0 - p.seconds for p in ps])[0].seconds
        2.0
    """
    if len(candidates) == 1:
        return candidates[0], []
    seconds = [float(s) for s in time_plans(candidates)]
    if len(seconds) != len(candidates):
        raise ValueError(f"time_plans gave {len(seconds)} times for {len(candidates)} plans")
    best = min(range(len(candidates)), key=lambda k: seconds[k])
    return candidates[best], seconds


def _plan_within(
    stats, workers, link, slots, wire, allowed: list[Layout], may: May | None
) -> Plan | None:
    if not allowed:
        return None
    choices = []
    for s in stats:
        options = [
            _choice(s, x, x.pricing.table(s, workers, link, slots, wire))
            for x in _options(s, allowed, may)
        ]
        if not options:  # a softmax table, table-wise only
            return None
        choices.append(min(options, key=lambda c: c.seconds))
    return _total(choices, stats, workers, link, slots, wire)


def _total(choices: list[Choice], stats, workers: int, link: Link, slots: int, wire) -> Plan:
    """The plan of ``choices``, the tables of layouts priced together (table-wise
    packs) priced by ``Pricing.together``."""
    choices = list(choices)
    by_layout: dict[str, list[int]] = {}
    for k, c in enumerate(choices):
        by_layout.setdefault(c.layout, []).append(k)
    for name, mine in by_layout.items():
        layout = registry.get(name)
        if layout.pricing.together is None:
            continue
        prices = layout.pricing.together([stats[k] for k in mine], workers, link, slots, wire)
        for k, price in zip(mine, prices, strict=True):
            choices[k] = _choice(stats[k], layout, price)
    used = {c.layout for c in choices}
    seconds = sum(c.seconds for c in choices) + group_seconds(used, workers, link)
    return Plan(tuple(choices), seconds, sum(c.memory for c in choices), workers)


def _fit_memory(
    plan, stats, workers, link, slots, wire, group, memory_bytes, may: May | None
) -> Plan | None:
    """Moves tables to a sharded layout of ``group``, the most memory saved per second
    added first, until the plan fits (``None`` when it cannot)."""
    if memory_bytes is None or plan.memory <= memory_bytes:
        return plan
    choices = list(plan.choices)
    while _total(choices, stats, workers, link, slots, wire).memory > memory_bytes:
        moves = []
        for i, (c, s) in enumerate(zip(choices, stats, strict=True)):
            if registry.get(c.layout).sharded:
                continue
            for x in _options(s, group, may):
                new = _choice(s, x, x.pricing.table(s, workers, link, slots, wire))
                saved = c.memory - new.memory
                moves.append((saved / max(new.seconds - c.seconds, 1e-12), i, new))
        if not moves:
            return None
        _, i, new = max(moves, key=lambda m: m[0])
        choices[i] = new
    return _total(choices, stats, workers, link, slots, wire)


def describe(plan: Mapping[str, Any]) -> str:
    """A plan's layouts counted, e.g. ``"3 row, 2 dense"`` (for a line of output);
    ``plan`` a ``TablePlan`` or its JSON (``{table: layout name}``, a configured table
    ``{"layout": name, "config": ...}``).

    Example:
        >>> describe({"a": "row", "b": "dense", "c": {"layout": "row", "config": [1]}})
        '1 dense, 2 row'
    """
    counts: dict[str, int] = {}
    for layout in plan.values():
        if isinstance(layout, Layout):
            name = layout.name
        elif isinstance(layout, Mapping):
            name = str(layout.get("layout"))
        else:
            name = str(layout)
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))


def save(plan: Plan, path: str) -> None:
    """Writes the plan as JSON."""
    with open(path, "w") as f:
        json.dump(plan.to_json(), f, indent=1)
