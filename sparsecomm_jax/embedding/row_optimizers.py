"""Row-sparse updates: any optax optimizer applied to the rows a step touched.

A step that looks up n rows of a V x D table has a gradient with at most n non-zero
rows. Here it travels as ``RowGrad(ids, rows)`` (distinct ids, their summed gradient
rows), and the optimizer reads and writes those rows only: the **row view** of the
parameters and the optimizer state (``rows_step``) takes the touched rows of every
table and of every state leaf that lies like a table (Adagrad's sums, Adam's moments,
a per-row count), hands optax that small tree, and writes the result back. A step then
costs O(n x D), not O(V x D).

Whether that equals the dense update depends on the optimizer:

=====================  ===============================================================
optimizer              on the row view
=====================  ===============================================================
``optax.sgd``          exact: an untouched row has zero gradient and does not move
``optax.adagrad``      exact: a zero gradient adds nothing to the sums
clipping by global     exact: the untouched rows add nothing to the norm
norm, schedules
``lazy_adam()``        lazy Adam: a row's moments advance only on steps that read it;
                       bias correction per row (``count="row"``) or per table
                       (``count="table"``, PyTorch ``SparseAdam``)
``optax.adam``,        lazy too: untouched rows keep their state (dense Adam decays
momentum               every row's moments and moves every row)
=====================  ===============================================================

Example:
    >>> import jax.numpy as jnp, optax
    >>> from sparsecomm_jax.embedding import row_optimizers as ro
    >>> opt, table = optax.adagrad(0.1), jnp.zeros((5, 2))
    >>> grad = ro.segment_rows(jnp.array([3, 1, 3]), jnp.ones((3, 2)), 5)
    >>> table, state = ro.apply_rows(opt, grad, opt.init(table), table)
    >>> [int(i) for i in jnp.nonzero(table[:, 0])[0]]
    [1, 3]

References:
    Duchi et al., "Adaptive Subgradient Methods", JMLR 2011 (Adagrad); Kingma and Ba,
    "Adam", ICLR 2015 (the lazy variant: PyTorch ``torch.optim.SparseAdam``, TF
    ``LazyAdam``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any
NOT_A_PARAM = -1  # the role of an optimizer-state leaf that lies like no parameter
DROP = jnp.iinfo(jnp.int32).max  # an id no table has: its row is neither read nor written


class RowGrad(NamedTuple):
    """A table's gradient as rows.

    Attributes:
      ids: int[m] distinct row indices; an index outside [0, V) is padding (ignored).
      rows: float[m, D] the summed gradient of each row.
    """

    ids: jax.Array
    rows: jax.Array


def is_row_grad(x) -> bool:
    return isinstance(x, RowGrad)


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
    """``x[ids]`` along the first axis; padding ids read zeros."""
    return jnp.take(x, ids, axis=0, mode="fill", fill_value=0)


def put_rows(x: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
    """``x`` with ``x[ids] = rows``; padding ids are dropped."""
    return x.at[ids].set(rows.astype(x.dtype), mode="drop")


# ----------------------------------------------------------------- the row view


def state_roles(optimizer: optax.GradientTransformation, opt_state: PyTree, params: PyTree):
    """The optimizer state with each leaf replaced by the leaf index of the parameter it
    lies like (``optax.tree_map_params``), or ``NOT_A_PARAM`` (a step count). The state
    of ``optax.partition`` keeps its masked places (``optax.MaskedNode``, no leaf)."""
    leaves, treedef = jax.tree.flatten(params)
    indices = treedef.unflatten(list(range(len(leaves))))
    not_a_param = lambda x: jax.tree.map(lambda _: NOT_A_PARAM, x)  # noqa: E731
    return map_params(optimizer, lambda _, i: i, opt_state, indices, not_a_param)


def map_params(
    optimizer: optax.GradientTransformation,
    f: Callable,
    opt_state: PyTree,
    tree: PyTree,
    transform_non_params: Callable,
    is_leaf: Callable | None = None,
) -> PyTree:
    """``optax.tree_map_params`` (``f(state leaf, leaf of tree)`` on the state leaves
    that lie like parameters) that keeps the masked places of ``optax.partition``'s
    state as they are (``optax.MaskedNode``, a subtree without leaves), wherever the
    partition's labels put them."""

    def masked(x):
        return isinstance(x, optax.MaskedNode)

    def stop(x):
        return masked(x) or bool(is_leaf and is_leaf(x))

    def keep_masked(leaf, other):
        return leaf if masked(leaf) else f(leaf, other)

    return optax.tree_map_params(
        optimizer,
        keep_masked,
        opt_state,
        tree,
        transform_non_params=transform_non_params,
        is_leaf=stop,
    )


