"""A digest of a checkpoint's arrays, recorded beside the run id at save and checked at
restore: a flipped byte in a data file, or another run's state copied in beside this
run's record, is caught before a single step trains on it.

Each array's digest is two 32-bit sums computed where the array lives (one jitted pass
over it, its shards summed by one all-reduce of two words), so it needs no gather to
the host, works across processes, and does not depend on how the array is sharded: a
checkpoint written on 8 devices checks the same on 4. The first sum weights each 32-bit
word by an odd number from its position, so any change of a single word changes it;
the second sums a mixing function of word and position (murmur3's finaliser), so moved
or swapped words change it too. Neither is a cryptographic hash: they catch damage and
mix-ups, not a forger (who could rewrite the recorded digest as well).

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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _position(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position modulo 2^32, built from per-axis iotas."""
    position, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        iota = lax.broadcasted_iota(jnp.uint32, shape, axis)
        position = position + iota * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return position


def _sums(x: jax.Array) -> jax.Array:
    """``uint32[2]``: the positional and the mixed sum of ``x``'s words."""
    words = _words(x)
    position = _position(words.shape)
    weighted = jnp.sum(words * (position * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
    mixed = jnp.sum(_mix(words ^ _mix(position)), dtype=jnp.uint32)
    return jnp.stack([weighted, mixed])


@jax.jit
def _all_sums(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([_sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def of(tree: PyTree) -> Record:
    """Each array of ``tree`` by name: its dtype and its digest (16 hex digits).

    Args:
      tree: a pytree of arrays (global ``jax.Array``, possibly over several processes,
        or numpy); every process of a job calls it together.

    Returns:
      ``{name: [dtype, digest]}``, JSON-ready.
    """
    named = jax.tree_util.tree_leaves_with_path(tree)
    sums = np.asarray(_all_sums([jnp.asarray(x) for _, x in named]))
    return {
        array_name(path): [str(np.dtype(x.dtype)), f"{int(a):08x}{int(b):08x}"]
        for (path, x), (a, b) in zip(named, sums, strict=True)
    }


def differing(recorded: Record, tree: PyTree) -> list[str]:
    """The arrays of ``tree`` whose digest differs from ``recorded`` (by name; an array
    of another dtype than recorded, read converted, is not compared)."""
    found = of(tree)
    return [
        name
        for name, (dtype, value) in recorded.items()
        if name in found and found[name][0] == dtype and found[name][1] != value
    ] + sorted(set(recorded) - set(found))
