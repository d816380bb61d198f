"""Checkpoints of a training run with orbax: exact resume, atomic writes, one run per folder.

What is saved: any pytree of arrays (``Checkpointer.save``); for the library's steps,
``save_state`` saves parameters (sharded tables as global arrays), optimizer state, the
aggregator's per-worker residuals. The data position and the random state need nothing
more: every batch is a pure function of ``(seed, step)`` and parameters are initialised
from the seed. ``embrace_2d``'s carry (rows fetched early for the next batch) is not
saved: a resumed run fetches them again, which gives the same rows.

Orbax writes each checkpoint into a temporary folder and renames it when complete, so a
crash while writing leaves the previous checkpoint as the latest usable one;
``clean_temporary`` removes what such a crash leaves behind. Saves are synchronous: a
save that fails raises at once and leaves no thread behind.

No checkpoint is trusted by its folder's name. The folder holds the run's identity
(``RUN_FILE``: a run id made at the first save plus whatever description the caller
gives, e.g. its configuration), and every checkpoint carries the run id and its step
inside: a checkpoint copied, linked or renamed from elsewhere is refused at restore
(``MismatchError``). Only real folders and regular files are read (never a link or a
FIFO). ``restore`` falls back past damaged checkpoints to the newest that restores
completely; an error of the file system itself (EIO, a permission) is raised instead,
the checkpoint kept. Nothing is removed until the resumed run writes its first
checkpoint: then the newer checkpoints it replaces are deleted and the damaged ones
renamed aside (``<step>.damaged``), never deleted. One writer per folder: a
``Checkpointer`` holds the folder's ``DirectoryLock`` while it is open, so a second
process is refused at once instead of mixing its checkpoints with the first's.

Example:
    >>> import jax.numpy as jnp, tempfile
    >>> from sparsecomm_jax import checkpoint
    >>> folder = tempfile.mkdtemp()
    >>> with checkpoint.Checkpointer(folder, run={"lr": 0.1}) as ckpt:  # holds the lock
    ...     _ = ckpt.save(3, {"w": jnp.ones(2)}, force=True)
    ...     tree, step = ckpt.restore({"w": jnp.zeros(2)})
    >>> step, tree["w"].tolist()
    (3, [1.0, 1.0])
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from sparsecomm_jax.step.placement import first_replica
from sparsecomm_jax.step.state import TrainState, TrainStep

RUN_FILE = "checkpoint_run.json"
LOCK_FILE = ".lock"
TMP_MARK = ".orbax-checkpoint-tmp"
DAMAGED = ".damaged"
# The items of a checkpoint: the saved pytree and who wrote it (run id and step).
STATE_ITEM, IDENTITY_ITEM = "default", "identity"
# OS errors that mean a piece of the checkpoint is missing (damage), not that reading
# failed (EIO, a permission): the latter are raised, never taken for damage.
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)

PyTree = Any


class MismatchError(ValueError):
    """A checkpoint that is intact but not this run's: another model or layout, or
    another run's (copied, linked or renamed into the folder)."""


class _Damaged(Exception):
    """A checkpoint that cannot be read completely: ``restore`` tries the one before."""


# What an orbax step folder holds (one of them suffices; an empty one counts as damaged).
_STEP_MARKS = ("_CHECKPOINT_METADATA", "commit_success.txt", STATE_ITEM, IDENTITY_ITEM)


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


