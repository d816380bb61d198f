"""A checkpoint folder's files: which step folders it holds, its run record, atomic
writes, the removal of unfinished or damaged checkpoints, and the lock that keeps one
writer per folder. Nothing here reads or writes arrays (``store`` does).

Only real folders and regular files are read: ``read_regular`` opens without following
a link and without blocking, so a link planted in a file's place or a FIFO is refused.

Example:
    >>> import tempfile
    >>> from sparsecomm_jax.checkpoint import files
    >>> folder = tempfile.mkdtemp()
    >>> with files.DirectoryLock(folder):
    ...     files.write_json(files.Path(folder) / files.RUN_FILE, {"run_id": "a1"})
    >>> files.read_run(folder)
    {'run_id': 'a1'}
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

RUN_FILE = "checkpoint_run.json"
LOCK_FILE = ".lock"
TMP_MARK = ".orbax-checkpoint-tmp"
DAMAGED = ".damaged"
# The items of a checkpoint: the saved pytree and who wrote it (run id and step).
STATE_ITEM, IDENTITY_ITEM = "default", "identity"
# OS errors that mean a piece of the checkpoint is missing (damage), not that reading
# failed (EIO, a permission): the latter are raised, never taken for damage.
MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


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
    except RecursionError:  # JSON nested deeper than Python goes: not a record we wrote
        raise ValueError(
            f"{path} is unreadable (nested too deep); move it away or start afresh"
        ) from None
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


def write_json(path: Path, record: dict[str, Any]) -> None:
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
        remove(p)
    return sorted(p.name for p in stale)


def remove(path: Path) -> None:
    """Removes a folder, file or link (a link, not what it points to)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def clear(directory: str | Path) -> None:
    """Removes every checkpoint, unfinished save and the run record from ``directory``."""
    clean_temporary(directory)
    for step in saved_steps(directory):
        remove(Path(directory) / str(step))
    with contextlib.suppress(FileNotFoundError):
        (Path(directory) / RUN_FILE).unlink()


def aside(folder: Path) -> Path:
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
