"""Managed tables: ids of any 64-bit value, each given a row of its own (``managed``).

A managed table of N slots takes ids of any value (``int64``, negative and huge ones
included) instead of rows below V. Its slots are stored as a row-wise table's rows
(each of the G workers of the table's group owns a block of ceil(N / G) of them, as
``row.ROW`` places them), and on the host a ``Vocabulary`` maps every id to a slot as
a batch is placed:

- **owner**: an id belongs to the worker ``owner_of(id, G)`` picks by a hash of it
  (splitmix64), balanced under any skew of the ids' values; that worker's block holds
  its slot, so the row-wise exchange sends the id's lookups to its owner;
- **admission**: an id seen fewer than ``threshold`` times (its reads over all steps,
  counted while it waits; at most N ids wait, the most read, ties to the lower id) has
  no slot: it reads its owner's *zero row*, the first slot of each block, which the
  step resets to zeros before reading it (its gradient is dropped: the next step resets
  the row again);
- **slots**: an admitted id takes a free slot of its owner's block, its row started
  at ``initial_rows`` (uniform in [-s, s), a hash of the id and the column, so a row
  does not depend on which slot it takes) and its optimizer state at the optimizer's
  ``init``;
- **eviction**: when the owner has no free slot, the id takes the slot whose id was
  read least recently (``"lru"``: the step it was last read) or least often (``"lfu"``:
  its reads, those while it waited included); ties go to the lower slot; an id read by the
  current batch is never evicted. The evicted id is forgotten (seen again, it waits
  for admission anew) and counted (``VocabState.evictions``);
- **zero collisions**: two distinct ids never share a slot. When one batch brings an
  owner more new ids than it can place, those of most reads (then lowest value) are
  admitted and the others keep waiting, reading the zero row.

``Vocabulary.map`` runs in the compiled kernel of ``embedding.mapkernel`` where a C++
compiler is found, else in numpy: the same slots to the tie. The step itself is the
row-wise layout's on the slot numbers (the trio of
``embedding.row``): the ids become slots on the host (``Vocabularies.map_batch``; the
model sees slot numbers in those batch keys, so it must read them through ``emb``
only: a mask computed from the id values would see slots), and the rows to start
afresh travel with the batch (``Fresh``) and are written at the start of the step's
program (``renew``), before anything reads them. A checkpoint saves the mappings with
the state as they stood after the steps run (``Vocabulary.state_at``), and restored
onto another device count moves each id to its new owner (``rehash``).

Example:
    >>> import numpy as np
    >>> vocab = Vocabulary(slots=8, dim=2, workers=2, policy=Policy("lru", threshold=2))
    >>> slots, fresh = vocab.map(np.array([2**63 - 1, -5, 2**63 - 1]))
    >>> slots.tolist(), fresh.slots.tolist()  # -5 waits: worker 0's zero row (slot 0)
    ([5, 0, 5], [0, 4, 5])
    >>> vocab.map(np.array([-5, 2**63 - 1]))[0].tolist()  # -5's second read admits it
    [1, 5]

References:
    TorchRec's ``ManagedCollisionCollection`` (MCH: id-to-slot remapping sharded with the
    table, LRU and LFU eviction); NVIDIA dynamicemb (hash-table embeddings, admission,
    score-based eviction); Liu et al., "Monolith: Real Time Recommendation System With
    Collisionless Embedding Table", 2022 (occurrence threshold, expiry).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparsecomm_jax.embedding import mapkernel, row
from sparsecomm_jax.embedding.layout import Layout, grow_with_margin, next_power_of_two
from sparsecomm_jax.embedding.row_optimizers import DROP, state_roles
from sparsecomm_jax.embedding.tables import table_name

#: The eviction policies: which slot a new id takes when its owner has none free.
EVICTIONS = ("lru", "lfu")


class Policy(NamedTuple):
    """How one managed table admits and evicts ids (one entry of the layout's config).

    Attributes:
      eviction: ``"lru"`` (the slot read longest ago) or ``"lfu"`` (the slot read least
        often since its id was admitted).
      threshold: K, the reads an id needs before it takes a slot (1: at once).
      init_scale: s, a new id's row starts uniform in [-s, s); ``None``: 1 / sqrt(N),
        as DLRM initialises a table of N rows.
      compete: (LFU only) a new id takes a used slot only when it has been read more
        often than the slot's id (its waiting reads counted); else it waits on, as
        TorchRec's MCH LFU admits. ``False``: a ready id always takes the least read.
    """

    eviction: str = "lru"
    threshold: int = 1
    init_scale: float | None = None
    compete: bool = False

    def checked(self) -> Policy:
        """The policy itself, or ``ValueError`` naming the field that is wrong."""
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {list(EVICTIONS)}, got {self.eviction!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, np.integer)):
            raise ValueError(f"threshold must be an integer >= 1, got {self.threshold!r}")
        if self.threshold < 1:
            raise ValueError(f"threshold must be an integer >= 1, got {self.threshold}")
        scale = self.init_scale
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0
        ):
            raise ValueError(f"init_scale must be a number >= 0 or null, got {scale!r}")
        if not isinstance(self.compete, (bool, np.bool_)):
            raise ValueError(f"compete must be true or false, got {self.compete!r}")
        if self.compete and self.eviction != "lfu":
            raise ValueError("compete compares read counts: it needs eviction lfu")
        return self

    def to_json(self) -> dict[str, Any]:
        """The policy as a JSON object (a plan's or checkpoint's ``config`` entry)."""
        return {
            "eviction": self.eviction,
            "threshold": int(self.threshold),
            "init_scale": self.init_scale,
            "compete": bool(self.compete),
        }

    @classmethod
    def from_json(cls, entry: Any) -> Policy:
        """The policy of a JSON object (``ValueError`` for an unknown field)."""
        if isinstance(entry, Policy):
            return entry.checked()
        if not isinstance(entry, Mapping):
            raise ValueError(
                "a managed table's config is an object {eviction, threshold, init_scale, "
                f"compete}}, got {entry!r:.60}"
            )
        if stray := sorted(set(entry) - set(cls._fields)):
            raise ValueError(
                f"a managed table's config has no field {stray}; its fields: {list(cls._fields)}"
            )
        return cls(**entry).checked()


#: LRU, admitted at once, rows started at 1 / sqrt(N).
DEFAULT = Policy()


# ------------------------------------------------------------------ hashing


_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX[0]
        z = (z ^ (z >> np.uint64(27))) * _MIX[1]
        return z ^ (z >> np.uint64(31))


def as_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """``ids`` as an ``int64`` array (``uint64`` values read as their bits), or
    ``ValueError`` for values that are not integers."""
    ids = np.asarray(ids)
    if ids.dtype == np.uint64:
        return ids.view(np.int64)
    if not np.issubdtype(ids.dtype, np.integer) or ids.dtype == np.bool_:
        raise ValueError(f"{what} must be integers (int64 ids of any value), got {ids.dtype}")
    return ids.astype(np.int64)


def owner_of(ids: np.ndarray, workers: int) -> np.ndarray:
    """int64 per id: the worker that owns it, a hash of its 64 bits modulo ``workers``.

    Example:
        >>> owner_of(np.array([0, 1, 2, 3, -1, 2**63 - 1]), 4).tolist()
        [0, 1, 2, 0, 3, 1]
    """
    return (_splitmix(as_ids(ids).view(np.uint64)) % np.uint64(workers)).astype(np.int64)


def initial_rows(ids: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """float32[n, dim]: the row each id starts from when it takes a slot, uniform in
    [-scale, scale) from a hash of (id, column): the same whichever slot, worker count or
    run gives it.

    Example:
        >>> rows = initial_rows(np.array([7, 7, 8]), 3, 0.5)
        >>> bool((rows[0] == rows[1]).all()), bool((rows[0] != rows[2]).any())
        (True, True)
        >>> float(abs(rows).max()) <= 0.5
        True
    """
    ids = as_ids(ids).reshape(-1)
    with np.errstate(over="ignore"):
        key = _splitmix(ids.view(np.uint64))[:, None] + _GOLDEN * np.arange(
            1, dim + 1, dtype=np.uint64
        )
    unit = (_splitmix(key) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-23) - 1
    return unit * np.float32(scale)


# ------------------------------------------------------------------ the slots


class Blocks(NamedTuple):
    """Where the slots of a table of N slots lie on G workers: worker w owns the row
    block ``[w B, min((w + 1) B, N))``, B = ceil(N / G) (the row-wise layout's blocks);
    the block's first slot is its zero row, the others hold ids."""

    slots: int
    workers: int

    @property
    def size(self) -> int:
        """B, the slots of each block (the last may hold fewer)."""
        return -(-self.slots // self.workers)

    def first(self) -> np.ndarray:
        """int64[G]: each worker's first slot, its zero row."""
        return np.arange(self.workers, dtype=np.int64) * self.size

    def problem(self) -> str:
        """What is wrong with these blocks ("": nothing): every block needs a slot for
        an id besides its zero row."""
        last = self.slots - (self.workers - 1) * self.size
        if self.slots < 2 * self.workers or last < 2:
            return (
                f"each of the {self.workers} workers needs a block of at least 2 (its zero "
                f"row and a slot for an id); give it at least {2 * self.workers} rows, a "
                f"multiple of {self.workers}"
            )
        return ""

    def check(self, table: str = "the table") -> None:
        """``ValueError`` naming ``table`` where ``problem`` says something."""
        if problem := self.problem():
            raise ValueError(f"managed table {table} has {self.slots} slots: {problem}")


class VocabState(NamedTuple):
    """One managed table's mapping as host arrays: what a checkpoint saves beside the
    rows (``Vocabulary.state``).

    Attributes:
      ids: int64[N], the id each slot holds (0 where it holds none).
      used: bool[N], whether the slot holds an id.
      score: int64[N], the eviction score: ``"lru"`` the step its id was last read,
        ``"lfu"`` its reads since it arrived (its waiting reads included).
      pending: int64[N], the ids waiting for admission, ascending, in its first
        ``waiting`` entries (at most N wait: ``Vocabulary.map`` keeps the most read).
      seen: int64[N], their reads so far.
      waiting: int64[], how many ids wait.
      steps: int64[], the batches mapped.
      evictions: int64[], the ids evicted so far.
    """

    ids: np.ndarray
    used: np.ndarray
    score: np.ndarray
    pending: np.ndarray
    seen: np.ndarray
    waiting: np.ndarray
    steps: np.ndarray
    evictions: np.ndarray

    @classmethod
    def empty(cls, slots: int) -> VocabState:
        """No id admitted, none waiting."""
        zeros = lambda dtype=np.int64: np.zeros(slots, dtype)  # noqa: E731
        return cls(zeros(), zeros(bool), zeros(), zeros(), zeros(), *(np.int64(0),) * 3)


def check_state(state: VocabState, blocks: Blocks) -> str:
    """What makes ``state`` a mapping no table of ``blocks`` saves ("": nothing), as a
    checkpoint written by hand or damaged could hold: fields of N integers (``used``
    booleans), each block's ids in its first slots after its zero row (as ``map`` and
    ``rehash`` place them), no id held twice, scores and read counts >= 0, at most N
    waiting ids, ascending."""
    n = blocks.slots
    for field in ("ids", "used", "score", "pending", "seen"):
        value = np.asarray(getattr(state, field))
        kind = np.bool_ if field == "used" else np.integer
        if value.shape != (n,) or not np.issubdtype(value.dtype, kind):
            return f"{field} is {value.dtype}{list(value.shape)}; the table has {n} slots"
    used, ids = np.asarray(state.used, bool), np.asarray(state.ids)
    for w, lo in enumerate(blocks.first()):
        rest = used[lo + 1 : min(lo + blocks.size, n)].astype(np.int8)
        if used[lo] or (np.diff(rest) > 0).any():  # used slots first, then free ones
            return (
                f"worker {w}'s block holds ids out of order (its zero row, or a slot after "
                "a free one): a mapping saved on other workers is restored through rehash"
            )
    if np.unique(ids[used]).size != int(used.sum()):
        return "an id is held in two slots"
    waiting = int(state.waiting)
    pending, seen = np.asarray(state.pending)[:waiting], np.asarray(state.seen)[:waiting]
    if (np.asarray(state.score)[used] < 0).any() or (seen < 0).any():
        return "a score or a read count is negative"
    if not 0 <= waiting <= n or (np.diff(pending) <= 0).any():
        return f"its {waiting} waiting ids are not at most {n}, ascending"
    return ""


class Fresh(NamedTuple):
    """The slots a step starts afresh, before its program reads them.

    Attributes:
      slots: int64[k], each slot once: the zero rows, then the slots new ids took.
      rows: float32[k, D], their rows (zeros for a zero row, ``initial_rows`` for an id).
      evicted: ids evicted by this batch (a slot that held one).
      bound: the most slots a batch of this shape can start afresh (its reads of the
        table, and the G zero rows).
    """

    slots: np.ndarray
    rows: np.ndarray
    evicted: int = 0
    bound: int = 0


class Vocabulary:
    """The id-to-slot mapping of one managed table (on the host: the compiled kernel of
    ``embedding.mapkernel``, or numpy), advanced batch by batch in step order (``map``).

    Args:
      slots: N, the table's rows.
      dim: D, its columns (the width of a fresh row).
      workers: G, the workers its slots are sharded over.
      policy: its ``Policy``.
      state: a saved ``VocabState`` to start from (``None``: empty).
      name: the table's name, for errors.
      kernel: map with the compiled host kernel (``embedding.mapkernel``): ``None``
        where it can be built, ``False`` in numpy (the same slots, slower), ``True``
        always (``RuntimeError`` where it cannot be built).

    Raises:
      ValueError: ``slots`` too few for ``workers``, or a ``state`` this table cannot
        have saved (``check_state``).
    """

    def __init__(
        self,
        slots: int,
        dim: int,
        workers: int,
        policy: Policy = DEFAULT,
        state: VocabState | None = None,
        name: str = "the table",
        kernel: bool | None = None,
    ):
        self.blocks = Blocks(int(slots), int(workers))
        self.blocks.check(name)
        self.dim, self.policy, self.name = int(dim), policy.checked(), name
        scale = policy.init_scale
        self.scale = 1 / math.sqrt(slots) if scale is None else float(scale)
        self.kernel = mapkernel.available() if kernel is None else bool(kernel)
        if self.kernel and not mapkernel.available():
            raise RuntimeError("the managed tables' host kernel cannot be built here")
        state = VocabState.empty(slots) if state is None else _copy(state)
        if problem := check_state(state, self.blocks):
            raise ValueError(f"the saved mapping of managed table {name}: {problem}")
        waiting = int(state.waiting)  # held in memory without the padding
        self._state = state._replace(
            ids=np.ascontiguousarray(state.ids, np.int64),  # (the kernel writes them)
            used=np.ascontiguousarray(state.used, bool),
            score=np.ascontiguousarray(state.score, np.int64),
            pending=np.asarray(state.pending[:waiting], np.int64),
            seen=np.asarray(state.seen[:waiting], np.int64),
        )
        self._journal: list[_Undo] = []  # what the last batches changed, oldest first
        self._lock = threading.RLock()  # a loop maps on a host thread while it saves
        self._index()

    def _index(self) -> None:
        """The admitted ids with their slots: a ``mapkernel.HashIndex`` for the kernel,
        else ascending (for ``np.searchsorted``); the slots taken in each block."""
        held = np.flatnonzero(self._state.used)
        if self.kernel:
            self._hash = mapkernel.HashIndex.of(self._state.ids[held], held, self.blocks.slots)
        else:
            order = np.argsort(self._state.ids[held], kind="stable")
            self._keys, self._slots = self._state.ids[held][order], held[order]
        size = self.blocks.size
        self._filled = np.array(
            [
                self._state.used[w * size + 1 : (w + 1) * size].sum()
                for w in range(self.blocks.workers)
            ],
            np.int64,
        )

    def state_at(self, steps: int) -> VocabState:
        """A copy of the mapping as it stood after ``steps`` batches: the batches mapped
        since undone (at most ``JOURNAL`` of them), to save a step while the batches
        after it are already mapped (placed ahead of the steps that read them).

        Raises:
          ValueError: ``steps`` ahead of the batches mapped, or more than ``JOURNAL``
            behind.
        """
        with self._lock:
            return self._state_at(steps)

    def _state_at(self, steps: int) -> VocabState:
        now = int(self._state.steps)
        if not now - len(self._journal) <= steps <= now:
            raise ValueError(
                f"the mapping of managed table {self.name} is at batch {now}; it can be "
                f"read back to batch {now - len(self._journal)} at most, not {steps}"
            )
        s = _copy(self._state)
        for undo in reversed(self._journal[len(self._journal) - (now - steps) :]):
            slots, ids, used, score = undo.taken
            s.ids[slots], s.used[slots], s.score[slots] = ids, used, score
            s.score[undo.read] = undo.scores
            s = s._replace(
                pending=undo.pending, seen=undo.seen, steps=undo.steps, evictions=undo.evictions
            )
        return self._padded(s)

    @property
    def state(self) -> VocabState:
        """A copy of the mapping (to save; ``Vocabulary(..., state=)`` restores it)."""
        with self._lock:
            return self._padded(self._state)

    def _padded(self, s: VocabState) -> VocabState:
        """``s`` with its waiting ids padded to N entries (a copy)."""
        slots = self.blocks.slots
        pad = lambda x: np.concatenate([x, np.zeros(slots - x.size, np.int64)])  # noqa: E731
        return _copy(
            s._replace(pending=pad(s.pending), seen=pad(s.seen), waiting=np.int64(s.pending.size))
        )

    def slot_of(self, ids: np.ndarray) -> np.ndarray:
        """int64 per id: its slot, or -1 where it holds none (waiting or never seen)."""
        ids = as_ids(ids)
        with self._lock:
            return self._slot_of(ids)

    def _slot_of(self, ids: np.ndarray) -> np.ndarray:
        if self.kernel:
            return self._hash.find(ids)
        pos = np.minimum(np.searchsorted(self._keys, ids), max(self._keys.size - 1, 0))
        hit = self._keys.size > 0
        found = hit & (self._keys[pos] == ids) if hit else np.zeros(ids.shape, bool)
        return np.where(found, self._slots[pos] if hit else -1, -1)

    def lookup(self, ids: Any) -> np.ndarray:
        """int32 slots of ``ids`` as the mapping stands, changing nothing (to evaluate):
        an id without a slot its owner's zero row."""
        ids = as_ids(ids, f"the ids of managed table {self.name}")
        slot = self.slot_of(ids)  # (under the lock)
        zero = self.blocks.first()[owner_of(ids, self.blocks.workers)]
        return np.where(slot >= 0, slot, zero).astype(np.int32)

    def view_at(self, steps: int | None = None) -> Vocabulary:
        """The mapping as it stood after ``steps`` batches (``state_at``; ``None``: as
        it stands), to ``lookup`` in: itself when it stands there, else a copy, built
        once for all the batches of an evaluation."""
        with self._lock:
            if steps is None or steps == int(self._state.steps):
                return self
            then = self._state_at(steps)
        return Vocabulary(
            self.blocks.slots, self.dim, self.blocks.workers, self.policy, then, kernel=self.kernel
        )

    def map(self, ids: Any) -> tuple[np.ndarray, Fresh]:
        """Admits, evicts and maps the ids of one batch (every read of the table).

        Args:
          ids: int64 ids of any shape, any values.

        Returns:
          ``(slots, fresh)``: int32 slots shaped like ``ids`` (a waiting id its owner's
          zero row), and the slots to start afresh before the step reads them.
        """
        ids = as_ids(ids, f"the ids of managed table {self.name}")
        with self._lock:  # a save on another thread sees it before or after, whole
            return self._map(ids)

    def _map(self, ids: np.ndarray) -> tuple[np.ndarray, Fresh]:
        if self.kernel:
            return self._map_kernel(ids)
        s, blocks = self._state, self.blocks
        steps = int(s.steps) + 1
        uniq, inverse, reads = np.unique(ids.reshape(-1), return_inverse=True, return_counts=True)
        slot = self.slot_of(uniq)
        held = slot >= 0
        undo = _Undo(
            slot[held], s.score[slot[held]].copy(), s.pending, s.seen, s.steps, s.evictions
        )
        if self.policy.eviction == "lru":
            s.score[slot[held]] = steps
        else:
            s.score[slot[held]] += reads[held]
        new, new_reads = uniq[~held], reads[~held]
        waited = _lookup(s.pending, s.seen, new)
        total = new_reads + waited
        owners = owner_of(new, blocks.workers)
        taken_ids, taken_slots, taken_total, evicted = [], [], [], 0
        ready = total >= self.policy.threshold
        for w in np.unique(owners[ready]):
            mine = np.flatnonzero(ready & (owners == w))
            mine = mine[np.lexsort((new[mine], -total[mine]))]  # most reads, then lowest id
            free = self._candidates(w, slot[held], mine.size)
            mine = mine[: free.size]
            if self.policy.compete:  # a used slot only to an id read more often than its
                beats = ~s.used[free] | (total[mine] > s.score[free])
                keep = mine.size if beats.all() else int(np.argmin(beats))  # (monotone)
                mine, free = mine[:keep], free[:keep]
            evicted += int(s.used[free].sum())
            taken_ids.append(new[mine])
            taken_slots.append(free)
            taken_total.append(total[mine])
        ids_in = np.concatenate(taken_ids) if taken_ids else np.zeros(0, np.int64)
        slots_in = np.concatenate(taken_slots) if taken_slots else np.zeros(0, np.int64)
        undo = undo._replace(
            taken=(
                slots_in,
                s.ids[slots_in].copy(),
                s.used[slots_in].copy(),
                s.score[slots_in].copy(),
            )
        )
        if slots_in.size:
            gone = np.searchsorted(self._keys, s.ids[slots_in][s.used[slots_in]])  # held ids
            keys, values = np.delete(self._keys, gone), np.delete(self._slots, gone)
            self._keys, self._slots = _insert(keys, values, ids_in, slots_in)
            s.ids[slots_in], s.used[slots_in] = ids_in, True
            s.score[slots_in] = (
                steps if self.policy.eviction == "lru" else np.concatenate(taken_total)
            )
        waiting = ~np.isin(new, ids_in)
        pending, seen = _merge(s.pending, s.seen, new[waiting], total[waiting], drop=ids_in)
        if pending.size > blocks.slots:  # the most read wait on (ties: the lower ids)
            keep = np.sort(np.lexsort((pending, -seen))[: blocks.slots])
            pending, seen = pending[keep], seen[keep]
        fresh = self._advance(undo, pending, seen, evicted, slots_in, ids_in, ids.size)
        return self.lookup(uniq)[inverse].reshape(ids.shape), fresh

    def _map_kernel(self, ids: np.ndarray) -> tuple[np.ndarray, Fresh]:
        """``_map`` by the compiled kernel (``mapkernel.map_ids``): the same slots."""
        s, blocks, policy = self._state, self.blocks, self.policy
        steps = int(s.steps) + 1
        config = (
            *blocks,
            blocks.size,
            policy.eviction == "lfu",
            policy.threshold,
            policy.compete,
            steps,
            SCORE_LIMIT // blocks.size - 2,
        )
        got = mapkernel.map_ids(self._hash, s, self._filled, config, ids.reshape(-1))
        undo = _Undo(
            got.read,
            got.scores,
            s.pending,
            s.seen,
            s.steps,
            s.evictions,
            (got.taken, got.old_ids, got.old_used, got.old_score),
        )
        fresh = self._advance(
            undo, got.pending, got.seen, got.evicted, got.taken, got.taken_ids, ids.size
        )
        return got.slots.reshape(ids.shape), fresh

    def _advance(self, undo, pending, seen, evicted: int, slots, ids, reads: int) -> Fresh:
        """The bookkeeping of one mapped batch, whichever backend mapped it: ``undo``
        journaled, the waiting ids set, the batch and its evictions counted; returns the
        ``Fresh`` of its ``reads`` reads, whose new ``ids`` took ``slots`` (the zero rows
        first)."""
        s = self._state
        self._journal = [*self._journal[1 - JOURNAL :], undo]
        self._state = s._replace(
            pending=pending,
            seen=seen,
            steps=np.int64(int(s.steps) + 1),
            evictions=np.int64(int(s.evictions) + evicted),
        )
        zero = self.blocks.first()
        rows = np.zeros((zero.size + ids.size, self.dim), np.float32)
        if self.kernel:
            mapkernel.initial_rows(ids, self.scale, rows[zero.size :])
        else:
            rows[zero.size :] = initial_rows(ids, self.dim, self.scale)
        return Fresh(np.concatenate([zero, slots]), rows, evicted, reads + zero.size)

    def _candidates(self, worker: int, read: np.ndarray, wanted: int) -> np.ndarray:
        """The first ``wanted`` slots of ``worker``'s block in the order new ids take
        them (fewer if the block has fewer): free ones first, then by score (lowest
        first), ties to the lower slot; the zero row and the slots ``read`` by this
        batch left out."""
        size = self.blocks.size
        lo, hi = worker * size + 1, min((worker + 1) * size, self.blocks.slots)
        s = self._state
        filled = int(self._filled[worker])  # a slot once taken stays taken: free ones follow
        if wanted <= hi - lo - filled:  # free slots, lowest first
            self._filled[worker] += wanted
            return np.arange(lo + filled, lo + filled + wanted)
        keep = np.ones(hi - lo, bool)
        keep[read[(read >= lo) & (read < hi)] - lo] = False
        block = np.flatnonzero(keep)
        score = np.minimum(s.score[lo:hi][block], SCORE_LIMIT // size - 2)  # no overflow
        rank = np.where(s.used[lo:hi][block], score + 1, 0) * size + block
        self._filled[worker] = hi - lo
        if wanted < block.size:  # the wanted lowest ranks (distinct), then in order
            part = np.argpartition(rank, wanted - 1)[:wanted]
            block, rank = block[part], rank[part]
        return lo + block[np.argsort(rank)]


def rehash(state: VocabState, workers: int) -> tuple[VocabState, np.ndarray, np.ndarray]:
    """A table's saved mapping moved onto ``workers`` workers (a checkpoint restored
    onto another device count): every held id to a slot of its new owner's block.

    An owner keeps, of the ids hashed to it, as many as its block holds (all of them
    while they fit), those of highest score first (ties: the lower id), in the order of
    their old slots; the others are evicted (counted, forgotten). The waiting ids and
    the counters stay as they are.

    Args:
      state: the saved ``VocabState`` (``Vocabulary.state``).
      workers: G', the workers of the step it is restored into.

    Returns:
      ``(state, old, new)``: the mapping on G' workers, and the slots whose rows move:
      the row (and optimizer state) of slot ``old[k]`` goes to slot ``new[k]``.

    Example:
        >>> vocab, ids = Vocabulary(16, 2, 4), np.arange(6) * 1000
        >>> before = vocab.map(ids)[0]  # slots on 4 workers
        >>> moved, old, new = rehash(vocab.state, 2)
        >>> after = Vocabulary(16, 2, 2, state=moved).lookup(ids)  # on 2
        >>> dict(zip(old.tolist(), new.tolist())) == dict(zip(before.tolist(), after.tolist()))
        True
    """
    slots = state.ids.size
    blocks = Blocks(slots, workers)
    held = np.flatnonzero(state.used)
    ids, score = state.ids[held], state.score[held]
    owner = owner_of(ids, workers)
    ids_out, used_out, score_out = (
        np.zeros(slots, np.int64),
        np.zeros(slots, bool),
        np.zeros(slots, np.int64),
    )
    old, new, evicted = [], [], 0
    for w in range(workers):
        mine = np.flatnonzero(owner == w)
        room = min((w + 1) * blocks.size, slots) - w * blocks.size - 1
        keep = mine[np.lexsort((ids[mine], -score[mine]))][:room]
        evicted += mine.size - keep.size
        keep = np.sort(keep)  # in the order of their old slots
        to = w * blocks.size + 1 + np.arange(keep.size)
        ids_out[to], used_out[to], score_out[to] = ids[keep], True, score[keep]
        old.append(held[keep])
        new.append(to)
    moved = state._replace(
        ids=ids_out,
        used=used_out,
        score=score_out,
        evictions=np.int64(int(state.evictions) + evicted),
    )
    return moved, np.concatenate(old), np.concatenate(new)


#: Scores beyond ``SCORE_LIMIT // B`` (B the block's slots) rank as equal (ties to the
#: lower slot): an LFU count that high no stream reaches.
SCORE_LIMIT = 2**62

#: The batches a ``Vocabulary`` can undo (``state_at``): a loop places a batch or two
#: ahead of the step it saves.
JOURNAL = 4


class _Undo(NamedTuple):
    """What one ``Vocabulary.map`` changed: the old values to put back."""

    read: np.ndarray  # the slots of held ids the batch read
    scores: np.ndarray  # their scores before it
    pending: np.ndarray  # the waiting ids before it (the arrays it replaced)
    seen: np.ndarray
    steps: np.ndarray
    evictions: np.ndarray
    taken: tuple = ()  # (slots new ids took, their ids, used and scores before)


def _copy(state: VocabState) -> VocabState:
    return VocabState(*(np.array(x, copy=True) for x in state))


def _lookup(keys: np.ndarray, values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """values[keys == id] per id (0 where absent); ``keys`` ascending."""
    if not keys.size:
        return np.zeros(ids.shape, np.int64)
    pos = np.minimum(np.searchsorted(keys, ids), keys.size - 1)
    return np.where(keys[pos] == ids, values[pos], 0)


def _insert(keys, values, new_keys, new_values):
    """``keys`` (ascending) with ``new_keys`` (absent from it) added, values alongside."""
    order = np.argsort(new_keys, kind="stable")
    at = np.searchsorted(keys, new_keys[order])
    return np.insert(keys, at, new_keys[order]), np.insert(values, at, new_values[order])


def _merge(keys, values, ids, counts, drop):
    """The waiting ids ``keys`` (ascending) with ``ids`` set to ``counts`` and ``drop``
    removed."""
    out = np.concatenate([ids, drop])
    if keys.size and out.size:
        pos = np.minimum(np.searchsorted(keys, out), keys.size - 1)
        at = pos[keys[pos] == out]
        keys, values = np.delete(keys, at), np.delete(values, at)
    return _insert(keys, values, ids, counts)


# ------------------------------------------------------------------ the layout


def layout(policies: Mapping[Any, Policy | Mapping] | None = None) -> Layout:
    """The ``managed`` layout with a ``Policy`` per table (a table without one takes
    ``Policy()``: LRU, admitted at once).

    Args:
      policies: table (path or name) -> its ``Policy`` or its JSON object.

    Returns:
      A ``Layout`` named ``"managed"``, for ``table_layouts``.

    Example:
        >>> value = layout({"params/sparse_0/embedding": Policy("lfu", threshold=2)})
        >>> value.name, value.config["params/sparse_0/embedding"]["eviction"]
        ('managed', 'lfu')
    """
    chosen = {table_name(k): Policy.from_json(v) for k, v in (policies or {}).items()}
    config = {k: v.to_json() for k, v in chosen.items()}
    waits = any(v.threshold > 1 for v in chosen.values())
    return row.ROW._replace(
        name="managed",
        # admitted ids climb for a while where ids wait: buckets grow by powers of two
        capacity=row.CAPACITY._replace(grow=_doubling) if waits else row.CAPACITY,
        pricing=PRICING,
        config=config or None,
        configure=layout,
        pipelined=None,
        maps_ids=True,
    )


#: What the planner knows of a managed table: the row layout's price at its N slots
#: (memory) and at the buckets of the sample's ids as a fresh mapping places them
#: (``planner.table_stats`` measures a raw table so); it serves only tables of raw ids
#: (``planner.serves``: ``Layout.maps_ids``). The host's mapping and the fresh rows'
#: upload do not cross the link and are not priced.
PRICING = row.PRICING


def _doubling(need: int) -> int:
    """``grow_with_margin`` rounded up to a power of two: a capacity that keeps growing
    makes a new program at each doubling only."""
    return next_power_of_two(grow_with_margin(need))


def policy_of(table: Any) -> Policy:
    """The ``Policy`` of a managed table (``tables.Table``)."""
    return Policy.from_json((table.layout.config or {}).get(table.name, {}))


#: The managed layout, every table LRU and admitted at once (``layout(...)`` for others).
MANAGED = layout()


# ------------------------------------------------------------------ a step's batches


class Vocabularies:
    """The vocabularies of a step's managed tables and the batch keys that feed them:
    ``map_batch`` turns a host batch's ids into slots (as ``TrainStep.place_batch``
    does before it places a batch).

    Args:
      tables: the step's managed tables (``tables.Table``).
      workers: G, the workers each table is sharded over.
      reads: ``reads(batch, direct) -> {key: table indices}`` (``access.key_tables``
        of the step's loss), which keys feed which tables.
    """

    def __init__(self, tables, workers: int, reads):
        self.tables = {t.index: t for t in tables}
        self.vocabularies = {
            t.index: Vocabulary(t.vocab, t.dim, workers, policy_of(t), name=t.name) for t in tables
        }
        self.workers, self._reads, self._keys = workers, reads, None
        self.stepped = 0  # batches whose step ran (``step.managed_ids.CountedStep``)

    def keys(self, batch: Mapping[str, Any]) -> dict[str, int]:
        """Batch key -> the managed table its values are ids of (found once, from the
        loss); ``ValueError`` for a key whose ids a managed table reads computed (an
        offset added, a hash taken) or that also feeds another table."""
        if self._keys is None:
            stand_in = {k: traceable(v) for k, v in batch.items()}
            fed, direct = self._reads(stand_in, False), self._reads(stand_in, True)
            keys = {}
            for key, tables in fed.items():
                mine = tables & set(self.tables)
                if not mine:
                    continue
                name = self.tables[min(mine)].name
                if len(tables) > 1:
                    raise ValueError(
                        f"batch[{key!r}] feeds managed table {name} and other tables: the "
                        "ids of a managed table need a batch key of their own"
                    )
                if key not in direct:
                    raise ValueError(
                        f"the loss computes the ids it reads managed table {name} by from "
                        f"batch[{key!r}]: a managed table's ids must be read as the batch "
                        "holds them (they are mapped to slots on the host)"
                    )
                keys[key] = min(mine)
            self._keys = keys
        return self._keys

    def map_batch(self, batch: Mapping[str, Any]) -> tuple[dict, dict[int, Fresh]]:
        """``(batch, fresh)``: the batch with each managed table's ids replaced by their
        slots (int32), and per managed table (leaf index) the slots to start afresh."""
        keys = self.keys(batch)
        out, fresh = dict(batch), {}
        for index, vocabulary in self.vocabularies.items():
            mine = [k for k, i in keys.items() if i == index]
            for key in mine:
                if not np.issubdtype(np.asarray(batch[key]).dtype, np.integer):
                    raise ValueError(
                        f"batch[{key!r}] holds {np.asarray(batch[key]).dtype} values but "
                        f"feeds managed table {vocabulary.name} as ids; give int64 ids"
                    )
            values = [as_ids(batch[k]) for k in mine]
            sizes = np.cumsum([v.size for v in values])[:-1]
            flat = (
                np.concatenate([v.reshape(-1) for v in values]) if values else np.zeros(0, np.int64)
            )
            slots, fresh[index] = vocabulary.map(flat)
            for key, part, value in zip(mine, np.split(slots, sizes), values, strict=True):
                out[key] = part.reshape(value.shape)
        return out, fresh

    def lookup_batch(self, batch: Mapping[str, Any], at: int | None = None) -> dict:
        """``lookup_batches`` of one batch."""
        return self.lookup_batches([batch], at)[0]

    def lookup_batches(self, batches: list[Mapping[str, Any]], at: int | None = None) -> list:
        """The batches with each managed table's ids replaced by their slots as the
        mappings stood after ``at`` batches (default ``stepped``, those whose step ran:
        the mappings of the parameters a step returned, whatever batches are placed
        ahead; ``Vocabulary.view_at``: nothing admitted, nothing counted), to evaluate
        a model on held-out data."""
        at = self.stepped if at is None else at
        views = {i: v.view_at(at) for i, v in self.vocabularies.items()}
        out = []
        for batch in batches:
            mapped = dict(batch)
            for key, index in self.keys(batch).items():
                mapped[key] = views[index].lookup(batch[key])
            out.append(mapped)
        return out

    def zero_rows(self) -> dict[str, np.ndarray]:
        """Table name -> int64[G], the slots that read as zeros (its blocks' first)."""
        return {self.tables[i].name: v.blocks.first() for i, v in self.vocabularies.items()}

    def names(self) -> list[str]:
        """The managed tables' names, in table order (that of ``states``)."""
        return [self.tables[i].name for i in self.vocabularies]

    def states(self, at: int | None = None) -> dict[str, VocabState]:
        """Table name -> a copy of its mapping (``restore`` takes it back): as it
        stands, or after the first ``at`` batches (``Vocabulary.state_at``: a step saved
        while the next batches are placed)."""
        return {
            self.tables[i].name: v.state if at is None else v.state_at(at)
            for i, v in self.vocabularies.items()
        }

    def restore(self, states: Mapping[str, VocabState]) -> None:
        """Starts every table's mapping from ``states`` (``states()`` of the same tables
        on the same G workers)."""
        for i, v in self.vocabularies.items():
            name = self.tables[i].name
            if name not in states:
                raise ValueError(f"no saved mapping of managed table {name}")
            self.vocabularies[i] = Vocabulary(
                v.blocks.slots, v.dim, self.workers, v.policy, VocabState(*states[name]), name
            )
            self.stepped = int(VocabState(*states[name]).steps)

    def evictions(self) -> dict[str, int]:
        """Table name -> the ids evicted so far."""
        return {self.tables[i].name: int(v.state.evictions) for i, v in self.vocabularies.items()}


def traceable(value: Any) -> Any:
    """A stand-in of a batch value the loss can be traced on (``access.key_tables``):
    64-bit ids as int32 zeros, any other value as it is."""
    value = np.asarray(value)
    if np.issubdtype(value.dtype, np.integer) and value.dtype.itemsize == 8:
        return np.zeros(value.shape, np.int32)
    return value


# ------------------------------------------------------------------ on the devices


def renew(optimizer: optax.GradientTransformation, params, opt_state, fresh: Mapping):
    """The parameters and optimizer state with each managed table's fresh slots
    started afresh: their rows set, and every optimizer-state leaf that lies like the
    table set at those rows to the value ``optimizer.init`` gives a fresh row (jit-able,
    on global arrays).

    Args:
      optimizer: the step's optax optimizer.
      params: the parameters (a managed table's leaf its stored slots).
      opt_state: ``optimizer``'s state.
      fresh: table leaf index -> ``(slots int32[R], rows float32[R, D])``; a slot out
        of range (``row_optimizers.DROP``) is padding.

    Returns:
      ``(params, opt_state)``.
    """
    leaves, treedef = jax.tree.flatten(params)
    rows = {i: r for i, (_, r) in fresh.items()}
    stand_in = treedef.unflatten([rows.get(i, x) for i, x in enumerate(leaves)])
    started = optimizer.init(stand_in)  # a fresh row's state (the rest unused: removed)
    roles = jax.tree.leaves(state_roles(optimizer, opt_state, params))

    def put(state_leaf, start_leaf, index):
        if index not in fresh or not jnp.ndim(state_leaf):  # not a table's, or a count
            return state_leaf
        slots = fresh[index][0]
        return state_leaf.at[slots].set(start_leaf.astype(state_leaf.dtype), mode="drop")

    s_leaves, s_def = jax.tree.flatten(opt_state)
    renewed = s_def.unflatten(
        [put(x, y, i) for x, y, i in zip(s_leaves, jax.tree.leaves(started), roles, strict=True)]
    )
    new_leaves = [
        x.at[fresh[i][0]].set(fresh[i][1].astype(x.dtype), mode="drop") if i in fresh else x
        for i, x in enumerate(leaves)
    ]
    return treedef.unflatten(new_leaves), renewed


def padded_fresh(fresh: Fresh, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """``(slots int32[capacity], rows float32[capacity, D])`` of ``fresh``, padded with
    ``row_optimizers.DROP`` (a slot no write reaches)."""
    k, dim = fresh.rows.shape
    slots = np.full(capacity, DROP, np.int32)
    rows = np.zeros((capacity, dim), np.float32)
    slots[:k], rows[:k] = fresh.slots, fresh.rows
    return slots, rows
