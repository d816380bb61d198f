"""The train-state layer of checkpoints: a library step's state saved as global arrays
and restored into any step of the same model, on any device count and in any layouts.

``Checkpointer`` is the ``store.Store`` of any pytree, plus ``save_state`` and
``restore_state`` for a ``TrainStep``'s state: parameters (sharded tables as global
arrays), optimizer state and the aggregator's per-worker residuals (``portable``). Each
checkpoint records the form its state is stored in (``TrainStep.form``: the device count
and each table's layout). A step that stores its state otherwise (another count, other
layouts, tables packed otherwise) reads the checkpoint in its own form and converts it
through the model's shapes (``step.stored_form``: resharding). Checkpoints written before
forms were recorded hold how their tables are stored together
(``TrainStep.stored_together``, the table-wise packs) and restore only into a step
that stores them the same way: a pack read as other layouts would read one table's
rows as another's.

The data position and the random state need nothing more: every batch is a pure
function of ``(seed, step)`` and parameters are initialised from the seed.
``embrace_2d``'s carry (rows fetched early for the next batch) is not saved: a resumed
run fetches them again, which gives the same rows.

Example:
    >>> import jax, jax.numpy as jnp, optax, tempfile
    >>> from sparsecomm_jax import make_train_step, runtime
    >>> from sparsecomm_jax.checkpoint import Checkpointer
    >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> ts = make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(), {"w": jnp.zeros((3, 1))})
    >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
    ...     _ = ckpt.save_state(1, ts, ts.state, force=True)
    ...     state, step = ckpt.restore_state(ts)
    >>> step, state.params["w"].shape
    (1, (3, 1))
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from sparsecomm_jax import runtime
from sparsecomm_jax.checkpoint.store import MismatchError, Reading, Store, _warn
from sparsecomm_jax.embedding import managed
from sparsecomm_jax.embedding.managed import VocabState
from sparsecomm_jax.step import stored_form
from sparsecomm_jax.step.host import first_replica
from sparsecomm_jax.step.state import TrainState, TrainStep

PyTree = Any
STORED_TOGETHER = "stored_together"  # the identity field of how tables are stored
FORM = "form"  # the identity field of the state's form (``StateForm.record``)
VOCABULARY = "vocabulary"  # the saved tree's entry of the managed tables' mappings


def portable(ts: TrainStep, state: TrainState, step: int | None = None) -> dict[str, Any]:
    """The saved form of a library step's state: global arrays (``pmap`` state: its
    first replica) under ``params``, ``opt_state`` and ``agg_state``; with managed
    tables, their mappings (``TrainStep.vocabulary``: host arrays, one entry per table
    in table order) after ``step`` batches (``None``: as they stand) under
    ``vocabulary``."""
    tree = {"params": state.params, "opt_state": state.opt_state, "agg_state": state.agg_state}
    if ts.per_device_state:
        return jax.tree.map(first_replica, tree)
    if ts.vocabulary is not None:
        _check_stepped(ts.vocabulary, step)
        states = ts.vocabulary.states(step).values()
        tree[VOCABULARY] = {str(k): _as_words(v._asdict()) for k, v in enumerate(states)}
    return tree


def _as_words(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each int64 array as uint32 words, ``[*shape, 2]``: JAX without 64-bit types
    would store it cut to int32."""
    return {
        k: np.ascontiguousarray(x).view(np.uint32).reshape(*np.shape(x), 2)
        if np.asarray(x).dtype == np.int64
        else np.asarray(x)
        for k, x in arrays.items()
    }


