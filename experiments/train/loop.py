"""The step loop of a run and its policy for non-finite steps.

``run_steps`` runs steps ``start .. config.steps - 1``: one compiled program per call
size and (state, batch) structure, the loss and step time of each step, a skipped step
recorded when its gradient was not finite (``--nonfinite skip``), the run stopped when
the parameters diverge, when ``--nonfinite error`` sees one, or when more than
``--max-skipped`` steps in a row are skipped; checkpoints saved when due, never of
non-finite parameters.

One step stays in flight: step ``t + 1`` is handed to the devices before step ``t``'s
loss is read, so the host's work between steps (reading the loss, the log line, the
progress bar, these checks) runs while the devices work instead of between their
programs. The loop waits for a step to end before starting the next only where the next
one needs it (``settles``): a checkpoint or an evaluation after it, the edges of the
profiler's window, the last step, and pipelined steps (a non-finite step's carry is
dropped on the host); before compiling a new program (no step's time holds a
compilation); and at every step with ``--in-flight no`` (``auto``, the default, is
``no`` where CPU processes outnumber a host's cores: ``in_flight_choice``). With a
step in flight a step's time is the time between two loss reads: the program and any
host work it did not hide.

With ``--steps-per-call S`` one program call runs S steps (``TrainStep.steps``, a scan
over their stacked batches): one dispatch, one program run and one read of S losses
instead of S of each; everything above holds per call, each step of a call is given an
equal share of its time, and a step whose state must be seen (saved, evaluated, at an
edge of the profiler's window, the last) ends its call (``call_plan``: calls that could
not end there run one step each).

Example:
    >>> from experiments.train.loop import skip_streak
    >>> skip_streak([3, 5, 6, 7], step=7)
    3
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
from tqdm import tqdm

from experiments.train.config import RunConfig
from sparsecomm_jax import (
    CapacityWarning,
    call_plan,
    checkpoint,
    loss_values,
    overflow_message,
    placed_calls,
    runtime,
)
from sparsecomm_jax.step import managed_ids
from sparsecomm_jax.step.apply import finite

_finite = jax.jit(finite)  # one reduction on the devices


def params_finite(ts, state) -> bool:
    """Whether every parameter of ``state`` is finite (one reduction on the devices)."""
    params = state.params
    if ts.per_device_state:  # identical replicas: the first one
        params = jax.tree.map(lambda x: x.addressable_data(0), params)
    return bool(np.asarray(_finite(params).addressable_data(0)))


def _runner(ts, compiled):
    """The compiled program, except for multi-process ``pmap`` (one step a call): its AOT
    executable wants global arrays where ``pmap`` takes this process's devices' slices;
    with managed tables, counting the steps it runs (``Vocabularies.stepped``) as
    ``ts.step`` does."""
    if ts.per_device_state and jax.process_count() > 1:
        return ts.step
    if ts.vocabulary is not None:  # the steps run, for the managed tables' mappings
        return managed_ids.CountedStep(compiled, ts.vocabulary)
    return compiled


class RunLog(NamedTuple):
    """What the step loop records."""

    losses: list  # one float per step run
    times: list  # seconds per step (compilation excluded)
    skipped: list  # steps whose update was skipped (non-finite gradient or loss)
    programs: dict  # (state, batch) structure -> compiled program
    runs: dict  # (state, batch) structure -> steps run with it
    compile_s: float
    per_step: tuple = ()  # the programs that together make one step (default: the most run)
    place_times: list | tuple = ()  # seconds per step waiting for its batch (host thread)
    wall_times: list | tuple = ()  # seconds since the previous step's loss (None: compiled)
    last_key: Any = None  # the (state, batch) structure of the last step run
    last_end: float = 0.0  # when the last step's loss was read (time.perf_counter)
    call_sizes: list | tuple = ()  # steps of each program call run, in order
    held: float = 0.0  # host seconds since last_end spent saving, evaluating, tracing
    compiled_at: list | tuple = ()  # the first step of each call whose program compiled


def warm_steps(log: RunLog, warmup: int) -> int:
    """The steps of the first ``warmup`` program calls (``--warmup`` counts program
    runs: the first runs of a program are slow however many steps a call holds)."""
    return sum(log.call_sizes[:warmup]) if log.call_sizes else warmup


def _diverged(step: int, seen_at: int | None = None) -> FloatingPointError:
    """The error of parameters found non-finite after ``step``; ``seen_at``: the step
    whose non-finite loss made the loop look (when the step after it was in flight)."""
    seen = "" if seen_at in (None, step) else f"step {seen_at}'s loss was not finite; "
    return FloatingPointError(
        f"the parameters are non-finite after step {step} ({seen}diverged: "
        "lower --lr?); stopping, this state is not saved"
    )


def skip_streak(skipped: list, step: int) -> int:
    """How many steps in a row up to ``step`` were skipped."""
    n = 0
    while n < len(skipped) and skipped[-1 - n] == step - n:
        n += 1
    return n


def _compiled(ts, log: RunLog, state, batch, key) -> tuple[Any, RunLog]:
    """The program of ``key`` (``program_key``), compiled on first use; its runs count
    steps."""
    size = key[0]
    if key not in log.programs:
        t = time.perf_counter()
        log.programs[key] = (ts.steps if size > 1 else ts.step).lower(state, batch).compile()
        log = log._replace(compile_s=log.compile_s + time.perf_counter() - t)
    log.runs[key] = log.runs.get(key, 0) + size
    return _runner(ts, log.programs[key]), log


class RecompileWarning(RuntimeWarning):
    """A program compiled after the warm-up steps for a call size already compiled."""


def late_compile_message(ts, batch, step: int) -> str:
    """Why step ``step`` compiles again, and how to fix the slots up front."""
    per_table = ", ".join(
        f"{name} {slots}"
        for (name, _), slots in zip(ts.capacity_slots, getattr(batch, "capacity", ()), strict=False)
    )
    return (
        f"step {step} compiles a new program after the warm-up: a batch needed more slots "
        f"than the first batches showed (slots per table now: {per_table or 'none'}); "
        "pass --capacity N (at least the largest) to size them once, up front"
    )


def program_key(state, batch, size: int) -> tuple:
    """What tells one compiled program from another: the steps a call runs and the
    (state, batch) structure."""
    return size, jax.tree.structure((state, batch))


class Flight(NamedTuple):
    """A program call handed to the devices whose losses have not been read yet."""

    step: int  # its first step
    loss: Any  # its losses, a device array (one per step)
    batch: Any  # its placed batch (named in a capacity warning)
    key: Any  # its program's ``program_key``
    compiled: bool  # its program was compiled for it (no wall time recorded)
    begin: float  # when it was handed over (time.perf_counter)
    size: int  # its steps


class StepLoop:
    """One run's step loop: what it works with (the run's config, train step, workload,
    checkpointer and hooks) and what it carries from one program call to the next (the
    state, the record, the call in flight).

    Args:
      config: the run; ``in_flight`` decided (``decide_in_flight``).
      ts: the ``TrainStep``.
      workload: the model and its data (``batch_at``).
      ckpt: the ``checkpoint.Checkpointer`` of the run's folder, or ``None``.
      hooks: ``experiments.train.runlog.RunHooks`` (logs, evaluations, the profiler's
        window), or ``None``.

    Raises:
      ValueError: ``config.in_flight`` is not decided.
    """

    def __init__(self, config: RunConfig, ts, workload, ckpt=None, hooks=None):
        if config.in_flight not in ("yes", "no"):
            raise ValueError(f"--in-flight {config.in_flight!r}: decide_in_flight(config) first")
        self.config, self.ts, self.workload, self.ckpt, self.hooks = (
            config,
            ts,
            workload,
            ckpt,
            hooks,
        )
        self.state = None
        self.log = RunLog(
            [], [], [], {}, {}, 0.0, place_times=[], wall_times=[], call_sizes=[], compiled_at=[]
        )
        self.flying: Flight | None = None
        self._capacity_of: dict[int, tuple] = {}  # call size -> capacity last compiled

    def run(self, state, start: int, show: bool):
        """Steps ``start .. config.steps - 1`` in program calls of ``config.steps_per_call``
        steps (``call_plan``: one step a call next to a step whose state is saved or
        evaluated, or where the profiler's window opens or closes): one compiled program
        per call size and (state, batch) structure (a new row-wise capacity or the
        pipelined carry makes a new one), each call's batches placed on a host thread
        while the call before runs (``placed_calls``), one call in flight while the call
        before it is read (``land``; a call whose program is compiled first waits for the
        one before, so no step's time holds a compilation); the hooks log, evaluate and
        trace around steps.

        Returns:
          ``(state, log)``: the state after the last step and the ``RunLog``.
        """
        config = self.config
        self.state = state
        self.log = self.log._replace(last_end=time.perf_counter())
        fresh = bool(self.ckpt) and self.ckpt.latest_step() is None  # first save after one step
        ends = functools.partial(self.planned_end, start if fresh else None)
        calls = call_plan(start, config.steps, config.steps_per_call, ends)
        self.log.call_sizes.extend(size for _, size in calls)
        _warn_single_steps(config, calls)
        bar = tqdm(total=config.steps - start, desc=config.strategy, disable=not show)
        placed = placed_calls(self.ts, self.workload.batch_at, calls, config.steps)
        with bar, contextlib.closing(placed) as batches:
            for first, size in calls:
                self._call(batches, first, size)
                bar.update(size)
                if self.log.losses:
                    bar.set_postfix(loss=f"{self.log.losses[-1]:.4f}", refresh=False)
        return self.state, self.log

    def _call(self, batches, first: int, size: int) -> None:
        """One program call of steps ``first .. first + size - 1``: its batch, the call
        before it read (before a new program compiles, or while this one runs), this one
        handed to the devices, and read at once where its state must be seen."""
        if self.hooks:
            for step in range(first, first + size):
                self.hooks.before_step(step)
        batch = self._next_batch(batches, size)
        if self.flying and program_key(self.state, batch, size) not in self.log.programs:
            self.land(self.flying, ahead=0)  # the call before is read, then the program compiled
            self.flying = None
        now = self._dispatch(batch, first, size)
        if self.flying:  # the call before, read while this one runs
            self.land(self.flying, ahead=size)
        self.flying = now
        if self.settles(first + size - 1):
            self.land(now, ahead=0)
            self.flying = None

    def ends_call(self, step: int) -> bool:
        """Whether the loop must see the state after ``step`` before the next step
        starts: the last step, a checkpoint due after it, an evaluation of its state, the
        profiler's window opening or closing after it."""
        return (
            step + 1 == self.config.steps
            or self._save_due(step)
            or bool(self.hooks and self.hooks.settles(step))
        )

    def planned_end(self, first: int | None, step: int) -> bool:
        """``ends_call`` as planned before a run: a checkpoint is planned every
        ``ckpt.every`` steps, and after step ``first`` (the run's first step, into a
        folder with no checkpoint; ``None``: none). The checkpointer decides each save
        when it comes (``_save_due``; a save the plan did not foresee, such as the
        folder's first after a skipped first step, is made at the end of the call that
        holds it)."""
        ckpt = self.ckpt
        saves = bool(ckpt) and (step == first or (step + 1) % ckpt.every == 0)
        return (
            saves or step + 1 == self.config.steps or bool(self.hooks and self.hooks.settles(step))
        )

    def settles(self, step: int) -> bool:
        """Whether the loop waits for ``step`` to end before starting the next: told so
        (``--in-flight no``; ``auto`` is decided before the loop: ``decide_in_flight``),
        the state after it must be seen (``ends_call``), or the step carries rows to the
        next (a pipelined step's carry is dropped on the host after a non-finite step)."""
        return (
            self.config.in_flight == "no"
            or self.ends_call(step)
            or bool(jax.tree.leaves(self.state.carry))
        )

    def _next_batch(self, batches, size: int):
        """The next placed batch, of a call of ``size`` steps; the wait for it (the host
        time on the step path) goes into the log, an equal share for each step."""
        begin = time.perf_counter()
        batch = next(batches)
        self.log.place_times.extend([(time.perf_counter() - begin) / size] * size)
        return batch

    def _dispatch(self, batch, first: int, size: int) -> Flight:
        """Hands the call of steps ``first .. first + size - 1`` (its placed ``batch``)
        to the devices, compiling its program on first use; the new state and the
        ``Flight`` are not waited for."""
        key = program_key(self.state, batch, size)
        compiles = key not in self.log.programs
        if compiles:
            self._note_compile(batch, key, first)
        program, self.log = _compiled(self.ts, self.log, self.state, batch, key)
        t = time.perf_counter()
        self.state, loss = program(self.state, batch)
        return Flight(first, loss, batch, key, compiles, t, size)

    def _note_compile(self, batch, key, first: int) -> None:
        """Records that the call starting at step ``first`` compiles a program, and warns
        where the tables' slots grew after the warm-up steps: the batch's capacity differs
        from that of the last program compiled for calls of its size (a new call size,
        or the carried rows of a pipelined step, compile without a warning)."""
        self.log.compiled_at.append(first)
        capacity = getattr(batch, "capacity", ())
        before = self._capacity_of.get(key[0], capacity)
        self._capacity_of[key[0]] = capacity
        if capacity != before and first >= warm_steps(self.log, self.config.warmup):
            warnings.warn(
                late_compile_message(self.ts, batch, first), RecompileWarning, stacklevel=3
            )

    def land(self, flight: Flight, ahead: int) -> None:
        """Reads ``flight``'s losses and does what follows each of its steps: the
        overflow warning, its times, the non-finite policy, the hooks; then the
        checkpoint after its last step. The state is the newest, ``ahead`` steps past
        ``flight``'s last (the steps of the call in flight; a call whose last step is due
        to be saved or evaluated is landed with nothing after it in flight: ``settles``).

        The call's time is from when the devices could start it (it was handed over, and
        the call before it was read) to when its losses were read, each of its steps
        given an equal share. Its wall time is from the previous call's losses to its
        own: each step gets an equal share, except that the host's time saving,
        evaluating or tracing before the call goes to its first step alone (one step a
        call: the time from loss to loss). No wall time for a call compiled first."""
        losses = loss_values(flight.loss)
        assert len(losses) == flight.size, f"{len(losses)} losses for {flight.size} steps"
        log = self.log
        end = time.perf_counter()
        started = max(flight.begin, log.last_end)
        seconds = (end - started) / flight.size
        gap = started - log.last_end  # the host's work before the call
        held = min(log.held, gap)  # of it, saving, evaluating, tracing: the first step's
        share = seconds + (gap - held) / flight.size  # the rest (logs, waits): every step's
        self.log = log = log._replace(last_key=flight.key, last_end=end, held=0.0)
        for i, loss in enumerate(losses):
            step = flight.step + i
            log.losses.append(loss)
            if loss == math.inf:  # a table's capacity was too small (mark_missed)
                warnings.warn(
                    overflow_message(self.ts, flight.batch), CapacityWarning, stacklevel=2
                )
            log.times.append(seconds)
            log.wall_times.append(None if flight.compiled else share + (held if i == 0 else 0))
            if not math.isfinite(loss):
                self._after_nonfinite(step, ahead + flight.size - 1 - i)
                self.state = self.state._replace(carry=())  # early-fetched rows may hold NaN
            if self.hooks:
                self._timed_hooks(step, loss, seconds, log.programs[flight.key])
            streak = skip_streak(log.skipped, step)
            self._stop_if_stuck(step, streak)
        if ahead:
            assert not self._save_due(step), "a step due to be saved settles"
        else:
            begin = time.perf_counter()
            self._save(step, streak)
            self.log = self.log._replace(held=self.log.held + time.perf_counter() - begin)

    def _timed_hooks(self, step: int, *args) -> None:
        """``hooks.after_step``; its time goes into ``log.held`` where it evaluates or
        closes a trace (work one step in many does, not the per-step log line)."""
        begin = time.perf_counter()
        self.hooks.after_step(step, self.state, *args)
        if self.hooks.settles(step):
            self.log = self.log._replace(held=self.log.held + time.perf_counter() - begin)

    def _after_nonfinite(self, step: int, ahead: int) -> None:
        """A step with a non-finite loss: stop (poisoned parameters, ``--nonfinite
        error``) or record it as skipped. The state is the newest, ``ahead`` steps past
        ``step`` (the step in flight, whose input ``step``'s state was).
        ``FloatingPointError`` stops the run."""
        if not params_finite(self.ts, self.state):
            raise _diverged(step + ahead, seen_at=step)
        if self.config.nonfinite == "error":
            raise FloatingPointError(
                f"non-finite loss or gradient at step {step}: the step was not applied "
                "(use --nonfinite skip to skip such steps)"
            )
        if self.config.nonfinite == "skip":
            self.log.skipped.append(step)

    def _stop_if_stuck(self, step: int, streak: int) -> None:
        """More than ``--max-skipped`` skipped steps in a row: the state they all started
        from yields non-finite gradients or losses; its checkpoint is removed and the
        run stops."""
        if streak <= self.config.max_skipped:
            return
        first = step - streak + 1
        if self.ckpt and first in checkpoint.saved_steps(self.ckpt.directory):
            self.ckpt.delete(first)
        raise FloatingPointError(
            f"steps {first}-{step} ({streak} in a row) had non-finite gradients or losses, "
            f"more than --max-skipped {self.config.max_skipped}: stopping; no checkpoint of "
            "the state they started from is kept (lower --lr?)"
        )

    def _save_due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` (before the skipped-steps rule)."""
        last = step + 1 == self.config.steps
        return bool(self.ckpt) and (last or self.ckpt.should_save(step + 1))

    def _save(self, step: int, streak: int) -> None:
        """Saves after ``step`` when due; never non-finite parameters, nor again the
        state a run of skipped steps keeps (it is the state from before them)."""
        last = step + 1 == self.config.steps
        if not self._save_due(step) or (streak and not last):
            return
        if not params_finite(self.ts, self.state):
            raise _diverged(step)
        self.ckpt.save_state(step + 1, self.ts, self.state, force=last)


def run_steps(config: RunConfig, ts, workload, state, start: int, ckpt, show: bool, hooks=None):
    """``StepLoop(config, ts, workload, ckpt, hooks).run(state, start, show)``: the
    steps ``start .. config.steps - 1`` of a run; returns ``(state, log)``."""
    return StepLoop(config, ts, workload, ckpt, hooks).run(state, start, show)


def _warn_single_steps(config: RunConfig, calls: list) -> None:
    """A warning when ``--steps-per-call`` asked for several steps a call and no call of
    that many fits between the steps whose state must be seen."""
    size = config.steps_per_call
    if size > 1 and calls and all(n == 1 for _, n in calls):
        warnings.warn(
            f"--steps-per-call {size}: no call of {size} steps fits between the steps "
            "whose state is saved, evaluated or traced, or in --steps; every step runs "
            "one a call",
            stacklevel=3,
        )


def in_flight_choice(choice: str, platform: str, processes: int, cores: int) -> str:
    """``--in-flight`` decided: ``auto`` is ``no`` where the devices are CPUs
    (``platform``) and a host runs more of the job's ``processes`` than it has
    ``cores``, else ``yes``; ``yes`` and ``no`` stay. Where processes outnumber cores, a
    host thread working while its program runs takes a core from another process's
    program instead of filling idle time (measured in the lab notebook of 2026-12-02,
    "The step's fixed costs").

    Args:
      choice: ``auto``, ``yes`` or ``no``.
      platform: the devices' platform (``cpu``, ``gpu``, ...).
      processes: the job's processes on its busiest host.
      cores: the cores they may run on (affinity masks, capped by a CPU quota).

    Returns:
      ``yes`` or ``no``.

    Example:
        >>> in_flight_choice("auto", "cpu", processes=4, cores=2)
        'no'
        >>> in_flight_choice("auto", "gpu", processes=8, cores=2)
        'yes'
    """
    if choice != "auto":
        return choice
    return "no" if platform == "cpu" and processes > cores else "yes"


def decide_in_flight(config: RunConfig) -> RunConfig:
    """``config`` with ``--in-flight auto`` decided for the whole job from its busiest
    host (``runtime.busiest_host``, ``in_flight_choice``): every process makes the same
    choice, or their programs (a step, the parameters' finite check after a non-finite
    loss) would run in different orders and their collectives would not meet.

    Args:
      config: the run; its ``in_flight`` kept unless ``auto``.

    Returns:
      ``config`` with ``in_flight`` ``yes`` or ``no``. Call it on every process (one
      collective in a job of several).
    """
    if config.in_flight != "auto":
        return config
    busiest = runtime.busiest_host()
    platform = jax.devices()[0].platform
    choice = in_flight_choice("auto", platform, busiest.processes, busiest.cores)
    return dataclasses.replace(config, in_flight=choice)


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