class RowViewOf(NamedTuple):
    """The row view of a step: what the optimizer sees, and the touched rows per table."""

    params: PyTree  # the tables' touched rows, the other leaves whole
    grads: PyTree  # the rows' gradients, the other leaves' gradients
    opt_state: PyTree  # leaves lying like a table: its touched rows; the others whole
    rows: dict  # table leaf index -> its RowGrad


def row_view_of(params, opt_state, grads, roles, take: Callable | None = None) -> RowViewOf:
    """The row view: every table (and every state leaf lying like it) cut to the rows
    of its ``RowGrad`` in ``grads`` (``take(i, x, ids)`` reads them; default
    ``take_rows``)."""
    take = take or (lambda i, x, ids: take_rows(x, ids))
    p_leaves, p_def = jax.tree.flatten(params)
    g_leaves = p_def.flatten_up_to(grads)
    rows = {i: g for i, g in enumerate(g_leaves) if is_row_grad(g)}
    s_leaves, s_def = jax.tree.flatten(opt_state)
    r_leaves = jax.tree.leaves(roles)

    def cut(i, x):  # a scalar lying like a table (a per-table step count) stays whole
        return take(i, x, rows[i].ids) if i in rows and jnp.ndim(x) else x

    return RowViewOf(
        p_def.unflatten([cut(i, x) for i, x in enumerate(p_leaves)]),
        p_def.unflatten([g.rows if is_row_grad(g) else g for g in g_leaves]),
        s_def.unflatten([cut(r, s) for s, r in zip(s_leaves, r_leaves, strict=True)]),
        rows,
    )


def row_updates(optimizer, params, opt_state, grads, roles, take: Callable | None = None):
    """The optimizer's updates on the row view (shaped like ``params``, a table's leaf
    the update of its touched rows); the state it would move to is dropped."""
    view = row_view_of(params, opt_state, grads, roles, take)
    updates, _ = optimizer.update(view.grads, view.opt_state, view.params)
    return updates


def rows_step(
    optimizer: optax.GradientTransformation,
    params: PyTree,
    opt_state: PyTree,
    grads: PyTree,
    roles: PyTree,
    ok=True,
    take: Callable | None = None,
    put: Callable | None = None,
):
    """One optimizer step on the row view: only the touched rows of the tables change.

    Args:
      optimizer: any optax optimizer (see the module's table for what it means here).
      params: the parameters.
      opt_state: ``optimizer``'s state.
      grads: shaped like ``params``; a table's leaf is its ``RowGrad``, the others are
        dense gradients.
      roles: ``state_roles(optimizer, opt_state, params)``.
      ok: a boolean scalar; when false nothing changes (no row is written, the other
        leaves keep their values), so a skipped step stays O(rows).
      take: ``take(i, x, ids)`` reads rows of a leaf that lies like table ``i``
        (default ``take_rows``; a sharded step reads inside ``shard_map``).
      put: ``put(i, x, ids, rows)`` writes them (default ``put_rows``).

    Returns:
      ``(params, opt_state)`` after the step.
    """
    put = put or (lambda i, x, ids, rows: put_rows(x, ids, rows))
    view = row_view_of(params, opt_state, grads, roles, take)
    updates, new_s_view = optimizer.update(view.grads, view.opt_state, view.params)
    new_p_view = optax.apply_updates(view.params, updates)

    def write(i, old, new):
        if i in view.rows and jnp.ndim(old):  # a table, or state lying like one: its rows
            ids = view.rows[i].ids if ok is True else jnp.where(ok, view.rows[i].ids, DROP)
            return put(i, old, ids, new)
        return new if ok is True else jnp.where(ok, new, old)

    p_leaves, p_def = jax.tree.flatten(params)
    s_leaves, s_def = jax.tree.flatten(opt_state)
    new_p = [
        write(i, x, n)
        for i, (x, n) in enumerate(zip(p_leaves, jax.tree.leaves(new_p_view), strict=True))
    ]
    new_s = [
        write(r, s, n)
        for s, n, r in zip(
            s_leaves, jax.tree.leaves(new_s_view), jax.tree.leaves(roles), strict=True
        )
    ]
    return p_def.unflatten(new_p), s_def.unflatten(new_s)


def apply_rows(optimizer, grad: RowGrad, opt_state, table):
    """``rows_step`` on one table: ``(table, opt_state)`` with only ``grad.ids`` changed.

    ``opt_state`` is ``optimizer.init(table)``.
    """
    roles = state_roles(optimizer, opt_state, table)
    return rows_step(optimizer, table, opt_state, grad, roles)


# ----------------------------------------------------------------- lazy Adam


