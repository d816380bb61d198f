"""The table layouts by name, and a plan of them: what a per-table choice
(``make_train_step(..., table_layouts=...)``, the planner, ``--plan``, a checkpoint's
record) refers to.

``LAYOUTS`` is the registry: the library's layouts (``column``, ``row``, ``table``,
``replicated``, ``dense``, ``hot``) and any a user registers (``register``). The planner, the
command line and the checkpoints iterate over it and ask each layout its facts
(``Layout.pricing``, ``sharded``, ``packs``, ``data_parallel``); nothing outside this
module names a layout. A ``TablePlan`` maps tables to layouts and reads and writes
itself as JSON by their names.

Example:
    >>> from sparsecomm_jax.embedding import layouts
    >>> layouts.get("row").name, sorted(layouts.LAYOUTS)
    ('row', ['column', 'dense', 'hot', 'replicated', 'row', 'table'])
    >>> plan = layouts.TablePlan.from_json({"params/user/embedding": "row"})
    >>> plan["params/user/embedding"] is layouts.get("row"), plan.to_json()
    (True, {'params/user/embedding': 'row'})
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from sparsecomm_jax.embedding.column import COLUMN
from sparsecomm_jax.embedding.dense import DENSE
from sparsecomm_jax.embedding.hot import HOT
from sparsecomm_jax.embedding.layout import Layout
from sparsecomm_jax.embedding.replicated import REPLICATED
from sparsecomm_jax.embedding.row import ROW
from sparsecomm_jax.embedding.tablewise import TABLE
from sparsecomm_jax.errors import few

#: The table layouts by name: the library's, and any registered (``register``).
LAYOUTS: dict[str, Layout] = {x.name: x for x in (COLUMN, ROW, TABLE, REPLICATED, DENSE, HOT)}


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


class TablePlan(Mapping):
    """A layout per table: table name (its path joined by ``/``) -> ``Layout``.

    What ``make_train_step(table_layouts=...)`` takes, the planner's ``Plan.layouts()``
    returns and ``--plan`` holds; written as JSON by the layouts' names (``to_json``)
    and read back through the registry (``from_json``).

    Example:
        >>> plan = TablePlan({"a": "row", "b": get("column")})
        >>> plan.names()
        {'a': 'row', 'b': 'column'}
        >>> TablePlan.from_json(plan.to_json()) == plan
        True
    """

    def __init__(self, layouts: Mapping[str, str | Layout] | None = None):
        self._layouts = {str(name): get(x) for name, x in (layouts or {}).items()}

    @classmethod
    def from_json(cls, value: Any) -> TablePlan:
        """The plan of a JSON object ``{table: layout name}`` (as ``json.loads`` gives).

        Raises:
          ValueError: not an object of names, or a layout no one registered (the
            message lists the known ones).
        """
        if not isinstance(value, Mapping):
            raise ValueError(f"a plan is a JSON object of table -> layout, got {value!r:.80}")
        if bad := sorted({str(x) for x in value.values() if not known(x)}):
            raise ValueError(f"the plan has layouts {few(bad)}; choose among {list(LAYOUTS)}")
        return cls(value)

    def to_json(self) -> dict[str, str]:
        """``{table: layout name}``, ready for ``json.dumps``."""
        return self.names()

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
