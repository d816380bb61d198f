"""Start-up measurements: the fusion threshold of ``--bucket-mb auto``, the table plan
of ``--plan auto``, the link fitted on this cluster and the local work ``adaptive``
prices with it.

Before training, ``fusion.search_threshold`` binary-searches the distinct bucket plans
of the model's gradient leaves (``fusion.candidate_thresholds``); each evaluation builds
the train step with that threshold and times a few steps of it on this cluster. With
``--strategy adaptive --link-gbit 0`` the local work of each sparse strategy is timed
at the run's bucket sizes (``topk.local_cost.measure_local_work``), and the link's alpha
and beta fitted by timed all-reduces (``calibrated_link``). ``--plan auto`` times a few
steps of each of the planner's candidate plans (``planner.candidate_plans``) and keeps
the fastest. Every timing is averaged over the processes (``runtime.agreed_mean``), so
that every process makes the same choice.

References:
    Peng et al., "TopKA2A", ICPP 2024 (binary-searched fusion threshold).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from experiments.train import histogram
from experiments.train.config import RunConfig
from models import get_workload
from sparsecomm_jax import optimizers, parse_strategy, place_for_step, planner, runtime
from sparsecomm_jax.comm import costmodel, fusion, wire
from sparsecomm_jax.comm.costmodel import Link
from sparsecomm_jax.strategies.registry import Strategy
from sparsecomm_jax.topk import local_cost

TIMED_STEPS = 3  # per evaluation; the first (warm-up) is not counted


def leaf_sizes(config: RunConfig) -> list[int]:
    """Entries of each parameter leaf of the model, in tree order (no arrays made)."""
    workload = get_workload(config.model, **config.model_overrides())
    params = jax.eval_shape(workload.init, jax.random.key(config.seed))
    return [int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params)]


def local_work(config: RunConfig):
    """``costmodel.LocalWork`` of the sparse strategies at this run's bucket sizes."""
    sizes = leaf_sizes(config)
    plan = fusion.plan_buckets(sizes, int(float(config.bucket_mb) * 2**20))
    buckets = tuple(sorted({sum(sizes[i] for i in bucket) for bucket in plan}))
    return _measure_local_work(buckets, config.density, config.devices)


@functools.cache  # once per process and bucket sizes
def _measure_local_work(buckets: tuple[int, ...], density: float, devices: int):
    return local_cost.measure_local_work(buckets, density, devices)


def selectable_thresholds(sizes: list[int], density: float) -> list[int]:
    """``fusion.candidate_thresholds`` whose every bucket keeps at least one entry at
    ``density`` (``round(density * n) >= 1``); the largest (one bucket) is always kept.

    Example:
        >>> selectable_thresholds([8, 400, 8], 0.01)  # an 8-entry bucket keeps none
        [1664]
    """
    candidates = fusion.candidate_thresholds(sizes)

    def selectable(threshold: int) -> bool:
        plan = fusion.plan_buckets(sizes, threshold)
        return all(round(density * sum(sizes[i] for i in b)) >= 1 for b in plan)

    return [c for c in candidates[:-1] if selectable(c)] + candidates[-1:]


def measured_step_s(config: RunConfig, build: Callable, bucket_bytes: int) -> float:
    """Median seconds of a step built with ``bucket_bytes`` (``TIMED_STEPS`` steps, the
    first not counted; ``interleaved_step_seconds`` of this one config).

    Args:
      config: the run; its ``bucket_mb`` is replaced.
      build: ``config -> (workload, TrainStep)`` (``experiments.train.build``).
      bucket_bytes: the fusion threshold to time.

    Returns:
      Seconds per step, the same on every process.
    """
    timed = dataclasses.replace(config, bucket_mb=repr(bucket_bytes / 2**20))
    return interleaved_step_seconds([timed], build, rounds=1, steps=TIMED_STEPS)[0]


