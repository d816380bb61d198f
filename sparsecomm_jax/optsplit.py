"""The optimizer state split by parameter kind: a table's leaves, the dense layers'
leaves, and the rest (e.g. Adam's step count), so two programs can each update their
half with any element-wise optax optimizer and the halves merge exactly.

Example:
    >>> import optax
    >>> from sparsecomm_jax import optsplit
    >>> # optsplit.opt_kinds(ctx, optax.adam(1e-3).init(params)) -> [OTHER, TABLE, DENSE, ...]

References:
    Li et al., "EmbRace", ICPP 2022, section 4 (the table update after the late chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from sparsecomm_jax.step import (
    StepContext,
    TrainState,
    apply_optimizer,
    finite,
    merge_tables,
    split_tables,
)

TABLE, DENSE, OTHER = 0, 1, 2  # kinds of optimizer-state leaves


def opt_kinds(ctx: StepContext, opt_state) -> list[int]:
    """``TABLE``, ``DENSE`` or ``OTHER`` (e.g. Adam's count) per optimizer-state leaf."""
    kinds = optax.tree_map_params(
        ctx.optimizer,
        lambda _, m: TABLE if m else DENSE,
        opt_state,
        ctx.table_mask,
        transform_non_params=lambda _: OTHER,
    )
    return jax.tree.leaves(kinds)


def pick(kinds: list[int], wanted: Sequence[int], new, old):
    """The optimizer state with ``new``'s leaves of the ``wanted`` kinds, else ``old``'s."""
    leaves_new, treedef = jax.tree.flatten(new)
    leaves_old = jax.tree.leaves(old)
    out = [n if k in wanted else o for k, n, o in zip(kinds, leaves_new, leaves_old, strict=True)]
    return jax.tree.unflatten(treedef, out)


def dense_update(ctx: StepContext, state: TrainState, mean, ok) -> TrainState:
    """The optimizer step of the dense leaves only (tables and their optimizer state
    untouched, no pass over them); kept as it was unless ``ok``."""
    mask = ctx.table_mask
    tables, dense = split_tables(state.params, mask)
    opt = optax.tree_map_params(
        ctx.optimizer,
        lambda x, m: None if m else x,
        state.opt_state,
        mask,
        transform_non_params=lambda x: x,
    )
    new_dense, new_opt = apply_optimizer(ctx.optimizer, mean, opt, dense)
    params = merge_tables(tables, where(ok, new_dense, dense), mask)
    new_opt = jax.tree.map(
        lambda o, n: o if n is None else jnp.where(ok, n, o),
        state.opt_state,
        new_opt,
        is_leaf=lambda x: x is None,
    )
    return TrainState(params, new_opt, state.agg_state)


def nonfinite(*trees):
    """True when this worker has a NaN or Inf in any of ``trees``."""
    return ~finite(trees)


def where(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def with_other(kinds: list[int], opt_state, other: list):
    """``opt_state`` with its ``OTHER`` leaves replaced by ``other`` (in order)."""
    leaves, treedef = jax.tree.flatten(opt_state)
    rest = iter(other)
    return jax.tree.unflatten(
        treedef, [next(rest) if k == OTHER else x for k, x in zip(kinds, leaves, strict=True)]
    )