class LazyAdamState(NamedTuple):
    """Lazy Adam's state: moments shaped like the parameters and step counts, one per
    row of each parameter (``count="row"``: int[rows]) or one per parameter
    (``"table"``: int[])."""

    mu: PyTree
    nu: PyTree
    count: PyTree


def scale_by_lazy_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, count: str = "row"
) -> optax.GradientTransformation:
    """Lazy Adam's scaling, ``m_hat / (sqrt(v_hat) + eps)`` with the bias correction of
    ``count`` (see ``lazy_adam``), as ``optax.scale_by_adam`` is Adam's: the learning
    rate is a separate transform.

    Args:
      b1, b2, eps: as ``optax.scale_by_adam``.
      count: ``"row"`` or ``"table"``.

    Returns:
      An ``optax.GradientTransformation`` whose state is a ``LazyAdamState``.
    """
    if count not in ("row", "table"):
        raise ValueError(f'lazy_adam count must be "row" or "table", got {count!r}')

    def count_like(p):
        return jnp.zeros(p.shape[:1] if count == "row" else (), jnp.int32)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return LazyAdamState(zeros, zeros, jax.tree.map(count_like, params))

    def update(grads, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, grads, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * g * g + b2 * v, grads, state.nu)
        steps = jax.tree.map(lambda c: c + 1, state.count)

        def one(m, v, t):  # t: the count after this step, per row or per parameter
            t = t.astype(m.dtype).reshape(t.shape + (1,) * (m.ndim - t.ndim))
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
            return m_hat / (jnp.sqrt(v_hat) + eps)

        return jax.tree.map(one, mu, nu, steps), LazyAdamState(mu, nu, steps)

    return optax.GradientTransformation(init, update)


def lazy_adam(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    count: str = "row",
) -> optax.GradientTransformation:
    """Adam whose table rows change only on steps that read them (with the row-sparse
    table update; on a dense leaf every row is read every step, so it is Adam).

    A row's moments advance only when the row view holds it. The bias correction counts
    steps per row (``count="row"``: a row's updates are those ``optax.adam`` would make
    on the sequence of that row's gradients) or per parameter (``count="table"``: the
    step count of PyTorch ``SparseAdam`` and TF ``LazyAdam``, which advances on every
    step the table has a gradient). The learning rate, a schedule included, follows the
    optimizer's own step count (``optax.scale_by_learning_rate``), whichever ``count``:
    a row first read at step 1,000 takes the schedule's value at step 1,000.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, eps: as ``optax.adam``.
      count: ``"row"`` or ``"table"``, for the bias correction.

    Returns:
      ``optax.chain(scale_by_lazy_adam(b1, b2, eps, count),
      optax.scale_by_learning_rate(learning_rate))``; its state's first entry is the
      ``LazyAdamState``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from sparsecomm_jax.embedding import row_optimizers as ro
        >>> opt = ro.lazy_adam(optax.linear_schedule(0.1, 0.0, 10))
        >>> table = jnp.zeros((4, 2))
        >>> state = opt.init(table)
        >>> for _ in range(3):  # row 0 read three times
        ...     g = ro.RowGrad(jnp.array([0]), jnp.ones((1, 2)))
        ...     table, state = ro.apply_rows(opt, g, state, table)
        >>> g = ro.RowGrad(jnp.array([1]), jnp.ones((1, 2)))  # row 1 first read at step 3
        >>> table, state = ro.apply_rows(opt, g, state, table)
        >>> round(float(table[1, 0]), 4)  # -schedule(3): Adam's first step is the rate
        -0.07
    """
    return optax.chain(
        scale_by_lazy_adam(b1, b2, eps, count), optax.scale_by_learning_rate(learning_rate)
    )


def is_lazy(optimizer: optax.GradientTransformation, params: PyTree) -> bool:
    """Whether ``optimizer`` holds a ``lazy_adam`` (in a chain or a partition): an
    update defined on the rows a step reads, so it asks for the row-sparse update."""
    state = jax.eval_shape(optimizer.init, _probe_tree(params, jax.random.key(0), 1.0))
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, LazyAdamState))
    return any(isinstance(x, LazyAdamState) for x in nodes)


# ------------------------------------------------ what an optimizer does to rows


