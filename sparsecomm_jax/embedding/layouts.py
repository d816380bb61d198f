"""The table layouts by name: what a per-table choice (``make_train_step(...,
table_layouts=...)``, a planner's plan) refers to.

Example:
    >>> from sparsecomm_jax.embedding import layouts
    >>> layouts.get("row").name, sorted(layouts.LAYOUTS)
    ('row', ['column', 'replicated', 'row', 'table'])
"""

from __future__ import annotations

from sparsecomm_jax.embedding.column import COLUMN
from sparsecomm_jax.embedding.layout import Layout
from sparsecomm_jax.embedding.replicated import REPLICATED
from sparsecomm_jax.embedding.row import ROW
from sparsecomm_jax.embedding.tablewise import TABLE

LAYOUTS: dict[str, Layout] = {x.name: x for x in (COLUMN, ROW, REPLICATED, TABLE)}


def get(layout: str | Layout) -> Layout:
    """The ``Layout`` named ``layout`` (a value is returned as it is).

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(layout, Layout):
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown table layout {layout!r}; choose one of {sorted(LAYOUTS)}")
    return LAYOUTS[layout]