def choose_bucket(config: RunConfig, build: Callable) -> tuple[RunConfig, dict[str, Any]]:
    """The config with the searched ``bucket_mb``, and the search's record.

    Args:
      config: a run with ``bucket_mb == "auto"``.
      build: ``config -> (workload, TrainStep)``.

    Returns:
      ``(config, {"bucket_bytes", "evaluations", "step_s"})``; ``step_s`` maps each
      timed threshold (bytes, as a string) to its measured step time.

    Example:
        >>> # python -m experiments.train --strategy topk_allgather --bucket-mb auto
    """
    sizes = leaf_sizes(config)
    timed: dict[str, float] = {}

    def cost(bucket_bytes: int) -> float:
        timed[str(bucket_bytes)] = measured_step_s(config, build, bucket_bytes)
        return timed[str(bucket_bytes)]

    candidates = selectable_thresholds(sizes, config.density)
    best, evaluations = fusion.search_threshold(cost, candidates)
    chosen = dataclasses.replace(config, bucket_mb=repr(best / 2**20))
    return chosen, {"bucket_bytes": best, "evaluations": evaluations, "step_s": timed}


@functools.cache
def calibrated_link(devices: int) -> dict[str, Any]:
    """``costmodel.calibrate`` on the data mesh: alpha (s), beta (s/B), the timed points.
    Once per process and device count: ``--link-gbit 0`` with ``--calibrate`` reuses the
    link fitted before training."""
    link, points = costmodel.calibrate(runtime.data_mesh(devices))
    return {"alpha": link.alpha, "beta": link.beta, "points": points}


def plan_link(config: RunConfig) -> Link:
    """The link the planner prices layouts on: ``--link-gbit`` and ``--link-alpha-us``,
    or with ``--link-gbit 0`` the one calibrated on this cluster."""
    if config.link_gbit > 0:
        return Link.from_bandwidth(config.link_gbit, config.link_alpha_us * 1e-6)
    fitted = calibrated_link(config.devices)
    return Link(fitted["alpha"], fitted["beta"])


PLAN_ROUNDS, PLAN_STEPS = 4, 3  # turns over the candidate plans, steps of each per turn
DEFAULT_BUCKET_MB = RunConfig().bucket_mb  # the threshold candidates are timed at


def interleaved_step_seconds(
    configs: list[RunConfig],
    build: Callable,
    names: list[str] | None = None,
    rounds: int = PLAN_ROUNDS,
    steps: int = PLAN_STEPS,
) -> list[float]:
    """Median seconds of a step of each config, timed in turns: every config is built
    first, then ``rounds`` turns run ``steps`` steps of each, so a change of load on the
    host during the timing falls on all of them. A config's program compiles at its
    first step, which is not counted; each median is the same on every process
    (``runtime.agreed_mean``). Every config's state is held at once.

    Args:
      configs: the runs to time (their batches from step 0 on, again from 0 past the
        end).
      build: ``config -> (workload, TrainStep)`` (``experiments.train.build``).
      names: one per config, for the progress lines (rank 0; ``None``: no lines).
      rounds: turns over the configs.
      steps: steps of each config per turn.

    Returns:
      Seconds per step, one per config.
    """
    built = []
    for k, (config, name) in enumerate(zip(configs, names or [None] * len(configs), strict=True)):
        if name and jax.process_index() == 0:  # each costs a compile (at its first step)
            print(f"timing: building {k + 1}/{len(configs)} ({name})", file=sys.stderr, flush=True)
        built.append(build(config))
    states = [ts.state for _, ts in built]
    times: list[list[float]] = [[] for _ in configs]
    for turn in range(rounds):
        for k, ((workload, ts), config) in enumerate(zip(built, configs, strict=True)):
            for i in range(steps):
                step = (turn * steps + i) % config.steps
                batch = place_for_step(ts, workload.batch_at, step, config.steps)
                start = time.perf_counter()
                states[k], loss = ts.step(states[k], batch)
                jax.block_until_ready(loss)
                if turn or i:  # the first step of each warms up
                    times[k].append(time.perf_counter() - start)
    return [runtime.agreed_mean(statistics.median(t)) for t in times]


def step_may(strategy: Strategy, workers: int) -> planner.May | None:
    """What the step of ``strategy`` constrains the planner to: one that stores the
    tables of its own layout unpadded (``Strategy.unpadded``: ``embrace_2d``'s column
    tables) takes there only tables whose split dimension divides by the workers."""
    return planner.unpadded(workers) if strategy.unpadded else None


