"""Where state and batches live: partition specs, host-side batch checks and placement,
and the capacity policies that size a strategy's static buffers from each batch.

Planning happens here, on the host, before a step runs: which keys are sharded, how many
slots a bucket needs, and that every token id lies in the vocabulary. The step bodies
(``bodies``, ``pipeline``) only move data.

Example:
    >>> import numpy as np
    >>> from sparsecomm_jax import placement
    >>> placement.check_ids({"tokens": np.array([[1, 2]])}, vocab=10, id_keys=None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import embedding, rowwise, runtime
from sparsecomm_jax.step import Batch, PyTree, StepContext, TrainState, named_tables

# ------------------------------------------------------------------ batch checks


def check_batch(batch: Batch, num_workers: int, replicated_keys: Sequence[str]) -> None:
    """Raises ``ValueError`` unless every sharded leaf's leading axis divides by P."""
    if not isinstance(batch, dict):
        raise ValueError(f"batch must be a dict of arrays, got {type(batch).__name__}")
    for key, x in batch.items():
        if key in replicated_keys:
            continue
        n = np.shape(x)[0] if np.ndim(x) else None
        if n is None or n % num_workers:
            raise ValueError(
                f"batch[{key!r}] has leading size {n}, which must be divisible by the "
                f"number of devices ({num_workers})"
            )


def id_leaves(batch: Batch, id_keys: Sequence[str] | None) -> dict[str, np.ndarray]:
    """The batch entries that hold token ids (all integer entries when not named)."""
    keys = [k for k in id_keys if k in batch] if id_keys is not None else batch
    return {
        k: np.asarray(batch[k])
        for k in keys
        if np.issubdtype(np.asarray(batch[k]).dtype, np.integer)
    }


def check_ids(batch: Batch, vocab: int, id_keys: Sequence[str] | None) -> None:
    """``ValueError`` for any token id outside [0, vocab): never a silent clamp."""
    for key, ids in id_leaves(batch, id_keys).items():
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            hint = (
                "; integer entries that are not token ids (labels, an ignore index such "
                "as -100) must be left out by naming the id keys: id_keys=[...]"
                if id_keys is None
                else ""
            )
            raise ValueError(
                f"batch[{key!r}] has token ids in [{ids.min()}, {ids.max()}], outside the "
                f"vocabulary [0, {vocab}){hint}"
            )


def worker_ids(ctx: StepContext, batch: Batch) -> list[np.ndarray]:
    """The ids each worker's slice of ``batch`` holds (replicated ids go to all)."""
    per_worker: list[list[np.ndarray]] = [[] for _ in range(ctx.num_workers)]
    for key, ids in id_leaves(batch, ctx.id_keys).items():
        parts = (
            [ids] * ctx.num_workers
            if key in ctx.replicated_keys
            else np.split(ids, ctx.num_workers)
        )
        for acc, part in zip(per_worker, parts, strict=True):
            acc.append(part.ravel())
    return [np.concatenate(p) if p else np.zeros(0, np.int32) for p in per_worker]


def check_host_batch(ctx: StepContext, batch: Batch) -> None:
    """Every check a batch passes before it is placed."""
    check_batch(batch, ctx.num_workers, ctx.replicated_keys)
    if ctx.vocabs:
        check_ids(batch, min(ctx.vocabs), ctx.id_keys)


# ------------------------------------------------------------------- the batch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlacedBatch:
    """A batch on the devices, as every ``shard_map`` step body receives it.

    Attributes:
      data: the batch (sharded keys split over the workers, replicated keys whole).
      capacity: slots of the strategy's static buffers (0: none); static, so one
        program is compiled per value.
      next: the next step's batch for pipelined strategies (``None`` otherwise and at
        the last step).
      later: the batches of steps t+2, t+3, ... a pipelined strategy's lookahead asks
        for (as many as remain), soonest first.
    """

    data: dict = dataclasses.field(metadata=dict(static=False))
    capacity: int = dataclasses.field(default=0, metadata=dict(static=True))
    next: dict | None = dataclasses.field(default=None, metadata=dict(static=False))
    later: tuple = dataclasses.field(default=(), metadata=dict(static=False))


def batch_specs(batch: Batch, axis_name: str, replicated_keys: Sequence[str]) -> dict:
    """``PartitionSpec`` per batch key: split along ``axis_name`` unless replicated."""
    return {k: P() if k in replicated_keys else P(axis_name) for k in batch}