def _from_words(arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    """``_as_words`` undone (an array of uint32 words read back as int64)."""
    out = {}
    for k, x in arrays.items():
        x = np.asarray(x)
        out[k] = x.astype(np.uint32).view(np.int64)[..., 0] if x.dtype == np.uint32 else x
    return out


def _restore_vocabulary(ts: TrainStep, tree: dict) -> None:
    """``ts.vocabulary`` started from the mappings of a restored ``portable`` tree."""
    if ts.vocabulary is None:
        return
    saved = tree[VOCABULARY]
    names = ts.vocabulary.names()
    ts.vocabulary.restore(
        {name: VocabState(**_from_words(saved[str(k)])) for k, name in enumerate(names)}
    )


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


def _one_dimension_differs(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) == 2 and (a[0] == b[0]) != (a[1] == b[1])


def shape_hint(name: str, saved: tuple, ours: tuple) -> str:
    """What a state's shape that differs may mean (``store.restore``'s ``hint``)."""
    if name.startswith("agg_state"):
        return " (per-worker residuals: resume error-feedback runs on the same number of devices)"
    if _one_dimension_differs(saved, ours):
        return (
            " (if it is an embedding table stored padded to a multiple of the workers: "
            "resume it on a device count that pads it to the same size; a table-wise pack "
            "on the same device count)"
        )
    return ""


def stored_together_check(ours: tuple, converts: bool = True) -> Callable[[dict, Path], None]:
    """``store.restore``'s ``check``: the tables stored together must be stored so here
    too (a table-wise pack restored into other layouts, or another pack, would read one
    table's rows as another's, silently where the shapes agree). A checkpoint that does
    not record it (written by ``save`` of another pytree, or by an earlier version) is
    not checked; nor one that records its form, restored by a step that ``converts``
    it (``reading``)."""

    def check(identity: dict, folder: Path) -> None:
        if STORED_TOGETHER not in identity or (converts and FORM in identity):  # converted
            return
        theirs, mine = identity[STORED_TOGETHER], _as_json(ours)  # as the record reads back
        if theirs == mine:
            return
        try:
            words = _stored_words(theirs)
        except (TypeError, ValueError) as e:
            raise MismatchError(
                f"checkpoint {folder}: its record of the tables stored together is "
                f"unreadable ({e}); this step stores {_stored_words(mine)}"
            ) from e
        raise MismatchError(
            f"checkpoint {folder} stores tables together as {words}; this step stores "
            f"{_stored_words(mine)}: restore it into a step with the table layouts it was "
            "saved with (the same tables table-wise, on as many workers)"
        )

    return check


def reading(ts: TrainStep, ours: dict[str, Any]) -> Callable[[dict, Path], Reading | None]:
    """``store.restore``'s ``read_as`` for ``ts``: a checkpoint that recorded another
    form (other layouts, another device count) is read in its own shapes whole on each
    process's CPU (never on every accelerator: a model that fits only sharded would not
    fit there), and converted through the model's shapes into ``ts``'s (``step.stored_form``),
    placed as ``ours`` (``portable(ts, ts.state)``) is."""

    def read_as(identity: dict, folder: Path) -> Reading | None:
        _check_managed(ts, identity, folder)
        record = identity.get(FORM)
        if ts.form is None or record is None or record == _as_json(ts.form.record()):
            return None
        try:
            saved = stored_form.recorded(ts.form, record)
            stored_form.check_residuals(saved, ts.form, ours["agg_state"])
        except ValueError as e:
            raise MismatchError(f"checkpoint {folder}: {e}") from e
        host = SingleDeviceSharding(jax.local_devices(backend="cpu")[0])  # not the devices
        shapes = stored_form.stored_shapes(saved, ours)
        if VOCABULARY in ours:  # the mappings' arrays: N slots on any device count
            shapes[VOCABULARY] = ours[VOCABULARY]
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), shapes)

        def convert(tree):
            host = jax.tree.map(runtime.to_host, tree)
            words = host.pop(VOCABULARY, None)
            model = stored_form.to_model(saved, host)
            if words is not None:  # each id's row to its slot on our workers
                model, words = _rehashed(ts, model, words)
            mine = stored_form.to_stored(ts.form, model)
            placed = {k: jax.tree.map(_placed_as, mine[k], ours[k]) for k in mine}
            return placed if words is None else {**placed, VOCABULARY: words}

        return Reading(like, convert)

    return read_as


def _check_stepped(vocab, step: int | None) -> None:
    """``ValueError`` unless ``step`` is the number of batches the step ran: the rows
    saved were trained with the mappings of that many batches."""
    if step is not None and step != vocab.stepped:
        raise ValueError(
            f"checkpoint step {step}: the step has run {vocab.stepped} batches; save it "
            "under the number of steps run (its managed tables' mappings are saved as "
            "they stood after that many batches, the ones its rows were trained with)"
        )


