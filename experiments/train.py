"""Trains one model with one strategy and writes a JSON result.

    python -m experiments.train --model lstm_lm --strategy dense --devices 8 \\
        --steps 20 --seed 0 --out run.json

On a CPU-only host ``--devices N`` simulates N devices; on GPU hosts it takes the first N
GPUs. Under ``python -m sparsecomm_jax.launch`` every process joins one job and rank 0
writes the result.

Every flag, output location and checkpoint folder is checked before JAX starts; a bad
one is a one-line error (exit status 2). A checkpoint folder holds one run: a fresh run
refuses another run's checkpoints (unless --overwrite), --resume refuses a configuration
that changes the trajectory, and a lock keeps two processes out of one folder.

The pieces: ``config`` (the flags), ``validate`` (their checks), ``checkpoints`` (the
folder), ``loop`` (the steps), ``record`` (the result), ``runlog`` (logs and traces).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from typing import Any

import jax
import optax

import sparsecomm_jax as sc
from experiments import runlog
from experiments.checkpoints import claim_checkpoint_dir, resumed_config, start_state
from experiments.config import OneLineErrors, RunConfig, add_arguments, from_namespace
from experiments.loop import decide_in_flight, run_overlapped, run_steps
from experiments.record import result, write_json
from experiments.startup import adaptive_link, choose_bucket, choose_plan
from experiments.validate import check_outputs, in_flags, table_update_of, validate
from models import get_workload
from sparsecomm_jax import launch, optimizers, parse_strategy, runtime
from sparsecomm_jax.embedding.layouts import TablePlan
from sparsecomm_jax.errors import ArgumentError

__all__ = ["build", "main", "start_devices", "train_and_evaluate", "validate", "write_json"]


def start_devices(devices: int) -> int:
    """Joins a multi-process job (launcher or scheduler), else simulates ``devices`` CPU
    devices (0: the default count); returns the rank."""
    if not runtime.backend_started():
        runtime.enable_collective_overlap()  # GPU: async collectives overlap compute
    rank, processes = runtime.initialize_distributed()
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


def build(config: RunConfig):
    """The workload and ``TrainStep`` of ``config`` (JAX must be started); with
    ``--overlap`` an ``Overlapped`` trainer instead of the ``TrainStep``."""
    workload = get_workload(config.model, **config.model_overrides())
    _check_tables(config, workload)
    try:
        mesh = runtime.data_mesh(config.devices)
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
    if config.overlap:
        return workload, sc.make_overlapped(workload.loss, optimizer, mesh, params, **common)
    try:
        ts = _make_train_step(config, workload, mesh, params, optimizer, common)
    except ArgumentError as e:
        raise in_flags(e) from None
    if config.steps_per_call > 1 and not ts.scannable:
        raise ValueError(
            f"--steps-per-call {config.steps_per_call}: --strategy {config.strategy} runs "
            f"as {ts.runs_as}, a pipelined step (its steps carry rows and look ahead), one "
            "step a call"
        )
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
        **common,
        **_aggregator_options(config),
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
      to its loss; ``experiments.loop`` keeps one step in flight unless ``--in-flight``
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
    validate(dataclasses.replace(config, devices=config.devices or 1))  # before JAX starts
    check_outputs(config)
    runlog.check_run_io(config)
    config = resumed_config(config)
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
        workload, ts = build(config)
        show = progress and rank == 0
        if config.overlap:
            _, log = run_overlapped(config, ts, workload, show)
            return {**result(config, workload, log, 0, rank), "overlap": True}
        config = decide_in_flight(config)  # auto: by the busiest host's processes and cores
        ckpt, state, start = start_state(config, ts, lock)
        hooks = runlog.RunHooks(config, workload, ts, rank, start)
        state, log = hooks.guard(run_steps, config, ts, workload, state, start, ckpt, show, hooks)
        record = result(config, workload, log, start, rank)
        record["runs_as"] = ts.runs_as  # embrace_2d runs as embrace where nothing overlaps
        record.update(hooks.finish(state))
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


def make_parser() -> argparse.ArgumentParser:
    """The command line: one flag per ``RunConfig`` field, one-line errors."""
    parser = OneLineErrors(
        prog="python -m experiments.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(devices=0)  # every device of the job
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line: trains, writes ``--out`` and prints one line; returns the exit
    status (2 for a bad flag, said in one line on stderr, as for any error a user can
    act on)."""
    try:
        config = from_namespace(make_parser().parse_args(argv))
    except SystemExit as e:  # --help (0), or a flag argparse refused (2, said already)
        return e.code if isinstance(e.code, int) else 2
    try:
        record = train_and_evaluate(config)
        if record["rank"] == 0:
            write_json(record, config.out)
    except (ValueError, FloatingPointError, OSError, runtime.JobError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if record["rank"] == 0:
        items = next(k for k in record if k.endswith("_per_s"))
        print(
            f"{config.strategy}: final loss {record['losses'][-1]:.4f}, "
            f"step {record['step_time_s'] * 1e3:.1f} ms "
            f"({(record['wall_time_s'] or record['step_time_s']) * 1e3:.1f} ms wall), "
            f"{items} {record[items]:.0f}, "
            f"comm {record['comm_bytes_per_step'] / 1e6:.3f} MB/step/worker"
        )
    return 0


def cli() -> None:
    """``main`` as a process: a failed run ends at once with a non-zero status instead
    of waiting at shutdown for threads a failure left behind (orbax, coordination)."""
    try:
        code = main()
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2)
        code = e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    sys.exit(0)


if __name__ == "__main__":
    cli()
