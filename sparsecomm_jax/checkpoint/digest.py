"""A digest of a checkpoint's arrays, recorded beside the run id at save and checked at
restore: a flipped byte in a data file, or another run's state copied in beside this
run's record, is caught before a single step trains on it.

Each array's digest is two 32-bit sums computed where the array lives (one jitted pass
over it, each device summing its own block, then one all-reduce of two words), so it
needs no gather to the host, works across processes, and does not depend on how the
array is sharded: a checkpoint written on 8 devices checks the same on 4 (the sums
wrap modulo 2^32, in any order). The first sum weights every 32-bit word by an odd
number made from its row and column, so any change of a single word changes it (an odd
weight is invertible modulo 2^32); being linear, it misses changes that cancel (two
sign bits flipped add 2^32). The second sums murmur3's finaliser of each word, with
other weights: a changed word changes its term at random, so changes that cancel in
the first are caught here but with a chance of about 2^-32. Host arrays (numpy, Python
numbers) are summed on the host, whole, to the same value. Neither sum is a
cryptographic hash: they catch damage and mix-ups, not a forger (who could rewrite the
recorded digest as well).

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.checkpoint import digest
    >>> tree = {"w": jnp.arange(4.0), "b": jnp.zeros(2, jnp.bfloat16)}
    >>> record = digest.of(tree)
    >>> sorted(record), record["w"][0]
    (['b', 'w'], 'float32')
    >>> digest.differing(record, {**tree, "w": tree["w"].at[1].set(1.5)})
    ['w']
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any
Record = dict[str, list[str]]  # array name -> [dtype, 16 hex digits]


def array_name(path) -> str:
    """A key path as orbax names the array: ``opt_state.0.mu.w``."""
    parts = []
    for key in path:
        for field in ("key", "name", "idx"):
            if hasattr(key, field):
                parts.append(str(getattr(key, field)))
                break
    return ".".join(parts)


def _words(x: jax.Array) -> jax.Array:
    """``x``'s bits as ``uint32`` words, in ``x``'s own shape (64-bit types gain a
    trailing axis of 2): elementwise, so no array moves between devices."""
    if jnp.iscomplexobj(x):
        return jnp.stack([_words(jnp.real(x)), _words(jnp.imag(x))], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


# Odd multipliers of the two sums' weights (any odd numbers would do; these spread
# consecutive positions over the word).
_ROW, _COLUMN = (0x9E3779B1, 0x85EBCA77), (0xC2B2AE3D, 0x27D4EB2F)


def _fmix(h, xp):
    """murmur3's 32-bit finaliser: every bit of ``h`` reaches every bit of the result."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _iota(shape: tuple[int, ...], axis: int, xp):
    """Each element's index along ``axis`` (``uint32``), broadcastable to ``shape``."""
    if xp is jnp:
        return lax.broadcasted_iota(jnp.uint32, shape, axis)
    index = np.arange(shape[axis], dtype=np.uint32)
    return index.reshape([-1 if k == axis else 1 for k in range(len(shape))])


def _sums(words, offsets: list, shape: tuple[int, ...], xp=jnp):
    """``uint32[2]``: the two sums of a block of words (``xp``: ``jnp`` on devices, ``np``
    on the host; the same value). Each word, or its mix for the second sum, is weighted
    by the product of an odd weight of its row and one of its column, the array seen as
    rows of its last axis; ``offsets`` place the block in the array of word shape
    ``shape`` (zeros for the whole array). Summed along the rows first, where the words
    lie together (XLA:CPU sums the minor axis fastest), then over the rows."""
    if words.ndim == 0:
        words, offsets, shape = words.reshape(1), [xp.uint32(0)], (1,)
    lead = tuple(words.shape[:-1])
    column = xp.arange(words.shape[-1], dtype=xp.uint32) + offsets[-1]
    row, stride = xp.zeros(lead, xp.uint32), 1
    for k in reversed(range(len(lead))):
        index = _iota(lead, k, xp) + offsets[k]
        row, stride = row + index * xp.uint32(stride % 2**32), stride * shape[k]
    sums = []
    for terms, r, c in zip((words, _fmix(words, xp)), _ROW, _COLUMN, strict=True):
        per_row = xp.sum(terms * _weights(column, c, xp), axis=-1, dtype=xp.uint32)
        sums.append(xp.sum(per_row * _weights(row, r, xp), dtype=xp.uint32))
    return xp.stack(sums)


def _weights(position, odd: int, xp=jnp):
    """``2 * position * odd + 1`` modulo 2^32: an odd weight for each position."""
    return position * xp.uint32(2 * odd % 2**32) + xp.uint32(1)


def _host_words(x: np.ndarray) -> np.ndarray:
    """A host array's bits as ``uint32`` words, as ``_words`` makes them on a device
    (64-bit types: a pair per element, low word first)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    if x.dtype.itemsize >= 8:
        return x.view(np.uint32).reshape(*x.shape, -1)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    return x.view(unsigned).astype(np.uint32)


def _word_shape(shape: tuple[int, ...], dtype) -> tuple[int, ...]:
    """The shape of an array's words: its own, and a pair per element of 64 bits."""
    wide = np.dtype(dtype).itemsize == 8 or np.issubdtype(dtype, np.complexfloating)
    return (*shape, 2) if wide else tuple(shape)


