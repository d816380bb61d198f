"""The step loop of a run and its policy for non-finite steps.

``run_steps`` runs steps ``start .. config.steps - 1``: one compiled program per (state,
batch) structure, the loss and step time of each step, a skipped step recorded when its
gradient was not finite (``--nonfinite skip``), the run stopped when the parameters
diverge, when ``--nonfinite error`` sees one, or when more than ``--max-skipped`` steps
in a row are skipped; checkpoints saved when due, never of non-finite parameters.

Example:
    >>> from experiments.loop import skip_streak
    >>> skip_streak([3, 5, 6, 7], step=7)
    3
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
from tqdm import tqdm

from experiments.config import RunConfig
from sparsecomm_jax import (
    CapacityWarning,
    checkpoint,
    loss_value,
    overflow_message,
    placed_batches,
)
from sparsecomm_jax.step.finish import finite

_finite = jax.jit(finite)  # one reduction on the devices


def params_finite(ts, state) -> bool:
    """Whether every parameter of ``state`` is finite (one reduction on the devices)."""
    params = state.params
    if ts.per_device_state:  # identical replicas: the first one
        params = jax.tree.map(lambda x: x.addressable_data(0), params)
    return bool(np.asarray(_finite(params).addressable_data(0)))


def _runner(ts, compiled):
    """The compiled program, except for multi-process ``pmap``: its AOT executable wants
    global arrays where ``pmap`` takes this process's devices' slices."""
    if ts.per_device_state and jax.process_count() > 1:
        return ts.step
    return compiled


class RunLog(NamedTuple):
    """What the step loop records."""

    losses: list  # one float per step run
    times: list  # seconds per step (compilation excluded)
    skipped: list  # steps whose update was skipped (non-finite gradient)
    programs: dict  # (state, batch) structure -> compiled program
    runs: dict  # (state, batch) structure -> steps run with it
    compile_s: float
    per_step: tuple = ()  # the programs that together make one step (default: the most run)
    place_times: list | tuple = ()  # seconds per step waiting for its batch (host thread)
    wall_times: list | tuple = ()  # seconds since the previous step's loss (None: compiled)
    last_key: Any = None  # the (state, batch) structure of the last step run
    last_end: float = 0.0  # when the last step's loss was read (time.perf_counter)


def _diverged(step: int) -> FloatingPointError:
    return FloatingPointError(
        f"the parameters are non-finite after step {step} (diverged: "
        "lower --lr?); stopping, this state is not saved"
    )


def _after_nonfinite(config: RunConfig, ts, state, step: int, log: RunLog) -> None:
    """A step with a non-finite loss: stop (poisoned parameters, ``--nonfinite error``)
    or record it as skipped. ``FloatingPointError`` stops the run."""
    if not params_finite(ts, state):
        raise _diverged(step)
    if config.nonfinite == "error":
        raise FloatingPointError(
            f"non-finite gradient at step {step}: the step was not applied "
            "(use --nonfinite skip to skip such steps)"
        )
    if config.nonfinite == "skip":
        log.skipped.append(step)


def skip_streak(skipped: list, step: int) -> int:
    """How many steps in a row up to ``step`` were skipped."""
    n = 0
    while n < len(skipped) and skipped[-1 - n] == step - n:
        n += 1
    return n


def _stop_if_stuck(config: RunConfig, ckpt, step: int, streak: int) -> None:
    """More than ``--max-skipped`` skipped steps in a row: the state they all started
    from yields non-finite gradients; its checkpoint is removed and the run stops."""
    if streak <= config.max_skipped:
        return
    first = step - streak + 1
    if ckpt and first in checkpoint.saved_steps(ckpt.directory):
        ckpt.delete(first)
    raise FloatingPointError(
        f"steps {first}-{step} ({streak} in a row) had non-finite gradients, more than "
        f"--max-skipped {config.max_skipped}: stopping; no checkpoint of the state they "
        "started from is kept (lower --lr?)"
    )


def _save(config: RunConfig, ckpt, ts, state, step: int, streak: int) -> None:
    """Saves after ``step`` when due; never non-finite parameters, nor again the state a
    run of skipped steps keeps (it is the state from before them)."""
    last = step + 1 == config.steps
    if not ckpt or (streak and not last) or not (last or ckpt.should_save(step + 1)):
        return
    if not params_finite(ts, state):
        raise _diverged(step)
    ckpt.save_state(step + 1, ts, state, force=last)


def _compiled(ts, log: RunLog, state, batch, key) -> tuple[Any, RunLog]:
    """The program of ``key`` (the (state, batch) structure), compiled on first use."""
    if key not in log.programs:
        t = time.perf_counter()
        log.programs[key] = ts.step.lower(state, batch).compile()
        log = log._replace(compile_s=log.compile_s + time.perf_counter() - t)
    log.runs[key] = log.runs.get(key, 0) + 1
    return _runner(ts, log.programs[key]), log


def run_steps(config: RunConfig, ts, workload, state, start: int, ckpt, show: bool, hooks=None):
    """Steps ``start .. config.steps - 1``: one compiled program per (state, batch)
    structure (a new row-wise capacity or the pipelined carry makes a new one), each
    step's batch placed on a host thread while the step before runs
    (``placed_batches``); ``hooks`` (``experiments.runlog.RunHooks``) log, evaluate and
    trace around steps."""
    log = RunLog([], [], [], {}, {}, 0.0, place_times=[], wall_times=[])
    log = log._replace(last_end=time.perf_counter())
    bar = tqdm(range(start, config.steps), desc=config.strategy, disable=not show)
    with contextlib.closing(placed_batches(ts, workload.batch_at, start, config.steps)) as batches:
        for step in bar:
            if hooks:
                hooks.before_step(step)
            state, log = _one_step(ts, state, batches, log)
            if not math.isfinite(log.losses[-1]):
                _after_nonfinite(config, ts, state, step, log)
                state = state._replace(carry=())  # the early-fetched rows may hold NaN
            if hooks:
                program = log.programs[log.last_key]
                hooks.after_step(step, state, log.losses[-1], log.times[-1], program)
            streak = skip_streak(log.skipped, step)
            _stop_if_stuck(config, ckpt, step, streak)
            _save(config, ckpt, ts, state, step, streak)
            bar.set_postfix(loss=f"{log.losses[-1]:.4f}")
    return state, log


def _one_step(ts, state, batches, log: RunLog) -> tuple[Any, RunLog]:
    """Waits for the next placed batch and runs its step: its loss, the wait (the host
    time on the step path), the program's time and the wall time since the previous
    step's loss (logging, saving, the wait and the program) go into ``log``."""
    begin = time.perf_counter()
    batch = next(batches)
    log.place_times.append(time.perf_counter() - begin)
    key = jax.tree.structure((state, batch))
    compiles = key not in log.programs
    program, log = _compiled(ts, log, state, batch, key)
    t = time.perf_counter()
    state, loss = program(state, batch)
    log.losses.append(loss_value(loss))
    end = time.perf_counter()
    if log.losses[-1] == math.inf:  # a table's capacity was too small (mark_missed)
        warnings.warn(overflow_message(ts, batch), CapacityWarning, stacklevel=2)
    log.times.append(end - t)
    log.wall_times.append(None if compiles else end - log.last_end)  # no compile time
    return state, log._replace(last_key=key, last_end=end)


