"""Feeding a step: each step's batch placed on a host thread while the step before
runs, and the program calls of a run (one step a call, or several: ``call_plan``).

Example:
    >>> call_plan(0, 10, 4, ends=lambda step: step == 5)
    [(0, 4), (4, 1), (5, 1), (6, 4)]
"""

from __future__ import annotations

import concurrent.futures
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from sparsecomm_jax.errors import ArgumentError
from sparsecomm_jax.step.batches import PlacedBatch
from sparsecomm_jax.step.state import Batch, TrainStep


def place_for_step(ts: TrainStep, batch_at: Callable[[int], Batch], step: int, steps: int):
    """The placed batch of ``step`` of a ``steps``-step run, with the next
    ``ts.lookahead`` steps' batches for pipelined strategies (none at the last step)."""
    if ts.lookahead and step + 1 < steps:
        # near the end the last batch stands in for those past it: one program shape
        ahead = [min(s, steps - 1) for s in range(step + 1, step + 1 + ts.lookahead)]
        return ts.place_batch(batch_at(step), *(batch_at(s) for s in ahead))
    return ts.place_batch(batch_at(step))


def placed_batches(
    ts: TrainStep, batch_at: Callable[[int], Batch], start: int, steps: int
) -> Iterator[PlacedBatch]:
    """The placed batches of steps ``start .. steps - 1`` (``place_for_step``), each
    made on a host thread while the step before it runs: when batch ``t`` is handed
    out, batch ``t + 1`` is already being read, checked, sized and placed (double
    buffering), so the step path never waits on the host unless placing takes longer
    than a step. Batches are placed in step order on one thread; an error placing a
    batch is raised when that batch is asked for.

    Args:
      ts: the train step (its ``place_batch``).
      batch_at: step -> host batch; called from one thread, as ``place_for_step`` asks
        (with a lookahead, also for the steps ahead of each one).
      start: the first step.
      steps: the run's number of steps: the step to end before, not a count (a resume
        from step 10 of a 30-step run is ``placed_batches(ts, batch_at, 10, 30)``).

    Returns:
      An iterator of ``PlacedBatch``; closing it (or leaving a ``for`` loop early) waits
      for the batch in flight and drops it.

    Raises:
      ArgumentError: ``start`` is negative, or ``steps`` before it. ``steps == start``
        (a finished run resumed, or a count taken for the end step) runs nothing and
        says so in a ``UserWarning``.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from sparsecomm_jax import make_train_step, runtime
        >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
        >>> ts = make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(),
        ...                      {"w": jnp.zeros((3, 1))})
        >>> n = len(jax.devices())
        >>> batch_at = lambda step: {"x": jnp.full((n, 3), step), "y": jnp.ones((n, 1))}
        >>> state = ts.state
        >>> for batch in placed_batches(ts, batch_at, 0, 3):
        ...     state, loss_value = ts.step(state, batch)  # the next batch placed meanwhile
        >>> ts.host_params(state)["w"].shape
        (3, 1)
    """
    for name, value in (("start", start), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ArgumentError(name, value, "must be an integer step")
    if start < 0:
        raise ArgumentError("start", start, "must be >= 0 (the first step to run)")
    if steps < start:
        raise ArgumentError(
            "steps",
            steps,
            "is the step to end before (the run's number of steps), not a count: it is "
            "before $start; pass the end step, e.g. start + count",
            start=start,
        )
    if steps == start:  # a finished run resumed, or a count taken for the end step
        warnings.warn(
            f"placed_batches(..., start={start}, steps={steps}) runs nothing: steps is the "
            "step to end before, not a count (start + count for more steps)",
            stacklevel=2,
        )
    place = functools.partial(place_for_step, ts, batch_at, steps=steps)
    return _placed_ahead(place, range(start, steps))


def _placed_ahead(place: Callable[[Any], PlacedBatch], items: Sequence) -> Iterator[PlacedBatch]:
    """``place(item)`` for each of ``items`` in order on one host thread, the next one
    placed while the caller uses the one before (double buffering)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="place-batch") as pool:
        pending = pool.submit(place, items[0]) if items else None
        for i in range(len(items)):
            batch = pending.result()
            pending = pool.submit(place, items[i + 1]) if i + 1 < len(items) else None
            yield batch


def call_plan(
    start: int, steps: int, size: int, ends: Callable[[int], bool] = lambda step: False
) -> list[tuple[int, int]]:
    """The program calls of steps ``start .. steps - 1`` as ``(first step, steps)``:
    ``size`` steps a call (``TrainStep.steps``) where none of them but the last ends a
    call (``ends(step)``: the caller must see the state after ``step``, to save or
    evaluate it), else one step (``TrainStep.step``). So a run uses at most two call
    sizes (a program each, for each (state, batch) structure), and every step ``ends``
    names is the last of its call.

    Args:
      start: the first step.
      steps: the run's number of steps: the step to end before, not a count (a resume
        from step 10 of a 30-step run is ``placed_batches(ts, batch_at, 10, 30)``).
      size: steps a call (1: one call a step).
      ends: whether the state after a step must be seen before the next step starts.

    Returns:
      The calls in step order; their steps are ``start .. steps - 1``, each once.

    Example:
        >>> call_plan(0, 10, 4, ends=lambda step: step == 5)
        [(0, 4), (4, 1), (5, 1), (6, 4)]
    """
    if size < 1:
        raise ValueError(f"a call runs one step or more, got size={size}")
    calls, first = [], start
    while first < steps:
        fits = first + size <= steps and not any(ends(s) for s in range(first, first + size - 1))
        calls.append((first, size if fits else 1))
        first += calls[-1][1]
    return calls


def place_for_call(
    ts: TrainStep, batch_at: Callable[[int], Batch], call: tuple[int, int], steps: int
) -> PlacedBatch:
    """The placed batch of one call of ``call_plan``: ``place_for_step``'s for a call
    of one step, the call's batches stacked by ``ts.place_steps`` for several (with
    those a pipelined step looks ahead to, past the call)."""
    first, size = call
    if size == 1:
        return place_for_step(ts, batch_at, first, steps)
    batches = [batch_at(s) for s in range(first, first + size)]
    end = first + size
    if not ts.lookahead or end >= steps:
        return ts.place_steps(batches)
    # a pipelined step looks ahead past the call: the last batch stands in near the end
    ahead = [batch_at(min(s, steps - 1)) for s in range(end, end + ts.lookahead)]
    return ts.place_steps(batches, *ahead)


def placed_calls(
    ts: TrainStep, batch_at: Callable[[int], Batch], calls: Sequence[tuple[int, int]], steps: int
) -> Iterator[PlacedBatch]:
    """The placed batches of ``calls`` (``call_plan``; ``place_for_call``), each made on
    a host thread while the call before it runs, as ``placed_batches`` does for single
    steps.

    Args:
      ts: the train step (its ``place_batch`` and ``place_steps``).
      batch_at: step -> host batch; called from one thread, in step order.
      calls: ``(first step, steps)`` of each call.
      steps: the run's number of steps.

    Returns:
      An iterator of ``PlacedBatch``, one per call: run a call of one step with
      ``ts.step``, of several with ``ts.steps``.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from sparsecomm_jax import make_train_step, runtime
        >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
        >>> ts = make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(),
        ...                      {"w": jnp.zeros((3, 1))})
        >>> n = len(jax.devices())
        >>> batch_at = lambda step: {"x": jnp.full((n, 3), step), "y": jnp.ones((n, 1))}
        >>> calls = call_plan(0, 5, 4)  # [(0, 4), (4, 1)]
        >>> state, losses = ts.state, []
        >>> for (first, size), batch in zip(calls, placed_calls(ts, batch_at, calls, 5)):
        ...     state, loss = (ts.steps if size > 1 else ts.step)(state, batch)
        ...     losses += [float(x) for x in jnp.ravel(loss)]
        >>> len(losses)
        5
    """
    place = functools.partial(place_for_call, ts, batch_at, steps=steps)
    return _placed_ahead(place, list(calls))