@jax.jit
def _whole_sums(leaves: list[jax.Array]) -> jax.Array:
    """Each device array's sums, computed as one array (on one device, or split
    unevenly: then XLA sums it across its devices)."""
    out = [_sums(_words(x), [jnp.uint32(0)] * _words(x).ndim, _words(x).shape) for x in leaves]
    return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


def _sharded_sums(leaves: list[jax.Array], mesh, specs: tuple) -> jax.Array:
    """Each global array's sums, each device summing its own block (placed in the
    array by its mesh coordinates) and one all-reduce of two words per array over the
    mesh axes that split it: no array moves between devices."""
    shapes = tuple((x.shape, np.dtype(x.dtype)) for x in leaves)
    return _sharded_program(mesh, specs, shapes)(*leaves)


@functools.lru_cache(maxsize=32)
def _sharded_program(mesh, specs: tuple, shapes: tuple):
    """The jitted ``shard_map`` of ``_sharded_sums`` for these arrays (compiled once per
    mesh, splits, shapes and dtypes: a run saves the same state again and again)."""

    def body(*blocks):
        out = []
        for block, spec, (shape, dtype) in zip(blocks, specs, shapes, strict=True):
            words = _words(block)
            spec = (*spec, None) if words.ndim > block.ndim else spec
            offsets = [
                jnp.uint32(0) if s is None else lax.axis_index(s).astype(jnp.uint32) * jnp.uint32(n)
                for s, n in zip(spec, words.shape, strict=True)
            ]
            sums = _sums(words, offsets, _word_shape(shape, dtype))
            split = tuple(
                a for s in spec if s is not None for a in (s if isinstance(s, tuple) else (s,))
            )
            out.append(lax.psum(sums, split) if split else sums)
        return jnp.stack(out)

    in_specs = tuple(P(*spec) for spec in specs)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P()))


def _spec(x: jax.Array) -> tuple | None:
    """The ``PartitionSpec`` of a global array split by a mesh into even blocks, as a
    tuple of one entry per axis; ``None`` for any other (summed whole): replicated,
    split unevenly (``shard_map`` takes even blocks only), complex (its words pair up)."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding) or sharding.is_fully_replicated:
        return None
    if jnp.iscomplexobj(x):
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(tuple(sharding.spec)))
    for size, entry in zip(x.shape, spec, strict=True):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        if size % int(np.prod([sharding.mesh.shape[a] for a in names])):
            return None
    return spec


def _whole(x: jax.Array) -> jax.Array:
    """A device array to sum whole: a replicated global array's copy on one of this
    process's devices (every device would otherwise sum the same words), else itself."""
    if x.sharding.is_fully_replicated and len(x.devices()) > 1:
        return x.addressable_data(0)
    return x


def _leaf(x) -> tuple[Any, str]:
    """A leaf as the array its digest sums (a typed PRNG key: its key data; a Python or
    numpy number: a numpy array) and the dtype recorded with it."""
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x), str(x.dtype)
        return x, str(np.dtype(x.dtype))
    host = np.asarray(x)
    return host, str(host.dtype)


def of(tree: PyTree) -> Record:
    """Each array of ``tree`` by name: its dtype and its digest (16 hex digits), the
    same however the array is split over devices or whether it is on the host.

    Args:
      tree: a pytree of arrays (global ``jax.Array``, possibly over several processes,
        numpy, Python numbers, PRNG keys); every process of a job calls it together.

    Returns:
      ``{name: [dtype, digest]}``, JSON-ready.
    """
    named = jax.tree_util.tree_leaves_with_path(tree)
    leaves = [_leaf(x) for _, x in named]
    sums = _all_sums([x for x, _ in leaves])
    return {
        array_name(path): [dtype, f"{int(a):08x}{int(b):08x}"]
        for (path, _), (_, dtype), (a, b) in zip(named, leaves, sums, strict=True)
    }


def _all_sums(leaves: list) -> list[np.ndarray]:
    """Each leaf's two sums: host arrays on the host; device arrays split evenly by a
    mesh on their devices, one program per mesh; the others whole, one program per
    device they are on."""
    sums: dict[int, np.ndarray] = {}
    groups: dict = {}  # ("mesh", mesh) or ("device", device or None) -> leaf indices
    specs: dict[int, tuple | None] = {}
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            words = _host_words(x)
            sums[i] = _sums(words, [np.uint32(0)] * max(words.ndim, 1), words.shape, np)
            continue
        specs[i] = _spec(x)
        if specs[i] is not None:
            key = ("mesh", x.sharding.mesh)
        else:
            leaves[i] = _whole(x)
            key = ("device", next(iter(leaves[i].devices())) if leaves[i].committed else None)
        groups.setdefault(key, []).append(i)
    for (kind, where), indices in groups.items():
        mine = [leaves[i] for i in indices]
        if kind == "device":
            found = _whole_sums(mine)
        else:
            found = _sharded_sums(mine, where, tuple(specs[i] for i in indices))
        sums.update(zip(indices, np.asarray(found), strict=True))
    return [sums[i] for i in range(len(leaves))]


def differing(recorded: Record, tree: PyTree) -> list[str]:
    """The arrays of ``tree`` whose digest differs from ``recorded`` (by name; an array
    of another dtype than recorded, read converted, is not compared)."""
    found = of(tree)
    return [
        name
        for name, (dtype, value) in recorded.items()
        if name in found and found[name][0] == dtype and found[name][1] != value
    ] + sorted(set(recorded) - set(found))