def placed_specs(batch: PlacedBatch, axis_name: str, replicated_keys: Sequence[str]):
    """The ``PartitionSpec`` tree of a ``PlacedBatch``."""
    nxt = None if batch.next is None else batch_specs(batch.next, axis_name, replicated_keys)
    data = batch_specs(batch.data, axis_name, replicated_keys)
    later = tuple(batch_specs(b, axis_name, replicated_keys) for b in batch.later)
    return PlacedBatch(data, batch.capacity, nxt, later)


def put_batch(ctx: StepContext, batch: Batch) -> dict:
    """Checks a host batch and places it on ``ctx.mesh``."""
    check_host_batch(ctx, batch)
    specs = batch_specs(batch, ctx.axis_name, ctx.replicated_keys)
    return {k: runtime.put_global(np.asarray(v), ctx.mesh, specs[k]) for k, v in batch.items()}


class CapacityPolicy(NamedTuple):
    """How many slots a strategy's static buffers need for a batch.

    Attributes:
      need: ``need(ctx, batch[, next_batch]) -> int``, the slots this batch fills.
      what: what a slot holds, for the error when a fixed capacity is too small.
      grow: ``grow(need) -> capacity`` when the current capacity is exceeded.
    """

    need: Callable[..., int]
    what: str
    grow: Callable[[int], int]


def next_power_of_two(need: int) -> int:
    """At least 8, doubling: a run compiles a handful of programs at most."""
    return 1 << max(3, (need - 1).bit_length())


