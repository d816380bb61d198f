"""A layout for each embedding table, chosen on the alpha-beta model of the link.

Planning is apart from the collectives: ``table_stats`` measures what the tables see
(V, D, and from sample batches, the ids each worker reads per step), ``plan_tables``
picks each table's layout to minimise the modelled step time within the memory of a
worker, and the plan's ``layouts()`` go to ``make_train_step(table_layouts=...)``.

The model proposes, a measurement decides: ``candidate_plans`` gives the best modelled
plan of each set of sharded exchanges and each layout for every table, and
``choose_measured`` keeps the one whose step is fastest when timed (``--plan auto``
times real steps on the cluster that will train; ``--plan model`` trusts the model
alone). The model prices bytes and messages; the layouts also differ in local work
(finding distinct ids, bucketing, scattering rows), which it does not see: on many
small tables and on a few large ones its own choice ran at 0.77x and 0.67x of the best
hand-picked plan.

The layouts and what a step costs one worker under each (b = 4 bytes a float, P
workers, n ids read per worker, C the slots the layout's exchange is padded to,
``s`` optimizer slots per parameter):

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
=========== ================================ ================= ===================

The tables of one layout share its exchange (``embedding.column.fetch``,
``embedding.row.fetch_many``, ``embedding.replicated.fetch``), so a layout's messages
are paid once per step whatever number of tables it holds; the search therefore tries
every set of sharded layouts and gives each table its cheapest layout within the set. A
table whose D (column) or V (row) does not divide by P is priced at its padded size.
Table-wise tables are priced together, as ``embedding.tablewise`` places them: per pack
(the tables of one D), C is the most distinct ids one worker asks of the busiest owner
and R the most rows an owner holds; while the search compares one table's layouts it
takes the table's share of an even split (C = distinct / P).

Example:
    >>> from sparsecomm_jax import planner
    >>> from sparsecomm_jax.comm.costmodel import Link
    >>> stats = [planner.TableStats("big", 100_000, 64, 512, 400, 60),
    ...          planner.TableStats("tiny", 16, 64, 512, 16, 4)]
    >>> plan = planner.plan_tables(stats, 4, Link.from_bandwidth(1.0))
    >>> plan.layouts()  # the tiny table joins the big one's exchange
    {'big': 'row', 'tiny': 'row'}
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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from sparsecomm_jax.comm.costmodel import Link
from sparsecomm_jax.embedding import access, row, tablewise
from sparsecomm_jax.embedding.layout import distinct_per_worker
from sparsecomm_jax.embedding.tables import Table, find_tables, table_mask

FLOAT = 4  # bytes
# Seconds per table entry of a dense table's update on the host (gradient, optimizer,
# apply: about 4 passes of 0.2 ns; one jitted pass over 8M float32 takes 1.2-2 ms).
DENSE_UPDATE_S = 0.8e-9
LAYOUT_NAMES = ("dense", "replicated", "column", "row", "table")
SHARDED = ("column", "row", "table")


class TableStats(NamedTuple):
    """What a table sees per step, per worker.

    Attributes:
      name: the table's path joined by ``/``.
      vocab: V. dim: D.
      reads: ids read per worker per step (every read, duplicates included).
      distinct: the most distinct ids one worker reads in a step (column's slots).
      bucket: the most distinct ids one worker asks of one owner (row's slots).
      lookups: how many reads of the table the loss makes (replicated pays per read).
      attended: the loss reads the whole table by a full softmax (``emb.attend``),
        which the table-wise layout does not serve.
    """

    name: str
    vocab: int
    dim: int
    reads: int
    distinct: int
    bucket: int
    lookups: int = 1
    attended: bool = False


class Choice(NamedTuple):
    """One table's layout and what it costs one worker per step."""

    table: str
    layout: str
    bytes: float
    seconds: float
    memory: float


class Plan(NamedTuple):
    """A layout per table; ``seconds`` the modelled step time of the tables."""

    choices: tuple[Choice, ...]
    seconds: float
    memory: float
    workers: int

    def layouts(self) -> dict[str, str]:
        """``{table name: layout}``, for ``make_train_step(table_layouts=...)``."""
        return {c.table: c.layout for c in self.choices}

    def table(self) -> str:
        """The plan as a text table (one line per table, then the total)."""
        lines = [f"{'table':<32} {'layout':<10} {'MB/step':>9} {'ms/step':>8} {'memory MB':>10}"]
        for c in self.choices:
            lines.append(
                f"{c.table:<32} {c.layout:<10} {c.bytes / 1e6:>9.3f} {c.seconds * 1e3:>8.3f} "
                f"{c.memory / 1e6:>10.2f}"
            )
        lines.append(
            f"{'(one worker of ' + str(self.workers) + ')':<43} {'':>9} "
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
) -> list[TableStats]:
    """Each table's ``TableStats`` from sample ``batches`` (host-side, the model on
    zeros, as the steps plan their buffers; the largest need over the sample).

    Args:
      loss_fn: ``loss_fn(params, batch, emb)``.
      params: the parameters. embedding_paths: as ``make_train_step``.
      batches: a few global batches.
      workers: P.
      replicated_keys: batch keys every worker sees whole.
    """
    mask = table_mask(params, embedding_paths)
    tables = find_tables(params, mask, None)
    reads_of = access.host_reads(loss_fn, params, mask, replicated_keys, workers)
    samples = [reads_of(b) for b in batches]
    lookups, attended = _reads_per_table(loss_fn, params, batches[0], mask)
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
        stats.append(
            TableStats(t.name, t.vocab, t.dim, reads, distinct, bucket, count, t.index in attended)
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


def layout_cost(
    stats: TableStats, layout: str, workers: int, link: Link, optimizer_slots: int = 1
) -> Choice:
    """What ``layout`` costs one worker per step for this table (a sharded layout at
    the table's padded size, ``layout.padded_shape``: its split dimension rounded up to
    a multiple of P)."""
    p, v, d = workers, stats.vocab, stats.dim
    v_padded, d_padded = -(-v // p) * p, -(-d // p) * p
    whole = v * d * FLOAT * (1 + optimizer_slots)
    if layout == "dense":
        nbytes = 2 * (p - 1) / p * v * d * FLOAT
        seconds = nbytes * link.beta + v * d * DENSE_UPDATE_S
        return Choice(stats.name, layout, nbytes, seconds, whole)
    if layout == "replicated":  # its messages: group_seconds, once for every table
        nbytes = (p - 1) * stats.reads * (d * FLOAT + 4)
        return Choice(stats.name, layout, nbytes, nbytes * link.beta, whole)
    if layout == "column":
        nbytes = (p - 1) * stats.distinct * (4 + 2 * d_padded * FLOAT / p)
        return Choice(stats.name, layout, nbytes, nbytes * link.beta, whole / d * d_padded / p)
    if layout == "row":
        nbytes = (p - 1) * stats.bucket * (4 + 2 * d * FLOAT)
        return Choice(stats.name, layout, nbytes, nbytes * link.beta, whole / v * v_padded / p)
    if layout == "table":  # its share of an even split; table_wise_choices prices the packs
        nbytes = (p - 1) * stats.distinct / p * (4 + 2 * d * FLOAT)
        return Choice(stats.name, layout, nbytes, nbytes * link.beta, whole / p)
    raise ValueError(f"unknown layout {layout!r}; choose among {LAYOUT_NAMES}")


def table_wise_choices(
    stats: Sequence[TableStats], workers: int, link: Link, optimizer_slots: int = 1
) -> list[Choice]:
    """The table-wise tables priced as they are placed (``tablewise.assign``): per pack,
    the bytes of an exchange whose buckets hold C = the most distinct ids one worker asks
    of one owner (the owner's tables' ``distinct`` summed), and R rows per worker; each
    table gets its share (by distinct ids, by rows).

    Example:
        >>> link = Link.from_bandwidth(1.0)
        >>> two = [TableStats("a", 1000, 8, 64, 60, 20), TableStats("b", 900, 8, 64, 50, 20)]
        >>> found = table_wise_choices(two, 2, link)  # an owner each, buckets of 60 ids
        >>> round(sum(c.bytes for c in found)) == (2 - 1) * 60 * (4 + 2 * 8 * 4)
        True
    """
    records = [Table(i, s.name, s.vocab, s.dim, None) for i, s in enumerate(stats)]
    packing = tablewise.assign(records, workers)
    choices = [None] * len(stats)
    for pack, rows in packing.rows.items():
        members = packing.members(pack)
        per_owner = [0] * workers
        for i in members:
            per_owner[packing.slots[i].owner] += stats[i].distinct
        dim = packing.dims[pack]
        nbytes = (workers - 1) * max(per_owner) * (4 + 2 * dim * FLOAT)
        memory = rows * dim * FLOAT * (1 + optimizer_slots)
        distinct = sum(stats[i].distinct for i in members) or 1
        vocab = sum(stats[i].vocab for i in members)
        for i in members:
            share = nbytes * stats[i].distinct / distinct
            held = memory * stats[i].vocab / vocab
            choices[i] = Choice(stats[i].name, "table", share, share * link.beta, held)
    return choices


def group_seconds(layouts: set[str], workers: int, link: Link) -> float:
    """The messages of the layouts' shared exchanges: 3(P-1) per step for each sharded
    layout, 2(P-1) for the replicated tables' two all-gathers."""
    sharded = sum(3 * (workers - 1) * link.alpha for name in layouts if name in SHARDED)
    return sharded + (2 * (workers - 1) * link.alpha if "replicated" in layouts else 0.0)


def plan_tables(
    stats: Sequence[TableStats],
    workers: int,
    link: Link,
    memory_bytes: float | None = None,
    optimizer_slots: int = 1,
    layouts: Sequence[str] = LAYOUT_NAMES,
) -> Plan:
    """Each table's layout, minimising the modelled step time within ``memory_bytes``
    of tables (and their optimizer state) per worker.

    Args:
      stats: ``table_stats(...)``.
      workers: P.
      link: the alpha-beta model (``costmodel.calibrate`` or ``Link.from_bandwidth``).
      memory_bytes: the tables' memory per worker (``None``: no limit).
      optimizer_slots: optimizer state per parameter entry (SGD 0, Adagrad 1, Adam 2).
      layouts: the layouts to choose from.

    Returns:
      The ``Plan`` of least modelled time (the first of ``candidate_plans``).

    Raises:
      ValueError: no assignment fits ``memory_bytes``.
    """
    return candidate_plans(stats, workers, link, memory_bytes, optimizer_slots, layouts)[0]


def candidate_plans(
    stats: Sequence[TableStats],
    workers: int,
    link: Link,
    memory_bytes: float | None = None,
    optimizer_slots: int = 1,
    layouts: Sequence[str] = LAYOUT_NAMES,
    within: float = 10.0,
) -> list[Plan]:
    """The plans worth timing (``choose_measured``), least modelled time first: the best
    modelled plan of each set of sharded exchanges (none, column, row, table-wise and
    their combinations) and each
    layout for every table, within ``memory_bytes``; distinct plans only, none modelled
    slower than ``within`` times the best.

    Within one set of exchanges the model ranks tables by bytes, where it is reliable;
    between layouts it misses the local work that differs by layout (the column-wise
    exchange finds the distinct ids of every worker's reads, the replicated one scatters
    every worker's gradient rows), which only a step can measure. One layout for every
    table is a candidate of its own because the model's mixes pay every such cost.

    Args:
      stats, workers, link, memory_bytes, optimizer_slots, layouts: as ``plan_tables``.
      within: candidates modelled slower than this many times the best are left out
        (a 1M-row table data parallel is not worth a compile).

    Returns:
      One or more ``Plan``s.

    Raises:
      ValueError: no assignment fits ``memory_bytes``.

    Example:
        >>> from sparsecomm_jax.comm.costmodel import Link
        >>> stats = [TableStats("big", 100_000, 64, 512, 400, 60)]
        >>> [p.layouts()["big"] for p in candidate_plans(stats, 4, Link.from_bandwidth(1.0))]
        ['row', 'column', 'replicated', 'table']
    """
    local = [name for name in layouts if name not in SHARDED]
    sharded = [name for name in layouts if name in SHARDED]
    groups = [g for k in range(len(sharded) + 1) for g in itertools.combinations(sharded, k)]
    allowed = [([*local, *g], g) for g in groups]
    allowed += [([x], (x,) if x in SHARDED else ()) for x in layouts]  # one layout alone
    found: dict[str, Plan] = {}
    for names, group in allowed:
        plan = _plan_within(stats, workers, link, optimizer_slots, names)
        if plan is not None:
            plan = _fit_memory(plan, stats, workers, link, optimizer_slots, group, memory_bytes)
        if plan is None:
            continue
        key = json.dumps(plan.layouts(), sort_keys=True)
        if key not in found or plan.seconds < found[key].seconds:
            found[key] = plan
    if not found:
        raise ValueError(
            f"no layout of the tables fits {memory_bytes} bytes per worker; give more "
            "memory or more workers"
        )
    ranked = sorted(found.values(), key=lambda p: p.seconds)
    return [p for p in ranked if p.seconds <= within * ranked[0].seconds]


def choose_measured(
    candidates: Sequence[Plan], time_plans: Callable[[Sequence[Plan]], Sequence[float]]
) -> tuple[Plan, list[float]]:
    """The candidate of least measured step time.

    Args:
      candidates: ``candidate_plans(...)``.
      time_plans: ``plans -> seconds of a step under each`` (timed on the cluster that
        will train; ``experiments.startup.choose_plan`` runs real steps of every plan in
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


def _plan_within(stats, workers, link, slots, allowed) -> Plan | None:
    if not allowed:
        return None
    choices = []
    for s in stats:
        options = [layout_cost(s, x, workers, link, slots) for x in allowed if serves(s, x)]
        if not options:  # a softmax table, table-wise only
            return None
        choices.append(min(options, key=lambda c: c.seconds))
    return _total(choices, stats, workers, link, slots)


def serves(stats: TableStats, layout: str) -> bool:
    """Whether ``layout`` can serve the table's reads (table-wise: no full softmax)."""
    return not (layout == "table" and stats.attended)


def _total(choices: list[Choice], stats, workers: int, link: Link, slots: int) -> Plan:
    """The plan of ``choices``, its table-wise tables priced by their packs."""
    mine = [k for k, c in enumerate(choices) if c.layout == "table"]
    if mine:
        packed = table_wise_choices([stats[k] for k in mine], workers, link, slots)
        choices = list(choices)
        for k, c in zip(mine, packed, strict=True):
            choices[k] = c
    used = {c.layout for c in choices}
    seconds = sum(c.seconds for c in choices) + group_seconds(used, workers, link)
    return Plan(tuple(choices), seconds, sum(c.memory for c in choices), workers)


def _fit_memory(plan, stats, workers, link, slots, group, memory_bytes) -> Plan | None:
    """Moves tables to a sharded layout of ``group``, the most memory saved per second
    added first, until the plan fits (``None`` when it cannot)."""
    if memory_bytes is None or plan.memory <= memory_bytes:
        return plan
    choices = list(plan.choices)
    while _total(choices, stats, workers, link, slots).memory > memory_bytes:
        moves = []
        for i, (c, s) in enumerate(zip(choices, stats, strict=True)):
            if c.layout in SHARDED:
                continue
            for x in (x for x in group if serves(s, x)):
                new = layout_cost(s, x, workers, link, slots)
                saved = c.memory - new.memory
                moves.append((saved / max(new.seconds - c.seconds, 1e-12), i, new))
        if not moves:
            return None
        _, i, new = max(moves, key=lambda m: m[0])
        choices[i] = new
    return _total(choices, stats, workers, link, slots)


def describe(layouts: dict[str, str]) -> str:
    """A plan's layouts counted, e.g. ``"3 row, 2 dense"`` (for a line of output).

    Example:
        >>> describe({"a": "row", "b": "dense", "c": "row"})
        '1 dense, 2 row'
    """
    counts: dict[str, int] = {}
    for layout in layouts.values():
        counts[layout] = counts.get(layout, 0) + 1
    return ", ".join(f"{n} {layout}" for layout, n in sorted(counts.items()))


def save(plan: Plan, path: str) -> None:
    """Writes the plan as JSON."""
    with open(path, "w") as f:
        json.dump(plan.to_json(), f, indent=1)
