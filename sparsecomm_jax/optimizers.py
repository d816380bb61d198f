"""Optimizers by name: what a command line or a config means by ``--optimizer adam``.

The library takes any optax optimizer as a value (``make_train_step(loss, optax.adam(
1e-3), ...)``); this registry is for the places that choose one by name. Each entry
owns its facts, so no caller keeps a table of names of its own:

- ``make(lr)``: the optax optimizer at a learning rate (a float or a schedule);
- ``slots``: optimizer state per parameter entry (the planner's memory of a table);
- ``rows``: how the row-sparse table update (``table_update="rows"``) treats it:
  ``"exact"`` (a row whose gradient is zero keeps its value and state, so updating the
  rows a step reads equals the dense update: SGD, Adagrad), ``"lazy"`` (defined on the
  rows a step reads: ``lazy_adam``), or ``None`` (it moves every row: Adam, momentum,
  whose tables are updated densely).

Example:
    >>> from sparsecomm_jax import optimizers
    >>> adagrad = optimizers.get("adagrad")
    >>> adagrad.slots, adagrad.rows
    (1, 'exact')
    >>> [o.name for o in optimizers.OPTIMIZERS.values() if o.rows]
    ['sgd', 'adagrad', 'lazy_adam']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import optax

from sparsecomm_jax.embedding.row_optimizers import lazy_adam


class Optimizer(NamedTuple):
    """A named optimizer (see the module doc).

    Attributes:
      name: its registry key.
      make: ``make(learning_rate) -> optax.GradientTransformation``.
      slots: optimizer state per parameter entry.
      rows: ``"exact"``, ``"lazy"`` or ``None`` (the row-sparse update's view of it).
    """

    name: str
    make: Callable[[float | optax.Schedule], optax.GradientTransformation]
    slots: int
    rows: str | None = None


#: The optimizers by name (``--optimizer``).
OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        Optimizer("sgd", optax.sgd, slots=0, rows="exact"),
        Optimizer("momentum", lambda lr: optax.sgd(lr, momentum=0.9), slots=1),
        Optimizer("adam", optax.adam, slots=2),
        Optimizer("adagrad", optax.adagrad, slots=1, rows="exact"),
        Optimizer("lazy_adam", lazy_adam, slots=2, rows="lazy"),
    )
}


def get(name: str) -> Optimizer:
    """The optimizer called ``name``.

    Raises:
      ValueError: an unknown name (the message lists ``OPTIMIZERS``).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {list(OPTIMIZERS)}")
    return OPTIMIZERS[name]
