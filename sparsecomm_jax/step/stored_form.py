"""How a step stores its state, and the same state in the model's own shapes: what lets
a checkpoint restore onto another device count or other layouts (resharding).

A step stores each table as its layout says: padded along the dimension it splits to a
multiple of P (``layout.padded_shape``), or packed with other tables (table-wise packs,
``Layout.storage``). The optimizer state lying like a table (Adam's moments, a lazy
optimizer's per-row counts) is stored the same way. ``StateForm`` records that
placement; ``to_model`` undoes it (every table and its state cut back to V x D, packs
unpacked: the state a single device would hold) and ``to_stored`` redoes it for any
form. A checkpoint records the form it was saved in (``StateForm.record``), so a
restore reads it in that form and converts: ``to_stored(ours, to_model(theirs, tree))``.

What no conversion can carry: the aggregator's per-worker residuals (error feedback),
one per worker; another count refuses them (``ValueError``).

Example:
    >>> import numpy as np
    >>> from sparsecomm_jax.embedding import row, tables
    >>> t = tables.Table(0, "t", 5, 2, row.ROW)
    >>> four = StateForm((t,), 4, (), (("t", (5, 2)),))
    >>> three = four._replace(workers=3)
    >>> stored = {"params": [np.arange(16.0).reshape(8, 2)], "opt_state": (), "agg_state": ()}
    >>> to_stored(three, to_model(four, stored))["params"][0].shape  # 8 rows -> 5 -> 6
    (6, 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from sparsecomm_jax.embedding import layout_registry
from sparsecomm_jax.embedding.layout import padded_shape
from sparsecomm_jax.embedding.row_optimizers import NOT_A_PARAM, state_roles
from sparsecomm_jax.embedding.tables import (
    Table,
    bind_tables,
    path_keys,
    replace_leaves,
    table_name,
)

PyTree = Any
Leaves = dict[int, Any]  # parameter leaf index -> an array lying like it


class StateForm(NamedTuple):
    """How a step stores its state.

    Attributes:
      tables: the tables it places, their layouts bound at ``workers`` (table-wise
        owners).
      workers: the workers a table is sharded over (G; P on a 1-D mesh).
      roles: the optimizer state with each leaf replaced by the index of the
        parameter leaf it lies like, or ``NOT_A_PARAM`` (``row_optimizers.state_roles``).
      leaves: per parameter leaf, its name and its shape in the model.
      replicas: R, the groups a table is replicated over: the per-worker residuals
        are R x G.
    """

    tables: tuple[Table, ...]
    workers: int
    roles: PyTree
    leaves: tuple[tuple[str, tuple[int, ...]], ...]
    replicas: int = 1

    def record(self) -> dict:
        """The form as JSON: the workers, each placed table's name, V, D and layout, and
        the configuration of each layout made with one (``Layout.config``)."""
        placed = [[t.name, t.vocab, t.dim, t.layout.name] for t in self.tables]
        configs = {t.layout.name: t.layout.config for t in self.tables if t.layout.config}
        record = {"workers": self.workers, "tables": placed}
        if self.replicas > 1:
            record["replicas"] = self.replicas
        return {**record, "configs": configs} if configs else record


def form_of(ctx: Any, opt_state: PyTree) -> StateForm:
    """The ``StateForm`` of a step built from ``ctx``.

    Args:
      ctx: the step's ``StepContext`` (its tables bound, its optimizer, its mesh).
      opt_state: the step's optimizer state (its structure: which leaf lies like
        which parameter).

    Returns:
      How the step stores its state.
    """
    roles = state_roles(ctx.optimizer, opt_state, ctx.params)
    paths = jax.tree_util.tree_leaves_with_path(ctx.params)
    leaves = tuple((table_name(path_keys(p)), tuple(np.shape(x))) for p, x in paths)
    return StateForm(ctx.tables, ctx.group_size, roles, leaves, ctx.num_replicas)


def recorded(ours: StateForm, record: Any) -> StateForm:
    """The form a checkpoint recorded (``StateForm.record``), for this model.

    Args:
      ours: the form of the step restoring it (its model's parameters and optimizer).
      record: what the checkpoint recorded.

    Returns:
      ``ours`` with the recorded workers and tables, their layouts bound at that count.

    Raises:
      ValueError: the record is unreadable, names a table this model lacks or has at
        another size, or a layout no one registered.
    """
    try:
        workers, placed = int(record["workers"]), list(record["tables"])
        replicas = int(record.get("replicas", 1))
        rows = [(str(n), int(v), int(d), str(x)) for n, v, d, x in placed]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"its record of how the state is stored is unreadable ({e})") from e
    index = {name: i for i, (name, _) in enumerate(ours.leaves)}
    found = []
    for name, vocab, dim, layout in rows:
        if name not in index or ours.leaves[index[name]][1] != (vocab, dim):
            has = f"{ours.leaves[index[name]][1]}" if name in index else "no such table"
            raise ValueError(f"it holds table {name} of {vocab} x {dim}; this model has {has}")
        if not layout_registry.known(layout):
            raise ValueError(
                f"it stores table {name} in layout {layout!r}, which no one registered "
                f"here; known: {list(layout_registry.LAYOUTS)}"
            )
        found.append(Table(index[name], name, vocab, dim, _layout(layout, record)))
    tables = bind_tables(tuple(found), workers)
    return ours._replace(tables=tables, workers=workers, replicas=replicas)


def _layout(name: str, record: dict):
    """The layout ``name`` as the record made it (``Layout.configure`` of its config)."""
    layout = layout_registry.get(name)
    config = (record.get("configs") or {}).get(name)
    if config is None:
        return layout
    if layout.configure is None:
        raise ValueError(f"it records a configuration of layout {name!r}, which takes none")
    return layout.configure(config)


# ---------------------------------------------------------------- shapes


def stored_shape(form: StateForm, index: int, ndim: int) -> tuple[int, ...]:
    """The stored shape of an array of ``ndim`` dimensions lying like parameter leaf
    ``index`` (a table's rows and columns, or its rows alone: a per-row count)."""
    for t in form.tables:
        if t.index == index:
            return tuple(padded_shape(t, form.workers)[:ndim])
    return tuple(form.leaves[index][1][:ndim])


def stored_shapes(form: StateForm, like: PyTree) -> PyTree:
    """``like`` (a saved-form tree: ``params``, ``opt_state``, ``agg_state`` of arrays or
    ``jax.ShapeDtypeStruct``) as ``jax.ShapeDtypeStruct`` of the shapes ``form`` stores
    (no sharding): the per-worker residuals lead with its R x G."""

    def struct(role: int, x) -> jax.ShapeDtypeStruct:
        shape = x.shape if role == NOT_A_PARAM else stored_shape(form, role, len(x.shape))
        return jax.ShapeDtypeStruct(shape, x.dtype)

    params = jax.tree.map(struct, _indices(like["params"]), like["params"])
    opt = jax.tree.map(struct, form.roles, like["opt_state"])
    every = form.workers * form.replicas  # one residual per worker of the batch
    agg = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((every, *x.shape[1:]), x.dtype), like["agg_state"]
    )
    return {"params": params, "opt_state": opt, "agg_state": agg}


def _indices(tree: PyTree) -> PyTree:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(list(range(len(leaves))))


# ---------------------------------------------------------------- conversions


def to_model(form: StateForm, tree: PyTree) -> PyTree:
    """A state in the model's own shapes.

    Args:
      form: how ``tree`` is stored.
      tree: ``params``, ``opt_state`` and ``agg_state`` of host arrays
        (``checkpoint.portable``'s tree, gathered to the host).

    Returns:
      ``tree`` with every table and the state lying like it cut back to the model's
      shape (packs unpacked, padding cut); the per-worker residuals as they are.
    """
    return _each_view(form, tree, lambda leaves: cut_leaves(form.tables, leaves))


def to_stored(form: StateForm, tree: PyTree) -> PyTree:
    """``to_model``'s inverse.

    Args:
      form: how to store it.
      tree: a state in the model's shapes (``to_model``'s result).

    Returns:
      ``tree`` stored as a step of ``form`` stores it (padding zeros, packs packed).
    """
    return _each_view(form, tree, lambda leaves: store_leaves(form.tables, form.workers, leaves))


def cut_leaves(tables: tuple[Table, ...], leaves: Leaves) -> Leaves:
    """Arrays lying like ``tables`` (by leaf index; rows and columns, or rows alone) as
    they are stored, cut back to the model's shapes: packs unpacked, padding cut.
    Leaves of other parameters are returned as they are.

    Args:
      tables: the tables as placed (layouts bound).
      leaves: parameter leaf index -> array.

    Returns:
      ``leaves``, the tables' cut to V x D (or V).
    """
    out = dict(leaves)
    for storage, members in packs(tables):
        if mine := {t.index: leaves[t.index] for t in members if t.index in leaves}:
            out.update(storage.unpack(mine, {t.index: t.vocab for t in members}))
    for t in tables:
        if t.layout.storage is None and t.index in leaves:
            x = leaves[t.index]
            out[t.index] = x[tuple(slice(0, n) for n in (t.vocab, t.dim)[: np.ndim(x)])]
    return out


def store_leaves(tables: tuple[Table, ...], workers: int, leaves: Leaves) -> Leaves:
    """``cut_leaves``' inverse: arrays in the model's shapes stored as ``tables``' layouts
    store them on ``workers`` (padding zeros, packs packed; a table that needs no
    padding is not copied)."""
    out = dict(leaves)
    for storage, members in packs(tables):
        if mine := {t.index: leaves[t.index] for t in members if t.index in leaves}:
            out.update(storage.pack(mine, workers))
    for t in tables:
        if t.layout.storage is None and t.index in leaves:
            x = np.asarray(leaves[t.index])
            want = padded_shape(t, workers)[: x.ndim]
            if want != x.shape:
                out[t.index] = np.pad(x, [(0, w - n) for w, n in zip(want, x.shape, strict=True)])
    return out


def packs(tables: tuple[Table, ...]) -> list[tuple[Any, list[Table]]]:
    """Each ``Storage`` of ``tables`` (table-wise packs, hot rows), with the tables it
    stores together."""
    out: dict = {}
    for t in tables:
        if t.layout.storage is not None:
            out.setdefault(id(t.layout.storage), (t.layout.storage, []))[1].append(t)
    return list(out.values())


def _each_view(form: StateForm, tree: PyTree, convert: Callable[[Leaves], Leaves]) -> PyTree:
    """``tree`` with ``convert`` applied to each view of the parameters: the parameters
    themselves, then per place in the optimizer state, the leaves lying like them (the
    k-th leaf lying like each parameter: Adam's first moments, then its second)."""
    params = replace_leaves(
        tree["params"], convert(dict(enumerate(jax.tree.leaves(tree["params"]))))
    )
    opt, opt_def = jax.tree.flatten(tree["opt_state"])
    roles = jax.tree.leaves(form.roles)
    for view in _views(roles):
        new = convert({r: opt[k] for r, k in view.items()})
        for r, k in view.items():
            opt[k] = new[r]
    return {"params": params, "opt_state": opt_def.unflatten(opt), "agg_state": tree["agg_state"]}


def _views(roles: list[int]) -> list[dict[int, int]]:
    """Per occurrence, parameter index -> position in the flat optimizer state."""
    views: list[dict[int, int]] = []
    seen: dict[int, int] = {}
    for k, r in enumerate(roles):
        if r == NOT_A_PARAM:
            continue
        n = seen.get(r, 0)
        seen[r] = n + 1
        if n == len(views):
            views.append({})
        views[n][r] = k
    return views


def check_residuals(saved: StateForm, ours: StateForm, agg_state: PyTree) -> None:
    """``ValueError`` where per-worker residuals (error feedback) would change count."""
    theirs, mine = saved.workers * saved.replicas, ours.workers * ours.replicas
    if jax.tree.leaves(agg_state) and theirs != mine:
        raise ValueError(
            f"it holds per-worker residuals of error feedback for {theirs} workers; "
            f"this step has {mine}: resume it on {theirs} devices"
        )
