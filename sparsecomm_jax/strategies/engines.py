"""The engines that turn a strategy's step into a ``TrainStep``: ``jax.jit`` of a
``shard_map`` step (its calls checked, its state donated, several steps a call by a
``lax.scan``) and ``jax.pmap`` (the classic baseline).

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.step.batches import PlacedBatch
    >>> add = lambda state, batch: (state + batch.data["x"].sum(), state)
    >>> scan_steps(add)(jnp.float32(0), PlacedBatch({"x": jnp.ones((3, 2))}))
    (Array(6., dtype=float32), Array([0., 2., 4.], dtype=float32))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sparsecomm_jax.step import batches, capacities, host, managed_ids, placed_state
from sparsecomm_jax.step.batches import PlacedBatch
from sparsecomm_jax.step.state import StepContext, TrainState, TrainStep
from sparsecomm_jax.step.stored_form import form_of
from sparsecomm_jax.strategies.registry import Strategy


def jit_step(ctx: StepContext, strategy: Strategy) -> TrainStep:
    """``jax.jit`` of the strategy's step over ``ctx.mesh``, its state and batch placer."""
    managed_ids.check_strategy(ctx, strategy.lookahead, strategy.name)
    if strategy.serial is not None and not (ctx.overlap and pipelines_a_table(ctx, strategy)):
        strategy = strategy.serial  # the pipeline could only lose, or has nothing to carry
    state, specs = placed_state.place_state(ctx, strategy.unpadded)
    step = strategy.step(ctx, specs)
    policies = capacities.layout_policies(ctx, strategy.capacity)
    capacity = capacities.capacity_fn(ctx, policies) if policies else None
    # a pipelined step carries rows and looks ahead: its steps unrolled, not scanned
    several = scan_steps(step) if strategy.scannable else unrolled_steps(step, strategy.lookahead)
    built = TrainStep(
        step=DonatingStep(jax.jit(step, donate_argnums=0)),
        state=state,
        place_batch=batches.batch_placer(ctx, policies, strategy.lookahead, capacity),
        steps=DonatingStep(jax.jit(several, donate_argnums=0), stacked=True),
        place_steps=batches.steps_placer(ctx, capacity, strategy.lookahead),
        scannable=True,
        host_params=placed_state.host_params_of(ctx),
        strategy=strategy.name,
        lookahead=strategy.lookahead,
        capacity_slots=_capacity_slots(ctx, policies),
        runs_as=strategy.name,
        stored_together=placed_state.stored_together(ctx),
        form=form_of(ctx, state.opt_state),
    )
    return with_managed_ids(ctx, built, step) if managed_ids.managed_tables(ctx) else built


def with_managed_ids(ctx: StepContext, built: TrainStep, step: Callable) -> TrainStep:
    """``built`` with its managed tables' ids mapped as a batch is placed and their
    fresh slots started in the step's program (``step.managed_ids``): one step a call."""
    vocab = managed_ids.vocabularies(ctx)
    return built._replace(
        step=managed_ids.CountedStep(
            DonatingStep(jax.jit(managed_ids.renewing(ctx, step), donate_argnums=0)), vocab
        ),
        place_batch=managed_ids.mapping_placer(ctx, vocab, built.place_batch),
        steps=managed_ids.refuse_steps,
        place_steps=managed_ids.refuse_steps,
        scannable=False,
        vocabulary=vocab,
    )


def scan_steps(step: Callable) -> Callable:
    """``steps(state, placed) -> (state, losses)``: ``step`` run on each batch of
    ``placed`` in turn (its data stacked along a leading step axis, one capacity for
    all), as one ``lax.scan``: one program call for several steps, the same arithmetic
    (to float rounding: XLA compiles the loop body on its own and may fuse it otherwise).

    Args:
      step: ``step(state, placed_batch) -> (state, loss)`` (not yet jitted).

    Returns:
      The scanned step; ``losses`` holds one loss per step.

    Example:
        >>> import jax.numpy as jnp
        >>> from sparsecomm_jax.step.batches import PlacedBatch
        >>> add = lambda state, batch: (state + batch.data["x"].sum(), state)
        >>> scan_steps(add)(jnp.float32(0), PlacedBatch({"x": jnp.ones((3, 2))}))
        (Array(6., dtype=float32), Array([0., 2., 4.], dtype=float32))
    """

    def steps(state: TrainState, placed: PlacedBatch):
        def one(state, data):  # data: one step's batch, [B, ...] per key
            return step(state, PlacedBatch(data, placed.capacity))

        return jax.lax.scan(one, state, placed.data)  # placed.data: [S, B, ...] per key

    return steps


