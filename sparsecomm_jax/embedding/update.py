"""How the tables change each step: ``DENSE`` or ``ROWS``, two values of ``TableUpdate``.

A step's layouts bring each table's gradient to its owner as ``(ids, rows)`` pairs
(``embedding.gradients``). A ``TableUpdate`` says what the optimizer makes of them:

- ``DENSE``: the pairs are scatter-added into a dense gradient of the shard (V x D/P
  for a column-wise table) and the optimizer runs on the whole parameter tree: exact
  for every optax optimizer, O(V x D/P) per step and worker;
- ``ROWS``: the pairs are summed per id into a ``RowGrad`` and the optimizer runs on the
  row view (``row_optimizers.rows_step``): only the touched rows of a table and of its
  optimizer state are read and written, O(tokens x D). Exact for optimizers under which
  an untouched row does not move (SGD, Adagrad, clipping by global norm, schedules);
  lazy for the others (see ``row_optimizers``).

Both run the optimizer at the level of global arrays (outside ``shard_map``): sharded
tables and their states are global ``jax.Array`` s, so an optax transform that reduces
over the whole tree (clipping by global norm, a trust ratio) sums over every shard, as
XLA partitions it. The row view reads and writes rows inside ``shard_map`` (each worker
its own shard), so no table is gathered.

Example:
    >>> from sparsecomm_jax.embedding import update
    >>> update.get("rows") is update.ROWS
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from sparsecomm_jax.embedding.layout import cut_spec
from sparsecomm_jax.embedding.row_optimizers import (
    RowGrad,
    is_row_grad,
    put_rows,
    rows_step,
    segment_rows,
    state_roles,
    take_rows,
)

PyTree = Any
F32 = jnp.float32


class TableUpdate(NamedTuple):
    """What the optimizer makes of a table's gradient (a value: ``DENSE`` or ``ROWS``).

    Attributes:
      name: ``"dense"`` or ``"rows"``.
      gradient: ``gradient(pairs, shard, num) -> leaf`` inside ``shard_map``: the mean
        gradient of one table from its ``(ids, rows)`` pairs summed at the owner (a dense
        shard, or a ``RowGrad``).
      apply: ``apply(optimizer, params, opt_state, grads, ok, view) -> (params,
        opt_state)`` on global arrays; ``view`` reads and writes rows (``RowView``).
      early_rows: ``early_rows(pairs, next_ids, shard, num) -> RowGrad`` inside
        ``shard_map``: of the rows the next batch reads (``next_ids``), those this step
        moves, with their mean gradient from ``pairs`` (the pipelined step updates them
        early). ``DENSE`` moves every row (a zero gradient still moves a row under Adam
        or momentum); ``ROWS`` only the rows with a gradient.
    """

    name: str
    gradient: Callable[[list, jax.Array, int], Any]
    apply: Callable[..., tuple[PyTree, PyTree]]
    early_rows: Callable[[list, jax.Array, jax.Array, int], RowGrad]


def dense_gradient(pairs: list, shard: jax.Array, num: int) -> jax.Array:
    """The pairs scatter-added into a zero shard, divided by P: the mean gradient."""
    grad = jnp.zeros(shard.shape, F32)
    for ids, rows in pairs:
        grad = grad.at[ids].add(rows.astype(F32), mode="drop")
    return (grad / num).astype(shard.dtype)


def row_gradient(pairs: list, shard: jax.Array, num: int) -> RowGrad:
    """The pairs summed per id (``segment_rows``), divided by P."""
    if not pairs:
        return RowGrad(jnp.zeros((0,), jnp.int32), jnp.zeros((0, shard.shape[1]), F32))
    ids = jnp.concatenate([a.astype(jnp.int32) for a, _ in pairs])
    grad = segment_rows(ids, jnp.concatenate([b for _, b in pairs]), shard.shape[0])
    return RowGrad(grad.ids, grad.rows / num)


def every_next_row(pairs: list, next_ids, shard: jax.Array, num: int) -> RowGrad:
    """The rows of ``pairs`` and every row in ``next_ids`` (zero gradient), per id."""
    zeros = jnp.zeros((next_ids.shape[0], shard.shape[1]), F32)
    return row_gradient([*pairs, (next_ids, zeros)], shard, num)


def rows_with_gradient(pairs: list, next_ids, shard: jax.Array, num: int) -> RowGrad:
    """The rows of ``pairs`` alone (``next_ids`` unused: an untouched row does not move)."""
    del next_ids
    return row_gradient(pairs, shard, num)


def where(ok, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``ok``, else ``old``, leaf by leaf (``ok is True``: ``new``)."""
    if ok is True:
        return new
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def dense_apply(optimizer, params, opt_state, grads, ok=True, view=None):
    """``optimizer`` on the whole tree; nothing changes unless ``ok``."""
    updates, new_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return where(ok, new_params, params), where(ok, new_state, opt_state)


