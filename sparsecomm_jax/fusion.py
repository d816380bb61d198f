"""Tensor fusion: packing gradient leaves into flat buckets, one collective per bucket,
and TopKA2A's binary search for the bucket-size threshold.

Planning (``plan_buckets``) is pure and host-side; ``pack`` / ``unpack`` move data.

Example:
    >>> from sparsecomm_jax import fusion
    >>> fusion.plan_buckets([10, 10, 30, 5], bucket_bytes=80, itemsize=4)
    [[0, 1], [2], [3]]

References:
    Peng et al., "TopKA2A", ICPP 2024 (binary-searched fusion threshold).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp


def plan_buckets(sizes: Sequence[int], bucket_bytes: int | None, itemsize: int = 4):
    """Greedy packing of leaves, in order, into buckets of at most ``bucket_bytes``.

    A leaf larger than the threshold gets a bucket of its own; ``None`` or 0 puts every
    leaf in one bucket.

    Args:
      sizes: element count of each leaf.
      bucket_bytes: the fusion threshold in bytes.
      itemsize: bytes per element.

    Returns:
      A list of buckets, each a list of leaf indices.
    """
    if bucket_bytes is not None and bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0 or None, got {bucket_bytes}")
    if not bucket_bytes:
        return [list(range(len(sizes)))] if len(sizes) else []
    buckets: list[list[int]] = []
    used = bucket_bytes  # forces a new bucket for the first leaf
    for i, n in enumerate(sizes):
        if used + n * itemsize > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += n * itemsize
    return buckets


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def pack(leaves, bucket: Sequence[int], multiple: int = 1):
    """Concatenates the flattened ``leaves[i]`` for i in ``bucket``; zero-pads the result
    to a multiple of ``multiple`` (per-shard selection needs d divisible by P)."""
    flat = jnp.concatenate([leaves[i].reshape(-1) for i in bucket])
    pad = padded_size(flat.shape[0], multiple) - flat.shape[0]
    return jnp.pad(flat, (0, pad)) if pad else flat


def unpack(flat, leaves_like, bucket: Sequence[int]) -> dict[int, jnp.ndarray]:
    """Inverse of ``pack``: ``{leaf index: array shaped like leaves_like[i]}``."""
    out, start = {}, 0
    for i in bucket:
        like = leaves_like[i]
        out[i] = flat[start : start + like.size].reshape(like.shape).astype(like.dtype)
        start += like.size
    return out


def candidate_thresholds(sizes: Sequence[int], itemsize: int = 4) -> list[int]:
    """Thresholds at which the greedy plan can change: every contiguous run's bytes,
    limited to the distinct prefix sums and leaf sizes (sorted, ascending)."""
    prefix, total = set(), 0
    for n in sizes:
        total += n * itemsize
        prefix.add(total)
        prefix.add(n * itemsize)
    return sorted(prefix)


def search_threshold(cost: Callable[[int], float], candidates: Sequence[int]) -> tuple[int, int]:
    """Binary search for the threshold of least ``cost`` (assumed unimodal in the
    threshold: small buckets pay latency, large ones lose overlap).

    Compares ``cost(c[m])`` with ``cost(c[m + 1])`` and keeps the half that descends;
    about 2 log2(len) evaluations, each a measured or modelled step time.

    Args:
      cost: threshold in bytes -> step time.
      candidates: ascending thresholds (``candidate_thresholds``).

    Returns:
      ``(best threshold, number of cost evaluations)``.
    """
    if not candidates:
        raise ValueError("candidates must not be empty")
    cache: dict[int, float] = {}

    def f(i: int) -> float:
        if i not in cache:
            cache[i] = cost(candidates[i])
        return cache[i]

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if f(mid) <= f(mid + 1):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo], len(cache)


def pipelined_time(
    buckets: Sequence[Sequence[int]],
    ready_s: Sequence[float],
    comm_s: Callable[[int], float],
    sizes: Sequence[int],
) -> float:
    """Modelled end of the gradient exchange when buckets overlap backward compute:
    a bucket starts once its last leaf is ready and the previous bucket is done.

    Args:
      buckets: the plan (leaf indices).
      ready_s: time at which each leaf's gradient is ready.
      comm_s: elements -> communication time of one bucket.
      sizes: element count of each leaf.

    Returns:
      Seconds until the last bucket is exchanged.
    """
    done = 0.0
    for bucket in buckets:
        start = max(done, max(ready_s[i] for i in bucket))
        done = start + comm_s(sum(sizes[i] for i in bucket))
    return done
