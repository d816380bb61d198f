"""Balanced sparse all-reduce: each worker's selected (index, value) pairs go to owners
chosen by a fixed hash of the index, in one all-to-all; each owner sums what it received
into its shard; the reduced shards come back to every worker whole (Zen), or only their
entries in the global top-k (Ok-Topk). Pure functions for ``shard_map`` bodies; the
exchanges built from them are ``topk_balanced`` and ``oktopk`` of ``topk.exchanges``.

**Owners.** A bucket of d entries is cut into blocks of P consecutive indices. Entry
``c`` of block ``b`` (index ``i = b P + c``) belongs to owner ``(c + h(b)) mod P``, at
position ``b`` of that owner's shard, ``h`` an integer hash of the block
(``OwnerHash``). Within a block the owners are a rotation, so the map is a bijection
onto P shards of ``ceil(d/P)`` positions, cheap to invert for every entry. A contiguous
hot region (an embedding table's hot rows, an attention layer's heads) spreads over
every owner to within one entry a block, and a strided one is spread by the hash;
contiguous shards, as TopKA2A cuts them, would send all of such a region to one owner.

**Static buffers, nothing dropped.** Every buffer has a static size (an equal-split
``all_to_all``; XLA has no ragged collective on CPU): ``topk.costs.owner_slots``
slots for a worker's pairs to one owner, and ``union_slots`` (or ``owner_slots`` of the
global k) for an owner's entries on the way back. A pair that finds no slot, or whose
entry does not come back (not in oktopk's global top-k, or past the slots of the way
back), stays in the residual of the worker that selected it; the pairs short of a slot
are counted (``deferred``). What every worker sends and keeps adds up to what came in,
and each worker's residual holds only what it selected itself. Sums are taken in
float32 at the owner.

Per worker (P=2, d=4; neither block is rotated: indices 0 and 2 are owner 0's,
indices 1 and 3 owner 1's, each at position 0 then 1 of its shard)::

    selected:    w0 {0: 5., 3: 1.}              w1 {0: 2., 2: 4.}
    all_to_all:  w0 gets {0: 5., 0: 2., 2: 4.}  w1 gets {3: 1.}
    owner sums:  w0 shard [7., 4.]              w1 shard [0., 1.]
    all_gather:  both [7., 0., 4., 1.]

Example:
    >>> import jax.numpy as jnp
    >>> h = OwnerHash(size=10, workers=4)
    >>> owner, position = h.owners(jnp.arange(10))
    >>> h.indices(owner, position).tolist()   # the map inverts
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]

References:
    Wang et al., "Zen: Near-Optimal Sparse Tensor Synchronization for Distributed DNN
    Training", OSDI 2025 (hashed owners, the reduced shard as a bitmap and its values).
    Li and Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning"
    (Ok-Topk), PPoPP 2022 (balanced split and reduce, then a global top-k).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsecomm_jax.comm.vma import all_gather_replicated
from sparsecomm_jax.topk.selectors import magnitude_keys

RADIX_DIGITS = (11, 11, 9)  # oktopk's threshold search: bits a round, of 31-bit keys

# The block hash: two multiply-xorshift rounds (C. Wellons' "lowbias32"), every bit of
# the block's index mixed into every bit of the hash. One multiply alone is nearly
# linear in its low bits: blocks a stride apart would rotate alike, and a gradient's
# column (indices a multiple of P^2 apart) would all go to one owner.
MIX = (0x7FEB352D, 0x846CA68B)


class Comm(NamedTuple):
    """The collectives of the balanced exchanges, over one mesh axis (``over``) or
    stood in for on one worker (``stand_in``: what ``topk.local_cost`` times, the
    exchange's local work alone).

    Attributes:
      all_to_all: ``int32[P, n] -> int32[P, n]``: row ``w`` sent to / received from
        worker ``w``.
      all_gather: ``x[n] -> x[P n]``, every worker's in worker order, typed replicated.
      psum: the sum over the workers, typed replicated.
      index: ``() -> int32[]``, this worker's index.
    """

    all_to_all: Callable
    all_gather: Callable
    psum: Callable
    index: Callable

    @classmethod
    def over(cls, axis_name: str) -> Comm:
        """The collectives over the mesh axis ``axis_name`` (inside ``shard_map``)."""
        return cls(
            lambda x: jax.lax.all_to_all(x, axis_name, 0, 0),
            lambda x: all_gather_replicated(x, axis_name),
            lambda x: jax.lax.psum(x, axis_name),
            lambda: jax.lax.axis_index(axis_name),
        )

    @classmethod
    def stand_in(cls, workers: int) -> Comm:
        """Worker 0 of ``workers`` whose every peer sent what it sent: no collective."""
        return cls(lambda x: x, lambda x: jnp.tile(x, workers), lambda x: x, lambda: jnp.int32(0))


class OwnerHash(NamedTuple):
    """Where each entry of a bucket of ``size`` entries is owned, over ``workers``.

    Attributes:
      size: d, the bucket's entries.
      workers: P, the owners.
    """

    size: int
    workers: int

    @property
    def width(self) -> int:
        """ceil(d/P): the positions of an owner's shard (one a block)."""
        return -(-self.size // self.workers)

    def rotation(self, blocks: jax.Array) -> jax.Array:
        """``h(b) mod P`` of each block index ``b``: int32 like ``blocks``."""
        x = blocks.astype(jnp.uint32)
        x = (x ^ (x >> jnp.uint32(16))) * jnp.uint32(MIX[0])
        x = (x ^ (x >> jnp.uint32(15))) * jnp.uint32(MIX[1])
        x = x ^ (x >> jnp.uint32(16))
        return (x % jnp.uint32(self.workers)).astype(jnp.int32)

    def owners(self, indices: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(owner, position)`` of each index: int32 arrays like ``indices``."""
        p = self.workers
        block = indices.astype(jnp.int32) // p
        return (indices % p + self.rotation(block)) % p, block

    def indices(self, owner: jax.Array, positions: jax.Array) -> jax.Array:
        """The index at each ``(owner, position)``: int32, ``size`` or more where the
        last block is short (no entry there)."""
        c = (owner - self.rotation(positions)) % self.workers
        return positions * self.workers + c

    def unshard(self, shards: jax.Array) -> jax.Array:
        """Every owner's shard (``[P, width]``) put back in index order: ``[size]``."""
        blocks = jnp.arange(self.width, dtype=jnp.int32)
        entries = jnp.arange(self.workers, dtype=jnp.int32)
        owner = (entries[None, :] + self.rotation(blocks)[:, None]) % self.workers  # [s, P]
        return jnp.take_along_axis(shards.T, owner, axis=1).reshape(-1)[: self.size]


class Routed(NamedTuple):
    """This worker's pairs laid out for the all-to-all to their owners.

    Attributes:
      sends: int32[P, 2C]: row ``o`` the pairs for owner ``o``: C positions in its
        shard (``width``, out of range, in unused slots), then C values' float32 bits.
      fits: bool[k]: each selected pair found a slot (in the order of the selection);
        one that did not stays in the residual.
      deferred: int32[]: how many found no slot.
    """

    sends: jax.Array
    fits: jax.Array
    deferred: jax.Array


def route(h: OwnerHash, values: jax.Array, indices: jax.Array, slots: int) -> Routed:
    """Lays out ``values`` at ``indices`` (float[k], int32[k]) by owner, ``slots`` an
    owner; those past an owner's slots do not fit.

    Example:
        >>> import jax.numpy as jnp
        >>> h = OwnerHash(8, 2)   # indices 0, 2, 5 and 7 are owner 0's
        >>> r = route(h, jnp.array([1.0, 2.0, 3.0]), jnp.array([0, 2, 5]), slots=2)
        >>> r.fits.tolist(), int(r.deferred)
        ([True, True, False], 1)
    """
    p = h.workers
    owner, position = h.owners(indices)  # int32[k] each
    # each pair's rank among its owner's, in selection order (no sort: a running count
    # per owner, cheaper on CPU than an argsort of the k owners)
    mine = owner[:, None] == jnp.arange(p, dtype=jnp.int32)[None, :]  # bool[k, P]
    counted = jnp.cumsum(mine, axis=0, dtype=jnp.int32)
    ranked = jnp.take_along_axis(counted, owner[:, None], axis=1)[:, 0] - 1  # int32[k]
    fits = ranked < slots
    slot = jnp.where(fits, owner * slots + ranked, p * slots)  # past the end: none
    bits = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
    where = jnp.full(p * slots, h.width, jnp.int32).at[slot].set(position, mode="drop")
    what = jnp.zeros(p * slots, jnp.int32).at[slot].set(bits, mode="drop")
    sends = jnp.concatenate([where.reshape(p, slots), what.reshape(p, slots)], axis=1)
    return Routed(sends, fits, jnp.sum(~fits, dtype=jnp.int32))


def reduce_at_owners(h: OwnerHash, sends: jax.Array, comm: Comm) -> jax.Array:
    """One all-to-all of every worker's ``Routed.sends``; each owner sums what it
    received into its shard: float32[width], this worker's (typed varying)."""
    got = comm.all_to_all(sends)  # int32[P, 2C]: row w from worker w
    slots = got.shape[1] // 2
    positions = got[:, :slots].reshape(-1)  # int32[P*C]
    values = jax.lax.bitcast_convert_type(got[:, slots:], jnp.float32).reshape(-1)
    return jnp.zeros(h.width, jnp.float32).at[positions].add(values, mode="drop")


# ------------------------------------------------------------------ the way back


class Returned(NamedTuple):
    """An owner's shard returned to every worker.

    Attributes:
      total: float32[d], every owner's returned entries in index order (typed
        replicated: the same on every worker).
      deferred: int32[]: how many chosen entries did not fit the slots.
    """

    total: jax.Array
    deferred: jax.Array


# XLA:CPU runs a cumulative sum over n entries as a slow loop (about 10 ns an entry, and
# ``jnp.nonzero`` is one); these count set bits 32 at a time instead.


def pack_bits(mask: jax.Array) -> jax.Array:
    """``mask`` (bool[n]) as uint32[ceil(n/32)] words, entry ``i`` bit ``i % 32`` of word
    ``i // 32``.

    Example:
        >>> import jax.numpy as jnp
        >>> pack_bits(jnp.array([True, False, True])).tolist()
        [5]
    """
    words = -(-mask.shape[0] // 32)
    bits = jnp.pad(mask, (0, words * 32 - mask.shape[0])).reshape(words, 32).astype(jnp.uint32)
    return jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def select_bits(words: jax.Array, count: int, fill: int) -> jax.Array:
    """The positions of the first ``count`` set bits of ``words`` (uint32[w], as
    ``pack_bits`` lays them out), ``fill`` past them: int32[count]. Each is found in its
    word by the word's place among the words' running counts, then within the word by
    five halvings."""
    ones = jax.lax.population_count(words).astype(jnp.int32)  # int32[w]
    before = jnp.cumsum(ones) - ones  # set bits in the words before each (w entries)
    rank = jnp.arange(count, dtype=jnp.int32)
    starts = jnp.where((ones > 0) & (before < count), before, count)  # a word's first rank
    word_of = jnp.zeros(count, jnp.int32).at[starts].set(jnp.arange(words.shape[0]), mode="drop")
    word_of = jax.lax.cummax(word_of)  # int32[count]: the word holding each rank
    word, nth = words[word_of], rank - before[word_of]  # the nth set bit of that word
    bit = jnp.zeros(count, jnp.uint32)
    for half in (16, 8, 4, 2, 1):  # the lowest bit with more than nth set bits up to it
        below = word & ((jnp.uint32(1) << (bit + half)) - 1)
        bit = jnp.where(jax.lax.population_count(below).astype(jnp.int32) <= nth, bit + half, bit)
    position = word_of * 32 + bit.astype(jnp.int32)
    return jnp.where(rank < jnp.sum(ones), position, fill)


def bit_ranks(mask: jax.Array) -> jax.Array:
    """How many entries of ``mask`` (bool[n]) before each are set: int32[n]."""
    words = pack_bits(mask)
    ones = jax.lax.population_count(words).astype(jnp.int32)
    below = (jnp.uint32(1) << jnp.arange(32, dtype=jnp.uint32)) - 1  # bits under each bit
    within = jax.lax.population_count(words[:, None] & below).astype(jnp.int32)  # [w, 32]
    return ((jnp.cumsum(ones) - ones)[:, None] + within).reshape(-1)[: mask.shape[0]]


def first_set(mask: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """The positions of the first ``slots`` set entries of ``mask`` (int32[slots],
    ``mask.size`` past them) and the mask of just those entries.

    Example:
        >>> import jax.numpy as jnp
        >>> pos, taken = first_set(jnp.array([False, True, True, True]), 2)
        >>> pos.tolist(), taken.tolist()
        ([1, 2], [False, True, True, False])
    """
    size = mask.shape[0]
    positions = select_bits(pack_bits(mask), slots, size)
    return positions, jnp.zeros(size, bool).at[positions].set(True, mode="drop")


def send_back(
    h: OwnerHash, shard: jax.Array, chosen: jax.Array, form: str, slots: int, comm: Comm
) -> Returned:
    """The ``chosen`` entries of this worker's ``shard`` (bool and float32[width]) to
    every worker, by one all-gather in ``form`` (``topk.costs.RESULT_FORMS``), at most
    ``slots`` of them (``shard``: all, the whole shard); summed into the bucket."""
    if form == "shard":
        taken = chosen
        sent = jnp.where(taken, shard, 0.0)
        total = h.unshard(comm.all_gather(sent).reshape(h.workers, h.width))
    else:
        positions, taken = first_set(chosen, slots)
        values = jnp.take(shard, positions, mode="fill", fill_value=0.0)  # float32[R]
        send = _pairs if form == "pairs" else _bitmap
        total = send(h, positions, taken, values, comm)
    return Returned(total, jnp.sum(chosen & ~taken, dtype=jnp.int32))


def _bits(values: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(values, jnp.int32)


def _floats(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _pairs(h: OwnerHash, positions, taken, values, comm: Comm) -> jax.Array:
    """Every owner's ``(position, value)`` pairs, one int32 all-gather: float32[d]."""
    slots = positions.shape[0]
    mine = jnp.concatenate([positions, _bits(values)])  # int32[2R]
    every = comm.all_gather(mine).reshape(h.workers, 2 * slots)
    owner = jnp.arange(h.workers, dtype=jnp.int32)[:, None]
    index = jnp.where(every[:, :slots] < h.width, h.indices(owner, every[:, :slots]), h.size)
    total = jnp.zeros(h.size, jnp.float32)
    return total.at[index.reshape(-1)].add(_floats(every[:, slots:]).reshape(-1), mode="drop")


def _bitmap(h: OwnerHash, positions, taken, values, comm: Comm) -> jax.Array:
    """Every owner's taken entries as a bitmap of its shard and their values in position
    order, one int32 all-gather: float32[d]."""
    slots, words = positions.shape[0], -(-h.width // 32)
    mine = jnp.concatenate([_bits(pack_bits(taken)), _bits(values)])  # int32[words + R]
    every = comm.all_gather(mine).reshape(h.workers, words + slots)
    maps = every[:, :words].astype(jnp.uint32)  # uint32[P, words]
    where = jax.vmap(lambda m: select_bits(m, slots, h.width))(maps)  # int32[P, R]
    owner = jnp.arange(h.workers, dtype=jnp.int32)[:, None]
    index = jnp.where(where < h.width, h.indices(owner, where), h.size)
    total = jnp.zeros(h.size, jnp.float32)
    return total.at[index.reshape(-1)].add(_floats(every[:, words:]).reshape(-1), mode="drop")


# ------------------------------------------------------------------ the global top-k


def global_threshold(keys: jax.Array, k: int, comm: Comm) -> tuple[jax.Array, jax.Array]:
    """The k-th largest of every worker's ``keys`` together (non-negative int32, as
    ``selectors.magnitude_keys`` gives), by a radix search: one ``psum`` of a histogram
    of the keys' next digit a round (``RADIX_DIGITS``), among the keys that
    match the digits found so far.

    Returns:
      ``(threshold, ties)``: int32[], the k-th largest key of all, and int32[], how
      many keys equal to it are among the k largest (the rest of the k are above it).
      Both the same on every worker.
    """
    prefix, remaining, done = jnp.int32(0), jnp.int32(k), 0
    for bits in RADIX_DIGITS:
        shift = 31 - done - bits  # the digit's lowest bit
        same = (keys >> (shift + bits)) == prefix  # the keys still in the running
        digit = (keys >> shift) & (2**bits - 1)
        hist = jnp.zeros(2**bits, jnp.int32).at[digit].add(same.astype(jnp.int32))
        hist = comm.psum(hist)  # int32[2^bits], every worker's
        above = jnp.cumsum(hist[::-1])  # keys in this digit or a higher one
        top = jnp.argmax(above >= remaining)  # the first digit, from the top, reaching k
        chosen = 2**bits - 1 - top
        remaining = remaining - (above[top] - hist[chosen])
        prefix, done = prefix * 2**bits + chosen.astype(jnp.int32), done + bits
    return prefix, remaining


def take_global_top(keys: jax.Array, threshold: jax.Array, ties: jax.Array, comm: Comm):
    """Which of this worker's ``keys`` are among the k largest of all workers': those
    above ``threshold``, and of those equal to it the first ``ties`` of all workers' in
    worker order (an all-gather of each worker's count of them). Zero keys never are.

    Returns:
      bool like ``keys``.
    """
    equal = keys == threshold
    mine = jnp.sum(equal, dtype=jnp.int32)
    counts = comm.all_gather(mine[None])  # int32[P], in worker order
    before = jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < comm.index(), counts, 0))
    quota = jnp.clip(ties - before, 0, mine)
    return ((keys > threshold) | (equal & (bit_ranks(equal) < quota))) & (keys > 0)


def global_top(shard: jax.Array, k: int, comm: Comm, arrived: int | None = None) -> jax.Array:
    """The entries of this worker's reduced ``shard`` among the k of largest magnitude
    of all workers' shards (exact; ties to the lower worker, then the lower position;
    zeros never): bool like ``shard``. ``arrived``: at most this many entries of the
    shard are nonzero (the pairs that can arrive, P C): the search then reads only
    those, gathered first, instead of the whole shard (zeros are never chosen, and
    each worker's ``arrived`` entries with their zeros still hold k in all).

    Example:
        >>> import jax.numpy as jnp
        >>> one = Comm.stand_in(1)
        >>> global_top(jnp.array([0.5, -3.0, 0.0, 2.0]), 2, one).tolist()
        [False, True, False, True]
    """
    width = shard.shape[0]
    if arrived is None or arrived >= width:
        keys = magnitude_keys(shard)
        threshold, ties = global_threshold(keys, k, comm)
        return take_global_top(keys, threshold, ties, comm)
    where, _ = first_set(shard != 0, arrived)  # int32[arrived], position order
    keys = magnitude_keys(jnp.take(shard, where, mode="fill", fill_value=0.0))
    threshold, ties = global_threshold(keys, k, comm)
    chosen = take_global_top(keys, threshold, ties, comm)
    return jnp.zeros(width, bool).at[where].set(chosen, mode="drop")
