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
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from tqdm import tqdm

from experiments import runlog
from experiments.config import (
    OneLineErrors,
    RunConfig,
    add_arguments,
    check_fields,
    from_namespace,
)
from experiments.startup import choose_bucket, local_work
from models import MODELS, config_fields, get_workload
from sparsecomm_jax import checkpoint, costmodel, hlo, rowwise, runtime, train
from sparsecomm_jax.costmodel import Link
from sparsecomm_jax.step import finite
from sparsecomm_jax.train import loss_value, parse_strategy, place_for_step

# XLA's CPU backend runs a collective on a pool of at most 256 threads, one per
# participating device: more simulated devices in one process deadlock, then abort.
MAX_PROCESS_DEVICES = 256

# ------------------------------------------------------------------ validation


def validate(config: RunConfig) -> None:
    """Checks a config before JAX starts; raises ``ValueError`` naming the bad flag."""
    check_fields(config)
    row_updates(config)
    _check_combinations(config)
    _check_model_fields(config)
    _check_text_file(config)
    _check_resources(config)


def _check_combinations(config: RunConfig) -> None:
    if config.devices and config.batch % config.devices:
        raise ValueError(f"--batch {config.batch} is not divisible by --devices {config.devices}")
    if (config.resume or config.checkpoint_every) and not config.checkpoint_dir:
        raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
    if config.resume_step and not config.resume:
        raise ValueError("--resume-step needs --resume")
    if config.resume and config.overwrite:
        raise ValueError(
            "--resume continues the folder's run, --overwrite replaces it: pass one of them"
        )


def _check_model_fields(config: RunConfig) -> None:
    """Constraints between the fields of the chosen model."""
    fields = config_fields(config.model)
    if "heads" in fields and config.dim % config.heads:
        raise ValueError(
            f"--heads {config.heads} does not divide --dim {config.dim} "
            f"(the width of --model {config.model})"
        )
    if "masked" in fields and config.masked > config.seq_len:
        raise ValueError(f"--masked {config.masked} is more than --seq-len {config.seq_len}")


def _check_text_file(config: RunConfig) -> None:
    if not config.text_file:
        return
    readers = sorted(m for m in MODELS if "text_file" in config_fields(m))
    if config.model not in readers:
        raise ValueError(
            f"--text-file is read by {', '.join(readers)} only; --model "
            f"{config.model} would ignore it (drop the flag)"
        )
    path = Path(config.text_file)
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"--text-file {config.text_file} {problem}; give a text file")
    try:
        path.open("rb").close()
    except OSError as e:
        raise ValueError(f"--text-file {config.text_file}: {e.strerror}") from None


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _batch_bytes(config: RunConfig) -> int:
    """A lower bound on the host memory that building one global batch takes."""
    if "image_size" in config_fields(config.model):
        per_example = 3 * config.image_size**2 * 8 * 3  # float64 noise, templates, sum
    else:
        per_example = 2 * (config.seq_len + 1) * 8  # uniform draws and token ids
    return config.batch * per_example


def _check_resources(config: RunConfig) -> None:
    """A request no machine of this kind can serve, refused before XLA is asked."""
    if runtime.distributed_args() is None and config.devices > MAX_PROCESS_DEVICES:
        raise ValueError(
            f"--devices {config.devices}: one process runs at most "
            f"{MAX_PROCESS_DEVICES} devices (XLA's CPU collectives cannot "
            "join more simulated devices); use fewer, or the launcher"
        )
    need, have = _batch_bytes(config), _physical_memory()
    if need > have // 2:
        raise ValueError(
            f"--batch {config.batch}: one global batch alone needs "
            f"{need / 2**30:.1f} GiB, this machine has {have / 2**30:.1f} GiB; "
            "use a smaller --batch"
        )


# ------------------------------------------------------------ output locations


def _writable_folder(folder: Path, what: str) -> None:
    """Creates ``folder`` if needed and writes a probe file into it; ``ValueError``
    (starting with ``what``) when that is impossible."""
    for parent in (folder, *folder.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what}: {parent} is a file, not a directory")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"{what}: cannot write into {folder} ({e.strerror or e})") from None


def check_output_file(path: str, flag: str) -> None:
    """``ValueError`` unless a file can be written at ``path`` (its folder is created)."""
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path")
    _writable_folder(Path(path).absolute().parent, f"{flag} {path}")
    if Path(path).exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} exists and is not writable")


