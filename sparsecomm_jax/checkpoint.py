"""Checkpoints of a training run with orbax: exact resume, atomic writes, one run per folder.

What is saved: parameters (sharded tables as global arrays), optimizer state, the
aggregator's per-worker residuals and the step. The data position and the random state
need nothing more: every batch is a pure function of ``(seed, step)`` and parameters
are initialised from the seed. ``embrace_2d``'s carry (rows fetched early for the next
batch) is not saved: a resumed run fetches them again, which gives the same rows.

Orbax writes each checkpoint into a temporary folder and renames it when complete, so a
crash while writing leaves the previous checkpoint as the latest usable one;
``clean_temporary`` removes what such a crash leaves behind. ``Checkpointer.restore``
falls back to the newest checkpoint that restores completely. Saves are synchronous:
a save that fails raises at once and leaves no thread behind.

The folder also holds the run's identity (``RUN_FILE``: a run id made at the first save
plus whatever description the caller gives, e.g. its configuration), so a caller can
refuse to mix runs, and ``DirectoryLock`` keeps two processes from using one folder.

Example:
    >>> from sparsecomm_jax import checkpoint
    >>> # with checkpoint.DirectoryLock("/tmp/run1"):
    >>> #     ckpt = checkpoint.Checkpointer("/tmp/run1", every=10, run={"lr": 0.1})
    >>> #     ckpt.save(step, ts, state); state, step = ckpt.restore(ts)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sparsecomm_jax.step.placement import first_replica
from sparsecomm_jax.step.state import TrainState, TrainStep

RUN_FILE = "checkpoint_run.json"
LOCK_FILE = ".lock"
TMP_MARK = ".orbax-checkpoint-tmp"


class MismatchError(ValueError):
    """A checkpoint that is intact but does not fit this run (other model or layout)."""


# What an orbax step folder holds (one of them suffices; an empty one counts as damaged).
_STEP_MARKS = ("_CHECKPOINT_METADATA", "commit_success.txt", "default")


def _step_folders(directory: str | Path) -> list[Path]:
    path = Path(directory)
    if not path.is_dir():
        return []
    return [p for p in path.iterdir() if p.name.isdigit() and p.is_dir()]


def _is_checkpoint(folder: Path) -> bool:
    return not any(folder.iterdir()) or any((folder / m).exists() for m in _STEP_MARKS)


def saved_steps(directory: str | Path) -> list[int]:
    """Steps of the checkpoint folders in ``directory`` (complete or not), ascending."""
    return sorted(int(p.name) for p in _step_folders(directory) if _is_checkpoint(p))


def foreign_folders(directory: str | Path) -> list[str]:
    """Folders named like steps that are no checkpoints (a folder used for other things)."""
    return sorted(p.name for p in _step_folders(directory) if not _is_checkpoint(p))


def read_run(directory: str | Path) -> dict[str, Any] | None:
    """The run record of ``directory`` (``run_id`` and the caller's description), or
    ``None`` when there is none.

    Raises:
      ValueError: the record exists but is not readable JSON.
    """
    path = Path(directory) / RUN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}); move it away or start afresh") from e


def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Writes ``record`` to ``path`` atomically (a complete file or none)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def clean_temporary(directory: str | Path) -> list[str]:
    """Removes the unfinished checkpoint folders a killed save leaves; returns their names.
    Call only while holding the folder's ``DirectoryLock`` (no save in progress)."""
    path = Path(directory)
    stale = [p for p in path.glob(f"*{TMP_MARK}*")] if path.is_dir() else []
    for p in stale:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return sorted(p.name for p in stale)


def clear(directory: str | Path) -> None:
    """Removes every checkpoint, unfinished save and the run record from ``directory``."""
    clean_temporary(directory)
    for step in saved_steps(directory):
        shutil.rmtree(Path(directory) / str(step))
    with contextlib.suppress(FileNotFoundError):
        (Path(directory) / RUN_FILE).unlink()


class DirectoryLock:
    """An exclusive lock on a checkpoint folder (``flock`` on ``LOCK_FILE``), held until
    ``release`` or the end of the process: a killed process never leaves it held.

    Args:
      directory: an existing folder.

    Raises:
      ValueError: another process holds the lock.
    """

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK_FILE
        self._file = open(self.path, "a+")  # noqa: SIM115 (held until release)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise ValueError(
                f"{directory} is in use by another run ({holder} holds {self.path}); "
                "wait for it to end or use another folder"
            ) from None
        self._file.truncate(0)
        self._file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _portable(ts: TrainStep, state: TrainState) -> dict[str, Any]:
    """The saved form: global arrays (``pmap`` state: its first replica)."""
    tree = {"params": state.params, "opt_state": state.opt_state, "agg_state": state.agg_state}
    if ts.per_device_state:
        return jax.tree.map(first_replica, tree)
    return tree


