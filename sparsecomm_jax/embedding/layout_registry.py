"""The table layouts by name, and a plan of them: what a per-table choice
(``make_train_step(..., table_layouts=...)``, the planner, ``--plan``, a checkpoint's
record) refers to.

``LAYOUTS`` is the registry: the library's layouts (``column``, ``row``, ``table``,
``replicated``, ``dense``, ``hot``, ``managed``) and any a user registers
(``register``). The planner, the command line and the checkpoints iterate over it and
ask each layout its facts (``Layout.pricing``, ``sharded``, ``packs``,
``data_parallel``); nothing outside this module names a layout. A ``TablePlan`` maps
tables to layouts and reads and writes itself as JSON by their names.

Example:
    >>> from sparsecomm_jax.embedding import layout_registry
    >>> layout_registry.get("row").name, sorted(layout_registry.LAYOUTS)
    ('row', ['column', 'dense', 'hot', 'managed', 'replicated', 'row', 'table'])
    >>> plan = layout_registry.TablePlan.from_json({"params/user/embedding": "row"})
    >>> plan["params/user/embedding"] is layout_registry.get("row"), plan.to_json()
    (True, {'params/user/embedding': 'row'})
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from sparsecomm_jax.embedding.column import COLUMN
from sparsecomm_jax.embedding.dense import DENSE
from sparsecomm_jax.embedding.hot import HOT
from sparsecomm_jax.embedding.layout import Layout
from sparsecomm_jax.embedding.managed import MANAGED
from sparsecomm_jax.embedding.replicated import REPLICATED
from sparsecomm_jax.embedding.row import ROW
from sparsecomm_jax.embedding.tablewise import TABLE
from sparsecomm_jax.errors import few

#: The table layouts by name: the library's, and any registered (``register``).
LAYOUTS: dict[str, Layout] = {
    x.name: x for x in (COLUMN, ROW, TABLE, REPLICATED, DENSE, HOT, MANAGED)
}


def register(layout: Layout) -> Layout:
    """Adds ``layout`` to ``LAYOUTS`` under its name (a layout of that name is replaced):
    from then on ``table_layouts``, the planner (where it has ``pricing``) and the
    command line's ``--plan`` accept it. Returns it, so a module can write ``MINE =
    register(Layout(...))``.

    Raises:
      ValueError: not a ``Layout``, or an empty name.
    """
    if not isinstance(layout, Layout) or not layout.name:
        raise ValueError(f"register takes a Layout with a name, got {layout!r}")
    LAYOUTS[layout.name] = layout
    return layout


def get(layout: str | Layout) -> Layout:
    """The ``Layout`` named ``layout`` (a value is returned as it is).

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown table layout {layout!r}; choose one of {list(LAYOUTS)}")
    return LAYOUTS[layout]


def known(layout: Any) -> bool:
    """Whether ``layout`` is a ``Layout`` value or the name of a registered one."""
    return isinstance(layout, Layout) or (isinstance(layout, str) and layout in LAYOUTS)


def _configured(entry: Any) -> tuple[Any, Any]:
    """A plan's entry for a table as ``(layout, its configuration or None)``."""
    if not isinstance(entry, Mapping):
        return entry, None
    if set(entry) != {"layout", "config"} or not isinstance(entry["layout"], str):
        raise ValueError(
            'a configured table in a plan is {"layout": name, "config": ...}, got '
            f"{dict(entry)!r:.80}"
        )
    return entry["layout"], entry["config"]


def _check_configured(layouts: dict[str, Layout]) -> None:
    """``ValueError`` unless the tables of each configurable layout share one value of it
    whose configuration names only them: what the JSON form can say (one configuration
    entry per table) and what a step binds (one value per layout)."""
    given: dict[str, dict[str, Layout]] = {}
    for table, layout in layouts.items():
        if layout.configure is not None:
            given.setdefault(layout.name, {})[table] = layout
    for name, tables in given.items():
        configs = {json.dumps(x.config, sort_keys=True) for x in tables.values()}
        if len(configs) > 1:
            raise ValueError(
                f"the tables given the {name} layout share one {name} layout: give all "
                "their configurations to one value of it"
            )
        config = next(iter(tables.values())).config or {}
        if stray := sorted(set(config) - set(tables)):
            raise ValueError(
                f"the {name} layout's configuration names {few(stray)}, no table the plan gives it"
            )


