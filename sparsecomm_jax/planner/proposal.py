"""The model's proposals: the best plan within a worker's memory (``plan_tables``),
the best plan of each set of sharded exchanges (``candidate_plans``), and a plan
described and saved."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.comm.costmodel import Link
from sparsecomm_jax.embedding import layout_registry as registry
from sparsecomm_jax.embedding.layout import (
    Layout,
    TableStats,
    split_size,
)
from sparsecomm_jax.embedding.layout_registry import TablePlan
from sparsecomm_jax.planner.pricing import (
    Choice,
    choice_of,
    group_seconds,
    priced,
    priced_layout,
    serves,
)


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
        """The plan as a text table: one line per table (its rows' bytes and their time
        on the link), one for the messages of the layouts' exchanges (their latency,
        once per exchange per step, often most of the total), then the total."""
        lines = [f"{'table':<32} {'layout':<14} {'MB/step':>9} {'ms/step':>8} {'memory MB':>10}"]
        for c in self.choices:
            layout = f"{c.layout} {c.setting}".strip()
            lines.append(
                f"{c.table:<32} {layout:<14} {c.bytes / 1e6:>9.3f} {c.seconds * 1e3:>8.3f} "
                f"{c.memory / 1e6:>10.2f}"
            )
        messages = self.seconds - sum(c.seconds for c in self.choices)
        lines.append(f"{'(messages: latency per exchange)':<47} {'':>9} {messages * 1e3:>8.3f}")
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
    return [x for x in layouts if serves(stats, x) and (may is None or may(stats, x))]


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
    chosen = priced() if layouts is None else [priced_layout(x) for x in layouts]
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


def _plan_within(
    stats, workers, link, slots, wire, allowed: list[Layout], may: May | None
) -> Plan | None:
    if not allowed:
        return None
    choices = []
    for s in stats:
        options = [
            choice_of(s, x, x.pricing.table(s, workers, link, slots, wire))
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
            choices[k] = choice_of(stats[k], layout, price)
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
                new = choice_of(s, x, x.pricing.table(s, workers, link, slots, wire))
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
