"""Which parameters are embedding tables, and how each is placed.

The parameter tree does not say which leaves are tables: the caller names them, by
paths (``("params", "embed", "embedding")`` for flax) or a predicate, and
``find_tables`` returns one ``Table`` per such leaf, in leaf order, with its layout
(``embedding.layout``). ``split_tables`` / ``merge_tables`` separate a tree into the
tables and the rest (the dense layers).

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.embedding import tables
    >>> params = {"embed": jnp.zeros((10, 4)), "w": jnp.zeros((4, 2))}
    >>> tables.table_mask(params, [("embed",)])
    {'embed': True, 'w': False}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

PyTree = Any
TablePaths = str | Sequence[str | Sequence[str]] | Callable[..., bool]


class Table(NamedTuple):
    """One embedding table of the parameter tree.

    Attributes:
      index: its position among the parameter leaves (``jax.tree.leaves`` order).
      name: its path joined by ``/``, e.g. ``"params/embed/embedding"``.
      vocab: V, its rows.
      dim: D, its columns.
      layout: how it is placed over the workers (an ``embedding.layout.Layout``).
    """

    index: int
    name: str
    vocab: int
    dim: int
    layout: Any


def path_keys(path) -> tuple:
    """A ``tree_util`` key path as plain keys: ``(DictKey('a'), SequenceKey(0))`` ->
    ``('a', 0)``."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def table_name(path: str | Sequence) -> str:
    """A table's name: its path's keys joined by ``/`` (a string is a name already).

    Example: ``("params", "embed", "embedding")`` -> ``"params/embed/embedding"``.
    """
    return path if isinstance(path, str) else "/".join(str(k) for k in path)


def table_mask(params: PyTree, tables: TablePaths) -> PyTree:
    """Bool per leaf of ``params``: is it an embedding table?

    Args:
      params: the parameter pytree.
      tables: parameter paths (tuples of dict keys, e.g. ``("embed",)`` or, for flax,
        ``("params", "embed", "embedding")``; a string is a path of dict keys written
        as a table's name, joined by ``/``: ``"embed"`` and ``["embed"]`` are
        ``[("embed",)]``, ``"params/embed/embedding"`` the flax path above) or a
        predicate ``tables(path, leaf) -> bool``.

    Returns:
      A pytree of bools shaped like ``params``.

    Raises:
      ValueError: a path that is not in ``params`` (the message lists the 2-D leaves
        that could be tables).
    """
    if isinstance(tables, str):  # one table by name
        tables = [tables]
    # a path as keys or as a table's name, matched by name (the rule of find_tables)
    names = None if callable(tables) else {table_name(p): p for p in tables}

    def is_table(path, leaf):
        keys = path_keys(path)
        return tables(keys, leaf) if names is None else table_name(keys) in names

    mask = jax.tree_util.tree_map_with_path(is_table, params)
    found = {table_name(keys) for keys in _paths_where(mask)}
    if names is not None and (missing := [_path(p) for n, p in names.items() if n not in found]):
        candidates = list(_paths_where(params, lambda x: np.ndim(x) == 2))
        raise ValueError(
            f"embedding paths {sorted(missing)} are not in the parameters; "
            f"2-D parameters that could be tables: {candidates}"
        )
    return mask


def _paths_where(tree: PyTree, keep: Callable[[Any], bool] = bool) -> dict[tuple, Any]:
    """``{path keys: leaf}`` of the leaves of ``tree`` for which ``keep(leaf)``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {path_keys(path): leaf for path, leaf in leaves if keep(leaf)}


def _path(path: str | Sequence) -> tuple:
    """A path as keys, for messages (a name split at ``/``)."""
    return tuple(path.split("/")) if isinstance(path, str) else tuple(path)


def find_tables(params: PyTree, mask: PyTree, layout: Any) -> tuple[Table, ...]:
    """One ``Table`` per leaf flagged in ``mask``, in leaf order, each with ``layout``.

    Raises:
      ValueError: a flagged leaf that is not 2-D (V x D).
    """
    leaves = jax.tree_util.tree_leaves_with_path(params)
    flags = jax.tree.leaves(mask)
    found = []
    for i, ((path, leaf), flag) in enumerate(zip(leaves, flags, strict=True)):
        if not flag:
            continue
        name = table_name(path_keys(path))
        shape = tuple(np.shape(leaf))
        if len(shape) != 2:
            raise ValueError(f"embedding table {name} must be 2-D (V x D), got shape {shape}")
        found.append(Table(i, name, shape[0], shape[1], layout))
    return tuple(found)


def split_tables(tree: PyTree, mask: PyTree) -> tuple[PyTree, PyTree]:
    """``(tables, rest)``: two copies of ``tree`` with ``None`` where the other lives."""
    tables = jax.tree.map(lambda x, m: x if m else None, tree, mask)
    rest = jax.tree.map(lambda x, m: None if m else x, tree, mask)
    return tables, rest


def merge_tables(tables: PyTree, rest: PyTree, mask: PyTree) -> PyTree:
    """Inverse of ``split_tables``."""
    return jax.tree.map(
        lambda m, t, r: t if m else r, mask, tables, rest, is_leaf=lambda x: x is None
    )


def replace_leaves(tree: PyTree, new: dict[int, Any]) -> PyTree:
    """``tree`` with leaf ``i`` replaced by ``new[i]`` (leaf order)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([new.get(i, x) for i, x in enumerate(leaves)])


def bind_tables(tables: tuple[Table, ...], num_workers: int) -> tuple[Table, ...]:
    """``tables`` with each layout that places its tables by looking at all of them
    bound to that placement on P workers (``Layout.bind``: table-wise owners)."""
    for bind in {t.layout.bind for t in tables if t.layout.bind is not None}:
        tables = bind(tables, num_workers)
    return tuple(tables)