def run_overlapped(config: RunConfig, ov, workload, show: bool) -> tuple[Any, RunLog]:
    """``config.steps`` steps of the overlapped ``embrace_2d`` (``--overlap``): its own
    loop (``Overlapped.run``, compiled by a first short run); each step's time is the
    time between the ends of consecutive steps' ``high`` programs. Its programs are
    recorded under their names (``high`` and ``low`` carry the step's collectives)."""
    start = time.perf_counter()
    ov.run(ov.state, workload.batch_at, min(3, config.steps))  # compiles every program
    compile_s = time.perf_counter() - start
    timeline: list = []
    state, losses = ov.run(ov.state, workload.batch_at, config.steps, timeline)
    ends = {step: end for phase, step, _, end in timeline if phase == "high"}
    times = [ends[s] - ends[s - 1] for s in range(1, config.steps)] or [ends[0]]
    programs = _overlap_programs(ov, workload, config.steps)
    runs = dict.fromkeys(programs, config.steps)
    skipped = [s for s, loss in enumerate(losses) if not math.isfinite(loss)]
    if show:
        print(f"{config.strategy} (overlapped): final loss {losses[-1]:.4f}")
    return state, RunLog(losses, times, skipped, programs, runs, compile_s, ("high", "low"))


def _overlap_programs(ov, workload, steps: int) -> dict:
    """The compiled ``high`` and ``low`` programs of a middle step."""
    progs, state = ov.programs, ov.state
    ahead = [min(s, steps - 1) for s in range(1, 5)]
    batch = ov.place(workload.batch_at(0), *(workload.batch_at(s) for s in ahead))
    rows = progs.fetch(state.params, batch.data)
    grads = progs.compute(state.params, rows, batch.data)
    high = progs.high.lower(state, *grads, batch).compile()
    new, _, pend, _, _ = progs.high(state, *grads, batch)
    low = progs.low.lower(new.params, new.opt_state, pend, batch.capacity, False).compile()
    return {"high": high, "low": low}
