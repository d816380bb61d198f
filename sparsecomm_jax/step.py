"""What every train step shares: its state, its context, and the pieces of a step body.

A *model* is a pure loss ``loss_fn(params, batch, emb) -> scalar``: the mean loss over
the examples of ``batch``, where ``emb`` (an ``EmbeddingOps``) does every embedding-table
access, so a strategy can swap a replicated table for a sharded one without model code.
A *batch* is a flat dict of arrays whose leading axis is the global batch, except the
keys in ``replicated_keys`` that every worker sees whole.

A step body runs once per worker (inside ``shard_map`` or ``pmap``): it computes local
gradients, reduces them (``aggregate``), and applies the optimizer (``finish_step``).
This module holds those pieces; ``bodies`` and ``pipeline`` compose them, ``placement``
puts state and batches on the devices, and ``train`` names the strategies.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax import step
    >>> params = {"embed": jnp.zeros((10, 4)), "w": jnp.zeros((4, 2))}
    >>> step.table_mask(params, [("embed",)])
    {'embed': True, 'w': False}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from sparsecomm_jax import rowwise, runtime
from sparsecomm_jax.aggregators import Aggregator
from sparsecomm_jax.embedding import EmbeddingOps

PyTree = Any
Batch = dict[str, Any]
LossFn = Callable[[PyTree, Batch, EmbeddingOps], jax.Array]
TablePaths = Sequence[Sequence[str]] | Callable[..., bool]


class TrainState(NamedTuple):
    """Everything a step reads and writes (a plain pytree: jit, shard, checkpoint).

    Attributes:
      params: model parameters (sharded tables hold only this worker's shard).
      opt_state: the optax optimizer state.
      agg_state: the gradient aggregator's state (error-feedback residuals), or ``()``.
      carry: what a pipelined step hands to the next (``embrace_2d``: the embedding rows
        of the next batch), ``()`` otherwise and before the first step.
    """

    params: PyTree
    opt_state: PyTree
    agg_state: PyTree
    carry: PyTree = ()


class TrainStep(NamedTuple):
    """A built strategy.

    Attributes:
      step: ``step(state, placed_batch) -> (state, loss)``, a ``jax.jit`` function or a
        ``jax.pmap`` one (``step.lower(...)`` gives its program); ``loss`` is the mean
        loss over the global batch, a scalar (``placement.loss_value`` reads it).
      state: the initial ``TrainState``, placed on the devices.
      place_batch: host batch (global, identical on every process) -> device batch;
        validates it first.
      host_params: ``state -> params`` as ordinary numpy arrays (sharded tables
        gathered back to V x D).
      strategy: the strategy's name, e.g. ``"embrace+topk_a2a"``.
      lookahead: k > 0 when ``place_batch(batch, next_batch, *later)`` wants the next
        k steps' batches too (``embrace_2d``: as many as remain), else 0.
      per_device_state: True when every state leaf has a leading local-device axis
        (``jax.pmap``), False for global arrays (``jax.jit``).
    """

    step: Callable[[TrainState, Any], tuple[TrainState, jax.Array]]
    state: TrainState
    place_batch: Callable[..., Any]
    host_params: Callable[[TrainState], PyTree]
    strategy: str
    lookahead: int = 0
    per_device_state: bool = False


class StepContext(NamedTuple):
    """What a step body is built from (validated by ``train.make_train_step``)."""

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    mesh: Mesh
    params: PyTree  # initial parameters, unsharded (shapes of the full tables)
    axis_name: str
    replicated_keys: tuple[str, ...]
    table_mask: PyTree  # bool per parameter leaf: is it an embedding table?
    vocabs: tuple[int, ...]  # distinct table vocabularies V (empty without tables)
    id_keys: tuple[str, ...] | None  # batch keys holding token ids (None: integer keys)
    capacity: int | None  # fixed slots per bucket (None: sized per batch)
    aggregator: Aggregator  # reduces the data-parallel gradients (dense: pmean)
    nonfinite: str  # "skip" (keep the state, NaN loss), "error" (the same; callers stop), "off"
    table_optimizer: rowwise.RowTransform | None = None  # row-sparse table update, or dense
    comm_dtype: str = "float32"  # wire dtype of row exchanges and the dense all-reduce

    @property
    def num_workers(self) -> int:
        return runtime.mesh_axis_size(self.mesh, self.axis_name)


# ------------------------------------------------------------------------ tables


def _path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def table_mask(params: PyTree, tables: TablePaths) -> PyTree:
    """Bool per leaf of ``params``: is it an embedding table?

    Args:
      params: the parameter pytree.
      tables: parameter paths (tuples of dict keys, e.g. ``("embed",)`` or, for flax,
        ``("params", "embed", "embedding")``) or a predicate ``tables(path, leaf) -> bool``.

    Returns:
      A pytree of bools shaped like ``params``.

    Raises:
      ValueError: a path that is not in ``params`` (the message lists the 2-D leaves
        that could be tables).
    """
    paths = None if callable(tables) else {tuple(p) for p in tables}

    def is_table(path, leaf):
        keys = _path_keys(path)
        return tables(keys, leaf) if paths is None else keys in paths

    mask = jax.tree_util.tree_map_with_path(is_table, params)
    if paths is not None and (missing := paths - set(_paths_where(mask))):
        candidates = list(_paths_where(params, lambda x: np.ndim(x) == 2))
        raise ValueError(
            f"embedding paths {sorted(missing)} are not in the parameters; "
            f"2-D parameters that could be tables: {candidates}"
        )
    return mask


def _paths_where(tree: PyTree, keep: Callable[[Any], bool] = bool) -> dict[tuple, Any]:
    """``{path keys: leaf}`` of the leaves of ``tree`` for which ``keep(leaf)``."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {_path_keys(path): leaf for path, leaf in leaves if keep(leaf)}


def named_tables(params: PyTree, mask: PyTree) -> list[tuple[int, str, Any]]:
    """``(leaf index, name, leaf)`` of every table; ``name`` like ``"dec/embed"``."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    flags = jax.tree.leaves(mask)
    return [
        (i, "/".join(str(k) for k in _path_keys(path)), leaf)
        for i, ((path, leaf), m) in enumerate(zip(leaves, flags, strict=True))
        if m
    ]


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


# -------------------------------------------------------------- pieces of a body


def apply_optimizer(optimizer: optax.GradientTransformation, grads, opt_state, params):
    """``(new params, new opt_state)`` after one optax update."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def finite(tree: PyTree) -> jax.Array:
    """True when no leaf of ``tree`` holds a NaN or Inf (what this worker sees)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def all_finite(ctx: StepContext, tree: PyTree) -> jax.Array:
    """True on every worker when no worker has a NaN or Inf in ``tree``."""
    return jax.lax.pmin(finite(tree).astype(jnp.int32), ctx.axis_name) == 1


def finish_step(
    ctx: StepContext, state: TrainState, grads, loss, agg_state=None, carry=(), rows=None
):
    """Optimizer step and the mean loss over workers.

    With ``rows`` (a ``rowwise.RowGrad`` per table, in leaf order), the tables take
    ``ctx.table_optimizer`` on those rows only and ``grads`` is read for the other
    leaves. With ``nonfinite`` on, a step whose mean gradient (or rows) or new
    residuals hold NaN/Inf on any worker leaves parameters, optimizer state and
    residuals as they were and reports a NaN loss.
    """
    agg_state = state.agg_state if agg_state is None else agg_state
    loss = jax.lax.pmean(loss, ctx.axis_name)
    check = ctx.nonfinite != "off"
    ok = all_finite(ctx, (grads, agg_state, [g.rows for g in rows or ()])) if check else True
    if rows is not None:  # skipping touches the rows only, never whole tables
        params, opt_state = rowwise.apply_tables(
            ctx.optimizer,
            ctx.table_optimizer,
            grads,
            rows,
            state.opt_state,
            state.params,
            ctx.table_mask,
            ok,
        )
        agg_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), agg_state, state.agg_state)
        return TrainState(params, opt_state, agg_state, carry), jnp.where(ok, loss, jnp.nan)
    params, opt_state = apply_optimizer(ctx.optimizer, grads, state.opt_state, state.params)
    new = TrainState(params, opt_state, agg_state, carry)
    if not check:
        return new, loss
    keep = TrainState(state.params, state.opt_state, state.agg_state, carry)
    new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, keep)
    return new, jnp.where(ok, loss, jnp.nan)


def aggregate(ctx: StepContext, grads, agg_state):
    """``ctx.aggregator`` on local gradients; its state is stored per worker with a
    leading axis of 1 inside ``shard_map`` (global: one slice per worker)."""
    local = jax.tree.map(lambda x: x[0], agg_state)
    mean, local = ctx.aggregator.update(grads, local)
    return mean, jax.tree.map(lambda x: x[None], local)
