"""Trains one model with one strategy and writes a JSON result.

    python -m experiments.train --model lstm_lm --strategy dense --devices 8 \\
        --steps 20 --seed 0 --out run.json

On a CPU-only host ``--devices N`` simulates N devices; on GPU hosts it takes the first N
GPUs. Under ``python -m sparsecomm_jax.launch`` every process joins one job and rank 0
writes the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from experiments import runlog
from experiments.config import RunConfig, add_arguments, from_namespace

if TYPE_CHECKING:
    from sparsecomm_jax.costmodel import Link

OPTIMIZERS = ("sgd", "momentum", "adam", "adagrad", "lazy_adam")
TABLE_UPDATES = ("auto", "sparse", "dense")


def validate(config: RunConfig) -> None:
    """Checks a config before JAX starts; raises ``ValueError`` naming the bad field."""
    from models import MODELS
    from sparsecomm_jax.sparsify import SELECTORS
    from sparsecomm_jax.train import strategy_names

    if config.model not in MODELS:
        raise ValueError(f"unknown --model {config.model!r}; choose one of {sorted(MODELS)}")
    if config.strategy not in strategy_names():
        raise ValueError(
            f"unknown --strategy {config.strategy!r}; choose one of {strategy_names()}"
        )
    if not 0 < config.density <= 1:
        raise ValueError(f"--density must be in (0, 1], got {config.density}")
    if config.selector not in SELECTORS:
        raise ValueError(f"unknown --selector {config.selector!r}; choose one of {SELECTORS}")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown --optimizer {config.optimizer!r}; choose one of {OPTIMIZERS}")
    row_updates(config)
    for name in ("steps", "devices", "batch"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(config, name)}")
    if config.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {config.warmup}")
    if config.batch % config.devices:
        raise ValueError(f"--batch {config.batch} is not divisible by --devices {config.devices}")
    if config.link_gbit < 0:
        raise ValueError(f"--link-gbit must be >= 0 (0 = calibrate), got {config.link_gbit}")
    if config.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {config.lr}")
    if config.nonfinite not in ("skip", "error", "off"):
        raise ValueError(f"--nonfinite must be skip, error or off, got {config.nonfinite!r}")
    if config.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0, got {config.checkpoint_every}")
    if (config.resume or config.checkpoint_every) and not config.checkpoint_dir:
        raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")


def start_devices(devices: int) -> int:
    """Joins a multi-process job (launcher or scheduler), else simulates ``devices`` CPU
    devices (0: the default count); returns the rank."""
    from sparsecomm_jax import runtime

    if not runtime.backend_started():
        runtime.enable_collective_overlap()  # GPU: async collectives overlap compute
    rank, processes = runtime.initialize_distributed()
    if processes == 1 and not runtime.backend_started():
        runtime.simulate_cpu_devices(devices or RunConfig.devices)
    return rank


def make_optimizer(name: str, lr: float):
    """The optax optimizer of ``--optimizer`` (``lazy_adam``: Adam for the dense layers)."""
    import optax

    if name == "momentum":
        return optax.sgd(lr, momentum=0.9)
    return {"sgd": optax.sgd, "adam": optax.adam, "adagrad": optax.adagrad,
            "lazy_adam": optax.adam}[name](lr)  # fmt: skip


def row_updates(config: RunConfig) -> bool:
    """Whether tables get the row-sparse update (``--table-update``: ``auto`` = when the
    strategy and ``--optimizer`` allow); ``ValueError`` for combinations that cannot."""
    from sparsecomm_jax import rowgrad, rowwise
    from sparsecomm_jax.train import STRATEGIES, parse_strategy

    if config.table_update not in TABLE_UPDATES:
        raise ValueError(
            f"--table-update must be one of {TABLE_UPDATES}, got {config.table_update!r}"
        )
    if config.comm_dtype not in rowgrad.COMM_DTYPES:
        raise ValueError(
            f"unknown --comm-dtype {config.comm_dtype!r}; "
            f"choose one of {sorted(rowgrad.COMM_DTYPES)}"
        )
    can = STRATEGIES[parse_strategy(config.strategy)[0]].row_updates
    has_form = config.optimizer in rowwise.ROW_OPTIMIZERS
    sparse = config.table_update == "sparse" or (config.table_update == "auto" and can and has_form)
    if sparse and not has_form:
        raise ValueError(
            f"--optimizer {config.optimizer} has no row-sparse table update; "
            f"use --table-update dense or one of {sorted(rowwise.ROW_OPTIMIZERS)}"
        )
    if sparse and not can:
        rows = [s.name for s in STRATEGIES.values() if s.row_updates]
        raise ValueError(f"--table-update sparse needs a strategy among {rows}")
    if config.optimizer == "lazy_adam" and not sparse:
        raise ValueError(
            "--optimizer lazy_adam is a row-sparse table update: use it with "
            "--table-update auto or sparse and embrace, embrace_rowwise or sparse_allgather"
        )
    if config.comm_dtype != "float32" and parse_strategy(config.strategy)[1] != "dense":
        raise ValueError(
            f"--comm-dtype {config.comm_dtype} replaces the dense all-reduce: no top-k"
        )
    if config.comm_dtype != "float32" and not sparse:
        raise ValueError(
            f"--comm-dtype {config.comm_dtype} needs the row-sparse table update "
            "(--table-update sparse with sgd, adagrad or lazy_adam)"
        )
    return sparse


def _peak_memory(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        return int(total - m.alias_size_in_bytes)
    except Exception:  # memory analysis is optional on some backends
        return None


def _aggregator_options(config: RunConfig) -> dict[str, Any]:
    from sparsecomm_jax.train import parse_strategy

    agg = parse_strategy(config.strategy)[1]
    if agg == "dense":
        return {}
    options = {"density": config.density, "bucket_bytes": int(config.bucket_mb * 2**20)}
    if agg != "gtopk":
        options["selector"] = config.selector
    if agg == "adaptive":
        options["link"] = adaptive_link(config)
    return options


def adaptive_link(config: RunConfig) -> Link:
    """The link adaptive prices buckets with: ``--link-gbit`` and ``--link-alpha-us``,
    or with ``--link-gbit 0`` the link calibrated on this cluster before training."""
    from sparsecomm_jax.costmodel import Link

    if config.link_gbit > 0:
        return Link.from_bandwidth(config.link_gbit, config.link_alpha_us * 1e-6)
    fitted = calibrated_link(config.devices)
    return Link(fitted["alpha"], fitted["beta"])


def build(config: RunConfig):
    """The workload, mesh and ``TrainStep`` of ``config`` (JAX must be started)."""
    import jax

    from models import get_workload
    from sparsecomm_jax import rowwise, runtime, train

    workload = get_workload(config.model, **config.model_overrides())
    mesh = runtime.data_mesh(config.devices)
    params = workload.init(jax.random.key(config.seed))
    ts = train.make_train_step(
        workload.loss,
        make_optimizer(config.optimizer, config.lr),
        mesh,
        params,
        config.strategy,
        replicated_keys=workload.replicated_keys,
        embedding_paths=workload.embedding_paths,
        id_keys=workload.id_keys,
        capacity=config.capacity or None,
        nonfinite=config.nonfinite,
        table_optimizer=rowwise.by_name(config.optimizer, config.lr)
        if row_updates(config)
        else None,
        comm_dtype=config.comm_dtype,
        **_aggregator_options(config),
    )
    return workload, ts


def _start_state(config: RunConfig, ts):
    """(checkpointer or None, state, first step): fresh, or from the newest checkpoint."""
    if not config.checkpoint_dir:
        return None, ts.state, 0
    from sparsecomm_jax.checkpoint import Checkpointer

    ckpt = Checkpointer(config.checkpoint_dir, every=config.checkpoint_every or config.steps)
    if not config.resume:
        return ckpt, ts.state, 0
    state, start = ckpt.restore(ts)
    return ckpt, state, start


def _on_nonfinite(config: RunConfig, step: int) -> None:
    if config.nonfinite == "error":
        raise FloatingPointError(
            f"non-finite gradient at step {step}: the step was not applied "
            "(use --nonfinite skip to skip such steps)"
        )


def _runner(ts, compiled):
    """The compiled program, except for multi-process ``pmap``: its AOT executable wants
    global arrays where ``pmap`` takes this process's devices' slices."""
    import jax

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


def run_steps(config: RunConfig, ts, workload, state, start: int, ckpt, show: bool, hooks=None):
    """Steps ``start .. config.steps - 1``: one compiled program per (state, batch)
    structure (a new row-wise capacity or the pipelined carry makes a new one);
    ``hooks`` (``experiments.runlog.RunHooks``) log, evaluate and trace around steps."""
    import jax
    from tqdm import tqdm

    from sparsecomm_jax.train import loss_value, place_for_step

    log = RunLog([], [], [], {}, {}, 0.0)
    bar = tqdm(range(start, config.steps), desc=config.strategy, disable=not show)
    for step in bar:
        if hooks:
            hooks.before_step(step)
        batch = place_for_step(ts, workload.batch_at, step, config.steps)
        key = jax.tree.structure((state, batch))
        if key not in log.programs:
            t = time.perf_counter()
            log.programs[key] = ts.step.lower(state, batch).compile()
            log = log._replace(compile_s=log.compile_s + time.perf_counter() - t)
        t = time.perf_counter()
        state, loss = _runner(ts, log.programs[key])(state, batch)
        log.runs[key] = log.runs.get(key, 0) + 1
        log.losses.append(loss_value(loss))
        log.times.append(time.perf_counter() - t)
        if not math.isfinite(log.losses[-1]):
            _on_nonfinite(config, step)
            log.skipped.append(step)
            state = state._replace(carry=())  # the early-fetched rows may hold NaN
        if hooks:
            hooks.after_step(step, state, log.losses[-1], log.times[-1], log.programs[key])
        if ckpt:
            ckpt.save(step + 1, ts, state, force=step + 1 == config.steps)
        bar.set_postfix(loss=f"{log.losses[-1]:.4f}")
    return state, log


def train_and_evaluate(config: RunConfig, progress: bool = True) -> dict[str, Any]:
    """Runs ``config`` and returns the result record (see the module doc).

    Args:
      config: the run; validated first.
      progress: show a progress bar (rank 0 only).

    Returns:
      A JSON-ready dict: model, strategy, devices, steps, losses, step_times_s,
      step_time_s (median after warm-up), tokens_per_s or samples_per_s,
      comm_bytes_per_step, collectives, peak_memory_bytes, compile_s, start_step,
      skipped_steps, the fitted ``link`` with ``--calibrate``, and the full config;
      with held-out data ``heldout`` (final metrics per split) and ``eval`` (every
      ``--eval-every`` steps); ``log_dir`` and ``trace_dir`` when written.
    """
    validate(dataclasses.replace(config, devices=config.devices or 1))  # before JAX starts
    runlog.check_run_io(config)
    rank = start_devices(config.devices)
    if not config.devices:  # --devices left out: every device of the job
        import jax

        config = dataclasses.replace(config, devices=jax.device_count())
        validate(config)
    from sparsecomm_jax import hlo

    workload, ts = build(config)
    ckpt, state, start = _start_state(config, ts)
    hooks = runlog.RunHooks(config, workload, ts, rank)
    show = progress and rank == 0
    state, log = hooks.guard(run_steps, config, ts, workload, state, start, ckpt, show, hooks)
    if not log.programs:
        raise ValueError(f"nothing to run: the checkpoint is at step {start} >= --steps")
    compiled = log.programs[max(log.runs, key=log.runs.get)]  # the steady-state program
    colls = hlo.parse_collectives(compiled.as_text())
    step_time = statistics.median(log.times[config.warmup :] or log.times)
    result = {
        "model": config.model,
        "strategy": config.strategy,
        "devices": config.devices,
        "steps": config.steps,
        "losses": log.losses,
        "step_times_s": log.times,
        "step_time_s": step_time,
        f"{workload.items_name}_per_s": workload.items_per_step / step_time,
        "comm_bytes_per_step": hlo.total_bytes(colls),
        "collectives": [c.as_dict() for c in colls],
        "peak_memory_bytes": _peak_memory(compiled),
        "compile_s": log.compile_s,
        "programs": len(log.programs),
        "start_step": start,
        "skipped_steps": log.skipped,
        "rank": rank,
        "config": {**dataclasses.asdict(config), "model_config": workload.config},
    }
    result.update(hooks.finish(state))
    if config.calibrate:
        result["link"] = calibrated_link(config.devices)
    return result


@functools.cache
def calibrated_link(devices: int) -> dict[str, Any]:
    """``costmodel.calibrate`` on the data mesh: alpha (s), beta (s/B), the timed points.
    Once per process and device count: ``--link-gbit 0`` with ``--calibrate`` reuses the
    link fitted before training."""
    from sparsecomm_jax import costmodel, runtime

    link, points = costmodel.calibrate(runtime.data_mesh(devices))
    return {"alpha": link.alpha, "beta": link.beta, "points": points}


def write_json(result: dict[str, Any], path: str) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.train", description=__doc__)
    add_arguments(parser)
    parser.set_defaults(devices=0)  # every device of the job
    config = from_namespace(parser.parse_args(argv))
    try:
        result = train_and_evaluate(config)
    except (ValueError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result["rank"] == 0:
        write_json(result, config.out)
        items = next(k for k in result if k.endswith("_per_s"))
        print(
            f"{config.strategy}: final loss {result['losses'][-1]:.4f}, "
            f"step {result['step_time_s'] * 1e3:.1f} ms, {items} {result[items]:.0f}, "
            f"comm {result['comm_bytes_per_step'] / 1e6:.3f} MB/step/worker"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
