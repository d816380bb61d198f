"""The store of a checkpoint folder: any pytree of arrays written by orbax and read
back exactly, sharded like the arrays it is given, each checkpoint checked to be this
run's before it is trusted.

Orbax writes each checkpoint into a temporary folder and renames it when complete, so a
crash while writing leaves the previous checkpoint as the latest usable one. Saves are
synchronous: a save that fails raises at once, and its unfinished folder is removed
when the store is closed. Every checkpoint carries the run id, its step and a digest of
each array (``digest``, checked at restore: a mismatch is damage) inside, and
a caller may record more (``save(..., identity=...)``) and check it at restore
(``restore(..., check=...)``): the train-state layer (``checkpoint.state``) records how
tables are stored that way. ``restore`` falls back past damaged checkpoints to the
newest that restores completely; an error of the file system itself is raised.

Example:
    >>> import jax.numpy as jnp, tempfile
    >>> from sparsecomm_jax.checkpoint.store import Store
    >>> with Store(tempfile.mkdtemp(), every=2) as store:
    ...     _ = store.save(2, {"w": jnp.ones(2)})
    ...     tree, step = store.restore({"w": jnp.zeros(2)})
    >>> step, tree["w"].tolist()
    (2, [1.0, 1.0])
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from sparsecomm_jax.checkpoint import digest, files, quiet
from sparsecomm_jax.checkpoint.files import (
    IDENTITY_ITEM,
    MISSING,
    RUN_FILE,
    STATE_ITEM,
    DirectoryLock,
    clean_temporary,
    read_run,
)

PyTree = Any
Hint = Callable[[str, tuple, tuple], str]  # (array name, saved shape, ours) -> a hint


class MismatchError(ValueError):
    """A checkpoint that is intact but not this run's: another model or layout, or
    another run's (copied, linked or renamed into the folder)."""


class _Damaged(Exception):
    """A checkpoint that cannot be read completely: ``restore`` tries the one before."""


class Reading(NamedTuple):
    """How to read a checkpoint stored in another form than the caller's state.

    Attributes:
      like: what to restore into: the checkpoint's own shapes, with shardings.
      convert: the restored tree -> the caller's form, placed as its state is.
    """

    like: PyTree
    convert: Callable[[PyTree], PyTree]


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


def _shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {digest.array_name(path): tuple(leaf.shape) for path, leaf in leaves}


def _check_shapes(saved: PyTree, target: PyTree, where: str, hint: Hint | None = None) -> None:
    """Each array of ``target`` against the saved one of the same key path; ``hint``
    adds what the caller knows of a shape that differs (the train-state layer: residuals
    per worker, tables padded to the workers)."""
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
            said = hint(name, theirs[name], shape) if hint else ""
            raise MismatchError(
                f"{where}: array {name} has shape {theirs[name]}, this run needs {shape}{said}"
            )


def _check_files(folder: Path) -> None:
    """Only a real folder of folders and regular files is read: a link is another
    run's checkpoint (``MismatchError``); anything else (a FIFO) is damage."""
    if folder.is_symlink():
        raise MismatchError(
            f"checkpoint {folder} is a link to {os.readlink(folder)}: a run's checkpoints "
            "are folders of its own; remove the link"
        )
    for root, dirs, names in os.walk(folder, followlinks=False):
        for name in dirs + names:
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


