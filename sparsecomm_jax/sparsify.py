"""Top-k selectors and error feedback on flat gradient buckets.

Every selector returns fixed-size ``(values, indices)`` (so collectives have static
shapes) and selects each index at most once; padding entries carry value 0 at index 0.
``densify`` scatter-adds a selection back, so ``acc - densify(sel)`` is exactly what
error feedback keeps (``select_with_residual`` returns both, fused where it can).

Selectors: ``"auto"`` (the default) is exact and the fastest one for the platform: on
CPU the host kernel of ``hostkernel`` (a sampled band, then an exact finish on the band:
a few passes over d); elsewhere ``lax.top_k``. ``"exact"`` is ``lax.top_k`` itself, the
reference; ``"radix"`` the same entries by bitwise counting; ``"threshold"`` the sampled
DGC threshold (approximate). The exact selectors agree entry for entry: the k largest
magnitudes, and among equal magnitudes the lower index first (the rule of
``lax.top_k``); NaN ranks above inf, and -0.0 ties with 0.0.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax import sparsify
    >>> vals, idx = sparsify.exact_topk(jnp.array([0.1, -3.0, 2.0, 0.5]), k=2)
    >>> idx.tolist(), vals.tolist()
    ([1, 2], [-3.0, 2.0])

References:
    Lin et al., "Deep Gradient Compression", ICLR 2018 (sampled threshold, error feedback).
    Alabi et al., "Fast K-selection algorithms for GPUs", JEA 2012 (radix select).
    Peng et al., "TopKA2A", ICPP 2024 (per-shard selection for one AlltoAll).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp

from sparsecomm_jax import hostkernel

SELECTORS = ("auto", "exact", "threshold", "radix")
DEFAULT_SELECTOR = "auto"


def check_density(density: float) -> None:
    """``ValueError`` unless density is a number in (0, 1]."""
    if not isinstance(density, int | float) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")


def num_selected(density: float, size: int) -> int:
    """k = round(density * size), checked: density in (0, 1] and k >= 1.

    Raises:
      ValueError: density outside (0, 1], or k rounds to 0 for this size.
    """
    check_density(density)
    k = min(size, round(density * size))
    if k < 1:
        raise ValueError(
            f"density={density} keeps k = round({density} * {size}) = 0 entries of a "
            f"{size}-element bucket; raise the density or the bucket size"
        )
    return k


def per_shard_k(k: int, num_shards: int) -> int:
    """Entries kept per shard by per-shard selection: ceil(k / P)."""
    return math.ceil(k / num_shards)


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


def exact_topk(x, k: int):
    """The k entries of largest magnitude: ``(values, indices)``, int32 indices."""
    _, idx = jax.lax.top_k(jnp.abs(x), k)
    return x[idx], idx.astype(jnp.int32)


def threshold_topk(x, k: int, sample: int = 4096):
    """DGC-style selection: the magnitude threshold of the top-k is estimated from a
    strided sample of ``sample`` entries; entries at or above it are taken in index
    order, up to k (fixed size; unused slots are padding). Cheaper than a full top-k on
    large buckets; may return fewer than k true entries (the rest stays in the residual).
    """
    d = x.shape[0]
    stride = max(1, d // sample)
    probe = jnp.abs(x[::stride])
    rank = min(probe.shape[0], max(1, round(k * probe.shape[0] / d)))
    thr = jax.lax.top_k(probe, rank)[0][-1]
    (idx,) = jnp.nonzero(jnp.abs(x) >= thr, size=k, fill_value=0)
    taken = jnp.arange(k) < jnp.sum(jnp.abs(x) >= thr)
    return jnp.where(taken, x[idx], 0.0), jnp.where(taken, idx, 0).astype(jnp.int32)


def kth_largest_bits(a, k: int):
    """The int32 bit pattern of the k-th largest entry of ``a`` (non-negative float32
    viewed as int32, which orders like the floats): 31 counting passes, one per bit."""

    def try_bit(i, t):
        candidate = t | jnp.left_shift(jnp.int32(1), 30 - i)
        return jnp.where(jnp.sum(a >= candidate) >= k, candidate, t)

    zero = jnp.zeros_like(a[0])  # int32, varying like a inside shard_map
    return jax.lax.fori_loop(0, 31, try_bit, zero)


def radix_topk(x, k: int):
    """Exact top-k by magnitude without sorting: find the k-th largest magnitude bit by
    bit (``kth_largest_bits``), take every entry above it and, in index order, as many
    equal to it as make k. The same entries as ``exact_topk`` (ties go to the lower
    index), returned in index order; O(31 d) work where a top-k with large k sorts.

    Example:
        >>> vals, idx = radix_topk(jnp.array([0.1, -3.0, 2.0, 0.5]), k=2)
        >>> idx.tolist(), vals.tolist()
        ([1, 2], [-3.0, 2.0])
    """
    a = jax.lax.bitcast_convert_type(jnp.abs(x), jnp.int32)  # int32[d], ordered like |x|
    t = kth_largest_bits(a, k)
    above, tied = a > t, a == t
    need = k - jnp.sum(above)  # how many of the tied entries complete the k
    keep = above | (tied & (jnp.cumsum(tied) <= need))
    (idx,) = jnp.nonzero(keep, size=k, fill_value=0)
    return x[idx], idx.astype(jnp.int32)


def check_selector(selector: str) -> None:
    """``ValueError`` unless ``selector`` is one of ``SELECTORS``."""
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")


def _lax_topk(x, k: int):
    """``lax.top_k`` while k is small against d, else ``radix_topk`` (the crossover
    measured with XLA:CPU at d = 8M lies between densities 0.01 and 0.2)."""
    return exact_topk(x, k) if 50 * k <= x.shape[-1] else radix_topk(x, k)


def _use_host(x) -> bool:
    return x.dtype == jnp.float32 and hostkernel.available()


def auto_topk(x, k: int):
    """The fastest exact top-k on this platform: the same entries as ``exact_topk``.

    On CPU the host kernel (``hostkernel.topk``, entries in index order), or, when no
    C++ compiler is found, ``lax.top_k`` or ``radix_topk`` by density; on other
    platforms ``lax.top_k``.

    Example:
        >>> vals, idx = auto_topk(jnp.array([0.1, -3.0, 2.0, 0.5]), k=2)
        >>> sorted(idx.tolist())
        [1, 2]
    """
    if not _use_host(x):
        return _lax_topk(x, k)
    return jax.lax.platform_dependent(
        x, cpu=lambda v: hostkernel.topk(v, k)[:2], default=lambda v: exact_topk(v, k)
    )


def select_with_residual(x, k: int, selector: str = DEFAULT_SELECTOR):
    """``(values, indices, residual)``: ``select(x, k, selector)`` and what it leaves,
    ``x - densify(values, indices, d)`` (on CPU with ``"auto"``: written by the kernel
    in the same pass, zero where taken; the same numbers for finite x).
    """
    if selector != "auto" or not _use_host(x):
        values, indices = select(x, k, selector)
        return values, indices, x - densify(values, indices, x.shape[0])

    def other(v):
        values, indices = exact_topk(v, k)
        return values, indices, v - densify(values, indices, v.shape[0])

    return jax.lax.platform_dependent(x, cpu=lambda v: hostkernel.topk(v, k, True), default=other)


def select_with_residual_parts(parts, k: int, selector: str = DEFAULT_SELECTOR):
    """``select_with_residual`` of the concatenation of ``parts`` (1-D), the residual
    returned per part. With ``"auto"`` on CPU the kernel reads the parts where they are
    and writes each residual over its part (no concatenated copy).

    Returns:
      ``(values, indices, residuals)``: indices into the concatenation, one residual
      per part.
    """

    def other(*ps):
        values, indices, kept = select_with_residual(jnp.concatenate(ps), k, selector)
        return values, indices, _split_like(kept, ps)

    if selector != "auto" or not all(_use_host(p) for p in parts):
        return other(*parts)
    return jax.lax.platform_dependent(
        *parts, cpu=lambda *ps: hostkernel.topk_parts(ps, k), default=other
    )


def _split_like(flat, parts) -> list:
    return jnp.split(flat, list(itertools.accumulate(p.shape[0] for p in parts[:-1])))


def add_to_parts(parts, values, indices) -> list:
    """``parts`` (1-D, read as one vector) with ``values`` added at ``indices`` into
    their concatenation (repeated indices add up); on CPU (float32) by the host kernel,
    over the parts' buffers.
    """

    def other(*ps):
        return _split_like(jnp.concatenate(ps).at[indices].add(values), ps)

    if values.dtype != jnp.float32 or not all(_use_host(p) for p in parts):
        return other(*parts)
    return jax.lax.platform_dependent(
        *parts, cpu=lambda *ps: hostkernel.add_parts(ps, values, indices), default=other
    )


def select(x, k: int, selector: str = DEFAULT_SELECTOR):
    """Dispatch to ``auto_topk``, ``exact_topk``, ``threshold_topk`` or ``radix_topk``."""
    if selector == "auto":
        return auto_topk(x, k)
    if selector == "exact":
        return exact_topk(x, k)
    if selector == "threshold":
        return threshold_topk(x, k)
    if selector == "radix":
        return radix_topk(x, k)
    raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}")


def per_shard_topk(x, k_shard: int, num_shards: int, selector: str = DEFAULT_SELECTOR):
    """TopKA2A's selection: ``k_shard`` entries in each of P contiguous shards.

    Args:
      x: float[d], d divisible by ``num_shards``.
      k_shard: entries per shard.
      num_shards: P.
      selector: one of ``SELECTORS``, applied per shard.

    Returns:
      ``(values, indices)`` of shape [P, k_shard]; indices are shard-local.
    """
    shards = x.reshape(num_shards, -1)  # float[P, d/P]
    return jax.vmap(lambda s: select(s, k_shard, selector))(shards)


def per_shard_topk_with_residual(x, k_shard: int, num_shards: int, selector: str = "auto"):
    """``per_shard_topk`` and what it leaves: ``(values, local, residual)`` with
    ``residual = x - densify(values, local + shard offsets, d)`` (with ``"auto"`` on
    CPU written by the kernel in the same call).
    """
    d = x.shape[0]
    if selector != "auto" or not _use_host(x):
        values, local = per_shard_topk(x, k_shard, num_shards, selector)
        offsets = (jnp.arange(num_shards) * (d // num_shards))[:, None]
        return values, local, x - densify(values, local + offsets, d)

    def other(v):
        return per_shard_topk_with_residual(v, k_shard, num_shards, "exact")

    def cpu(v):
        values, local, rest = hostkernel.topk(v.reshape(num_shards, -1), k_shard, True)
        return values, local, rest.reshape(-1)

    return jax.lax.platform_dependent(x, cpu=cpu, default=other)


def shard_topk_with_residual(x, k: int, num_shards: int, selector: str = DEFAULT_SELECTOR):
    """TopKA2A's selection on a bucket of any length d: ``shard_slots(k, d, P)`` entries
    of largest magnitude in each shard of ``to_shards`` (ties to the lower index).

    Args:
      x: float[d].
      k: entries selected in all, 1 <= k <= d.
      num_shards: P.
      selector: one of ``SELECTORS``, applied per shard.

    Returns:
      ``(values, local, residual)``: float[P, s] and int32[P, s] shard-local indices,
      s = ceil(k/P) (a shard with one slot fewer sends a zero), and float[d], ``x`` less
      what is sent.

    Example:
        >>> vals, local, rest = shard_topk_with_residual(jnp.arange(5.0), 2, 2)
        >>> vals.tolist(), local.tolist(), rest.tolist()
        ([[2.0], [4.0]], [[2], [1]], [0.0, 1.0, 0.0, 3.0, 0.0])
    """
    d, slots = x.shape[0], shard_slots(k, x.shape[0], num_shards)
    shards = to_shards(x, num_shards)  # float[P, c]
    values, local, rest = per_shard_topk_with_residual(
        shards.reshape(-1), max(slots), num_shards, selector
    )  # [P, s], [P, s], float[P*c]
    if min(slots) < max(slots):  # the last shards give their weakest entry back
        values, back, at = _drop_weakest(values, local, slots, shards.shape[1])
        rest = rest.at[at].add(back)
    return values, local, from_shards(rest.reshape(shards.shape), d)


def _drop_weakest(values, local, slots: list[int], width: int):
    """Each shard with fewer ``slots`` than the most gives back its selected entry of
    least magnitude (the higher index among equals: the last of a top-k). Returns
    ``(kept values [P, s], given-back values [P*s], their flat positions [P*s])``, the
    positions in shards of ``width`` entries laid end to end."""
    key = jax.lax.bitcast_convert_type(jnp.abs(values), jnp.int32)  # ordered like |v|
    low = key == key.min(axis=1, keepdims=True)
    last = jnp.max(jnp.where(low, local, -1), axis=1, keepdims=True)
    fewer = (jnp.array(slots) < max(slots))[:, None]
    weakest = low & (local == last) & fewer
    at = (local + jnp.arange(len(slots))[:, None] * width).reshape(-1)
    return jnp.where(weakest, 0.0, values), jnp.where(weakest, values, 0.0).reshape(-1), at


def per_shard_topk_with_residual_parts(
    parts, k_shard: int, num_shards: int, selector: str = "auto"
):
    """``per_shard_topk_with_residual`` of the concatenation of ``parts`` (1-D, total
    divisible by ``num_shards``), the residual returned per part; with ``"auto"`` on CPU
    without concatenating, each residual written over its part.
    """

    def other(*ps):
        flat = jnp.concatenate(ps)
        values, local, kept = per_shard_topk_with_residual(flat, k_shard, num_shards, selector)
        return values, local, _split_like(kept, ps)

    if selector != "auto" or not all(_use_host(p) for p in parts):
        return other(*parts)
    return jax.lax.platform_dependent(
        *parts, cpu=lambda *ps: hostkernel.topk_parts(ps, k_shard, num_shards), default=other
    )


def shard_topk_with_residual_parts(parts, k: int, num_shards: int, selector: str = "auto"):
    """``shard_topk_with_residual`` of the concatenation of ``parts`` (1-D), the residual
    returned per part. When the shards are equal (d divisible by P) the selection reads
    the parts where they are (``per_shard_topk_with_residual_parts``).
    """
    d = sum(p.shape[0] for p in parts)
    if d % num_shards:
        flat = jnp.concatenate(parts)
        values, local, rest = shard_topk_with_residual(flat, k, num_shards, selector)
        return values, local, _split_like(rest, parts)
    slots = shard_slots(k, d, num_shards)
    values, local, kept = per_shard_topk_with_residual_parts(
        parts, max(slots), num_shards, selector
    )  # [P, s], [P, s], residual parts
    if min(slots) < max(slots):  # the last shards give their weakest entry back
        values, back, at = _drop_weakest(values, local, slots, d // num_shards)
        kept = add_to_parts(kept, back, at)
    return values, local, kept


def densify(values, indices, size: int):
    """Scatter-add a selection into a dense float[size] vector."""
    return jnp.zeros((size,), values.dtype).at[indices.reshape(-1)].add(values.reshape(-1))