def read_regular(path: str | Path) -> str | None:
    """The text of ``path`` if it is a regular file, ``None`` if there is none.

    Opened without following a link and without blocking, so a link planted in its
    place or a FIFO is refused instead of followed or waited on.

    Raises:
      ValueError: ``path`` is a link, a FIFO or anything but a regular file.
      OSError: reading failed (EIO, a permission).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link; remove it") from None
        raise
    with os.fdopen(fd, encoding="utf-8") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file; remove it")
        return f.read()


def read_run(directory: str | Path) -> dict[str, Any] | None:
    """The run record of ``directory`` (``run_id`` and the caller's description), or
    ``None`` when there is none.

    Raises:
      ValueError: the record is not a regular file or not a JSON object.
    """
    path = Path(directory) / RUN_FILE
    try:
        text = read_regular(path)
        record = None if text is None else json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}); move it away or start afresh") from e
    if text is not None and not (
        isinstance(record, dict) and isinstance(record.get("run_id"), str)
    ):
        raise ValueError(
            f"{path} holds no run record (a JSON object with a run_id); move it away or "
            "start afresh"
        )
    return record


def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Writes ``record`` to ``path`` atomically (a complete file or none, no leftover)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def clean_temporary(directory: str | Path) -> list[str]:
    """Removes the unfinished checkpoint folders a killed save leaves; returns their names.
    Call only while holding the folder's ``DirectoryLock`` (no save in progress)."""
    path = Path(directory)
    stale = [p for p in path.glob(f"*{TMP_MARK}*")] if path.is_dir() else []
    for p in stale:
        _remove(p)
    return sorted(p.name for p in stale)


def _remove(path: Path) -> None:
    """Removes a folder, file or link (a link, not what it points to)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def clear(directory: str | Path) -> None:
    """Removes every checkpoint, unfinished save and the run record from ``directory``."""
    clean_temporary(directory)
    for step in saved_steps(directory):
        _remove(Path(directory) / str(step))
    with contextlib.suppress(FileNotFoundError):
        (Path(directory) / RUN_FILE).unlink()


def _aside(folder: Path) -> Path:
    """A free name beside ``folder`` for keeping it out of the way: ``<name>.damaged``,
    then ``<name>.damaged-1``, ..."""
    target, n = folder.with_name(folder.name + DAMAGED), 0
    while target.exists() or target.is_symlink():
        n += 1
        target = folder.with_name(f"{folder.name}{DAMAGED}-{n}")
    return target


def _holder() -> str:
    """How a lock names the process that holds it."""
    return f"process {os.getpid()} on {socket.gethostname()}"


class DirectoryLock:
    """An exclusive lock on a folder (``flock`` on ``LOCK_FILE``), held until ``release``
    or the end of the process: a killed process never leaves it held. The lock file is
    opened without following links, so a link planted in its place is refused.

    Args:
      directory: the folder (created if missing).
      what: how the folder is named in errors (e.g. a command-line flag).

    Raises:
      ValueError: another process holds the lock, or the lock file is no regular file.
    """

    def __init__(self, directory: str | Path, what: str | None = None):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / LOCK_FILE
        what = what or str(directory)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"{self.path} is a symbolic link; remove it") from None
            raise
        self._file = os.fdopen(fd, "r+")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            self._file.close()
            raise ValueError(f"{self.path} is not a regular file; remove it")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._file.read().strip() or "another process"
            self._file.close()
            if holder == _holder():
                holder += ", this process: close the Checkpointer or lock that holds it first"
            raise ValueError(
                f"{what} is in use by another run ({holder} holds {self.path}); "
                "wait for it to end or use another folder"
            ) from None
        self._file.truncate(0)
        self._file.write(_holder() + "\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def portable(ts: TrainStep, state: TrainState) -> dict[str, Any]:
    """The saved form of a library step's state: global arrays (``pmap`` state: its
    first replica) under ``params``, ``opt_state`` and ``agg_state``."""
    tree = {"params": state.params, "opt_state": state.opt_state, "agg_state": state.agg_state}
    if ts.per_device_state:
        return jax.tree.map(first_replica, tree)
    return tree


def abstract(tree: PyTree) -> PyTree:
    """Shapes, dtypes and shardings of ``tree``'s arrays: what to restore into.

    An array JAX placed itself (uncommitted: made by ``jnp`` or ``jax.random`` without a
    ``device_put``, which a ``jit`` moves wherever its program runs) and a numpy array
    get no sharding: ``Checkpointer.restore`` gives such a leaf back uncommitted too,
    usable wherever the saved one was (a ``jit(shard_map)`` step over every device).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import SingleDeviceSharding
        >>> x = jnp.zeros(3)
        >>> abstract({"x": x})["x"].sharding is None  # JAX placed it: stays free
        True
        >>> put = jax.device_put(x, SingleDeviceSharding(jax.devices()[0]))
        >>> abstract({"x": put})["x"].sharding == put.sharding
        True
    """

    def leaf(x):
        sharding = getattr(x, "sharding", None) if getattr(x, "committed", True) else None
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def _placed_like(target: PyTree, tree: PyTree) -> PyTree:
    """``tree``'s arrays placed as ``target`` says: a leaf with no sharding uncommitted
    (as JAX places an array it makes), the others as restored."""

    def leaf(want, x):
        return x if want.sharding is not None else jnp.asarray(np.asarray(x))

    return jax.tree.map(leaf, target, tree)


def _name(path) -> str:
    """A key path as orbax names the array: ``opt_state.0.mu.w``."""
    parts = []
    for key in path:
        for field in ("key", "name", "idx"):
            if hasattr(key, field):
                parts.append(str(getattr(key, field)))
                break
    return ".".join(parts)


def _shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {_name(path): tuple(leaf.shape) for path, leaf in leaves}


def _one_dimension_differs(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) == 2 and (a[0] == b[0]) != (a[1] == b[1])


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples as lists)."""
    return json.loads(json.dumps(value))


