"""Checkpoints of a training run with orbax: exact resume, atomic writes.

What is saved: parameters (sharded tables as global arrays), optimizer state, the
aggregator's per-worker residuals and the step. The data position and the random state
need nothing more: every batch is a pure function of ``(seed, step)`` and parameters
are initialised from the seed. ``embrace_2d``'s carry (rows fetched early for the next
batch) is not saved: a resumed run fetches them again, which gives the same rows.

Orbax writes each checkpoint into a temporary folder and renames it when complete, so a
crash while writing leaves the previous checkpoint as the latest usable one.

Example:
    >>> from sparsecomm_jax import checkpoint
    >>> # ckpt = checkpoint.Checkpointer("/tmp/run1", every=10)
    >>> # ckpt.save(step, ts, state); state, step = ckpt.restore(ts)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from sparsecomm_jax.placement import first_replica
from sparsecomm_jax.step import TrainState, TrainStep


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
        raise ValueError(
            f"checkpoint in {directory} has {len(saved_leaves)} arrays, this run's state "
            f"{len(target_leaves)}: was it written by another strategy or model?"
        )
    for (path, s), t in zip(saved_leaves, target_leaves, strict=True):
        if tuple(s.shape) != tuple(t.shape):
            name = jax.tree_util.keystr(path)
            hint = (" (per-worker residuals: resume error-feedback runs on the same number "
                    "of devices)" if name.startswith("['agg_state']") else "")  # fmt: skip
            raise ValueError(f"checkpoint array {name} has shape {tuple(s.shape)}, this run "
                             f"needs {tuple(t.shape)}{hint}")  # fmt: skip


class Checkpointer:
    """Saves every ``every`` steps into ``directory``; keeps the newest ``keep``.

    Args:
      directory: checkpoint folder (created if missing).
      every: save interval in steps (>= 1).
      keep: how many checkpoints to keep.
    """

    def __init__(self, directory: str | Path, every: int = 1, keep: int = 2):
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {every}")
        self.directory = str(Path(directory).absolute())
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )

    def latest_step(self) -> int | None:
        """Steps completed by the newest complete checkpoint, or ``None``."""
        return self._manager.latest_step()

    def save(self, step: int, ts: TrainStep, state: TrainState, force: bool = False) -> bool:
        """Saves ``state`` after ``step`` completed steps when the interval says so."""
        saved = self._manager.save(
            step, args=ocp.args.StandardSave(_portable(ts, state)), force=force
        )
        self._manager.wait_until_finished()
        return saved

    def restore(self, ts: TrainStep, step: int | None = None) -> tuple[TrainState, int]:
        """The saved state, placed like ``ts.state``, and its step.

        Replicated state restores onto any device count; sharded tables onto any count
        that divides their sharded dimension. Per-worker residuals need the same count.

        Raises:
          ValueError: no checkpoint, or one whose arrays do not fit this run.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no complete checkpoint in {self.directory}")
        target = _target(ts)
        _check_shapes(self._manager.item_metadata(step), target, self.directory)
        tree = self._manager.restore(step, args=ocp.args.StandardRestore(target))
        tree = jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(tree))
        state = TrainState(tree["params"], tree["opt_state"], tree["agg_state"])
        if ts.per_device_state:
            local = jax.local_device_count()
            state = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (local, *x.shape)),
                                 state)  # fmt: skip
        return state, step

    def close(self) -> None:
        self._manager.close()