def choose_plan(
    config: RunConfig, build: Callable, batches: int = 16
) -> tuple[RunConfig, dict[str, Any]]:
    """``--plan auto`` and ``--plan model``: the config with the planner's layouts as its
    ``--plan`` (JSON), and the plan's record (printed on rank 0).

    ``model`` takes the plan of least modelled time. ``auto`` times steps of each of
    ``planner.candidate_plans`` (the best modelled plan of each set of sharded exchanges,
    and each layout for every table) on this cluster, in turns
    (``interleaved_step_seconds``), and keeps the fastest: the model prices bytes and
    messages, not the layouts' local work.

    Args:
      config: a run with ``plan`` ``"auto"`` or ``"model"``.
      build: ``config -> (workload, TrainStep)`` (``experiments.train.build``), to
        time the candidates of ``auto``.
      batches: sample batches the tables' ids are measured on (after those the
        histogram counts, when it is counted from the run's own batches). A layout's
        buffers grow to the largest need of any batch, padded (a power of two for
        row-wise buckets): the more batches, the closer the sample's largest.

    Returns:
      ``(config, record)``: the record is the chosen ``Plan.to_json()`` with, for
      ``auto``, ``candidates``: each candidate's layouts, modelled and measured seconds.
    """
    workload = get_workload(config.model, **config.model_overrides())
    params = workload.init(jax.random.key(config.seed))
    counts = histogram.planner_counts(config, workload, params)  # the hot rows' H
    # counted from the run's first batches: the buckets are measured on the ones after,
    # as a step after them would find them
    first = 0 if config.histogram else histogram.HISTOGRAM_BATCHES
    stats = planner.table_stats(
        workload.loss,
        params,
        workload.embedding_paths,
        [workload.batch_at(s) for s in range(first, first + batches)],
        config.devices,
        workload.replicated_keys,
        counts=counts,
    )
    memory = config.plan_memory_mb * 2**20 or None
    slots = optimizers.get(config.optimizer).slots
    link, codecs = plan_link(config), wire.parse(config.comm_dtype)
    may = step_may(parse_strategy(config.strategy).strategy, config.devices)
    try:
        candidates = planner.candidate_plans(
            stats, config.devices, link, memory, slots, wire=codecs, may=may
        )
    except ValueError as e:  # the memory the flag gives, as the user typed it
        if memory is None:
            raise
        raise ValueError(
            f"--plan-memory-mb {config.plan_memory_mb:g} on {config.devices} devices: {e}"
        ) from None
    if config.plan == "model":
        plan, measured = candidates[0], []
    else:
        # the fusion threshold is searched after the plan: the candidates are timed at
        # the default one
        bucket = config.bucket_mb if config.bucket_mb != "auto" else DEFAULT_BUCKET_MB

        def time_plans(plans: list[planner.Plan]) -> list[float]:
            timed = [dataclasses.replace(config, plan=p.layouts(), bucket_mb=bucket) for p in plans]
            names = [planner.describe(p.layouts()) for p in plans]
            return interleaved_step_seconds(timed, build, names)

        plan, measured = planner.choose_measured(candidates, time_plans)
    record = plan.to_json()
    if measured:
        record["candidates"] = [
            {"layouts": c.layouts().to_json(), "modelled_s": c.seconds, "measured_s": s}
            for c, s in zip(candidates, measured, strict=True)
        ]
    if jax.process_index() == 0:
        print(plan.table(), file=sys.stderr)
        for c in record.get("candidates", []):
            print(_candidate_line(c), file=sys.stderr)
    return dataclasses.replace(config, plan=plan.layouts()), record


def _candidate_line(candidate: dict[str, Any]) -> str:
    """One timed candidate: its layouts counted, modelled and measured milliseconds."""
    return (
        f"candidate ({planner.describe(candidate['layouts'])}): modelled "
        f"{candidate['modelled_s'] * 1e3:.2f} ms, measured {candidate['measured_s'] * 1e3:.2f} "
        "ms a step"
    )


def adaptive_link(config: RunConfig) -> Link:
    """The link adaptive prices buckets with: ``--link-gbit`` and ``--link-alpha-us``,
    or with ``--link-gbit 0`` the link calibrated on this cluster before training, with
    the local work of each strategy measured at the run's bucket sizes."""
    if config.link_gbit > 0:
        return Link.from_bandwidth(config.link_gbit, config.link_alpha_us * 1e-6)
    fitted = calibrated_link(config.devices)
    return Link(fitted["alpha"], fitted["beta"], local_work(config))
