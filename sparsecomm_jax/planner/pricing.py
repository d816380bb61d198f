"""What one table costs one worker a step under a layout (``layout_cost``, asking the
layout's own ``Pricing``), and the messages of the exchanges the tables share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.comm.costmodel import Link
from sparsecomm_jax.embedding import layout_registry as registry
from sparsecomm_jax.embedding.layout import (
    Layout,
    Price,
    TableStats,
)


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


def priced() -> list[Layout]:
    """The registered layouts the planner can price (those with ``pricing``)."""
    return [x for x in registry.LAYOUTS.values() if x.pricing is not None]


def choice_of(stats: TableStats, layout: Layout, price: Price) -> Choice:
    """The ``Choice`` of a table priced under ``layout``."""
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
    return choice_of(
        stats, layout, layout.pricing.table(stats, workers, link, optimizer_slots, wire)
    )


def group_seconds(used: Iterable[str | Layout], workers: int, link: Link) -> float:
    """The messages of the layouts' shared exchanges, once each per step
    (``Pricing.messages``: 3(P-1) for a sharded layout's, 2(P-1) for the replicated
    tables' two all-gathers)."""
    return sum(registry.get(x).pricing.messages(workers) * link.alpha for x in set(used))


def serves(stats: TableStats, layout: str | Layout) -> bool:
    """Whether ``layout`` can serve the table's reads: a table of raw ids
    (``TableStats.raw``) by a layout that maps ids to rows alone (``Layout.maps_ids``),
    any other table by any other layout whose ``Pricing.serves`` it (table-wise: no
    full softmax).

    Example:
        >>> from sparsecomm_jax.embedding.layout import TableStats
        >>> plain = TableStats("t", 1000, 8, 64, 10, 4)
        >>> raw = plain._replace(raw=True)  # its sample held ids outside [0, 1000)
        >>> [serves(plain, x) for x in ("row", "managed")], serves(raw, "row")
        ([True, False], False)
    """
    layout = registry.get(layout)
    return layout.maps_ids == stats.raw and layout.pricing.serves(stats)


def priced_layout(layout: str | Layout) -> Layout:
    """The ``Layout`` of ``layout`` (a name or a value); ``ValueError`` where it has no
    pricing."""
    found = registry.get(layout)
    if found.pricing is None:
        raise ValueError(f"layout {found.name!r} has no pricing: the planner cannot price it")
    return found
