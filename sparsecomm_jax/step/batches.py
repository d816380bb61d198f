"""Batches on the devices: ``PlacedBatch``, its partition specs, and the placers a
``TrainStep`` hands out (one step's batch, several steps' batches stacked for one
program call, a ``pmap`` step's per-device slices), each checking the host batch
(``batch_checks``) and sizing its slots (``capacities``) first.

Example:
    >>> from sparsecomm_jax.step.batches import batch_specs
    >>> batch_specs({"tokens": None, "negatives": None}, "data", ["negatives"])
    {'tokens': P('data',), 'negatives': P()}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.embedding.layout import CapacityPolicy
from sparsecomm_jax.step.batch_checks import check_alike, check_host_batch
from sparsecomm_jax.step.capacities import capacity_fn
from sparsecomm_jax.step.state import Batch, StepContext


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlacedBatch:
    """A batch on the devices, as every ``shard_map`` step body receives it.

    Attributes:
      data: the batch (sharded keys split over the workers, replicated keys whole).
      capacity: slots of the static buffers, one entry per table in table order (0:
        none), ``()`` when the step has none; static, so one program is compiled per
        value.
      next: the next step's batch for pipelined strategies (``None`` otherwise and at
        the last step).
      later: the batches of steps t+2, t+3, ... a pipelined strategy's lookahead asks
        for (as many as remain), soonest first.
      steps: 0 for one step's batch (``place_batch``), else the steps whose batches
        ``place_steps`` stacked along ``data``'s leading axis (for ``TrainStep.steps``).
      fresh: the slots of managed tables the step starts afresh before it reads them,
        table leaf index -> ``(slots int32[R], rows float32[R, D])``
        (``step.managed_ids``); ``None`` without managed tables.
    """

    data: dict = dataclasses.field(metadata=dict(static=False))
    capacity: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    next: dict | None = dataclasses.field(default=None, metadata=dict(static=False))
    later: tuple = dataclasses.field(default=(), metadata=dict(static=False))
    steps: int = dataclasses.field(default=0, metadata=dict(static=True))
    fresh: dict | None = dataclasses.field(default=None, metadata=dict(static=False))

    def slots(self, tables) -> dict[int, int]:
        """Table leaf index -> its slots (``tables`` in the order of ``capacity``)."""
        return {t.index: c for t, c in zip(tables, self.capacity, strict=False)}


def batch_specs(
    batch: Batch, axis_name: str | tuple[str, ...], replicated_keys: Sequence[str]
) -> dict:
    """``PartitionSpec`` per batch key: split along ``axis_name`` (with replica groups,
    the tuple of both axes) unless replicated."""
    return {k: P() if k in replicated_keys else P(axis_name) for k in batch}


def placed_specs(
    batch: PlacedBatch, axis_name: str | tuple[str, ...], replicated_keys: Sequence[str]
):
    """The ``PartitionSpec`` tree of a ``PlacedBatch``."""
    nxt = None if batch.next is None else batch_specs(batch.next, axis_name, replicated_keys)
    data = batch_specs(batch.data, axis_name, replicated_keys)
    later = tuple(batch_specs(b, axis_name, replicated_keys) for b in batch.later)
    return PlacedBatch(data, batch.capacity, nxt, later)


def put_batch(ctx: StepContext, batch: Batch) -> dict:
    """Checks a host batch and places it on ``ctx.mesh``."""
    check_host_batch(ctx, batch)
    specs = batch_specs(batch, ctx.batch_axes, ctx.replicated_keys)
    return {k: runtime.put_global(np.asarray(v), ctx.mesh, specs[k]) for k, v in batch.items()}


def batch_placer(
    ctx: StepContext,
    policies: list[tuple[CapacityPolicy, tuple]],
    lookahead: int = 0,
    capacity: Callable[..., tuple[int, ...]] | None = None,
) -> Callable[..., PlacedBatch]:
    """``place(batch[, next_batch, *later]) -> PlacedBatch``: checked, placed, capacity
    sized by ``policies`` (``later``: up to ``lookahead - 1`` batches after the next);
    ``capacity``: a ``capacity_fn`` to share with another placer (``steps_placer``), so
    both grow the same capacities."""
    if capacity is None and policies:
        capacity = capacity_fn(ctx, policies)

    def place(batch: Batch, next_batch: Batch | None = None, *later: Batch) -> PlacedBatch:
        data = put_batch(ctx, batch)
        if not lookahead:
            return PlacedBatch(data, capacity(batch) if capacity else ())
        if next_batch is None:
            return PlacedBatch(data, capacity(batch) if capacity else ())
        later = tuple(put_batch(ctx, b) for b in later[: lookahead - 1])
        need = capacity(batch, next_batch) if capacity else ()
        return PlacedBatch(data, need, put_batch(ctx, next_batch), later)

    return place


def steps_placer(
    ctx: StepContext, capacity: Callable[..., tuple[int, ...]] | None, lookahead: int = 0
) -> Callable[..., PlacedBatch]:
    """``place_steps(batches, *ahead) -> PlacedBatch``: the batches of consecutive steps
    for one program call (``TrainStep.steps``), each checked and sized as
    ``batch_placer`` would, then stacked along a new leading axis and placed once.
    Capacities never shrink, so the last batch's capacity holds every batch's ids.

    A pipelined step (``lookahead`` > 0) also reads the batches after the call's:
    ``ahead``, up to ``lookahead`` of them (none when the call ends the run), stacked
    after the call's own; each step is sized on its batch and the next, as one step a
    call is.

    Args:
      ctx: the step's context.
      capacity: the ``capacity_fn`` the step's ``batch_placer`` uses (``None``: the
        step has no capacities).
      lookahead: the batches a step reads ahead (``Strategy.lookahead``; 0: none).

    Returns:
      ``place_steps``; its ``PlacedBatch.data`` holds ``[S + A, *shape]`` arrays (``S``
      steps and ``A`` ahead), split along the batch axis like a single step's, and
      ``steps`` is ``S``.
    """

    def place_steps(batches: Sequence[Batch], *ahead: Batch) -> PlacedBatch:
        if not batches:
            raise ValueError("place_steps needs the batches of one step or more")
        if len(ahead) > lookahead:
            raise ValueError(
                f"place_steps takes at most {lookahead} batches after the call's (this "
                f"step looks {lookahead} ahead); got {len(ahead)}"
            )
        every = [*batches, *ahead]
        check_alike(every)  # first: the checks below run the loss on each batch
        for batch in every:
            check_host_batch(ctx, batch)
        need = ()  # sized only once every batch passed: a refused call grows nothing
        for k, batch in enumerate(batches):
            nxt = every[k + 1 : k + 2] if lookahead else []  # a pipelined step: and its next
            need = capacity(batch, *nxt) if capacity else ()
        specs = batch_specs(every[0], ctx.batch_axes, ctx.replicated_keys)
        data = {
            k: runtime.put_global(np.stack([b[k] for b in every]), ctx.mesh, P(None, *spec))
            for k, spec in specs.items()
        }
        return PlacedBatch(data, need, steps=len(batches))

    return place_steps


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
                out[k] = v.reshape(num, len(v) // num, *v.shape[1:])[first : first + len(local)]
        return PlacedBatch(out)

    return place
