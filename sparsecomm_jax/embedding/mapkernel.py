"""Host kernel of the managed tables: a batch's ids mapped to slots in one compiled pass.

``managed.Vocabulary.map`` admits, evicts and maps a batch's ids with the policy its
module describes. In numpy that is some forty small array calls a batch, work the
host does beside every step. On CPU hosts with a C++ compiler, ``managed_kernel.cc``
does the same in one pass: it is built into the private cache of the top-k kernel
(``topk.hostkernel.build``) and called through ``ctypes`` on the mapping's own arrays.
Its id -> slot index is an open-addressing table (``HashIndex``) whose arrays the
``Vocabulary`` holds. ``available()`` is False where no compiler is found; the mapping
then runs in numpy, the same slots to the tie (the tests run both against one
reference).

Example:
    >>> import numpy as np
    >>> index = HashIndex.of(np.array([-5, 2**63 - 1]), np.array([3, 7]), 8)
    >>> index.find(np.array([2**63 - 1, 4, -5])).tolist()
    [7, -1, 3]
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sparsecomm_jax.topk import hostkernel

SOURCE = Path(__file__).with_name("managed_kernel.cc")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded kernel, or ``None`` (announced once) when it cannot be had."""
    try:
        lib = ctypes.CDLL(str(hostkernel.build(source=SOURCE)))
    except (RuntimeError, OSError) as e:
        warnings.warn(
            f"the managed tables' host kernel is not used ({' '.join(str(e).split())}); "
            "ids are mapped to slots by numpy instead, the same slots, slower",
            stacklevel=3,
        )
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sparsecomm_vocab_find.argtypes = [ptr, ptr, i64, ptr, i64, ptr]
    lib.sparsecomm_vocab_put.argtypes = [ptr, ptr, i64, ptr, ptr, i64]
    lib.sparsecomm_vocab_map.argtypes = [ptr] * 7 + [i64, ptr, ptr, i64, ptr, i64] + [ptr] * 11
    lib.sparsecomm_vocab_rows.argtypes = [ptr, i64, i64, ctypes.c_float, ptr]
    return lib


def available() -> bool:
    """Whether the kernel could be built and loaded on this machine."""
    return _library() is not None


def _ptr(array: np.ndarray) -> int:
    assert array.flags.c_contiguous, "the kernel reads contiguous arrays"
    return array.ctypes.data


class HashIndex(NamedTuple):
    """The admitted ids of a table and their slots, in an open-addressing table of H
    entries (H a power of two, at least twice the slots: probes stay short).

    Attributes:
      keys: int64[H], the ids (where ``slots`` >= 0).
      slots: int64[H], each entry's slot, -1 where the entry is empty.
    """

    keys: np.ndarray
    slots: np.ndarray

    @classmethod
    def of(cls, ids: np.ndarray, slots: np.ndarray, table_slots: int) -> HashIndex:
        """The index of the distinct ``ids`` at ``slots``, sized for a table of
        ``table_slots`` slots (the most ids it will hold)."""
        size = 16
        while size < 2 * max(table_slots, ids.size):
            size *= 2
        index = cls(np.zeros(size, np.int64), np.full(size, -1, np.int64))
        ids, values = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(slots, np.int64)
        _library().sparsecomm_vocab_put(*index._args(), _ptr(ids), _ptr(values), ids.size)
        return index

    def _args(self) -> tuple:
        return _ptr(self.keys), _ptr(self.slots), self.keys.size - 1

    def find(self, ids: np.ndarray) -> np.ndarray:
        """int64 per id: its slot, or -1 where it holds none."""
        flat = np.ascontiguousarray(ids, np.int64).reshape(-1)
        out = np.empty(flat.size, np.int64)
        _library().sparsecomm_vocab_find(*self._args(), _ptr(flat), flat.size, _ptr(out))
        return out.reshape(np.shape(ids))


def initial_rows(ids: np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
    """``managed.initial_rows(ids, D, scale)`` written into ``out`` (float32[n, D],
    contiguous), the same values to the bit."""
    ids = np.ascontiguousarray(ids, np.int64)
    assert out.shape[0] == ids.size and out.dtype == np.float32
    _library().sparsecomm_vocab_rows(_ptr(ids), ids.size, out.shape[1], scale, _ptr(out))
    return out


class Mapped(NamedTuple):
    """What ``map_ids`` did to one batch (the ``Vocabulary``'s state changed in place).

    Attributes:
      slots: int32[n], each read's slot (a waiting id its owner's zero row).
      read: int64[r], the held slots the batch read; ``scores`` their scores before.
      taken: int64[k], the slots new ids took, in order; ``taken_ids`` those ids;
        ``old_ids``, ``old_used``, ``old_score`` what the slots held before.
      pending, seen: the waiting ids after the batch (ascending) and their reads.
      evicted: the ids evicted.
    """

    slots: np.ndarray
    read: np.ndarray
    scores: np.ndarray
    taken: np.ndarray
    taken_ids: np.ndarray
    old_ids: np.ndarray
    old_used: np.ndarray
    old_score: np.ndarray
    pending: np.ndarray
    seen: np.ndarray
    evicted: int


def map_ids(index: HashIndex, state, filled: np.ndarray, config: tuple, ids: np.ndarray) -> Mapped:
    """One batch mapped by the kernel, ``state``'s ``ids``, ``used`` and ``score``,
    ``filled`` and ``index`` changed in place (``Vocabulary._map_kernel``).

    Args:
      index: the table's ``HashIndex``.
      state: its ``managed.VocabState`` (``pending``/``seen`` the waiting ids unpadded).
      filled: int64[G], the slots of each block ever taken.
      config: ``(N, G, B, lfu, threshold, compete, step, score cap)`` as integers.
      ids: int64[n], the batch's reads.

    Returns:
      ``Mapped``.
    """
    n, waiting = ids.size, state.pending.size
    ids = np.ascontiguousarray(ids, np.int64)
    pending = np.ascontiguousarray(state.pending, np.int64)
    seen = np.ascontiguousarray(state.seen, np.int64)
    buffer = np.empty(6 * n + 2 * (n + waiting) + 4, np.int64)  # the int64 outputs
    ends = np.cumsum([0, n, n, n, n, n, n, n + waiting, n + waiting, 4])
    read, scores, taken, taken_ids, old_ids, old_score, pending_out, seen_out, counts = (
        buffer[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)
    )
    slots, old_used = np.empty(n, np.int32), np.empty(n, bool)
    conf = np.array(config, np.int64)
    _library().sparsecomm_vocab_map(
        *(_ptr(x) for x in (conf, state.ids, state.used, state.score, filled)),
        *index._args(),
        _ptr(pending),
        _ptr(seen),
        waiting,
        _ptr(ids),
        n,
        *(_ptr(x) for x in (slots, read, scores, taken, taken_ids, old_ids, old_used)),
        *(_ptr(x) for x in (old_score, pending_out, seen_out, counts)),
    )
    r, k, w, evicted = counts.tolist()
    return Mapped(
        slots,
        read[:r],
        scores[:r],
        taken[:k],
        taken_ids[:k],
        old_ids[:k],
        old_used[:k],
        old_score[:k],
        pending_out[:w],
        seen_out[:w],
        evicted,
    )
