"""Every rule about what may be combined in a step, checked before anything is traced:
the arguments' kinds, a strategy's options, the table update and the wire, the tables'
layouts, the keys that hold ids, and the aggregator of the dense layers. Each refusal
is an ``errors.ArgumentError`` naming the argument; the command line shows it in flags.

Example:
    >>> from sparsecomm_jax.strategies import registry, rules
    >>> rules.check_options(registry.parse_strategy("gtopk"), 6, None, "skip")
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sparsecomm_jax.errors.ArgumentError: strategy='gtopk' needs a power-of-two number ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sparsecomm_jax import aggregators
from sparsecomm_jax.comm import wire
from sparsecomm_jax.embedding import layout_registry, row_optimizers, update
from sparsecomm_jax.embedding.layout import Layout
from sparsecomm_jax.embedding.replica_groups import SYNCS
from sparsecomm_jax.embedding.tables import (
    Table,
    table_name,
)
from sparsecomm_jax.embedding.update import TableUpdate
from sparsecomm_jax.errors import NO_VALUE, ArgumentError, few
from sparsecomm_jax.step.state import PyTree
from sparsecomm_jax.strategies.registry import STRATEGIES, StrategyName

NONFINITE = ("skip", "error", "off")


def check_arguments(loss_fn, optimizer, mesh, params) -> None:
    """``ArgumentError`` for arguments of the wrong kind, before anything is traced."""
    if not callable(loss_fn):
        raise ArgumentError("loss_fn", NO_VALUE, f"must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ArgumentError(
            "optimizer",
            NO_VALUE,
            "must be an optax GradientTransformation (init, update), got "
            f"{type(optimizer).__name__}",
        )
    if not isinstance(mesh, Mesh):
        raise ArgumentError(
            "mesh", NO_VALUE, f"must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        )
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ArgumentError("params", NO_VALUE, "has no arrays")
    for path, x in leaves:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ArgumentError(
                "params",
                NO_VALUE,
                f"{jax.tree_util.keystr(path)} must be a floating-point array, got "
                f"{type(x).__name__} of dtype {dtype}",
            )


def check_options(name: StrategyName, num: int, capacity, nonfinite) -> None:
    """The options every strategy takes."""
    if capacity is not None and (
        isinstance(capacity, bool) or not (isinstance(capacity, int) and capacity >= 1)
    ):
        raise ArgumentError(
            "capacity", capacity, "must be an integer >= 1, or None (sized per batch)"
        )
    if problem := aggregators.AGGREGATORS[name.aggregator].workers(num):
        raise ArgumentError("strategy", str(name), f"{problem}, got {num}")
    if nonfinite not in NONFINITE:
        raise ArgumentError("nonfinite", nonfinite, f"must be one of {list(NONFINITE)}")


def check_replicas(name: StrategyName, replicas: Any, num: int, sync: Any) -> None:
    """The rules of replica groups (2-D sparse parallelism, ``embedding.replica_groups``):
    ``replicas`` an integer that divides the ``num`` devices, and for more than one, a
    strategy that shards tables (``embrace``, ``embrace_rowwise``, ``sparse_allgather``,
    ``embrace_2d``; the dense layers' aggregator, top-k ones too, spans every device)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ArgumentError("replicas", replicas, "must be an integer >= 1")
    if num % replicas:
        raise ArgumentError(
            "replicas", replicas, f"must divide the {num} devices into groups of equal size"
        )
    if sync not in SYNCS:
        raise ArgumentError("replica_sync", sync, f"must be one of {list(SYNCS)}")
    if replicas == 1:
        return
    strategy = name.strategy
    if not strategy.needs_tables:
        able = [s.name for s in STRATEGIES.values() if s.needs_tables]
        raise ArgumentError(
            "replicas",
            replicas,
            f"needs a strategy among {able}; $strategy shards no tables",
            strategy=str(name),
        )


def check_table_update(
    name: StrategyName, table_update: TableUpdate, comm_dtype: str | wire.Wire
) -> None:
    """The rules of the table update and the wire (one place for all callers)."""
    chosen = wire.parse(comm_dtype)  # known codecs and directions
    strategy = name.strategy
    if table_update is update.ROWS and not strategy.row_updates:
        rows = [s.name for s in STRATEGIES.values() if s.row_updates]
        raise ArgumentError(
            "table_update",
            "rows",
            f"needs a strategy among {rows}; $strategy updates no table row-sparsely",
            strategy=str(name),
        )
    if not chosen.narrow:
        return
    if not (strategy.row_updates and strategy.narrow_wire):  # no rows, or chunks
        raise ArgumentError(
            "comm_dtype",
            chosen.name,
            f"is not available for {name}; use $comm_dtype",
            comm_dtype="float32",
        )
    if table_update is not update.ROWS:
        raise ArgumentError(
            "comm_dtype",
            chosen.name,
            "needs the row-sparse table update ($table_update)",
            table_update="rows",
        )
    if chosen.dense.narrow and aggregators.AGGREGATORS[name.aggregator].sparse:
        raise ArgumentError(
            "comm_dtype",
            chosen.name,
            f"narrows the dense mean, which {name} sends by top-k in float32: "
            "narrow forward and backward only, or use the dense all-reduce (no top-k)",
        )


def place_tables(
    tables: tuple[Table, ...],
    table_layouts: Mapping[Any, str | Layout] | None,
    name: StrategyName,
) -> tuple[Table, ...]:
    """``tables`` with the layouts ``table_layouts`` gives them (by path or name); a
    data-parallel layout (``"dense"``) makes a table an ordinary parameter of the step,
    its gradient dense and in the dense layers' all-reduce.

    Raises:
      ArgumentError: not a mapping, a path that names no table, a table named twice, an
        unknown layout, or a strategy whose step reads every table through one layout.
    """
    if table_layouts is None or (isinstance(table_layouts, Mapping) and not table_layouts):
        return tables
    if not isinstance(table_layouts, Mapping):
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            "must be a mapping {table path: layout}, e.g. "
            '{"params/user/embedding": "row"} (a planner Plan\'s .layouts()), got '
            f"{type(table_layouts).__name__}",
        )
    strategy = name.strategy
    if not strategy.any_layout:
        mixed = [s.name for s in STRATEGIES.values() if s.any_layout]
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"needs a strategy among {mixed}; $strategy reads every table through one layout",
            strategy=str(name),
        )
    names = [table_name(p) for p in table_layouts]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"names {few(twice)} more than once (a path as keys and as 'a/b/c' names one "
            "table): give each table one layout",
        )
    if bad := sorted({str(x) for x in table_layouts.values() if not layout_registry.known(x)}):
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"names unknown layouts {few(bad)}; choose among {list(layout_registry.LAYOUTS)}",
        )
    chosen = {
        name: layout_registry.get(x) for name, x in zip(names, table_layouts.values(), strict=True)
    }
    if unknown := sorted(set(chosen) - {t.name for t in tables}):
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"names {few(unknown)}, which are not embedding tables; the tables: "
            f"{few([t.name for t in tables])}",
        )
    return tuple(t._replace(layout=chosen.get(t.name, t.layout)) for t in tables)


