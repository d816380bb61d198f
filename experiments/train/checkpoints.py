"""The checkpoint folder of a run: one run per folder, exact resume.

``claim_checkpoint_dir`` (rank 0, before JAX starts) locks the folder, refuses another
run's checkpoints (unless ``--overwrite``) and a ``--resume`` whose configuration would
change the trajectory, and removes unfinished writes; ``start_state`` then gives the
state a run starts from (fresh, or the newest checkpoint that restores).

What the folder records is the trajectory as resolved at the start (``--table-update
auto`` as the update it chose, ``--bucket-mb auto`` as the threshold its search chose):
``resumed_config`` gives a resumed run those choices, so the same command resumes.

Example:
    >>> from experiments.train.config import RunConfig
    >>> from experiments.train.checkpoints import resolved_trajectory, trajectory_differences
    >>> sgd = dict(strategy="embrace", optimizer="sgd")  # --table-update auto: rows
    >>> theirs = {"trajectory": resolved_trajectory(RunConfig(lr=0.2, **sgd))}
    >>> trajectory_differences(RunConfig(lr=0.1, **sgd), theirs)
    ['--lr (0.2 there, 0.1 here)']
    >>> trajectory_differences(RunConfig(lr=0.2, table_update="rows", **sgd), theirs)
    []
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any

import jax

from experiments.train.config import RunConfig
from experiments.train.validate import is_primary, table_update_of
from sparsecomm_jax import checkpoint
from sparsecomm_jax.embedding.layout_registry import TablePlan


def resolved_trajectory(config: RunConfig) -> dict[str, Any]:
    """``config.trajectory()`` with ``--table-update`` as the update it resolves to
    (``auto`` and the update it picks are the same trajectory)."""
    return {**config.trajectory(), "table_update": table_update_of(config)}


def run_record(config: RunConfig) -> dict[str, Any]:
    """What a checkpoint folder records about its run (beside the run id)."""
    return {
        "config": config.to_json(),
        "trajectory": resolved_trajectory(config),
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
    theirs, ours = record.get("trajectory", {}), resolved_trajectory(config)
    if not isinstance(theirs, dict):
        theirs = {}
    return [
        f"--{k.replace('_', '-')} ({theirs.get(k)!r} there, {ours.get(k)!r} here)"
        for k in sorted(set(theirs) | set(ours))
        if theirs.get(k) != ours.get(k)
    ]


def resumed_config(config: RunConfig) -> RunConfig:
    """A ``--resume`` run with the choices its checkpoints were made with: ``--bucket-mb
    auto`` takes the threshold the first run's search chose, ``--plan auto`` (or
    ``model``) the plan it chose (a search anew could pick another: another trajectory,
    or tables stored another way). Read on every rank, before JAX starts."""
    if not (config.resume and config.checkpoint_dir):
        return config
    record = checkpoint.read_run(config.checkpoint_dir) or {}
    trajectory, first = record.get("trajectory"), record.get("config")
    chosen: dict[str, Any] = {}
    if config.bucket_mb == "auto" and isinstance(trajectory, dict):
        bucket = trajectory.get("bucket_mb")
        if isinstance(bucket, str) and bucket != "auto":
            chosen["bucket_mb"] = bucket
    if config.plan in ("auto", "model") and isinstance(first, dict):
        plan = recorded_plan(first.get("plan"))  # the plan chosen, one given, the strategy's
        if plan is not None:
            chosen["plan"] = plan
    return dataclasses.replace(config, **chosen) if chosen else config


def recorded_plan(value: Any) -> str | TablePlan | None:
    """The plan a checkpoint folder recorded for its run: a ``TablePlan`` (a JSON object
    of table -> layout, or the JSON text of one that versions before 0.3 wrote), ``""``
    (the strategy's layouts), or ``None`` when it recorded none it can say (a search
    that was never resolved, a layout no one registered here)."""
    if value == "":
        return ""
    try:
        plan = json.loads(value) if isinstance(value, str) else value
        return TablePlan.from_json(plan) if isinstance(plan, dict) else None
    except (ValueError, RecursionError):  # not JSON (auto, model), a layout unknown here,
        return None  # or nested deeper than Python goes


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
    if not (config.checkpoint_dir and is_primary()):
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


def _report_skip(step: int, reason: str) -> None:
    if jax.process_index() == 0:
        print(
            f"--resume: checkpoint step {step} skipped ({reason}); trying the one before",
            file=sys.stderr,
        )


def start_state(config: RunConfig, ts, lock: checkpoint.DirectoryLock | None = None):
    """(checkpointer or None, state, first step): fresh, or from a checkpoint; ``lock``
    the folder's lock ``claim_checkpoint_dir`` took (rank 0), which the checkpointer
    writes under."""
    if not config.checkpoint_dir:
        return None, ts.state, 0
    ckpt = checkpoint.Checkpointer(
        config.checkpoint_dir,
        every=config.checkpoint_every or config.steps,
        run=run_record(config),
        lock=lock or True,
    )
    if not config.resume:
        return ckpt, ts.state, 0
    newest = ckpt.latest_step()
    state, start = ckpt.restore_state(ts, config.resume_step or None, on_skip=_report_skip)
    if start >= config.steps:
        raise ValueError(f"nothing to run: the checkpoint is at step {start} >= --steps")
    if newest != start and jax.process_index() == 0:
        print(
            f"--resume: from step {start}; the checkpoints after it (to step {newest}) are "
            "replaced when this run writes its first one",
            file=sys.stderr,
        )
    return ckpt, state, start