def _check_managed(ts: TrainStep, identity: dict, folder: Path) -> None:
    """``MismatchError`` unless the checkpoint holds the mappings of exactly ``ts``'s
    managed tables (none, where it has none)."""
    ours = [] if ts.vocabulary is None else ts.vocabulary.names()
    saved = identity.get(VOCABULARY, [])
    if saved != ours:
        raise MismatchError(
            f"checkpoint {folder} holds the mappings of managed tables {saved}; this step's "
            f"managed tables are {ours}: a table's ids and its rows go together"
        )
    configs = (identity.get(FORM) or {}).get("configs", {})
    entries = {t: c for layout in configs.values() for t, c in (layout or {}).items()}
    vocab = ts.vocabulary
    for index, vocabulary in (vocab.vocabularies if vocab else {}).items():
        name, now = vocab.tables[index].name, vocabulary.policy.eviction
        then = managed.Policy.from_json(entries.get(name, {})).eviction
        if then != now:
            raise MismatchError(
                f"checkpoint {folder} evicts managed table {name}'s ids by {then}, this step "
                f"by {now}: their saved scores mean something else; keep {then}"
            )


def _rehashed(ts: TrainStep, model: dict, words: dict) -> tuple[dict, dict]:
    """A model-form state with every managed table's rows (and the optimizer-state rows
    lying like them) moved to their ids' slots on ``ts``'s workers
    (``managed.rehash``), and the moved mappings as saved words."""
    vocab = ts.vocabulary
    index = {t.name: t.index for t in vocab.tables.values()}
    leaves, treedef = jax.tree.flatten(model["params"])
    s_leaves, s_def = jax.tree.flatten(model["opt_state"])
    roles = jax.tree.leaves(ts.form.roles)
    out = {}
    for k, name in enumerate(vocab.names()):
        state = VocabState(**_from_words(words[str(k)]))
        moved, old, new = managed.rehash(state, ts.form.workers)
        i = index[name]
        leaves[i] = _moved(leaves[i], old, new)
        s_leaves = [
            _moved(x, old, new) if r == i and np.ndim(x) else x
            for x, r in zip(s_leaves, roles, strict=True)
        ]
        out[str(k)] = _as_words(moved._asdict())
    params, opt_state = treedef.unflatten(leaves), s_def.unflatten(s_leaves)
    return {**model, "params": params, "opt_state": opt_state}, out


def _moved(x, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Rows ``old`` of ``x`` at rows ``new`` of zeros shaped like it."""
    x = np.asarray(x)
    out = np.zeros_like(x)
    out[new] = x[old]
    return out


def _placed_as(x: np.ndarray, like: jax.Array) -> jax.Array:
    """Host array ``x``, identical on every process, placed as ``like`` is."""
    return jax.make_array_from_callback(x.shape, like.sharding, lambda idx: x[idx])


class Checkpointer(Store):
    """A ``store.Store`` that also saves and restores a library step's state (see the
    module doc); its arguments are the store's."""

    def save_state(self, step: int, ts: TrainStep, state: TrainState, force: bool = False) -> bool:
        """``save`` of a library step's state (``portable``), with how its tables are
        stored (``TrainStep.stored_together``). With managed tables, their mappings
        are saved as they stood after ``step`` batches (the few batches placed since
        undone: ``managed.Vocabulary.state_at``)."""
        identity = {STORED_TOGETHER: _as_json(ts.stored_together)}
        if ts.form is not None:
            identity[FORM] = _as_json(ts.form.record())
        if ts.vocabulary is not None:
            identity[VOCABULARY] = ts.vocabulary.names()
        return self.save(step, portable(ts, state, step), force, identity)

    def restore_state(
        self,
        ts: TrainStep,
        step: int | None = None,
        on_skip: Callable[[int, str], None] = _warn,
    ) -> tuple[TrainState, int]:
        """``restore`` of a library step's state, placed like ``ts.state``.

        Any device count and any table layouts: a checkpoint stored in another form
        (``TrainStep.form``) is converted (see the module doc); with managed tables,
        their mappings start from the saved ones (``ts.vocabulary`` is restored in
        place), on another device count each id's row moved to its slot on the new
        owner (``embedding.managed.rehash``). Per-worker residuals
        need the count they were saved on (``MismatchError`` naming both). A
        checkpoint that records no form (written before forms were) restores into the
        stored shapes and table-wise packs it was saved with.
        """
        check = stored_together_check(ts.stored_together, converts=ts.form is not None)
        like = portable(ts, ts.state)
        tree, s = self.restore(like, step, on_skip, check, shape_hint, reading(ts, like))
        state = TrainState(tree["params"], tree["opt_state"], tree["agg_state"])
        _restore_vocabulary(ts, tree)
        if ts.per_device_state:
            local = jax.local_device_count()
            state = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (local, *x.shape)), state)
        return state, s
