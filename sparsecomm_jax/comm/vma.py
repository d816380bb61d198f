"""Which workers a value varies over inside ``jax.shard_map``, and how to type it.

Under ``check_vma=True`` (``jax.shard_map``'s default, on in every library step) each
value carries the set of mesh axes it *varies* over. A ``P()`` output must be invariant
(really replicated), and ``jax.grad`` of a ``P()`` input is already summed over the
workers. These helpers read and set that type:

- ``varying_axes(x)``, ``vma_checked(axis)``: what the current value and trace are;
- ``vary(tree)``: each worker's own copy, so ``jax.grad`` gives each worker its own
  gradient (an aggregator then reduces it);
- ``varying_like(y, x)``: ``y`` (e.g. a host callback's result) typed like ``x``;
- ``same_varying(*xs)``: each typed varying over every axis any of them varies over
  (what a ``jax.custom_vjp`` needs of its inputs: its backward cannot add the implicit
  cast that a plain operation between a replicated and a varying value gets);
- ``all_gather_replicated(x)``: a tiled all-gather typed replicated;
- ``check_per_worker(grads)``: a clear error when gradients were already summed.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from sparsecomm_jax import runtime
    >>> from sparsecomm_jax.comm import vma
    >>> mesh = runtime.data_mesh()  # every device on the axis "data"
    >>> f = jax.shard_map(lambda x: vma.all_gather_replicated(x, "data"), mesh=mesh,
    ...                   in_specs=P("data"), out_specs=P())
    >>> f(jnp.arange(float(len(jax.devices())))).shape == (len(jax.devices()),)
    True
"""

from __future__ import annotations

from typing import Any

import jax

PyTree = Any


def varying_axes(x) -> frozenset:
    """The mesh axes over which ``x`` is typed as varying (``jax.typeof(x)``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10; earlier versions: ``aval.vma``
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


Axes = str | tuple[str, ...]  # one mesh axis, or several (a 2-D mesh's batch axes)


def _names(axis_name: Axes) -> frozenset:
    return frozenset((axis_name,) if isinstance(axis_name, str) else axis_name)


def vma_checked(axis_name: Axes) -> bool:
    """True inside a ``shard_map`` that types values as varying or replicated over
    ``axis_name`` (``check_vma=True``, the default); False under ``check_vma=False``
    and ``pmap``, where nothing is typed."""
    return _names(axis_name) <= varying_axes(jax.lax.axis_index(axis_name))


def vary(tree: PyTree, axis_name: Axes = "data") -> PyTree:
    """``tree`` typed as varying over ``axis_name`` (inside ``shard_map``; a tuple:
    over each of its axes).

    Under ``check_vma`` the gradient of a replicated (``P()``) input is summed over the
    workers by ``jax.grad`` itself. Differentiating with respect to ``vary(params)``
    instead gives each worker its own gradient, which an aggregator then reduces.
    Without ``check_vma`` (or under ``pmap``) returns ``tree``.

    Example:
        >>> # in a shard_map body:
        >>> # grads = jax.grad(loss)(vary(params), batch)
        >>> # mean, agg_state = agg.update(grads, agg_state)
    """
    if not vma_checked(axis_name):
        return tree

    def cast(x):
        missing = tuple(sorted(_names(axis_name) - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def varying_like(y, x):
    """``y`` typed varying over the axes ``x`` varies over (inside ``shard_map`` a host
    callback's results are otherwise typed replicated)."""
    axes = tuple(varying_axes(x))
    return jax.lax.pcast(y, axes, to="varying") if axes else y


def same_varying(*xs) -> tuple:
    """``xs``, each typed varying over every mesh axis that any of them varies over.

    Inside ``shard_map`` an operation between a replicated and a varying value casts the
    replicated one implicitly (and its gradient sums over the axis). A
    ``jax.custom_vjp`` function does not: its backward must return cotangents typed like
    its inputs, so it fails on such a pair unless they are typed alike first. Outside
    ``shard_map`` (or under ``check_vma=False``) returns ``xs`` unchanged.

    Example:
        >>> import jax.numpy as jnp
        >>> same_varying(jnp.ones(2), jnp.zeros(3))[1].shape
        (3,)
    """
    axes = frozenset().union(*(varying_axes(x) for x in xs))

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return tuple(cast(x) for x in xs)


def all_gather_replicated(x, axis_name: str):
    """Tiled all-gather typed replicated (the same HLO all-gather as
    ``lax.all_gather``): under ``check_vma`` a ``P()`` output of it is accepted."""
    return jax.lax.all_gather(x, axis_name, tiled=True, to="invarying")


def check_per_worker(grads: PyTree, axis_name: Axes) -> None:
    """``ValueError`` when, inside a ``check_vma`` ``shard_map``, a gradient is typed
    replicated over ``axis_name``: ``jax.grad`` has then already summed it over the
    workers (the gradient of a ``P()`` input), and averaging it again would be wrong."""
    if not vma_checked(axis_name):
        return  # check_vma=False or pmap: nothing is typed
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        if not _names(axis_name) <= varying_axes(g):
            raise ValueError(
                f"gradient {jax.tree_util.keystr(path)} is replicated over {axis_name!r}, so "
                "jax.grad already summed it over the workers; differentiate with respect to "
                f"aggregators.vary(params, {axis_name!r}) to get each worker's own gradient"
            )
