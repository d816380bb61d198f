"""Order inside one program by data edges: ``waits_for`` makes a value wait for others.

XLA schedules a program's operations by their data dependencies alone, and XLA:CPU drops
``jax.lax.optimization_barrier`` before scheduling. So where a collective must wait for
another (EmbRace's late chunks for every first chunk), the waiting value takes a real
data edge from what it waits for: ``x + (a - a)``, ``a`` one element of each array
waited for, made finite, so the edge adds exactly zero and a NaN elsewhere cannot reach
``x``. XLA does not fold ``a - a`` for floats, so the edge survives.

Example:
    >>> import jax.numpy as jnp
    >>> x, first = jnp.ones(3), jnp.array([jnp.nan, 2.0])
    >>> waits_for(x, [first]).tolist()  # the same values, after ``first``
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def waits_for(x: jax.Array, after, same_over: str | None = None) -> jax.Array:
    """``x``, made to wait for every array in ``after``: a real data edge ``x + (a - a)``
    with ``a`` the sum of one element of each (``edge``).

    Args:
      x: any array.
      after: a pytree of arrays ``x`` must wait for (an empty one: nothing).
      same_over: see ``edge``.

    Returns:
      ``x`` (the same values and dtype), computed after ``after``.
    """
    a = edge(after, same_over)
    return x + (a - a).astype(x.dtype)


def edge(after, same_over: str | None = None) -> jax.Array:
    """float32[]: the sum of one element of every array in ``after`` (0 where that is not
    finite), for ``waits_for``.

    ``same_over``: a mesh axis the waiting values are the same over while ``after`` is
    not (the replica groups, inside ``shard_map``): the sum is reduced over it (a scalar
    all-reduce), so they stay typed the same over it."""
    leaves = [leaf for leaf in jax.tree.leaves(after) if leaf.size]  # an empty one: nothing
    firsts = [leaf.reshape(-1)[0].astype(jnp.float32) for leaf in leaves]
    a = sum(firsts, jnp.zeros((), jnp.float32))
    a = jnp.where(jnp.isfinite(a), a, 0.0)  # a NaN row read next must not reach this step
    return jax.lax.pmax(a, same_over) if same_over is not None else a