def unrolled_steps(step: Callable, lookahead: int) -> Callable:
    """``steps(state, placed) -> (state, losses)`` of a pipelined step: ``step`` on each
    of ``placed.steps`` batches in turn, unrolled in one program (each step's carried
    rows feed the next; ``lax.scan`` cannot carry them, since the first step makes
    their structure). ``placed.data`` stacks the call's batches and then those the last
    step looks ahead to (none when the call ends the run); step ``k`` is given batch
    ``k + 1`` as its next and up to ``lookahead - 1`` after it, the last batch standing
    in for those past the end, as ``place_for_step`` does one step a call. Each step
    runs in the name scope ``step{k}``, so the compiled program tells them apart.

    Args:
      step: ``step(state, placed_batch) -> (state, loss)`` (not yet jitted).
      lookahead: the batches a step reads ahead (``Strategy.lookahead``).

    Returns:
      The unrolled steps; ``losses`` holds one loss per step.

    Example:
        >>> import jax.numpy as jnp
        >>> from sparsecomm_jax.step.batches import PlacedBatch
        >>> seen = lambda state, b: (state + b.data["x"][0], b.next["x"][0] if b.next else 0)
        >>> batches = PlacedBatch({"x": jnp.arange(4.0)[:, None]}, steps=3)  # 3 steps, 1 ahead
        >>> unrolled_steps(seen, 3)(jnp.float32(0), batches)
        (Array(3., dtype=float32), Array([1., 2., 3.], dtype=float32))
    """

    def steps(state: TrainState, placed: PlacedBatch):
        total = jax.tree.leaves(placed.data)[0].shape[0]  # the call's steps, then ahead

        def batch(j):
            return jax.tree.map(lambda x: x[min(j, total - 1)], placed.data)

        losses = []
        for k in range(placed.steps):
            nxt = batch(k + 1) if k + 1 < total else None
            ahead = range(k + 2, k + 1 + lookahead) if nxt is not None else ()
            later = tuple(batch(j) for j in ahead)
            with jax.named_scope(f"step{k}"):
                state, loss = step(state, PlacedBatch(batch(k), placed.capacity, nxt, later))
            losses.append(loss)
        return state, jnp.stack(losses)

    return steps


def one_step_a_call(strategy: Strategy, what: str) -> Callable:
    """``ts.steps`` or ``ts.place_steps`` of a strategy that runs one step a call: a
    function that says so (``ValueError``) when called."""

    def refuse(*args, **kwargs):
        raise ValueError(
            f"ts.{what}: strategy {strategy.name!r} runs one step a program call "
            f"({strategy.why_one_step_a_call()}); call ts.step(state, "
            "ts.place_batch(batch)) once a step (ts.scannable is False)"
        )

    return refuse


def pipelines_a_table(ctx: StepContext, strategy: Strategy) -> bool:
    """Whether a pipelined strategy has a table to pipeline: one of a layout it plans
    itself (``Strategy.capacity``: ``embrace_2d`` carries the tables of layouts with a
    ``Pipelined``, the column, row and hot ones; with none, ``embrace``'s step runs)."""
    own = strategy.capacity
    return own is not None and any(own(t.layout) is not None for t in ctx.tables)


def _capacity_slots(ctx: StepContext, policies) -> tuple:
    """Per table of ``ctx.tables`` (the order of a batch's capacity), its name and what a
    slot of its capacity holds."""
    what = {t.index: policy.what for policy, tables in policies for t in tables}
    return tuple((t.name, what.get(t.index, "none")) for t in ctx.tables)


def check_step_call(state: TrainState, batch: Any, stacked: bool = False) -> None:
    """``ValueError`` for a step called on a state an earlier call took (the step
    donates its state's buffers to the new one), on a batch ``place_batch`` did not
    place, or (``stacked``: ``ts.steps``) on one step's batch, and the reverse:
    mistakes the runtime would otherwise meet deep in a call, crash on, or run as
    something else."""
    one = "ts.step(state, ts.place_batch(host_batch))"
    several = "ts.steps(state, ts.place_steps(host_batches))"
    if not isinstance(batch, PlacedBatch):
        raise ValueError(
            f"batch must be placed first: {several if stacked else one} (a PlacedBatch; "
            f"got {type(batch).__name__})"
        )
    if bool(batch.steps) != stacked:
        made_by = "place_steps" if batch.steps else "place_batch"
        raise ValueError(
            f"this batch holds {batch.steps or 1} step(s) ({made_by}): call "
            f"{several if batch.steps else one}"
        )
    if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
        raise ValueError(
            "this state was donated to an earlier step (its buffers became that step's "
            "result): pass the state the last ts.step returned"
        )


class DonatingStep(NamedTuple):
    """A ``jax.jit`` step that donates its state: each call is checked first
    (``check_step_call``); ``lower`` is the jit's."""

    jitted: Callable
    stacked: bool = False  # ``TrainStep.steps``: batches of several steps

    def __call__(self, state: TrainState, batch: PlacedBatch):
        check_step_call(state, batch, self.stacked)
        return self.jitted(state, batch)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)


class PmapStep(NamedTuple):
    """A ``jax.pmap`` step that returns the loss as one scalar, like every other step
    (the per-device copies are equal after ``pmean``); ``lower`` is the pmap's."""

    pmapped: Callable

    def __call__(self, state: TrainState, batch: batches.PlacedBatch):
        check_step_call(state, batch)
        state, loss = self.pmapped(state, batch)
        return state, loss.addressable_data(0).reshape(())

    def lower(self, *args, **kwargs):
        return self.pmapped.lower(*args, **kwargs)


def pmap_step(ctx: StepContext, strategy: Strategy) -> TrainStep:
    """The classic ``jax.pmap`` + ``lax.pmean`` baseline (``dense_pmap``)."""
    devices = list(ctx.mesh.devices.flat)
    num_local = sum(d.process_index == jax.process_index() for d in devices)
    state = TrainState(ctx.params, ctx.optimizer.init(ctx.params), ())
    body = strategy.step(ctx)
    return TrainStep(
        step=PmapStep(jax.pmap(body, ctx.axis_name, devices=devices, donate_argnums=0)),
        state=placed_state.stack_per_device(state, num_local),
        place_batch=batches.pmap_placer(ctx),
        steps=one_step_a_call(strategy, "steps"),
        place_steps=one_step_a_call(strategy, "place_steps"),
        host_params=host.replica_params,
        strategy=strategy.name,
        per_device_state=True,
        runs_as=strategy.name,
    )


ENGINES = {"shard_map": jit_step, "pmap": pmap_step}
