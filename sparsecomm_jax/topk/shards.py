"""TopKA2A's selection: k entries of a bucket split over P contiguous shards, one
all-to-all destination each.

A bucket of d entries is cut into P shards (``to_shards``: the first d mod P shards one
entry longer, padding at the end of the others) and shard j goes to worker j. Each
worker keeps k entries in all, ``shard_slots`` per shard (slots follow the real entries,
padding earns none), the largest magnitudes of each shard (ties to the lower index), so
a plain equal-split ``all_to_all`` of ceil(k/P) slots per shard carries them.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.topk import selectors, shards
    >>> vals, local, rest = shards.shard_select(selectors.EXACT, jnp.arange(5.0), 2, 2)
    >>> vals.tolist(), local.tolist(), rest.tolist()
    ([[2.0], [4.0]], [[2], [1]], [0.0, 1.0, 0.0, 3.0, 0.0])

References:
    Peng et al., "TopKA2A", ICPP 2024 (per-shard selection for one AlltoAll).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsecomm_jax.topk import selectors
from sparsecomm_jax.topk.selectors import Selector


def shard_slots(k: int, size: int, num_shards: int) -> list[int]:
    """TopKA2A's entries per destination shard of a bucket of ``size`` entries: k in all,
    floor(k/P) per shard and one more in each of the first k mod P shards.

    The shards (``to_shards``) hold floor(d/P) or ceil(d/P) real entries, the longer
    ones first, so slots follow the real entries: no shard gets more slots than entries,
    and padding earns none (d=13, P=4, k=1: [1, 0, 0, 0], not one per shard).

    Example:
        >>> shard_slots(6, 13, 4)
        [2, 2, 1, 1]
    """
    if not 1 <= k <= size:
        raise ValueError(f"k must be in [1, size={size}], got {k}")
    return [k // num_shards + (j < k % num_shards) for j in range(num_shards)]


def to_shards(x: jax.Array, num_shards: int) -> jax.Array:
    """float[d] -> float[P, ceil(d/P)]: P contiguous shards, the first d - P*floor(d/P)
    of ceil(d/P) entries and the others of floor(d/P) entries plus one zero at the end
    (d a multiple of P: a plain reshape). ``from_shards`` inverts it."""
    d, long = x.shape[0], _long_shards(x.shape[0], num_shards)
    if long == num_shards:
        return x.reshape(num_shards, -1)
    width = -(-d // num_shards)
    head = x[: long * width].reshape(long, width)
    tail = x[long * width :].reshape(num_shards - long, width - 1)
    return jnp.concatenate([head, jnp.pad(tail, ((0, 0), (0, 1)))])


def from_shards(shards: jax.Array, size: int) -> jax.Array:
    """float[P, ceil(d/P)] -> float[d], the inverse of ``to_shards`` (drops the padding)."""
    num_shards = shards.shape[0]
    long = _long_shards(size, num_shards)
    if long == num_shards:
        return shards.reshape(-1)
    return jnp.concatenate([shards[:long].reshape(-1), shards[long:, :-1].reshape(-1)])


def _long_shards(size: int, num_shards: int) -> int:
    """How many shards of ``to_shards`` hold ceil(d/P) real entries."""
    return size - num_shards * (-(-size // num_shards) - 1)


def shard_select(selector: Selector, x, k: int, num_shards: int):
    """TopKA2A's selection on a bucket of any length d: ``shard_slots(k, d, P)`` entries
    of largest magnitude in each shard of ``to_shards`` (ties to the lower index).

    Args:
      selector: applied per shard (``selectors.AUTO``, ``EXACT``, ...).
      x: float[d].
      k: entries selected in all, 1 <= k <= d.
      num_shards: P.

    Returns:
      ``(values, local, residual)``: float[P, s] and int32[P, s] shard-local indices,
      s = ceil(k/P) (a shard with one slot fewer sends a zero), and float[d], ``x`` less
      what is sent.
    """
    d, slots = x.shape[0], shard_slots(k, x.shape[0], num_shards)
    shards = to_shards(x, num_shards)  # float[P, c]
    values, local, rest = selectors.select_rows(selector, shards, max(slots))  # [P, s] x2
    rest = rest.reshape(-1)  # float[P*c]
    if min(slots) < max(slots):  # the last shards give their weakest entry back
        values, back, at = _drop_weakest(values, local, slots, shards.shape[1])
        rest = rest.at[at].add(back)
    return values, local, from_shards(rest.reshape(shards.shape), d)


def shard_select_parts(selector: Selector, parts, k: int, num_shards: int):
    """``shard_select`` of the concatenation of ``parts`` (1-D), the residual returned
    per part. When the shards are equal (d divisible by P) the selection reads the
    parts where they are (``selectors.select_parts_rows``)."""
    d = sum(p.shape[0] for p in parts)
    if d % num_shards:
        values, local, rest = shard_select(selector, jnp.concatenate(parts), k, num_shards)
        return values, local, selectors.split_like(rest, parts)
    slots = shard_slots(k, d, num_shards)
    values, local, kept = selectors.select_parts_rows(selector, parts, max(slots), num_shards)
    if min(slots) < max(slots):  # the last shards give their weakest entry back
        values, back, at = _drop_weakest(values, local, slots, d // num_shards)
        kept = selectors.add_to_parts(kept, back, at)
    return values, local, kept


def _drop_weakest(values, local, slots: list[int], width: int):
    """Each shard with fewer ``slots`` than the most gives back its selected entry of
    least magnitude (the higher index among equals: the last of a top-k). Returns
    ``(kept values [P, s], given-back values [P*s], their flat positions [P*s])``, the
    positions in shards of ``width`` entries laid end to end."""
    key = selectors.magnitude_keys(values)  # ordered like |v|
    low = key == key.min(axis=1, keepdims=True)
    last = jnp.max(jnp.where(low, local, -1), axis=1, keepdims=True)
    fewer = (jnp.array(slots) < max(slots))[:, None]
    weakest = low & (local == last) & fewer
    at = (local + jnp.arange(len(slots))[:, None] * width).reshape(-1)
    return jnp.where(weakest, 0.0, values), jnp.where(weakest, values, 0.0).reshape(-1), at
