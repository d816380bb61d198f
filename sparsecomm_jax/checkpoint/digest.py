"""A digest of a checkpoint's arrays, recorded beside the run id at save and checked at
restore: a flipped byte in a data file, or another run's state copied in beside this
run's record, is caught before a single step trains on it.

Each array's digest is two 32-bit sums computed where the array lives (one jitted pass
over it, its shards summed by one all-reduce of two words), so it needs no gather to
the host, works across processes, and does not depend on how the array is sharded: a
checkpoint written on 8 devices checks the same on 4 (the sums wrap modulo 2^32, in
any order). Each sum weights every 32-bit word by an odd number made from its row and
column, so any change of a single word changes both (an odd weight is invertible
modulo 2^32); the two sums' weights differ, so moved or swapped words, which could
cancel in one, change the other but with a chance of about 2^-32. Neither is a
cryptographic hash: they catch damage and mix-ups, not a forger (who could rewrite
the recorded digest as well).

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


def _sums(words: jax.Array, offsets: list, shape: tuple[int, ...]) -> jax.Array:
    """``uint32[2]``: the two sums of a block of words. Each word is weighted by the
    product of an odd weight of its row and one of its column, the array seen as rows
    of its last axis; ``offsets`` place the block in the array of word shape ``shape``
    (zeros for the whole array). Summed along the rows first, where the words lie
    together (XLA:CPU sums the minor axis fastest), then over the rows."""
    if words.ndim == 0:
        words, offsets, shape = words.reshape(1), [jnp.uint32(0)], (1,)
    *lead, _ = words.shape
    column = jnp.arange(words.shape[-1], dtype=jnp.uint32) + offsets[-1]
    row, stride = jnp.zeros(lead, jnp.uint32), 1
    for k in reversed(range(len(lead))):
        index = lax.broadcasted_iota(jnp.uint32, tuple(lead), k) + offsets[k]
        row, stride = row + index * jnp.uint32(stride % 2**32), stride * shape[k]
    sums = []
    for r, c in zip(_ROW, _COLUMN, strict=True):
        per_row = jnp.sum(words * _weights(column, c), axis=-1, dtype=jnp.uint32)
        sums.append(jnp.sum(per_row * _weights(row, r), dtype=jnp.uint32))
    return jnp.stack(sums)


def _weights(position: jax.Array, odd: int) -> jax.Array:
    """``2 * position * odd + 1`` modulo 2^32: an odd weight for each position."""
    return position * jnp.uint32(2 * odd % 2**32) + jnp.uint32(1)


def _word_shape(shape: tuple[int, ...], dtype) -> tuple[int, ...]:
    """The shape of an array's words: its own, and a pair per element of 64 bits."""
    wide = np.dtype(dtype).itemsize == 8 or np.issubdtype(dtype, np.complexfloating)
    return (*shape, 2) if wide else tuple(shape)


@jax.jit
def _whole_sums(leaves: list[jax.Array]) -> jax.Array:
    """Each leaf's sums, computed as one array (numpy arrays, arrays on one device)."""
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


def _spec(x) -> tuple | None:
    """The ``PartitionSpec`` of a committed global array split by a mesh, as a tuple of
    one entry per axis; ``None`` for any other (computed whole, on one device)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not getattr(x, "committed", True):
        return None
    if sharding.is_fully_replicated:
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (np.ndim(x) - len(spec))


def _whole(x):
    """An array to compute whole: a replicated global array's copy on one of this
    process's devices (every device would otherwise sum the same words), else itself."""
    if isinstance(x, jax.Array) and x.sharding.is_fully_replicated and len(x.devices()) > 1:
        return x.addressable_data(0)
    return jnp.asarray(x)


def of(tree: PyTree) -> Record:
    """Each array of ``tree`` by name: its dtype and its digest (16 hex digits), the
    same however the array is split over devices.

    Args:
      tree: a pytree of arrays (global ``jax.Array``, possibly over several processes,
        or numpy); every process of a job calls it together.

    Returns:
      ``{name: [dtype, digest]}``, JSON-ready.
    """
    named = jax.tree_util.tree_leaves_with_path(tree)
    sums = _all_sums([x for _, x in named])
    return {
        array_name(path): [str(np.dtype(x.dtype)), f"{int(a):08x}{int(b):08x}"]
        for (path, x), (a, b) in zip(named, sums, strict=True)
    }


def _all_sums(leaves: list) -> list[np.ndarray]:
    """Each leaf's two sums: the arrays split by a mesh on their devices, one program
    per mesh; the others (numpy, one device, replicated) whole, one program per device
    they are on."""
    specs = [_spec(x) for x in leaves]
    whole = {
        i: _whole(x) for i, (x, spec) in enumerate(zip(leaves, specs, strict=True)) if spec is None
    }
    groups: dict = {}  # ("mesh", mesh) or ("device", device or None) -> leaf indices
    for i, spec in enumerate(specs):
        if spec is not None:
            key = ("mesh", leaves[i].sharding.mesh)
        else:
            committed = getattr(whole[i], "committed", False)
            key = ("device", next(iter(whole[i].devices())) if committed else None)
        groups.setdefault(key, []).append(i)
    sums: dict[int, np.ndarray] = {}
    for (kind, where), indices in groups.items():
        if kind == "device":
            found = _whole_sums([whole[i] for i in indices])
        else:
            found = _sharded_sums(
                [leaves[i] for i in indices], where, tuple(specs[i] for i in indices)
            )
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
