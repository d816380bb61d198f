"""Tensor fusion: packing gradient leaves into flat buckets, one collective per bucket,
and TopKA2A's binary search for the bucket-size threshold.

Planning (``plan_buckets``) is pure and host-side; ``pack`` / ``unpack`` move data.

Example:
    >>> from sparsecomm_jax.comm import fusion
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
    used = 0
    for i, n in enumerate(sizes):
        if not buckets or used + n * itemsize > bucket_bytes:
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


def parts(leaves, bucket: Sequence[int]) -> list:
    """``pack`` without the concatenation: the flattened ``leaves[i]`` for i in
    ``bucket``, read as one vector by the exchanges that can."""
    return [leaves[i].reshape(-1) for i in bucket]


def split(flat, sizes: Sequence[int]) -> list:
    """``flat`` cut into consecutive pieces of ``sizes`` (the inverse of concatenating)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [flat[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def unpack(flat, leaves_like, bucket: Sequence[int]) -> dict[int, jnp.ndarray]:
    """Inverse of ``pack``: ``{leaf index: array shaped like leaves_like[i]}``."""
    out, start = {}, 0
    for i in bucket:
        like = leaves_like[i]
        out[i] = flat[start : start + like.size].reshape(like.shape).astype(like.dtype)
        start += like.size
    return out


def candidate_thresholds(sizes: Sequence[int], itemsize: int = 4) -> list[int]:
    """One threshold per distinct greedy plan, ascending: the smallest leaf's bytes (every
    leaf alone), then the smallest threshold of each next plan, up to one bucket.

    A plan changes only when the threshold reaches a bucket's bytes plus its next leaf's,
    so the plans are swept in order, each once (no plateau of repeated plans), none
    missed.

    Example:
        >>> candidate_thresholds([10, 10, 30, 5])
        [20, 80, 140, 200, 220]
    """
    nbytes = [n * itemsize for n in sizes]
    if not nbytes:
        return []
    out, threshold = [], max(1, min(nbytes))
    while True:
        out.append(threshold)
        plan = plan_buckets(sizes, threshold, itemsize)
        grow = [sum(nbytes[i] for i in b) + nbytes[b[-1] + 1] for b in plan[:-1]]
        if not grow:
            return out
        threshold = min(grow)


def search_threshold(cost: Callable[[int], float], candidates: Sequence[int]) -> tuple[int, int]:
    """Binary search for the threshold of least ``cost`` (assumed unimodal in the
    threshold: small buckets pay latency, large ones lose overlap; plateaus allowed).

    Compares ``cost(c[m])`` with ``cost(c[m + 1])`` and keeps the half that descends; on
    a plateau (equal costs) it walks right to the first different cost to tell. About
    2 log2(len) evaluations off plateaus, each a measured or modelled step time.

    Args:
      cost: threshold in bytes -> step time.
      candidates: ascending thresholds (``candidate_thresholds``).

    Returns:
      ``(best threshold, number of cost evaluations)``.

    Example:
        >>> search_threshold(lambda c: {1: 5, 2: 5, 3: 5, 4: 1}[c], [1, 2, 3, 4])
        (4, 3)
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
        j = mid + 1
        while j < hi and f(j) == f(mid):  # a plateau: find where it ends
            j += 1
        if f(j) < f(mid):
            lo = j
        else:
            hi = mid
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