def _target(ts: TrainStep) -> dict[str, Any]:
    """Shapes, dtypes and shardings to restore into (those of a fresh state)."""
    tree = _portable(ts, ts.state)

    def abstract(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(abstract, tree)


def _check_shapes(saved: dict, target: dict, directory: str) -> None:
    saved_leaves = jax.tree_util.tree_leaves_with_path(saved)
    target_leaves = jax.tree.leaves(target)
    if len(saved_leaves) != len(target_leaves):
        raise MismatchError(
            f"checkpoint in {directory} has {len(saved_leaves)} arrays, this run's state "
            f"{len(target_leaves)}: was it written by another strategy or model?"
        )
    for (path, s), t in zip(saved_leaves, target_leaves, strict=True):
        if tuple(s.shape) != tuple(t.shape):
            name = jax.tree_util.keystr(path)
            hint = (
                " (per-worker residuals: resume error-feedback runs on the same number of devices)"
                if name.startswith("['agg_state']")
                else ""
            )
            raise MismatchError(
                f"checkpoint array {name} has shape {tuple(s.shape)}, this "
                f"run needs {tuple(t.shape)}{hint}"
            )


def _reason(error: Exception, folder: Path) -> str:
    """Why a checkpoint did not restore, in one short line."""
    if folder.is_dir() and not any(folder.iterdir()):
        return "its folder is empty"
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 160 else text[:157] + "..."


def _warn(step: int, reason: str) -> None:
    warnings.warn(f"checkpoint step {step} skipped: {reason}", stacklevel=3)


class Checkpointer:
    """Saves every ``every`` steps into ``directory``; keeps the newest ``keep``.

    Args:
      directory: checkpoint folder (created if missing).
      every: save interval in steps (>= 1).
      keep: how many checkpoints to keep.
      run: a JSON-ready description of the run (e.g. its configuration), written with a
        new ``run_id`` into ``RUN_FILE`` at the first save unless the folder has a record.
    """

    def __init__(
        self,
        directory: str | Path,
        every: int = 1,
        keep: int = 2,
        run: dict[str, Any] | None = None,
    ):
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {every}")
        self.directory = str(Path(directory).absolute())
        self._run = run or {}
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=every, enable_async_checkpointing=False
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )

    @property
    def run_id(self) -> str | None:
        """The id of the run whose checkpoints the folder holds (``None`` before any)."""
        record = read_run(self.directory)
        return record and record.get("run_id")

    def latest_step(self) -> int | None:
        """Steps completed by the newest complete checkpoint, or ``None``."""
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether the interval says to save after ``step`` completed steps."""
        return self._manager.should_save(step)

    def _record_run(self) -> None:
        path = Path(self.directory) / RUN_FILE
        if jax.process_index() == 0 and not path.exists():
            _write_json(path, {"run_id": uuid.uuid4().hex, **self._run})

    def save(self, step: int, ts: TrainStep, state: TrainState, force: bool = False) -> bool:
        """Saves ``state`` after ``step`` completed steps when the interval says so.

        Raises:
          OSError: the checkpoint could not be written (it is then not kept).
        """
        if not (force or self.should_save(step)):
            return False
        try:
            self._record_run()
            return self._manager.save(
                step, args=ocp.args.StandardSave(_portable(ts, state)), force=force
            )
        except Exception as e:  # orbax and tensorstore raise many kinds; keep the cause
            raise OSError(
                f"cannot write checkpoint step {step} into {self.directory}: "
                f"{' '.join(str(e).split())}"
            ) from e

    def delete(self, step: int) -> None:
        """Removes the checkpoint of ``step``."""
        self._manager.delete(step)

    def _restore_step(self, ts: TrainStep, step: int, target: dict) -> TrainState:
        _check_shapes(self._manager.item_metadata(step), target, self.directory)
        tree = self._manager.restore(step, args=ocp.args.StandardRestore(target))
        tree = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(tree))
        state = TrainState(tree["params"], tree["opt_state"], tree["agg_state"])
        if ts.per_device_state:
            local = jax.local_device_count()
            state = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (local, *x.shape)), state)
        return state

    def restore(
        self, ts: TrainStep, step: int | None = None, on_skip: Callable[[int, str], None] = _warn
    ) -> tuple[TrainState, int]:
        """The saved state, placed like ``ts.state``, and its step.

        Without ``step``, the newest checkpoint that restores completely: each newer one
        that does not (truncated files, an empty folder) is reported to
        ``on_skip(step, reason)``. Checkpoints newer than the one restored are removed,
        so the continued run saves its own.

        Replicated state restores onto any device count; sharded tables onto any count
        that divides their sharded dimension. Per-worker residuals need the same count.

        Raises:
          ValueError: no checkpoint (or not ``step``), none that restores, or one whose
            arrays do not fit this run (``MismatchError``).
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise ValueError(f"no complete checkpoint in {self.directory}")
        if step is not None and step not in steps:
            raise ValueError(
                f"no checkpoint of step {step} in {self.directory}; it has {sorted(steps)}"
            )
        target, failed = _target(ts), []
        for s in [step] if step is not None else steps:
            try:
                state = self._restore_step(ts, s, target)
            except MismatchError:
                raise
            except Exception as e:  # any read failure: try the next older checkpoint
                failed.append(f"step {s} ({_reason(e, Path(self.directory) / str(s))})")
                if step is None:
                    on_skip(s, _reason(e, Path(self.directory) / str(s)))
                continue
            for newer in (n for n in steps if n > s):
                self.delete(newer)
            return state, s
        raise ValueError(f"no checkpoint in {self.directory} restores: {'; '.join(failed)}")

    def close(self) -> None:
        self._manager.close()