def grow_by_quarter(need: int) -> int:
    """25% headroom, in multiples of 8: a buffer stays close to what it carries."""
    return max(8, -(-int(need * 1.25) // 8) * 8)


def capacity_fn(ctx: StepContext, policy: CapacityPolicy) -> Callable[..., int]:
    """Capacity per batch: ``ctx.capacity`` when fixed (``ValueError`` when too small),
    else grown by ``policy.grow`` whenever a batch needs more (never shrinks). A policy
    whose ``need`` is a tuple (one entry per table) gets a tuple, each entry so sized."""
    current: list = [0]

    def capacity(*batches: Batch) -> int | tuple[int, ...]:
        need = policy.need(ctx, *batches)
        if isinstance(need, tuple):  # one capacity per table
            fixed = ctx.capacity
            old = current[0] or (0,) * len(need)
            sized = [_sized(n, c, fixed, policy) for n, c in zip(need, old, strict=True)]
            current[0] = tuple(sized)
            return current[0]
        current[0] = _sized(need, current[0], ctx.capacity, policy)
        return current[0]

    return capacity


def _sized(need: int, current: int, fixed: int | None, policy: CapacityPolicy) -> int:
    if fixed is not None:
        if need > fixed:
            raise ValueError(
                f"capacity={fixed} is too small: this batch needs {need} "
                f"{policy.what}; pass a larger capacity or None (auto)"
            )
        return fixed
    if need > current or not current:
        return max(current, policy.grow(need))
    return current


def batch_placer(
    ctx: StepContext, policy: CapacityPolicy | None = None, lookahead: int = 0
) -> Callable[..., PlacedBatch]:
    """``place(batch[, next_batch, *later]) -> PlacedBatch``: checked, placed, capacity
    sized (``later``: up to ``lookahead - 1`` batches after the next)."""
    capacity = capacity_fn(ctx, policy) if policy else None

    def place(batch: Batch, next_batch: Batch | None = None, *later: Batch) -> PlacedBatch:
        data = put_batch(ctx, batch)
        if not lookahead:
            return PlacedBatch(data, capacity(batch) if capacity else 0)
        if next_batch is None:
            return PlacedBatch(data)
        later = tuple(put_batch(ctx, b) for b in later[: lookahead - 1])
        need = capacity(batch, next_batch)
        return PlacedBatch(data, need, put_batch(ctx, next_batch), later)

    return place


# ------------------------------------------------------------------- the state


def param_specs(ctx: StepContext, layout: str | None) -> PyTree:
    """``PartitionSpec`` per parameter: tables by ``layout``, the rest replicated."""
    spec = embedding.table_spec(layout, ctx.axis_name) if layout else P()
    return jax.tree.map(lambda m: spec if m else P(), ctx.table_mask)


def _opt_specs(ctx: StepContext, opt_state, specs) -> PyTree:
    return optax.tree_map_params(
        ctx.optimizer,
        lambda _, spec: spec,
        opt_state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )


def _opt_state(ctx: StepContext, host: PyTree, specs: PyTree) -> tuple[PyTree, PyTree]:
    """The optimizer state (host) and its specs; with ``ctx.table_optimizer`` a
    ``rowwise.TableOptState`` whose row states are sharded like their tables."""
    if ctx.table_optimizer is None:
        opt_state = jax.tree.map(np.asarray, ctx.optimizer.init(host))
        return opt_state, _opt_specs(ctx, opt_state, specs)
    state = rowwise.init_tables(ctx.optimizer, ctx.table_optimizer, host, ctx.table_mask)
    state = jax.tree.map(np.asarray, state)
    rest = jax.tree.map(lambda m: None if m else P(), ctx.table_mask)
    flags = jax.tree.leaves(ctx.table_mask)
    leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    table_specs = [s for s, m in zip(leaves, flags, strict=True) if m]
    rows = tuple(rowwise.state_specs(r, t) for r, t in zip(state.rows, table_specs, strict=True))
    return state, rowwise.TableOptState(_opt_specs(ctx, state.dense, rest), rows)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def initial_agg_state(ctx: StepContext, host_params, layout: str | None):
    """Zeros of the aggregator's state, one slice per worker: global [P, *shape]."""
    if layout:
        host_params = jax.tree.map(lambda x, m: None if m else x, host_params, ctx.table_mask)
    shapes = jax.eval_shape(ctx.aggregator.init, host_params)
    return jax.tree.map(lambda s: np.zeros((ctx.num_workers, *s.shape), s.dtype), shapes)


def place_state(ctx: StepContext, layout: str | None) -> tuple[TrainState, TrainState]:
    """The initial state on the devices, and its ``PartitionSpec`` tree (the carry of
    a pipelined step is per worker)."""
    specs = param_specs(ctx, layout)
    host = jax.tree.map(np.asarray, ctx.params)
    if layout:
        for _, name, table in named_tables(host, ctx.table_mask):
            embedding.check_divisible(table.shape, layout, ctx.num_workers, name)
    opt_state, opt_specs = _opt_state(ctx, host, specs)
    agg_state = initial_agg_state(ctx, host, layout)
    state = TrainState(host, opt_state, agg_state)
    agg_specs = jax.tree.map(lambda _: P(ctx.axis_name), agg_state)
    state_specs = TrainState(specs, opt_specs, agg_specs)
    placed = jax.tree.map(
        lambda x, s: runtime.put_global(x, ctx.mesh, s),
        state,
        state_specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    return placed, state_specs._replace(carry=P(ctx.axis_name))


# ------------------------------------------------------------- host utilities


def first_replica(x) -> np.ndarray:
    """One replica of a ``pmap``-stacked array (numpy or device), as numpy."""
    if isinstance(x, np.ndarray):
        return x[0]
    return np.asarray(x.addressable_data(0)).reshape(x.shape[1:])


def loss_value(loss: jax.Array) -> float:
    """The step's loss as a float (``pmap`` returns one copy per local device)."""
    return float(np.asarray(loss.addressable_data(0)).reshape(-1)[0])


def stack_per_device(tree: PyTree, num_local: int) -> PyTree:
    """Every leaf repeated along a new leading axis of ``num_local`` (``pmap`` state)."""
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (num_local, *np.shape(x))), tree)


def pmap_placer(ctx: StepContext) -> Callable[[Batch], PlacedBatch]:
    """``place(batch)`` for a ``pmap`` step: this process's devices' slices, stacked."""
    devices = list(ctx.mesh.devices.flat)
    local = [d for d in devices if d.process_index == jax.process_index()]
    num, first = len(devices), devices.index(local[0])

    def place(batch: Batch) -> PlacedBatch:
        check_host_batch(ctx, batch)
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            if k in ctx.replicated_keys:
                out[k] = np.broadcast_to(v, (len(local), *v.shape))
            else:
                out[k] = v.reshape(num, -1, *v.shape[1:])[first : first + len(local)]
        return PlacedBatch(out)

    return place
