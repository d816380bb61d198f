"""Row-sparse optimizer updates for embedding tables, optax-style: ``RowTransform``.

A step that looks up n rows of a V x D table has a gradient with at most n non-zero
rows. Here it travels as ``RowGrad(ids, rows)`` (distinct ids, their summed gradient
rows) and the update reads and writes those rows only: O(n x D) per step, not O(V x D).

=============  ===========================================================
transform      equal to the dense optax update?
=============  ===========================================================
``sgd``        yes (``optax.sgd``): untouched rows have zero gradient
``adagrad``    yes (``optax.adagrad``): a zero gradient adds nothing
``lazy_adam``  no: moments and step count of a row advance only on steps that
               touch it (PyTorch ``SparseAdam``, TF ``LazyAdam``); dense Adam
               decays every row's moments and moves every row each step.
=============  ===========================================================

Example:
    >>> import jax.numpy as jnp
import optax
    >>> from sparsecomm_jax import rowwise
    >>> opt = rowwise.adagrad(0.1)
    >>> table = jnp.zeros((5, 2))
    >>> grad = rowwise.segment_rows(jnp.array([3, 1, 3]), jnp.ones((3, 2)), 5)
    >>> table, state = rowwise.apply_rows(opt, grad, opt.init(table), table)
    >>> [int(i) for i in jnp.nonzero(table[:, 0])[0]]
    [1, 3]

References:
    Duchi et al., "Adaptive Subgradient Methods", JMLR 2011 (Adagrad); Kingma and Ba,
    "Adam", ICLR 2015 (lazy variant: PyTorch ``torch.optim.SparseAdam``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

PyTree = Any


class RowGrad(NamedTuple):
    """A table's gradient as rows.

    Attributes:
      ids: int[m] distinct row indices; an index outside [0, V) is padding (ignored).
      rows: float[m, D] the summed gradient of each row.
    """

    ids: jax.Array
    rows: jax.Array


class RowTransform(NamedTuple):
    """A row-wise optimizer.

    Attributes:
      init: ``init(table) -> state``: arrays whose leading axis is V (or scalars).
      update: ``update(grad, state, table) -> (update_rows, state)``: ``update_rows``
        float[m, D] is added to ``table[grad.ids]``; only those rows of the state change.
    """

    init: Callable[[jax.Array], PyTree]
    update: Callable[[RowGrad, PyTree, jax.Array], tuple[jax.Array, PyTree]]


class EmptyState(NamedTuple):
    """State of a stateless transform."""


class AdagradRowState(NamedTuple):
    """Adagrad's sum of squared gradients, float[V, D]."""

    sum_of_squares: jax.Array


class LazyAdamState(NamedTuple):
    """Lazy Adam: moments float[V, D] and each row's own step count int32[V]."""

    mu: jax.Array
    nu: jax.Array
    count: jax.Array


def segment_rows(ids: jax.Array, rows: jax.Array, num_rows: int) -> RowGrad:
    """Sums the gradient rows of equal ids (jit-able; output size fixed at ``len(ids)``).

    Args:
      ids: int[n] row of each gradient row; ids outside [0, num_rows) are dropped.
      rows: float[n, D].
      num_rows: V, the rows of the table (or of this worker's shard).

    Returns:
      ``RowGrad`` with ``n`` slots: the distinct ids in ascending order, then padding
      (id ``num_rows``, zero rows).
    """
    n = ids.shape[0]
    valid = (ids >= 0) & (ids < num_rows)
    ids = jnp.where(valid, ids, num_rows)
    uniq, inverse = jnp.unique(ids, size=n, fill_value=num_rows, return_inverse=True)
    rows = jnp.where(valid[:, None], rows, 0)
    summed = jax.ops.segment_sum(rows, inverse.reshape(-1), num_segments=n)
    return RowGrad(uniq, summed)


def take_rows(x: jax.Array, ids: jax.Array) -> jax.Array:
    """``x[ids]`` with padding ids clipped (never NaN-filled)."""
    return jnp.take(x, ids, axis=0, mode="clip")


