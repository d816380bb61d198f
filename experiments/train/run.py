"""One run: ``train_and_evaluate(config)`` builds the model and the step, runs the
loop and returns the result record.

In order: the config and every location it writes are checked before JAX starts
(``validate``, ``runlog.check_run_io``); the checkpoint folder is claimed
(``checkpoints``); the devices start (``start_devices``); start-up measurements decide
what the flags leave open (``startup``: ``--plan auto``, ``--bucket-mb auto``); the step
is built (``build``); the loop runs it (``loop``) with its logs (``runlog``); the result
is recorded (``record``).

Example:
    >>> from experiments.train.config import RunConfig
    >>> from experiments.train.run import train_and_evaluate
    >>> record = train_and_evaluate(RunConfig(vocab=50, dim=8, hidden=8, seq_len=4,
    ...                                       batch=8, steps=2, devices=2), progress=False)
    >>> len(record["losses"])
    2
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any

import jax
import optax

import sparsecomm_jax as sc
from experiments.train import runlog
from experiments.train.checkpoints import claim_checkpoint_dir, resumed_config, start_state
from experiments.train.config import RunConfig
from experiments.train.histogram import hot_plan
from experiments.train.loop import decide_in_flight, run_overlapped, run_steps
from experiments.train.record import deferred_entries, managed_tables, result
from experiments.train.startup import adaptive_link, choose_bucket, choose_plan
from experiments.train.validate import check_outputs, in_flags, table_update_of, validate
from models import get_workload
from sparsecomm_jax import distributed, launch, optimizers, parse_strategy, runtime
from sparsecomm_jax.embedding.layout_registry import TablePlan
from sparsecomm_jax.errors import ArgumentError

__all__ = ["build", "make_optimizer", "start_devices", "train_and_evaluate"]


def start_devices(devices: int) -> int:
    """Joins a multi-process job (launcher or scheduler), else simulates ``devices`` CPU
    devices (0: the default count); returns the rank."""
    if not runtime.backend_started():
        runtime.enable_collective_overlap()  # GPU: async collectives overlap compute
    rank, processes = distributed.initialize_distributed()
    launched = os.environ.get(launch.ENV_LOCAL_DEVICES)  # the launcher set the count
    if processes == 1 and not launched and not runtime.backend_started():
        runtime.simulate_cpu_devices(devices or RunConfig.devices)
    return rank


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    """The optax optimizer of ``--optimizer`` at ``--lr`` (``optimizers.OPTIMIZERS``)."""
    return optimizers.get(name).make(lr)


def _aggregator_options(config: RunConfig) -> dict[str, Any]:
    kind = sc.AGGREGATORS[parse_strategy(config.strategy).aggregator]
    if not kind.sparse:
        return {}
    options = {
        "density": config.density,
        "bucket_bytes": int(float(config.bucket_mb) * 2**20),
        "selector": config.selector,
    }
    if kind.link:
        options["link"] = adaptive_link(config)
    for option in kind.options:  # a field of the config each; 0 = the default
        options[option] = getattr(config, option) or None
    return options


COLLECTIVES_OVERLAP = {"auto": None, "yes": True, "no": False}  # --collectives-overlap


def _check_tables(config: RunConfig, workload) -> None:
    """A strategy that shards embedding tables on a model without any, told in flags."""
    name = parse_strategy(config.strategy)
    if name.strategy.needs_tables and not workload.embedding_paths:
        usable = sorted(n for n, s in sc.STRATEGIES.items() if not s.needs_tables)
        raise ValueError(
            f"--model {config.model} has no embedding tables for --strategy "
            f"{name.tables} to shard; use --strategy "
            f"{', '.join(usable)} or a top-k one (e.g. topk_a2a)"
        )


def build(config: RunConfig, mesh=None):
    """The workload and ``TrainStep`` of ``config`` (JAX must be started); with
    ``--overlap`` an ``Overlapped`` trainer instead of the ``TrainStep``. ``mesh``: the
    devices to build for (default ``--devices`` of this job's: ``runtime.data_mesh``;
    ``experiments.gpu_schedule`` gives compile-only GPUs)."""
    workload = get_workload(config.model, **config.model_overrides())
    _check_tables(config, workload)
    try:
        mesh = runtime.data_mesh(config.devices) if mesh is None else mesh
    except ArgumentError as e:
        raise in_flags(e) from None
    params = workload.init(jax.random.key(config.seed))
    common = dict(
        replicated_keys=workload.replicated_keys,
        embedding_paths=workload.embedding_paths,
        id_keys=workload.id_keys,
        nonfinite=config.nonfinite,
        table_update=table_update_of(config),
    )
    optimizer = make_optimizer(config.optimizer, config.lr)
    config = dataclasses.replace(config, plan=hot_plan(config, workload, params))
    if config.overlap:
        return workload, sc.make_overlapped(workload.loss, optimizer, mesh, params, **common)
    try:
        ts = _make_train_step(config, workload, mesh, params, optimizer, common)
    except ArgumentError as e:
        raise in_flags(e) from None
    if config.steps_per_call > 1 and not ts.scannable:
        why = f"--strategy {config.strategy} runs as {ts.runs_as}"
        if ts.vocabulary is not None:  # placing a batch maps its ids: one batch a call
            why = f"the managed tables {ts.vocabulary.names()} map each batch's ids as it is placed"
        raise ValueError(f"--steps-per-call {config.steps_per_call}: {why}, one step a call")
    return workload, ts


def _make_train_step(config: RunConfig, workload, mesh, params, optimizer, common: dict):
    """``make_train_step`` of ``config``'s strategy and its options."""
    return sc.make_train_step(
        workload.loss,
        optimizer,
        mesh,
        params,
        config.strategy,
        capacity=config.capacity or None,
        comm_dtype=config.comm_dtype,
        table_layouts=config.plan if isinstance(config.plan, TablePlan) else None,
        collectives_overlap=COLLECTIVES_OVERLAP[config.collectives_overlap],
        replicas=config.replicas,
        **common,
        **_aggregator_options(config),
    )


