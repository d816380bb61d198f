"""Gradient aggregators, optax-style: ``Aggregator(init, update)``.

Used inside ``shard_map`` bodies: ``state = agg.init(grads_like)``, then
``mean_grads, state = agg.update(grads, state)`` returns the mean gradient over the
``axis_name`` workers, identical on every worker. State is a NamedTuple of arrays (a
plain pytree), kept per worker.

Example:
    >>> from sparsecomm_jax import aggregators
    >>> agg = aggregators.dense_allreduce("data")
    >>> # inside shard_map: mean, state = agg.update(grads, agg.init(grads))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

PyTree = Any


class Aggregator(NamedTuple):
    """A gradient-exchange strategy.

    Attributes:
      init: ``init(params) -> state`` (local shapes).
      update: ``update(grads, state) -> (mean_grads, state)``.
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


class EmptyState(NamedTuple):
    """State of a stateless aggregator."""


def dense_allreduce(axis_name: str) -> Aggregator:
    """Mean of the gradients by ``lax.pmean`` (ring all-reduce).

    Args:
      axis_name: the data-parallel mesh axis.

    Returns:
      An ``Aggregator`` with empty state.
    """

    def update(grads, state):
        return jax.lax.pmean(grads, axis_name), state

    return Aggregator(init=lambda params: EmptyState(), update=update)
