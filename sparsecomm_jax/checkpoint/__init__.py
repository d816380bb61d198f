"""Checkpoints of a training run with orbax: exact resume, atomic writes, one run per folder.

Three layers: ``files`` (a folder's step folders, its run record written atomically,
the lock that keeps one writer per folder), ``store`` (any pytree of arrays through
orbax, each checkpoint checked to be this run's and intact, by ``digest``; ``quiet``
keeps orbax's noise around a failed save out of the output) and ``state`` (a library
step's state, its tables stored as the step stores them). ``Checkpointer`` is the last
of them, and what a training loop uses.

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
(``MismatchError``). Beside the run id each checkpoint records a digest of every array
(``digest``: computed where the array lives, whatever its sharding), checked at
restore: a flipped byte, or another run's state copied in beside this run's record,
makes the step damaged. Only real folders and regular files are read (never a link or a
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

from sparsecomm_jax.checkpoint.files import (
    DAMAGED,
    IDENTITY_ITEM,
    LOCK_FILE,
    RUN_FILE,
    STATE_ITEM,
    TMP_MARK,
    DirectoryLock,
    clean_temporary,
    clear,
    foreign_folders,
    read_regular,
    read_run,
    saved_steps,
)
from sparsecomm_jax.checkpoint.state import Checkpointer, portable
from sparsecomm_jax.checkpoint.store import MismatchError, Store, abstract

__all__ = [
    "DAMAGED",
    "IDENTITY_ITEM",
    "LOCK_FILE",
    "RUN_FILE",
    "STATE_ITEM",
    "TMP_MARK",
    "Checkpointer",
    "DirectoryLock",
    "MismatchError",
    "Store",
    "abstract",
    "clean_temporary",
    "clear",
    "foreign_folders",
    "portable",
    "read_regular",
    "read_run",
    "saved_steps",
]
