"""A step's results read back on the host: its loss as a float, a call's losses, one
replica of a ``pmap`` step's state.

Example:
    >>> import numpy as np
    >>> first_replica(np.array([[1.0, 2.0], [1.0, 2.0]])).tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

import jax
import numpy as np

from sparsecomm_jax.step.state import PyTree, TrainState


def first_replica(x) -> np.ndarray:
    """One replica of a ``pmap``-stacked array (numpy or device), as numpy."""
    if isinstance(x, np.ndarray):
        return x[0]
    return np.asarray(x.addressable_data(0)).reshape(x.shape[1:])


def loss_value(loss: jax.Array) -> float:
    """The step's loss as a float (``pmap`` returns one copy per local device)."""
    return float(np.asarray(loss.addressable_data(0)).reshape(-1)[0])


def loss_values(losses: jax.Array) -> list[float]:
    """The losses of a call of ``TrainStep.steps`` (one per step), or of ``step`` (one),
    as floats."""
    return [float(x) for x in np.asarray(losses.addressable_data(0)).reshape(-1)]


def replica_params(state: TrainState) -> PyTree:
    """``TrainStep.host_params`` of a ``jax.pmap`` step: the parameters of ``state`` as
    numpy arrays on this host, from the first device's replica (the replicas are equal
    after every step's ``pmean``).

    Args:
      state: a ``TrainState`` of the step, its leaves stacked per local device.

    Returns:
      The parameter pytree, like the ``params`` given to ``make_train_step``.
    """
    return jax.tree.map(first_replica, state.params)