def _stored_words(groups: Any) -> str:
    """``stored_together`` in words: ``table [a (20 x 4), b (8 x 4)] on 4 workers``, or
    ``none`` (``TypeError`` or ``ValueError`` for a record of another form)."""
    said = [
        f"{layout} [{', '.join(f'{n} ({v} x {d})' for n, v, d in tables)}] on {p} workers"
        for layout, tables, p in groups
    ]
    return "; ".join(said) or "none"


def _check_shapes(saved: PyTree, target: PyTree, where: str) -> None:
    """Each array of ``target`` against the saved one of the same key path."""
    ours, theirs = _shapes(target), _shapes(saved)
    if set(ours) != set(theirs):
        missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        raise MismatchError(
            f"{where} holds other arrays than this run's state (it lacks {missing[:3]}, "
            f"has {extra[:3]} besides): was it written by another strategy, optimizer "
            "or model?"
        )
    for name, shape in ours.items():
        if theirs[name] != shape:
            if name.startswith("agg_state"):
                hint = (
                    " (per-worker residuals: resume error-feedback runs on the same number of "
                    "devices)"
                )
            elif _one_dimension_differs(theirs[name], shape):
                hint = (
                    " (if it is an embedding table stored padded to a multiple of the workers: "
                    "resume it on a device count that pads it to the same size; a "
                    "table-wise pack on the same device count)"
                )
            else:
                hint = ""
            raise MismatchError(
                f"{where}: array {name} has shape {theirs[name]}, this run needs {shape}{hint}"
            )