def put_rows(x: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    """``x`` with ``x[ids] = rows``; padding ids are dropped."""
    return x.at[ids].set(rows.astype(x.dtype), mode="drop")


def apply_rows(
    transform: RowTransform, grad: RowGrad, state: PyTree, table: jax.Array
) -> tuple[jax.Array, PyTree]:
    """One optimizer step on the rows of ``grad``; every other row stays as it was.

    Args:
      transform: the ``RowTransform``.
      grad: distinct ids and their gradient rows (``segment_rows``).
      state: the transform's state for ``table``.
      table: float[V, D] (or this worker's shard of it).

    Returns:
      ``(table, state)`` after the step.
    """
    updates, state = transform.update(grad, state, table)
    return table.at[grad.ids].add(updates.astype(table.dtype), mode="drop"), state


def sgd(learning_rate: float) -> RowTransform:
    """Row-wise ``optax.sgd(learning_rate)`` (no momentum): exact."""

    def update(grad: RowGrad, state, table):
        return -learning_rate * grad.rows, state

    return RowTransform(lambda table: EmptyState(), update)


def adagrad(
    learning_rate: float, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> RowTransform:
    """Row-wise ``optax.adagrad`` with the same arguments: exact."""

    def init(table):
        return AdagradRowState(jnp.full(table.shape, initial_accumulator_value, table.dtype))

    def update(grad: RowGrad, state: AdagradRowState, table):
        acc = grad.rows * grad.rows + take_rows(state.sum_of_squares, grad.ids)
        scale = jnp.where(acc > 0, jax.lax.rsqrt(acc + eps), 0.0)
        updates = -learning_rate * (scale * grad.rows)
        return updates, AdagradRowState(put_rows(state.sum_of_squares, grad.ids, acc))

    return RowTransform(init, update)


def lazy_adam(
    learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> RowTransform:
    """Adam on the touched rows only, each row with its own step count.

    A row's sequence of updates is what ``optax.adam`` would give on the sequence of
    that row's non-zero gradients; rows not looked up keep their moments and do not
    move. Equal to ``optax.adam`` when every row is touched every step.
    """

    def init(table):
        zeros = jnp.zeros(table.shape, table.dtype)
        return LazyAdamState(zeros, zeros, jnp.zeros(table.shape[:1], jnp.int32))

    def update(grad: RowGrad, state: LazyAdamState, table):
        g, ids = grad.rows, grad.ids
        mu = (1 - b1) * g + b1 * take_rows(state.mu, ids)
        nu = (1 - b2) * (g * g) + b2 * take_rows(state.nu, ids)
        count = take_rows(state.count, ids) + 1  # int32[m]
        mu_hat = mu / (1 - b1 ** count.astype(g.dtype))[:, None]
        nu_hat = nu / (1 - b2 ** count.astype(g.dtype))[:, None]
        updates = -learning_rate * (mu_hat / (jnp.sqrt(nu_hat) + eps))
        new = LazyAdamState(
            put_rows(state.mu, ids, mu),
            put_rows(state.nu, ids, nu),
            put_rows(state.count, ids, count),
        )
        return updates, new

    return RowTransform(init, update)


ROW_OPTIMIZERS: dict[str, Callable[[float], RowTransform]] = {
    "sgd": sgd,
    "adagrad": adagrad,
    "lazy_adam": lazy_adam,
}


def check_transform(transform) -> None:
    """``ValueError`` unless ``transform`` is ``None`` or has ``init`` and ``update``."""
    if transform is not None and not (hasattr(transform, "init") and hasattr(transform, "update")):
        raise ValueError("table_optimizer must be a rowwise.RowTransform (init, update)")


def by_name(name: str, learning_rate: float) -> RowTransform:
    """The ``RowTransform`` called ``name``; ``ValueError`` when it has no row form."""
    if name not in ROW_OPTIMIZERS:
        raise ValueError(
            f"optimizer {name!r} has no row-sparse table update; choose one of "
            f"{sorted(ROW_OPTIMIZERS)} or the dense table update"
        )
    return ROW_OPTIMIZERS[name](learning_rate)


class TableOptState(NamedTuple):
    """Optimizer state when tables are updated row-wise.

    Attributes:
      dense: the optax state of the other leaves (``None`` at the tables).
      rows: the ``RowTransform`` state of each table, in leaf order.
    """

    dense: PyTree
    rows: tuple


def _split(tree: PyTree, mask: PyTree) -> tuple[PyTree, list, Any]:
    """(tree with ``None`` at the tables, the tables in leaf order, treedef)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_none)
    flags = jax.tree.leaves(mask)
    rest = [None if f else x for x, f in zip(leaves, flags, strict=True)]
    return treedef.unflatten(rest), [x for x, f in zip(leaves, flags, strict=True) if f], treedef


def init_tables(optimizer, rows: RowTransform, params: PyTree, mask: PyTree) -> TableOptState:
    """``TableOptState`` for ``params``: ``optimizer`` (optax) on the non-table leaves,
    ``rows`` on each table flagged in ``mask``."""
    rest, tables, _ = _split(params, mask)
    return TableOptState(optimizer.init(rest), tuple(rows.init(t) for t in tables))


def apply_tables(optimizer, rows: RowTransform, grads, table_grads, state, params, mask, ok=True):
    """One step: ``optimizer`` on the non-table gradients ``grads`` (``None`` or
    anything at the tables: ignored), ``rows`` on each table's ``RowGrad``.

    Args:
      optimizer: the optax optimizer of the other leaves.
      rows: the tables' ``RowTransform``.
      grads: gradient tree shaped like ``params``.
      table_grads: ``RowGrad`` per table, in leaf order.
      state: the ``TableOptState``.
      params: the parameters.
      mask: bool per leaf: is it a table?
      ok: a boolean scalar; when false nothing changes (the tables are not selected
        whole: their rows are dropped from the update, so this stays O(rows)).

    Returns:
      ``(params, state)`` after the step.
    """
    rest, tables, treedef = _split(params, mask)
    updates, dense = optimizer.update(_split(grads, mask)[0], state.dense, rest)
    rest = _unless(ok, optax.apply_updates(rest, updates), rest)
    dense = _unless(ok, dense, state.dense)
    stepped = [
        apply_rows(rows, g._replace(ids=jnp.where(ok, g.ids, t.shape[0])), s, t)
        for g, s, t in zip(table_grads, state.rows, tables, strict=True)
    ]
    new_tables = iter(t for t, _ in stepped)
    flags = jax.tree.leaves(mask)
    leaves = [
        next(new_tables) if f else x
        for x, f in zip(jax.tree.leaves(rest, is_leaf=_none), flags, strict=True)
    ]
    return treedef.unflatten(leaves), TableOptState(dense, tuple(s for _, s in stepped))


def _unless(ok, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``ok``, else ``old`` (leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _none(x) -> bool:
    return x is None


def state_specs(state: PyTree, table_spec: P) -> PyTree:
    """``PartitionSpec`` of each state leaf: the table's, cut to the leaf's rank."""
    return jax.tree.map(lambda x: P(*tuple(table_spec)[: x.ndim]), state)