def _probe_tree(params: PyTree, key: jax.Array, scale: float) -> PyTree:
    """A tree shaped like ``params`` (same structure, rank and dtype) with small leaves
    of 4 rows, random values times ``scale``."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    out = []
    for k, x in zip(keys, leaves, strict=False):
        shape = (4, *([2] * (jnp.ndim(x) - 1))) if jnp.ndim(x) else ()
        out.append(scale * jax.random.normal(k, shape, jnp.result_type(x)))
    return treedef.unflatten(out)


def _warm(optimizer, params, key):
    """The state after a step on random gradients (moments, sums, counts set)."""
    state = optimizer.init(params)
    updates, state = optimizer.update(_probe_tree(params, key, 1.0), state, params)
    return optax.apply_updates(params, updates), state


# Gradient scales (and seeds) of the probes: ordinary, and far past any clip threshold.
PROBE_SCALES = ((1.0, 1), (1e15, 2))


def _zero_rows_1_3(x):
    touched = jnp.array([1.0, 0.0, 1.0, 0.0], x.dtype)
    return x * touched.reshape(4, *([1] * (x.ndim - 1))) if jnp.ndim(x) else x


def _rows_of(tree: PyTree, rows: list[int]) -> PyTree:
    return jax.tree.map(lambda x: x[jnp.array(rows)] if jnp.ndim(x) else x, tree)


def _close(a: PyTree, b: PyTree) -> bool:
    return all(
        bool(jnp.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _picked_rows(x):
    """A leaf's ``RowGrad`` of rows [0, 2] (a scalar stays whole)."""
    return RowGrad(jnp.array([0, 2]), x[jnp.array([0, 2])]) if jnp.ndim(x) else x


def treats_rows_alone(optimizer: optax.GradientTransformation, params: PyTree) -> bool:
    """Whether ``optimizer`` updates each row of a parameter from that row's gradient,
    parameter and state alone (and from state of no parameter, a step count): SGD,
    momentum, Adam, Adagrad, lazy Adam do; clipping by global norm, a trust ratio or a
    per-parameter normalisation do not. Probed on small random trees shaped like
    ``params`` (gradients of scales 1 and 1e15, so a clip threshold is crossed): the
    update of rows [0, 2] of every leaf, alone, against the same rows of the whole one.

    The pipelined step's early update and the overlapped step's two halves rely on it.
    """
    for scale, key in PROBE_SCALES:
        start = _probe_tree(params, jax.random.key(key), 1.0)
        p, state = _warm(optimizer, start, jax.random.key(0))
        g = _probe_tree(params, jax.random.key(key + 10), scale)
        whole, _ = optimizer.update(g, state, p)
        rows = jax.tree.map(_picked_rows, g)
        alone = row_updates(optimizer, p, state, rows, state_roles(optimizer, state, p))
        if not _close(_rows_of(whole, [0, 2]), alone):
            return False
    return True


def untouched_rows_stay(
    optimizer: optax.GradientTransformation, params: PyTree, tables: PyTree | None = None
) -> bool:
    """Whether under ``optimizer`` a table row with a zero gradient keeps its value and
    state, and the other rows move as if it were absent: then the row-sparse update
    (the row view of the rows a step touched) equals the dense one. SGD, Adagrad,
    clipping by global norm and schedules do; Adam, momentum and weight decay move every
    row. Probed like ``treats_rows_alone``: rows [1, 3] of every table with a zero
    gradient, the other leaves updated whole as the row update does.

    Args:
      optimizer: any optax optimizer (a chain, ``optax.partition`` of one per label).
      params: a tree shaped like the parameters (only shapes and dtypes are read).
      tables: a tree of bools like ``params``: the leaves that are tables (default:
        every leaf of rank >= 1).

    Example:
        >>> import jax.numpy as jnp, optax
        >>> params = {"embed": jnp.zeros((8, 2)), "w": jnp.zeros(2)}
        >>> untouched_rows_stay(optax.sgd(0.1), params)
        True
        >>> untouched_rows_stay(optax.adam(0.1), params)
        False
        >>> labels = {"embed": "table", "w": "dense"}  # the table by SGD, the rest by Adam
        >>> per_label = optax.partition({"table": optax.sgd(0.1), "dense": optax.adam(0.1)}, labels)
        >>> untouched_rows_stay(per_label, params, {"embed": True, "w": False})
        True
    """
    is_table = jax.tree.map(lambda x: True, params) if tables is None else tables
    for scale, key in PROBE_SCALES:
        start = _probe_tree(params, jax.random.key(key), 1.0)
        p, state = _warm(optimizer, start, jax.random.key(0))
        g = _probe_tree(params, jax.random.key(key + 10), scale)
        g = jax.tree.map(lambda x, t: _zero_rows_1_3(x) if t else x, g, is_table)
        updates, dense_state = optimizer.update(g, state, p)
        dense = optax.apply_updates(p, updates)
        rows = jax.tree.map(lambda x, t: _picked_rows(x) if t else x, g, is_table)
        roles = state_roles(optimizer, state, p)
        sparse, sparse_state = rows_step(optimizer, p, state, rows, roles)
        if not (_close(dense, sparse) and _close(dense_state, sparse_state)):
            return False
    return True