def _is_primary() -> bool:
    """Process 0 of a multi-process job, or a single process (known before JAX starts)."""
    args = runtime.distributed_args()
    return args is None or args["process_id"] == 0


def check_outputs(config: RunConfig) -> None:
    """Every location the run writes, checked before it starts."""
    if config.out and _is_primary():
        check_output_file(config.out, "--out")
    if config.checkpoint_dir:
        _writable_folder(Path(config.checkpoint_dir), f"--checkpoint-dir {config.checkpoint_dir}")


# ---------------------------------------------------------- checkpoint folder


def run_record(config: RunConfig) -> dict[str, Any]:
    """What a checkpoint folder records about its run (beside the run id)."""
    return {
        "config": dataclasses.asdict(config),
        "trajectory": config.trajectory(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "a run that recorded no configuration"
    cfg = record.get("config", {})
    return (
        f"run {record.get('run_id', '?')[:8]} (--model {cfg.get('model')} --strategy "
        f"{cfg.get('strategy')} --seed {cfg.get('seed')})"
    )


def trajectory_differences(config: RunConfig, record: dict[str, Any]) -> list[str]:
    """``--flag (theirs there, ours here)`` for each trajectory field that differs."""
    theirs, ours = record.get("trajectory", {}), config.trajectory()
    return [
        f"--{k.replace('_', '-')} ({theirs.get(k)!r} there, {ours.get(k)!r} here)"
        for k in sorted(set(theirs) | set(ours))
        if theirs.get(k) != ours.get(k)
    ]


def _check_owner(config: RunConfig) -> None:
    """Refuses to mix runs in one folder; clears it for a fresh run."""
    folder = config.checkpoint_dir
    if foreign := checkpoint.foreign_folders(folder):
        raise ValueError(
            f"--checkpoint-dir {folder} holds folders {foreign} that are not "
            "checkpoints: give the run a folder of its own"
        )
    steps, record = checkpoint.saved_steps(folder), checkpoint.read_run(folder)
    if not config.resume:
        if steps and not config.overwrite:
            raise ValueError(
                f"--checkpoint-dir {folder} holds checkpoints (steps {steps}) of "
                f"{_describe(record)}: pass --resume to continue it, --overwrite "
                "to replace it, or use another folder"
            )
        checkpoint.clear(folder)
        return
    if not steps:
        raise ValueError(f"--resume: no checkpoint in {folder}")
    if record is None:
        raise ValueError(
            f"--resume: {folder} records no configuration for its checkpoints "
            f"(no {checkpoint.RUN_FILE}), so it cannot be checked against this "
            "run; start afresh with --overwrite"
        )
    if diff := trajectory_differences(config, record):
        raise ValueError(
            f"--resume: this run differs from {_describe(record)} in "
            f"{', '.join(diff)}; these change the trajectory: use the "
            "checkpoint's values or another --checkpoint-dir"
        )


def claim_checkpoint_dir(config: RunConfig) -> checkpoint.DirectoryLock | None:
    """On rank 0: locks the checkpoint folder for this run, checks whose checkpoints it
    holds and removes unfinished writes. Returns the lock (``None``: nothing to hold)."""
    if not (config.checkpoint_dir and _is_primary()):
        return None
    lock = checkpoint.DirectoryLock(config.checkpoint_dir)
    try:
        _check_owner(config)
        if stale := checkpoint.clean_temporary(config.checkpoint_dir):
            print(f"removed unfinished checkpoint writes {stale}", file=sys.stderr)
    except BaseException:
        lock.release()
        raise
    return lock


# -------------------------------------------------------------- building a run


def start_devices(devices: int) -> int:
    """Joins a multi-process job (launcher or scheduler), else simulates ``devices`` CPU
    devices (0: the default count); returns the rank."""
    if not runtime.backend_started():
        runtime.enable_collective_overlap()  # GPU: async collectives overlap compute
    rank, processes = runtime.initialize_distributed()
    if processes == 1 and not runtime.backend_started():
        runtime.simulate_cpu_devices(devices or RunConfig.devices)
    return rank


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    """The optax optimizer of ``--optimizer`` (``lazy_adam``: Adam for the dense layers)."""
    if name == "momentum":
        return optax.sgd(lr, momentum=0.9)
    return {
        "sgd": optax.sgd,
        "adam": optax.adam,
        "adagrad": optax.adagrad,
        "lazy_adam": optax.adam,
    }[name](lr)


def row_updates(config: RunConfig) -> bool:
    """Whether tables get the row-sparse update (``--table-update``: ``auto`` = when the
    strategy and ``--optimizer`` allow); ``ValueError`` for combinations that cannot."""
    base = parse_strategy(config.strategy)[0]
    can = train.STRATEGIES[base].row_updates
    rows = [s.name for s in train.STRATEGIES.values() if s.row_updates]
    has_form = config.optimizer in rowwise.ROW_OPTIMIZERS
    sparse = config.table_update == "sparse" or (config.table_update == "auto" and can and has_form)
    if sparse and not has_form:
        raise ValueError(
            f"--optimizer {config.optimizer} has no row-sparse table update; "
            f"use --table-update dense or one of {sorted(rowwise.ROW_OPTIMIZERS)}"
        )
    if sparse and not can:
        raise ValueError(f"--table-update sparse needs a strategy among {rows}")
    if config.optimizer == "lazy_adam" and not sparse:
        raise ValueError(
            "--optimizer lazy_adam is a row-sparse table update: use it with "
            f"--table-update auto or sparse and a strategy among {rows}"
        )
    if config.comm_dtype != "float32" and base == "embrace_2d":
        raise ValueError(
            f"--comm-dtype {config.comm_dtype} is not available for embrace_2d: "
            "use --comm-dtype float32 or --strategy embrace"
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
    agg = parse_strategy(config.strategy)[1]
    if agg == "dense":
        return {}
    options = {
        "density": config.density,
        "bucket_bytes": int(float(config.bucket_mb) * 2**20),
        "selector": config.selector,
    }
    if agg == "adaptive":
        options["link"] = adaptive_link(config)
    return options


def adaptive_link(config: RunConfig) -> Link:
    """The link adaptive prices buckets with: ``--link-gbit`` and ``--link-alpha-us``,
    or with ``--link-gbit 0`` the link calibrated on this cluster before training, with
    the local work of each strategy measured at the run's bucket sizes."""
    if config.link_gbit > 0:
        return Link.from_bandwidth(config.link_gbit, config.link_alpha_us * 1e-6)
    fitted = calibrated_link(config.devices)
    return Link(fitted["alpha"], fitted["beta"], local_work(config))


def build(config: RunConfig):
    """The workload, mesh and ``TrainStep`` of ``config`` (JAX must be started)."""
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


def _report_skip(step: int, reason: str) -> None:
    if jax.process_index() == 0:
        print(
            f"--resume: checkpoint step {step} skipped ({reason}); trying the one before",
            file=sys.stderr,
        )


def _start_state(config: RunConfig, ts):
    """(checkpointer or None, state, first step): fresh, or from a checkpoint."""
    if not config.checkpoint_dir:
        return None, ts.state, 0
    ckpt = checkpoint.Checkpointer(
        config.checkpoint_dir, every=config.checkpoint_every or config.steps, run=run_record(config)
    )
    if not config.resume:
        return ckpt, ts.state, 0
    newest = ckpt.latest_step()
    state, start = ckpt.restore(ts, config.resume_step or None, on_skip=_report_skip)
    if config.resume_step and newest != start and jax.process_index() == 0:
        print(
            f"--resume-step {start}: the checkpoints after it (to step {newest}) are "
            "removed; this run writes its own",
            file=sys.stderr,
        )
    return ckpt, state, start


# ------------------------------------------------------------------ the steps


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
    ckpt.save(step + 1, ts, state, force=last)


def _compiled(ts, log: RunLog, state, batch) -> tuple[Any, RunLog]:
    key = jax.tree.structure((state, batch))
    if key not in log.programs:
        t = time.perf_counter()
        log.programs[key] = ts.step.lower(state, batch).compile()
        log = log._replace(compile_s=log.compile_s + time.perf_counter() - t)
    log.runs[key] = log.runs.get(key, 0) + 1
    return _runner(ts, log.programs[key]), log


def run_steps(config: RunConfig, ts, workload, state, start: int, ckpt, show: bool, hooks=None):
    """Steps ``start .. config.steps - 1``: one compiled program per (state, batch)
    structure (a new row-wise capacity or the pipelined carry makes a new one);
    ``hooks`` (``experiments.runlog.RunHooks``) log, evaluate and trace around steps."""
    log = RunLog([], [], [], {}, {}, 0.0)
    bar = tqdm(range(start, config.steps), desc=config.strategy, disable=not show)
    for step in bar:
        if hooks:
            hooks.before_step(step)
        batch = place_for_step(ts, workload.batch_at, step, config.steps)
        key = jax.tree.structure((state, batch))
        program, log = _compiled(ts, log, state, batch)
        t = time.perf_counter()
        state, loss = program(state, batch)
        log.losses.append(loss_value(loss))
        log.times.append(time.perf_counter() - t)
        if not math.isfinite(log.losses[-1]):
            _after_nonfinite(config, ts, state, step, log)
            state = state._replace(carry=())  # the early-fetched rows may hold NaN
        if hooks:
            hooks.after_step(step, state, log.losses[-1], log.times[-1], log.programs[key])
        streak = skip_streak(log.skipped, step)
        _stop_if_stuck(config, ckpt, step, streak)
        _save(config, ckpt, ts, state, step, streak)
        bar.set_postfix(loss=f"{log.losses[-1]:.4f}")
    return state, log


def _result(config: RunConfig, workload, log: RunLog, start: int, rank: int) -> dict:
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
    if config.calibrate:
        result["link"] = calibrated_link(config.devices)
    return result


def train_and_evaluate(config: RunConfig, progress: bool = True) -> dict[str, Any]:
    """Runs ``config`` and returns the result record (see the module doc).

    Args:
      config: the run; it, its output locations and its checkpoint folder are checked
        before JAX starts.
      progress: show a progress bar (rank 0 only).

    Returns:
      A JSON-ready dict: model, strategy, devices, steps, losses, step_times_s,
      step_time_s (median after warm-up), tokens_per_s or samples_per_s,
      comm_bytes_per_step, collectives, peak_memory_bytes, compile_s, start_step,
      skipped_steps, the fitted ``link`` with ``--calibrate``, ``bucket_search`` with
      ``--bucket-mb auto``, and the full config; with held-out data ``heldout`` (final
      metrics per split) and ``eval`` (every ``--eval-every`` steps); ``log_dir`` and
      ``trace_dir`` when written.

    Raises:
      ValueError: a bad flag, output location or checkpoint folder.
      FloatingPointError: the run diverged (see ``--nonfinite``, ``--max-skipped``).
      OSError: a checkpoint could not be written.
    """
    validate(dataclasses.replace(config, devices=config.devices or 1))  # before JAX starts
    check_outputs(config)
    runlog.check_run_io(config)
    lock = claim_checkpoint_dir(config)
    ckpt = None
    try:
        rank = start_devices(config.devices)
        if not config.devices:  # --devices left out: every device of the job
            config = dataclasses.replace(config, devices=jax.device_count())
            validate(config)
        search = None
        if config.bucket_mb == "auto":  # the fusion threshold of least measured step time
            config, search = choose_bucket(config, build)
        workload, ts = build(config)
        ckpt, state, start = _start_state(config, ts)
        if start >= config.steps:
            raise ValueError(f"nothing to run: the checkpoint is at step {start} >= --steps")
        hooks = runlog.RunHooks(config, workload, ts, rank)
        show = progress and rank == 0
        state, log = hooks.guard(run_steps, config, ts, workload, state, start, ckpt, show, hooks)
        result = _result(config, workload, log, start, rank)
        result.update(hooks.finish(state))
        if search:
            result["bucket_search"] = search
        return result
    finally:
        if ckpt:
            ckpt.close()
        if lock:
            lock.release()


@functools.cache
def calibrated_link(devices: int) -> dict[str, Any]:
    """``costmodel.calibrate`` on the data mesh: alpha (s), beta (s/B), the timed points.
    Once per process and device count: ``--link-gbit 0`` with ``--calibrate`` reuses the
    link fitted before training."""
    link, points = costmodel.calibrate(runtime.data_mesh(devices))
    return {"alpha": link.alpha, "beta": link.beta, "points": points}


def write_json(result: dict[str, Any], path: str) -> None:
    """Writes ``result`` to ``path`` (if given) atomically: a complete file or none."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)


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
    config = from_namespace(make_parser().parse_args(argv))
    try:
        result = train_and_evaluate(config)
        if result["rank"] == 0:
            write_json(result, config.out)
    except (ValueError, FloatingPointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result["rank"] == 0:
        items = next(k for k in result if k.endswith("_per_s"))
        print(
            f"{config.strategy}: final loss {result['losses'][-1]:.4f}, "
            f"step {result['step_time_s'] * 1e3:.1f} ms, {items} {result[items]:.0f}, "
            f"comm {result['comm_bytes_per_step'] / 1e6:.3f} MB/step/worker"
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