def _configure(name: str, entries: dict[str, Any]) -> Layout:
    """The value of layout ``name`` for the tables' configurations ``entries``."""
    layout = get(name)
    if layout.configure is None:
        raise ValueError(f"the {name} layout takes no configuration; give its name alone")
    try:
        return layout.configure(entries)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the {name} layout's configuration: {e}") from None


class TablePlan(Mapping):
    """A layout per table: table name (its path joined by ``/``) -> ``Layout``.

    What ``make_train_step(table_layouts=...)`` takes, the planner's ``Plan.layouts()``
    returns and ``--plan`` holds; written as JSON by the layouts' names (``to_json``)
    and read back through the registry (``from_json``). A table whose layout value was
    made with a configuration (``Layout.config``, e.g. the hot layout's hot ids) is
    written ``{"layout": name, "config": the table's entry}`` and read back through
    the layout's ``configure``. Two plans are equal when their JSON is.

    Example:
        >>> plan = TablePlan({"a": "row", "b": get("column")})
        >>> plan.names()
        {'a': 'row', 'b': 'column'}
        >>> TablePlan.from_json(plan.to_json()) == plan
        True
        >>> hot = TablePlan.from_json({"c": {"layout": "hot", "config": [3, 1]}})
        >>> hot.to_json(), hot["c"].config
        ({'c': {'layout': 'hot', 'config': [1, 3]}}, {'c': [1, 3]})
    """

    def __init__(self, layouts: Mapping[str, str | Layout] | None = None):
        self._layouts = {str(name): get(x) for name, x in (layouts or {}).items()}
        _check_configured(self._layouts)

    @classmethod
    def from_json(cls, value: Any) -> TablePlan:
        """The plan of a JSON object ``{table: layout name or {"layout": name, "config":
        entry}}`` (as ``json.loads`` gives); the configured tables of one layout share one
        value of it, ``configure({table: entry, ...})``.

        Raises:
          ValueError: not such an object, a layout no one registered (the message lists
            the known ones), or a configuration its layout does not take.
        """
        if not isinstance(value, Mapping):
            raise ValueError(f"a plan is a JSON object of table -> layout, got {value!r:.80}")
        named = {t: _configured(x) for t, x in value.items()}
        if bad := sorted({str(x) for x, _ in named.values() if not known(x)}):
            raise ValueError(f"the plan has layouts {few(bad)}; choose among {list(LAYOUTS)}")
        configs: dict[str, dict[str, Any]] = {}
        for table, (name, config) in named.items():
            if config is not None:
                configs.setdefault(get(name).name, {})[table] = config
        made = {name: _configure(name, entries) for name, entries in configs.items()}
        # every table of a configured layout takes its one value (a table without an
        # entry has none: the hot layout's table without hot rows)
        return cls({t: made.get(get(x).name, x) for t, (x, _) in named.items()})

    def to_json(self) -> dict[str, Any]:
        """``{table: layout name}`` (a configured table ``{"layout": name, "config":
        entry}``), ready for ``json.dumps``."""
        out: dict[str, Any] = {}
        for table, layout in self._layouts.items():
            config = layout.config or {}
            if table in config:
                out[table] = {"layout": layout.name, "config": config[table]}
            else:
                out[table] = layout.name
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TablePlan):
            return NotImplemented
        return self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]

    def names(self) -> dict[str, str]:
        """``{table: layout name}``."""
        return {table: layout.name for table, layout in self._layouts.items()}

    def __getitem__(self, table: str) -> Layout:
        return self._layouts[table]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __repr__(self) -> str:
        return f"TablePlan({self.names()!r})"
