"""The state on the devices: each parameter's partition spec (a table by its layout),
the optimizer's and the aggregator's, tables padded to the workers or stored together as
their layouts say, and the initial ``TrainState`` placed.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from jax.sharding import PartitionSpec as P
    >>> opt_specs(optax.sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9).init(
    ...     {"w": jnp.zeros(3)}), {"w": P("data")})[0].trace
    {'w': P('data',)}
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.embedding.layout import check_divisible, cut_spec
from sparsecomm_jax.embedding.row_optimizers import map_params
from sparsecomm_jax.embedding.tables import replace_leaves
from sparsecomm_jax.step.state import PyTree, StepContext, TrainState
from sparsecomm_jax.step.stored_form import cut_leaves, packs, store_leaves


def param_specs(ctx: StepContext) -> PyTree:
    """``PartitionSpec`` per parameter: each table by its layout, the rest replicated."""
    leaves, treedef = jax.tree.flatten(ctx.params)
    specs = [P()] * len(leaves)
    for t in ctx.tables:
        specs[t.index] = t.layout.spec(ctx.axis_name)
    return treedef.unflatten(specs)


def opt_specs(optimizer: optax.GradientTransformation, opt_state, specs: PyTree) -> PyTree:
    """The optimizer state's specs: a leaf that lies like a parameter takes its spec
    (cut to the leaf's rank: a per-row count of a row-wise table lies like its rows),
    the rest is replicated (``optax.partition``'s masked places stay)."""
    return map_params(
        optimizer,
        lambda leaf, spec: cut_spec(spec, np.ndim(leaf)),
        opt_state,
        specs,
        transform_non_params=lambda x: jax.tree.map(lambda _: P(), x),
        is_leaf=lambda x: isinstance(x, P),
    )


def initial_agg_state(ctx: StepContext, host_params):
    """Zeros of the aggregator's state, one slice per worker: global ``[P, *shape]`` (the
    aggregator reduces the dense layers only when there are tables)."""
    if ctx.tables:
        host_params = jax.tree.map(lambda x, m: None if m else x, host_params, ctx.table_mask)
    shapes = jax.eval_shape(ctx.aggregator.init, host_params)
    return jax.tree.map(lambda s: np.zeros((ctx.num_workers, *s.shape), s.dtype), shapes)


def pad_tables(ctx: StepContext, params: PyTree) -> PyTree:
    """``params`` with each table padded with zero rows or columns to the shape it is
    stored in (``layout.padded_shape``: its split dimension a multiple of the G workers
    it is sharded over), or packed with others by its layout's ``storage``."""
    leaves = dict(enumerate(jax.tree.leaves(params)))
    return replace_leaves(params, store_leaves(ctx.tables, ctx.group_size, leaves))


def cut_tables(ctx: StepContext, params: PyTree) -> PyTree:
    """``params`` with each stored table cut back to its V x D (``pad_tables`` undone)."""
    return replace_leaves(params, cut_leaves(ctx.tables, dict(enumerate(jax.tree.leaves(params)))))


def host_params_of(ctx: StepContext) -> Callable[[TrainState], PyTree]:
    """``TrainStep.host_params`` of a step built from ``ctx``."""

    def host_params(state: TrainState) -> PyTree:
        """The parameters of ``state`` as numpy arrays on this host, shaped as the
        model made them: each sharded table gathered whole and cut back to V x D (a
        padded table's padding, a table-wise pack's neighbours left out).

        Args:
          state: a ``TrainState`` of this step (``ts.state`` or one ``ts.step``
            returned).

        Returns:
          The parameter pytree, like the ``params`` given to ``make_train_step``.
        """
        return cut_tables(ctx, jax.tree.map(runtime.to_host, state.params))

    return host_params


def stored_together(ctx: StepContext) -> tuple:
    """``TrainStep.stored_together``: per layout with a ``storage``, its name, its
    tables as ``(name, V, D)`` and P (what places them: table-wise owners follow the
    sizes)."""
    return tuple(
        (tables[0].layout.name, tuple((t.name, t.vocab, t.dim) for t in tables), ctx.group_size)
        for _, tables in packs(ctx.tables)
    )


def place_state(ctx: StepContext, unpadded: bool = False) -> tuple[TrainState, TrainState]:
    """The initial state on the devices, and its ``PartitionSpec`` tree (the carry of
    a pipelined step is per worker). A table whose split dimension does not divide by
    the G workers is stored padded (``pad_tables``).

    Args:
      ctx: the step's context.
      unpadded: refuse such a size instead for a table whose layout's carrier reads
        its stored rows whole (``Pipelined.unpadded``: the pipelined steps' column
        tables).
    """
    specs = param_specs(ctx)
    host = jax.tree.map(np.asarray, ctx.params)
    for t in ctx.tables:
        if unpadded and t.layout.pipelined is not None and t.layout.pipelined.unpadded:
            check_divisible(t, ctx.group_size)
    host = pad_tables(ctx, host)
    opt_state = jax.tree.map(np.asarray, ctx.optimizer.init(host))
    agg_state = initial_agg_state(ctx, host)
    state = TrainState(host, opt_state, agg_state)
    agg_specs = jax.tree.map(lambda _: P(ctx.batch_axes), agg_state)
    state_specs = TrainState(specs, opt_specs(ctx.optimizer, opt_state, specs), agg_specs)
    placed = jax.tree.map(
        lambda x, s: runtime.put_global(x, ctx.mesh, s),
        state,
        state_specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    return placed, state_specs._replace(carry=P(ctx.axis_name))


def stack_per_device(tree: PyTree, num_local: int) -> PyTree:
    """Every leaf repeated along a new leading axis of ``num_local`` (``pmap`` state)."""
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (num_local, *np.shape(x))), tree)