def resolve_id_keys(
    id_keys: Sequence[str] | Mapping[str, Any] | None, tables: Sequence[Table]
) -> tuple[str, ...] | dict[str, tuple[int, ...]] | None:
    """``id_keys`` as the step keeps it: ``None``, a tuple of keys, or key -> the leaf
    indices of its tables (a table named by its path, a tuple of keys or ``"a/b/c"``, or
    several of them).

    Raises:
      ArgumentError: not keys, or a table path that names no embedding table (the
        message lists them).
    """
    if id_keys is None or isinstance(id_keys, str):
        return None if id_keys is None else (id_keys,)
    if not isinstance(id_keys, Mapping):
        if not isinstance(id_keys, Sequence | set | frozenset) or not all(
            isinstance(k, str) for k in id_keys
        ):
            raise ArgumentError(
                "id_keys",
                id_keys,
                "must be batch keys (a tuple of strings) or {key: table path}, or None",
            )
        return tuple(id_keys)
    index = {t.name: t.index for t in tables}

    def table(path) -> int:
        name = table_name(path)
        if name not in index:
            raise ArgumentError(
                "id_keys",
                NO_VALUE,
                f"maps a key to {name!r}, which is not an embedding table; the tables: "
                f"{few(sorted(index))}",
            )
        return index[name]

    def tables_of(paths) -> tuple[int, ...]:
        several = isinstance(paths, list) or (
            isinstance(paths, tuple) and paths and not isinstance(paths[0], str)
        )
        return tuple(table(p) for p in paths) if several else (table(paths),)

    return {key: tables_of(paths) for key, paths in id_keys.items()}


def choose_table_update(
    requested: str | TableUpdate,
    name: StrategyName,
    optimizer,
    params,
    tables: PyTree,
    comm_dtype: str | wire.Wire,
) -> TableUpdate:
    """The ``TableUpdate`` of ``requested``: ``"auto"`` is ``ROWS`` where the strategy
    updates rows and the row-sparse update equals the dense one for ``optimizer`` on
    every table (``row_optimizers.untouched_rows_stay``, probed on small trees shaped
    like ``params``; ``tables`` marks the table leaves), where ``optimizer`` is defined
    on rows (``lazy_adam``); else ``DENSE``. A narrow ``comm_dtype`` needs ``ROWS``: under
    ``"auto"`` with an optimizer the row update is not exact for (Adam, momentum) it is
    refused rather than chosen, since it would turn the optimizer lazy without a word."""
    if not (isinstance(requested, str) and requested == "auto"):
        return update.get(requested)
    if not name.strategy.row_updates or not any(jax.tree.leaves(tables)):
        return update.DENSE
    if row_optimizers.is_lazy(optimizer, params):
        return update.ROWS
    exact = row_optimizers.untouched_rows_stay(optimizer, params, tables)
    narrow = wire.parse(comm_dtype)
    if narrow.narrow and not exact:
        raise ArgumentError(
            "comm_dtype",
            narrow.name,
            "needs the row-sparse table update, which is not exact for this optimizer (a "
            "row a step does not read would keep its moments: Adam becomes lazy Adam); "
            "pass $table_update to train so, or use float32 or an optimizer the row "
            "update is exact for (sgd, adagrad, lazy_adam)",
            table_update="rows",
        )
    return update.ROWS if exact else update.DENSE


def make_aggregator(
    name: StrategyName, axis_name: str, density: float, comm_dtype: str | wire.Wire, **options
):
    """The aggregator of the dense layers: the named one; a table strategy's ``dense``
    mean travels as one flat buffer in the wire's ``dense`` codec
    (``aggregators.flat_allreduce``)."""
    kind = aggregators.AGGREGATORS[name.aggregator]
    if kind.flat and not name.strategy.layout.data_parallel:
        return aggregators.flat_allreduce(axis_name, wire.parse(comm_dtype).dense)
    return kind(density, axis_name, **options)