def _clean_until_quiet(directory: str, quiet: float = 0.5, limit: float = 10.0) -> None:
    """``clean_temporary`` until no unfinished folder has come back for ``quiet``
    seconds (at most ``limit``): tensorstore's writes still in flight after a failed
    save create their folders anew."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        with contextlib.suppress(OSError):
            clean_temporary(directory)
        time.sleep(quiet)
        if not list(Path(directory).glob(f"*{files.TMP_MARK}*")):
            return


def _warn(step: int, reason: str) -> None:
    warnings.warn(f"checkpoint step {step} skipped: {reason}", stacklevel=3)


class Store:
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
        >>> ckpt = Store(tempfile.mkdtemp(), every=2)
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
            files.write_json(path, {"run_id": uuid.uuid4().hex, **self._run})

    def _replace_superseded(self) -> None:
        """The run goes ahead from an older step: its newer checkpoints go (the damaged
        ones renamed aside, kept for a look)."""
        if not self._superseded:
            return
        if jax.process_index() == 0:
            for step in self._superseded:
                folder = Path(self.directory) / str(step)
                if step in self._damaged:
                    folder.rename(files.aside(folder))
                else:
                    files.remove(folder)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("sparsecomm_jax.checkpoint.superseded")
        self._superseded, self._damaged = [], set()
        self._manager.reload()

    def save(
        self, step: int, tree: PyTree, force: bool = False, identity: dict | None = None
    ) -> bool:
        """Saves ``tree`` after ``step`` completed steps when the interval says so, at
        the first save into a folder without checkpoints, or with ``force``. Returns
        whether it saved.

        Args:
          step: completed steps; the checkpoint's name.
          tree: a pytree of arrays (global ``jax.Array`` or numpy).
          force: save whatever the interval says.
          identity: more JSON-ready facts recorded with it (beside the run id and the
            step), for a ``restore(..., check=...)`` to check.

        Raises:
          OSError: the checkpoint could not be written (it is then not kept).
        """
        if not (force or self.should_save(step)):
            return False
        try:
            self._replace_superseded()
            self._record_run()
            run = self.run_id if jax.process_index() == 0 else None
            sums = digest.of(tree)  # every process: its shards' part of each sum
            record = {**(identity or {}), "run_id": run, "step": step, "digest": sums}
            args = ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardSave(tree),
                    IDENTITY_ITEM: ocp.args.JsonSave(record),
                }
            )
            quiet.quiet_closed_loops()
            with quiet.errors_raised_not_logged():
                try:
                    return self._manager.save(step, args=args, force=force)
                except Exception:
                    self._failed_save = True  # its unfinished folder goes at close
                    quiet.quiet_failed_writers()
                    raise
        except Exception as e:  # orbax and tensorstore raise many kinds; keep the cause
            raise OSError(
                f"cannot write checkpoint step {step} into {self.directory}: "
                f"{' '.join(str(e).split())}"
            ) from e

    def delete(self, step: int) -> None:
        """Removes the checkpoint of ``step``."""
        self._manager.delete(step)

    def _check_identity(self, step: int, folder: Path) -> None:
        args = ocp.args.Composite(**{IDENTITY_ITEM: ocp.args.JsonRestore()})
        try:
            identity = self._manager.restore(step, args=args)[IDENTITY_ITEM]
        except Exception as e:
            if isinstance(e, OSError) and not isinstance(e, MISSING):
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

    def identity(self, step: int) -> dict:
        """What checkpoint ``step`` recorded of itself (run id, step, and the
        ``identity`` its save was given); ``{}`` when it recorded nothing readable."""
        args = ocp.args.Composite(**{IDENTITY_ITEM: ocp.args.JsonRestore()})
        try:
            record = self._manager.restore(step, args=args)[IDENTITY_ITEM]
        except Exception:  # no record (damage: _check_identity tells it)
            return {}
        return record if isinstance(record, dict) else {}

    def _restore_step(
        self, step: int, target: PyTree, check=None, hint=None, read_as=None
    ) -> PyTree:
        folder = Path(self.directory) / str(step)
        _check_files(folder)
        try:
            saved = self._manager.item_metadata(step)[STATE_ITEM]
        except Exception as e:
            if isinstance(e, OSError) and not isinstance(e, MISSING):
                raise
            saved = None
        if not saved or not jax.tree.leaves(saved):
            raise _Damaged("its array metadata is missing")
        reading = identity = None
        if read_as is not None:  # its identity says which form it was saved in
            self._check_identity(step, folder)
            identity = self.identity(step)
            reading = read_as(identity, folder)
        read = abstract(reading.like) if reading is not None else target
        _check_shapes(saved, read, f"checkpoint {folder}", hint)
        if identity is None:
            self._check_identity(step, folder)
            identity = self.identity(step)  # read once: the check and the digest use it
        if check is not None:
            check(identity, folder)
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(read)})
        quiet.quiet_closed_loops()  # reads of a damaged checkpoint still in flight
        tree = self._manager.restore(step, args=args)[STATE_ITEM]
        tree = jax.tree.unflatten(jax.tree.structure(read), jax.tree.leaves(tree))
        recorded = identity.get("digest")
        if recorded and (changed := digest.differing(recorded, tree)):
            raise _Damaged(
                f"its data differs from the digest saved with it in array {changed[0]}"
                f"{f' and {len(changed) - 1} more' if len(changed) > 1 else ''}: damaged, "
                "or another run's state copied in"
            )
        return reading.convert(tree) if reading is not None else tree

    def restore(
        self,
        like: PyTree,
        step: int | None = None,
        on_skip: Callable[[int, str], None] = _warn,
        check: Callable[[dict, Path], None] | None = None,
        hint: Hint | None = None,
        read_as: Callable[[dict, Path], Reading | None] | None = None,
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
          check: ``check(identity, folder)``: raises ``MismatchError`` for a checkpoint
            whose recorded ``identity`` is not what the caller restores into.
          hint: ``hint(name, saved shape, our shape) -> text`` added to a shape mismatch.
          read_as: ``read_as(identity, folder) -> Reading | None``: how to read a
            checkpoint stored in another form than ``like`` (its own shapes, and the
            conversion to ``like``'s); ``None``: read it as ``like`` is. Raises
            ``MismatchError`` for one that cannot be converted.

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
                tree = self._restore_step(s, target, check, hint, read_as)
            except MismatchError:
                raise
            except Exception as e:  # damage: the next older checkpoint; the OS failing: raise
                reason = _reason(e, Path(self.directory) / str(s))
                if isinstance(e, OSError) and not isinstance(e, MISSING):
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

    def close(self) -> None:
        """Ends the checkpointer: orbax's manager; the unfinished folder of a save that
        failed (once orbax's writers have stopped; the folder is ours, locked, so no
        other save is in progress); and the folder's lock if it took it."""
        try:
            self._manager.close()  # after a failed save it may raise that failure again
        finally:
            if self._failed_save and self._lock is not None:
                quiet.join_writers()
                _clean_until_quiet(self.directory)
            if self._own_lock:
                self._lock.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