def rows_apply(optimizer, params, opt_state, grads, ok=True, view=None):
    """``optimizer`` on the row view (``row_optimizers.rows_step``); ``view`` reads and
    writes the rows of sharded leaves (``None``: plain local arrays)."""
    if view is None:
        roles = state_roles(optimizer, opt_state, params)
        return rows_step(optimizer, params, opt_state, grads, roles, ok)
    return rows_step(optimizer, params, opt_state, grads, view.roles, ok, view.take, view.put)


#: A dense gradient of each table shard; every row updated (exact for any optimizer).
DENSE = TableUpdate("dense", dense_gradient, dense_apply, every_next_row)
#: The optimizer on the rows a step reads only (the row view).
ROWS = TableUpdate("rows", row_gradient, rows_apply, rows_with_gradient)
TABLE_UPDATES = {u.name: u for u in (DENSE, ROWS)}


def get(update: str | TableUpdate) -> TableUpdate:
    """The ``TableUpdate`` named ``update`` (a value is returned as it is)."""
    if isinstance(update, TableUpdate):
        return update
    if update not in TABLE_UPDATES:
        raise ValueError(f"table_update must be one of {sorted(TABLE_UPDATES)}, got {update!r}")
    return TABLE_UPDATES[update]


class RowView(NamedTuple):
    """Reads and writes rows of sharded leaves, each worker in its own shard.

    Attributes:
      mesh: the mesh the state lives on.
      axis: the data-parallel axis.
      specs: table leaf index -> ``(table spec, ids spec, rows spec)`` (from its layout).
      roles: the optimizer state's roles (``row_optimizers.state_roles``).
    """

    mesh: Mesh
    axis: str
    specs: dict[int, tuple]
    roles: PyTree

    def _smap(self, fn, i: int, ndim: int, write: bool):
        table, ids, rows = self.specs[i]
        leaf, got = cut_spec(table, ndim), cut_spec(rows, ndim)
        ins = (leaf, ids, got) if write else (leaf, ids)
        out = leaf if write else got
        return jax.shard_map(fn, mesh=self.mesh, in_specs=ins, out_specs=out)

    def take(self, i: int, x, ids):
        """``x[ids]`` (rows of a leaf lying like table ``i``), each worker from its shard."""
        return self._smap(take_rows, i, x.ndim, write=False)(x, ids)

    def put(self, i: int, x, ids, rows):
        """``x`` with ``x[ids] = rows``, each worker in its shard."""
        return self._smap(put_rows, i, x.ndim, write=True)(x, ids, rows)


def grad_specs(update: TableUpdate, tables, param_specs: PyTree, axis: str) -> PyTree:
    """The ``PartitionSpec`` tree of a step's gradient: a dense shard lies like its
    table, a ``RowGrad`` as its layout's ``row_specs`` say."""
    if update is DENSE:
        return param_specs
    leaves, treedef = jax.tree.flatten(param_specs, is_leaf=_is_spec)
    for t in tables:
        leaves[t.index] = RowGrad(*t.layout.row_specs(axis))
    return treedef.unflatten(leaves)


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def row_values(grads: PyTree) -> list:
    """The arrays the optimizer will read: a ``RowGrad``'s rows, other leaves whole
    (what the non-finite check looks at)."""
    leaves = jax.tree.leaves(grads, is_leaf=is_row_grad)
    return [g.rows if is_row_grad(g) else g for g in leaves]
