"""The strategy registry: each strategy a ``Strategy`` value, each name parsed once.

A strategy name has two parts, ``TABLES+AGGREGATOR``: how embedding tables travel (a
``Strategy`` of ``STRATEGIES``: ``dense``, ``embrace``, ...) and how the data-parallel
gradients are reduced (an aggregator of ``aggregators.AGGREGATORS``: ``dense`` =
``pmean``, ``topk_a2a``, ...). ``"embrace"`` means ``embrace+dense`` and ``"topk_a2a"``
means ``dense+topk_a2a``. ``parse_strategy`` turns a name into a ``StrategyName``, the
typed value that ``make_train_step``, the command line and the experiments share.

Adding a table strategy is one ``Strategy`` entry in ``STRATEGIES`` (its layout and its
step) and a test; names, validation and the command line's choices follow.

Example:
    >>> from sparsecomm_jax.strategies import registry
    >>> name = registry.parse_strategy("embrace+topk_a2a")
    >>> name.tables, name.aggregator, name.strategy.layout.name
    ('embrace', 'topk_a2a', 'column')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from sparsecomm_jax.aggregators import AGGREGATORS
from sparsecomm_jax.embedding.column import COLUMN
from sparsecomm_jax.embedding.dense import DENSE
from sparsecomm_jax.embedding.layout import CapacityPolicy, Layout
from sparsecomm_jax.embedding.replicated import REPLICATED
from sparsecomm_jax.embedding.row import ROW
from sparsecomm_jax.schedule import pipeline
from sparsecomm_jax.strategies import bodies


class Strategy(NamedTuple):
    """How one table strategy builds its step.

    Attributes:
      name: the registry key.
      step: ``step(ctx, specs) -> fn(state, batch) -> (state, loss)``: the step's
        function before ``jax.jit`` (``bodies.shard_map_step(body)`` for one body; for
        the ``pmap`` engine the body of ``jax.pmap``).
      layout: where its tables live (``embedding.column.COLUMN``, ...); the
        data-parallel ``embedding.dense.DENSE`` when it gives tables no special
        treatment (``dense``, ``dense_pmap``, the top-k strategies).
      capacity: its own plan of the ids for a table's layout, ``capacity(layout) ->
        CapacityPolicy`` or ``None`` (the layout's own): the pipelined step's, for the
        tables it carries (``Pipelined.capacity``: a column-wise table's first chunk, a
        row-wise or hot table's buckets for two batches); a pipelined strategy with none
        of those tables runs as ``serial``. ``None``: the layouts' own plans.
      lookahead: how many of the next steps' batches a step reads (pipelined), else 0.
      needs_tables: the strategy needs at least one embedding table.
      combines: it takes a sparse aggregator for the dense layers (``embrace+topk_a2a``).
      engine: ``"shard_map"`` (``jax.jit`` of the step) or ``"pmap"``.
      row_updates: its tables can be updated row-sparsely (``table_update="rows"``).
      any_layout: each table may have a layout of its own (``table_layouts``): its
        step reads every table through the table's layout.
      unpadded: its tables whose layout's carrier reads stored rows whole
        (``Pipelined.unpadded``: the column layout's) must divide by the G workers they
        are sharded over (``embrace_2d``'s pipeline); tables of other layouts are
        stored padded as those layouts say.
      across_steps: its step can also run across steps, as ``make_overlapped`` builds it
        (step t's late exchange and table update beside step t+1's compute).
      narrow_wire: its exchanges can travel in a narrower dtype than float32
        (``comm_dtype``); the pipelined ``embrace_2d``'s chunks cannot.
      serial: the strategy whose step it runs where a program's collectives cannot
        overlap its compute (``StepContext.overlap`` false, as on XLA:CPU), or ``None``.
        ``embrace_2d``'s early chunk, early update and second fetch only pay by hiding
        communication behind compute; where nothing can hide, its pipelined program is
        not built and ``embrace``'s step runs (every row in one exchange after the
        backward pass), under ``embrace_2d``'s rules (lookups only, column tables not
        padded). So does a step with no column-wise, row-wise or hot table (nothing
        to pipeline).
    """

    name: str
    step: Callable
    layout: Layout = DENSE
    capacity: Callable[[Layout], CapacityPolicy | None] | None = None
    lookahead: int = 0
    needs_tables: bool = False
    combines: bool = True
    engine: str = "shard_map"
    row_updates: bool = False
    any_layout: bool = False
    unpadded: bool = False
    across_steps: bool = False
    narrow_wire: bool = True
    serial: Strategy | None = None

    @property
    def scannable(self) -> bool:
        """Whether ``lax.scan`` can repeat its step: not a ``jax.pmap`` step, not a
        pipelined one (its steps carry rows, whose structure the first step makes, and
        look ahead: ``TrainStep.steps`` unrolls those instead)."""
        return self.engine != "pmap" and not self.lookahead

    @property
    def several_a_call(self) -> bool:
        """Whether one program call can run several of its steps (``TrainStep.steps``):
        scanned, or unrolled for a pipelined step; not a ``jax.pmap`` step."""
        return self.engine != "pmap"

    def why_one_step_a_call(self) -> str:
        """Why the step runs one step a program call (``""`` when it runs several)."""
        return "jax.pmap" if self.engine == "pmap" else ""


# embrace_2d where nothing can overlap: embrace's step, refusing what the pipeline refuses
SERIAL_2D = Strategy(
    "embrace",
    bodies.shard_map_step(bodies.lookups_only(bodies.table_body, pipeline.NO_ATTEND_2D)),
    layout=COLUMN,
    needs_tables=True,
    row_updates=True,
    any_layout=True,
    unpadded=True,
)

#: The table strategies by name: the first half of a strategy name.
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("dense_pmap", bodies.pmap_body, combines=False, engine="pmap"),
        Strategy("dense", bodies.shard_map_step(bodies.data_parallel_body)),
        Strategy(
            "sparse_allgather",
            bodies.shard_map_step(bodies.table_body),
            layout=REPLICATED,
            needs_tables=True,
            combines=False,
            row_updates=True,
            any_layout=True,
        ),
        Strategy(
            "embrace",
            bodies.shard_map_step(bodies.table_body),
            layout=COLUMN,
            needs_tables=True,
            row_updates=True,
            any_layout=True,
        ),
        Strategy(
            "embrace_rowwise",
            bodies.shard_map_step(bodies.table_body),
            layout=ROW,
            needs_tables=True,
            row_updates=True,
            any_layout=True,
        ),
        Strategy(
            "embrace_2d",
            pipeline.pipelined_step,
            layout=COLUMN,
            capacity=pipeline.carried_capacity,
            lookahead=pipeline.LOOKAHEAD,
            needs_tables=True,
            row_updates=True,
            any_layout=True,
            unpadded=True,
            across_steps=True,
            narrow_wire=False,
            serial=SERIAL_2D,
        ),
    )
}


class StrategyName(NamedTuple):
    """A parsed strategy name: ``tables`` a key of ``STRATEGIES``, ``aggregator`` a key
    of ``AGGREGATORS``. Unpacks as ``tables, aggregator = parse_strategy(name)``."""

    tables: str
    aggregator: str

    @property
    def strategy(self) -> Strategy:
        """The table strategy's ``Strategy``."""
        return STRATEGIES[self.tables]

    def __str__(self) -> str:
        if self.aggregator == "dense":
            return self.tables
        return self.aggregator if self.tables == "dense" else f"{self.tables}+{self.aggregator}"


def parse_strategy(strategy: str | StrategyName) -> StrategyName:
    """``"embrace+topk_a2a"`` -> ``StrategyName("embrace", "topk_a2a")``; ``"topk_a2a"``
    -> ``("dense", "topk_a2a")``; ``"embrace"`` -> ``("embrace", "dense")``.

    Raises:
      ValueError: an unknown name, or an aggregator for a strategy that takes none
        (both listing what is accepted).
    """
    if isinstance(strategy, StrategyName):
        return strategy
    base, _, agg = str(strategy).partition("+")
    if not agg and base in AGGREGATORS and base not in STRATEGIES:
        base, agg = "dense", base
    agg = agg or "dense"
    if base not in STRATEGIES or agg not in AGGREGATORS:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {strategy_names()}")
    if agg != "dense" and not STRATEGIES[base].combines:
        raise ValueError(f"strategy {base!r} cannot be combined with an aggregator ({agg!r})")
    return StrategyName(base, agg)


def strategy_names() -> list[str]:
    """Every accepted ``strategy`` name."""
    sparse = [name for name, kind in AGGREGATORS.items() if kind.sparse]
    tables = [s.name for s in STRATEGIES.values() if s.needs_tables and s.combines]
    return [*STRATEGIES, *sparse, *(f"{t}+{a}" for t in tables for a in sparse)]