def _check_files(folder: Path) -> None:
    """Only a real folder of folders and regular files is read: a link is another
    run's checkpoint (``MismatchError``); anything else (a FIFO) is damage."""
    if folder.is_symlink():
        raise MismatchError(
            f"checkpoint {folder} is a link to {os.readlink(folder)}: a run's checkpoints "
            "are folders of its own; remove the link"
        )
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            mode = os.lstat(os.path.join(root, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                where = os.path.relpath(os.path.join(root, name), folder)
                raise _Damaged(f"{where} is not a regular file")


def _reason(error: Exception, folder: Path) -> str:
    """Why a checkpoint did not restore, in one short line."""
    if folder.is_dir() and not any(folder.iterdir()):
        return "its folder is empty"
    if isinstance(error, _Damaged):
        return str(error)
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 160 else text[:157] + "..."


@contextlib.contextmanager
def _errors_raised_not_logged():
    """Orbax's writer threads log each failure with its traceback (hundreds of lines on
    a full disk) before the save raises it; the caller gets it once, as the raise."""

    def below_error(record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR

    logger = logging.getLogger("absl")
    logger.addFilter(below_error)
    try:
        yield
    finally:
        logger.removeFilter(below_error)


def _join_writers(timeout: float = 60.0) -> None:
    """Waits for orbax's writer threads: after a failed save some still write into its
    unfinished folder (orbax's own ``close`` does not wait for them). Their ``join``
    raises what failed them: the save has raised it already."""
    for thread in threading.enumerate():
        orbax = type(thread).__module__.startswith("orbax.")
        if orbax and thread is not threading.current_thread():
            with contextlib.suppress(Exception):
                thread.join(timeout)


def _quiet_failed_writers() -> None:
    """Drops, from here on, what a failed save's writers print after it has raised.

    After an orbax save fails, its writer threads still in flight fail too and log
    each failure with its traceback, and tensorstore's writes call back into the event
    loop the save has closed, which Python prints as ignored exceptions: dozens of
    lines around the one error the caller gets. Only those two are dropped (the absl
    records of orbax's failed writer threads, and ``RuntimeError("Event loop is
    closed")`` in ``sys.unraisablehook``); everything else is printed as before."""
    _quiet_closed_loops()
    if not getattr(_quiet_failed_writers, "done", False):
        logging.getLogger("absl").addFilter(_not_a_failed_writer)
        _quiet_failed_writers.done = True


def _not_a_failed_writer(record: logging.LogRecord) -> bool:
    return "_SignalingThread.run() raised an exception" not in str(record.msg)


def _closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _quiet_closed_loops() -> None:
    """Drops ``RuntimeError("Event loop is closed")`` from the hooks Python prints
    uncaught errors of callbacks with (``sys.unraisablehook``, ``sys.excepthook``):
    tensorstore's writes still in flight when an orbax save fails raise it from their
    own threads (installed once, at a checkpointer's first save; every other error is
    printed as before)."""
    if getattr(sys.unraisablehook, "quiet_closed_loops", False):
        return
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def on_unraisable(info) -> None:
        if not _closed_loop(info.exc_value):
            unraisable(info)

    def on_uncaught(kind, value, trace) -> None:
        if not _closed_loop(value):
            excepthook(kind, value, trace)

    on_unraisable.quiet_closed_loops = True
    sys.unraisablehook, sys.excepthook = on_unraisable, on_uncaught


def _clean_until_quiet(directory: str, quiet: float = 0.5, limit: float = 10.0) -> None:
    """``clean_temporary`` until no unfinished folder has come back for ``quiet``
    seconds (at most ``limit``): tensorstore's writes still in flight after a failed
    save create their folders anew."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        with contextlib.suppress(OSError):
            clean_temporary(directory)
        time.sleep(quiet)
        if not list(Path(directory).glob(f"*{TMP_MARK}*")):
            return


def _warn(step: int, reason: str) -> None:
    warnings.warn(f"checkpoint step {step} skipped: {reason}", stacklevel=3)


class Checkpointer:
    """Saves any pytree of arrays every ``every`` steps into ``directory`` (and at the
    first save of a folder that holds none, so that a run has a checkpoint from its
    start and an unwritable folder shows at once); keeps the newest ``keep``; restores
    it exactly, sharded like the arrays it is given.

    One writer per folder: the checkpointer holds the folder's ``DirectoryLock`` from
    construction to ``close`` (on process 0 of a job; its other processes write their
    shards under it), so a second process, or a second checkpointer in this one, is
    refused at once, naming the holder's process id and host. A save that fails (a full
    disk) leaves no unfinished folder behind.

    Args:
      directory: checkpoint folder (created if missing).
      every: save interval in steps (>= 1).
      keep: how many checkpoints to keep.
      run: a JSON-ready description of the run (e.g. its configuration), written with a
        new ``run_id`` into ``RUN_FILE`` at the first save unless the folder has a record.
      lock: ``True`` takes the folder's lock (released by ``close``); a
        ``DirectoryLock`` the caller already holds on the folder is used as it is (and
        released by the caller).

    Raises:
      ValueError: another process (or checkpointer) holds the folder.

    Example (a user's own loop; global arrays keep their shardings at restore):
        >>> import jax.numpy as jnp, tempfile
        >>> from sparsecomm_jax import checkpoint
        >>> ckpt = checkpoint.Checkpointer(tempfile.mkdtemp(), every=2)
        >>> state = {"w": jnp.zeros(3), "residual": jnp.ones((2, 3))}
        >>> [ckpt.save(s, state) for s in (1, 2, 3, 4)]  # the first, then every 2nd
        [True, True, False, True]
        >>> restored, step = ckpt.restore(state)
        >>> step, restored["residual"].shape
        (4, (2, 3))
        >>> ckpt.close()
    """

    def __init__(
        self,
        directory: str | Path,
        every: int = 1,
        keep: int = 2,
        run: dict[str, Any] | None = None,
        lock: DirectoryLock | bool = True,
    ):
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {every}")
        self.directory = str(Path(directory).absolute())
        self._lock, self._own_lock, self._failed_save = None, False, False
        if isinstance(lock, DirectoryLock):
            if lock.path.parent.resolve() != Path(self.directory).resolve():
                raise ValueError(f"lock holds {lock.path.parent}, not {self.directory}")
            self._lock = lock
        elif lock and jax.process_index() == 0:
            self._lock, self._own_lock = DirectoryLock(self.directory), True
        self.every = every
        self._run = run or {}
        self._superseded: list[int] = []  # newer than the restored step: replaced at the first save
        self._damaged: set[int] = set()  # of those, the ones that did not restore
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=every, enable_async_checkpointing=False
        )
        handlers = {
            STATE_ITEM: ocp.StandardCheckpointHandler(),
            IDENTITY_ITEM: ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
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
        """Whether to save after ``step`` completed steps: the interval says so, or the
        folder holds no checkpoint yet."""
        if self._superseded:  # resumed before newer checkpoints: they go at the first save
            return step % self.every == 0
        return self._manager.should_save(step)

    def _record_run(self) -> None:
        path = Path(self.directory) / RUN_FILE
        if jax.process_index() == 0 and not path.exists():
            _write_json(path, {"run_id": uuid.uuid4().hex, **self._run})

    def _replace_superseded(self) -> None:
        """The run goes ahead from an older step: its newer checkpoints go (the damaged
        ones renamed aside, kept for a look)."""
        if not self._superseded:
            return
        if jax.process_index() == 0:
            for step in self._superseded:
                folder = Path(self.directory) / str(step)
                if step in self._damaged:
                    folder.rename(_aside(folder))
                else:
                    _remove(folder)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("sparsecomm_jax.checkpoint.superseded")
        self._superseded, self._damaged = [], set()
        self._manager.reload()

    def save(
        self, step: int, tree: PyTree, force: bool = False, stored_together: tuple | None = None
    ) -> bool:
        """Saves ``tree`` after ``step`` completed steps when the interval says so, at
        the first save into a folder without checkpoints, or with ``force``. Returns
        whether it saved.

        Args:
          step: completed steps; the checkpoint's name.
          tree: a pytree of arrays (global ``jax.Array`` or numpy).
          force: save whatever the interval says.
          stored_together: how the tree's tables are stored
            (``TrainStep.stored_together``), recorded with it for ``restore``.

        Raises:
          OSError: the checkpoint could not be written (it is then not kept).
        """
        if not (force or self.should_save(step)):
            return False
        try:
            self._replace_superseded()
            self._record_run()
            identity = {"run_id": self.run_id if jax.process_index() == 0 else None, "step": step}
            if stored_together is not None:
                identity["stored_together"] = _as_json(stored_together)
            args = ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardSave(tree),
                    IDENTITY_ITEM: ocp.args.JsonSave(identity),
                }
            )
            _quiet_closed_loops()
            with _errors_raised_not_logged():
                try:
                    return self._manager.save(step, args=args, force=force)
                except Exception:
                    self._failed_save = True  # its unfinished folder goes at close
                    _quiet_failed_writers()
                    raise
        except Exception as e:  # orbax and tensorstore raise many kinds; keep the cause
            raise OSError(
                f"cannot write checkpoint step {step} into {self.directory}: "
                f"{' '.join(str(e).split())}"
            ) from e

    def save_state(self, step: int, ts: TrainStep, state: TrainState, force: bool = False) -> bool:
        """``save`` of a library step's state (see ``portable``), with how its tables
        are stored."""
        return self.save(step, portable(ts, state), force, ts.stored_together)

    def delete(self, step: int) -> None:
        """Removes the checkpoint of ``step``."""
        self._manager.delete(step)

    def _check_identity(self, step: int, folder: Path) -> None:
        args = ocp.args.Composite(**{IDENTITY_ITEM: ocp.args.JsonRestore()})
        try:
            identity = self._manager.restore(step, args=args)[IDENTITY_ITEM]
        except Exception as e:
            if isinstance(e, OSError) and not isinstance(e, _MISSING):
                raise
            raise _Damaged("it records no run id and step (damaged, or written before 0.2)") from e
        ours = self.run_id
        theirs = identity.get("run_id") if isinstance(identity, dict) else None
        if theirs != ours or identity.get("step") != step:
            raise MismatchError(
                f"checkpoint {folder} was written by run {str(theirs)[:8]} at step "
                f"{identity.get('step')}, not by this folder's run {str(ours)[:8]} at step "
                f"{step} (copied, linked or renamed from elsewhere?); move it away"
            )

    def _check_stored_together(self, step: int, folder: Path, ours: tuple | None) -> None:
        """The tables stored together must be stored so here too: a table-wise pack
        restored into other layouts (or another pack) would read one table's rows as
        another's, silently where the shapes agree (where they differ, ``_check_shapes``
        has refused it already). A checkpoint that does not record it (written by
        ``save`` without it, or by an earlier version) is not checked."""
        if ours is None:
            return
        args = ocp.args.Composite(**{IDENTITY_ITEM: ocp.args.JsonRestore()})
        try:
            theirs = self._manager.restore(step, args=args)[IDENTITY_ITEM]["stored_together"]
        except Exception:  # no record (damage: ``_check_identity``, run before, told it)
            return
        ours = _as_json(ours)  # as the record reads back
        if theirs == ours:
            return
        try:
            words = _stored_words(theirs)
        except (TypeError, ValueError) as e:
            raise MismatchError(
                f"checkpoint {folder}: its record of the tables stored together is "
                f"unreadable ({e}); this step stores {_stored_words(ours)}"
            ) from e
        raise MismatchError(
            f"checkpoint {folder} stores tables together as {words}; this step stores "
            f"{_stored_words(ours)}: restore it into a step with the table layouts it was "
            "saved with (the same tables table-wise, on as many workers)"
        )

    def _restore_step(self, step: int, target: PyTree, stored_together=None) -> PyTree:
        folder = Path(self.directory) / str(step)
        _check_files(folder)
        try:
            saved = self._manager.item_metadata(step)[STATE_ITEM]
        except Exception as e:
            if isinstance(e, OSError) and not isinstance(e, _MISSING):
                raise
            saved = None
        if not saved or not jax.tree.leaves(saved):
            raise _Damaged("its array metadata is missing")
        _check_shapes(saved, target, f"checkpoint {folder}")
        self._check_identity(step, folder)
        self._check_stored_together(step, folder, stored_together)
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target)})
        tree = self._manager.restore(step, args=args)[STATE_ITEM]
        return jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(tree))

    def restore(
        self,
        like: PyTree,
        step: int | None = None,
        on_skip: Callable[[int, str], None] = _warn,
        stored_together: tuple | None = None,
    ) -> tuple[PyTree, int]:
        """The saved pytree, shaped, typed and sharded like ``like``, and its step.

        Without ``step``, the newest checkpoint that restores completely: each newer one
        that does not (truncated files, an empty folder, a FIFO) is reported to
        ``on_skip(step, reason)``. The checkpoints newer than the one restored stay
        until this run's first ``save`` (then the intact ones are deleted, the damaged
        ones renamed ``<step>.damaged``).

        Args:
          like: a pytree of arrays or ``jax.ShapeDtypeStruct`` (with shardings), as the
            saved one; restored arrays take its structure, dtypes and shardings.
          step: the checkpoint to restore (default: the newest that restores).
          on_skip: told of each checkpoint skipped.
          stored_together: how ``like``'s tables are stored (``TrainStep.
            stored_together``): a checkpoint that recorded another is refused.

        Returns:
          ``(tree, step)``.

        Raises:
          ValueError: no checkpoint (or not ``step``), none that restores, or one that is
            not this run's (``MismatchError``: other arrays or shapes, another run's id or
            step, a link).
          OSError: the file system failed to read one (it is kept; try again).
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise ValueError(f"no complete checkpoint in {self.directory}")
        if step is not None and step not in steps:
            raise ValueError(
                f"no checkpoint of step {step} in {self.directory}; it has {sorted(steps)}"
            )
        target, failed = abstract(like), []
        for s in [step] if step is not None else steps:
            try:
                tree = self._restore_step(s, target, stored_together)
            except MismatchError:
                raise
            except Exception as e:  # damage: the next older checkpoint; the OS failing: raise
                reason = _reason(e, Path(self.directory) / str(s))
                if isinstance(e, OSError) and not isinstance(e, _MISSING):
                    raise OSError(
                        f"cannot read checkpoint step {s} in {self.directory} ({reason}); "
                        "it is kept: check the file system and retry"
                    ) from e
                if step is not None:
                    raise ValueError(
                        f"checkpoint step {s} in {self.directory} does not restore: {reason}"
                    ) from e
                failed.append(s)
                on_skip(s, reason)
                continue
            self._superseded = [n for n in steps if n > s]
            self._damaged = set(failed)
            return _placed_like(target, tree), s
        raise ValueError(f"no checkpoint in {self.directory} restores (steps {sorted(failed)})")

    def restore_state(
        self,
        ts: TrainStep,
        step: int | None = None,
        on_skip: Callable[[int, str], None] = _warn,
    ) -> tuple[TrainState, int]:
        """``restore`` of a library step's state, placed like ``ts.state``.

        Replicated state restores onto any device count; sharded tables onto any count
        that stores them at the same size (that divides their sharded dimension, or pads
        it to the same multiple: ``layout.padded_shape``) under the same layout;
        table-wise tables (packed by owner) onto the same count with the same tables
        table-wise (``TrainStep.stored_together``; another is refused). Per-worker
        residuals need the same count.
        """
        tree, s = self.restore(portable(ts, ts.state), step, on_skip, ts.stored_together)
        state = TrainState(tree["params"], tree["opt_state"], tree["agg_state"])
        if ts.per_device_state:
            local = jax.local_device_count()
            state = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (local, *x.shape)), state)
        return state, s

    def close(self) -> None:
        """Ends the checkpointer: orbax's manager; the unfinished folder of a save that
        failed (once orbax's writers have stopped; the folder is ours, locked, so no
        other save is in progress); and the folder's lock if it took it."""
        try:
            self._manager.close()  # after a failed save it may raise that failure again
        finally:
            if self._failed_save and self._lock is not None:
                _join_writers()
                _clean_until_quiet(self.directory)
            if self._own_lock:
                self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