def plan_origin(asked: RunConfig, config: RunConfig) -> str:
    """Where a resumed run's plan came from, when ``resumed_config`` took it from the
    checkpoint folder in place of the ``--plan`` asked (``""`` otherwise): what a refusal
    to build that plan adds, since the user did not write the plan."""
    if config.plan == asked.plan:
        return ""
    return (
        f" (this plan is the one the checkpoints in --checkpoint-dir {config.checkpoint_dir} "
        f"were made with, kept for --plan {asked.plan} on --resume; give --plan with a plan "
        f"for {config.devices} devices to resume with another)"
    )


def train_and_evaluate(config: RunConfig, progress: bool = True) -> dict[str, Any]:
    """Runs ``config`` and returns the result record (see the module doc).

    Args:
      config: the run; it, its output locations and its checkpoint folder are checked
        before JAX starts.
      progress: show a progress bar (rank 0 only).

    Returns:
      A JSON-ready dict: model, strategy, devices, steps, losses, step_times_s,
      step_time_s (the median time after warm-up from when the devices could start a step
      to its loss; ``experiments.train.loop`` keeps one step in flight unless ``--in-flight``
      decides no), wall_time_s (the median time from one step's loss to the next one's:
      logging, waiting for the batch, the program), tokens_per_s or samples_per_s (per
      wall_time_s), place_time_s, comm_bytes_per_step, collectives, peak_memory_bytes,
      compile_s, start_step, skipped_steps, the fitted ``link`` with ``--calibrate``,
      ``bucket_search`` with ``--bucket-mb auto``, and the full config; with held-out
      data ``heldout`` (final metrics per split) and ``eval`` (every ``--eval-every``
      steps); ``log_dir`` and ``trace_dir`` when written.

    Raises:
      ValueError: a bad flag, output location or checkpoint folder.
      FloatingPointError: the run diverged (see ``--nonfinite``, ``--max-skipped``).
      OSError: a checkpoint could not be written.
    """
    # before JAX starts; --devices 0 (every device) is counted from the launcher's
    # variables where it started the job (every rank refuses alike, none while the others
    # assemble), else once JAX has started, and checked then with --replicas
    known = config.devices or distributed.launched_devices()
    early = {"devices": known} if known else {"devices": 1, "replicas": 1}
    validate(dataclasses.replace(config, **early))
    check_outputs(config)
    runlog.check_run_io(config)
    asked, config = config, resumed_config(config)
    lock = claim_checkpoint_dir(config)
    ckpt, log_lock = None, None
    try:
        log_lock = runlog.claim_log_dir(config)
        rank = start_devices(config.devices)
        if not config.devices:  # --devices left out: every device of the job
            config = dataclasses.replace(config, devices=jax.device_count())
            validate(config)
        search = plan = None
        if config.plan in ("auto", "model"):  # a layout per table: measured or modelled
            config, plan = choose_plan(config, build)
        if config.bucket_mb == "auto":  # the fusion threshold of least measured step time
            config, search = choose_bucket(config, build)
        try:
            workload, ts = build(config)
        except ValueError as e:
            raise ValueError(f"{e}{plan_origin(asked, config)}") from None
        show = progress and rank == 0
        if config.overlap:
            _, log = run_overlapped(config, ts, workload, show)
            return {**result(config, workload, log, 0, rank), "overlap": True}
        config = decide_in_flight(config)  # auto: by the busiest host's processes and cores
        began = time.perf_counter()
        ckpt, state, start = start_state(config, ts, lock)
        restore_s = time.perf_counter() - began
        hooks = runlog.RunHooks(config, workload, ts, rank, start)
        state, log = hooks.guard(run_steps, config, ts, workload, state, start, ckpt, show, hooks)
        record = result(config, workload, log, start, rank)
        record["runs_as"] = ts.runs_as  # embrace_2d runs as embrace where nothing overlaps
        if ts.vocabulary is not None:  # what the managed tables hold, admit and evict
            record["managed_tables"] = managed_tables(ts.vocabulary)
        if config.resume:  # reading the checkpoint, converted where its form differs
            record["restore_s"] = round(restore_s, 3)
        record.update(hooks.finish(state))
        record["deferred_entries"] = deferred = deferred_entries(state)
        if deferred:
            warnings.warn(
                f"{deferred} selected entries waited in a residual for a slot at their owner "
                "(sent in a later step, none lost); to send each when it is selected, raise "
                "--capacity-factor (0 = the mean share plus six standard deviations; try 2)",
                stacklevel=2,
            )
        if search:
            record["bucket_search"] = search
        if plan:
            record["plan"] = plan
        return record
    finally:
        if ckpt:
            ckpt.close()
        for held in (lock, log_lock):
            if held:
                held.release()
