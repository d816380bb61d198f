"""What each top-k exchange costs one worker: messages and bytes per bucket, as compiled.

For a bucket of d float32 entries among P workers and k = density * d (``comm.costmodel``
holds the link model and the dense all-reduce's cost, ``dense_cost``):

============== ========================= ==============================
exchange       messages                  bytes per worker
============== ========================= ==============================
topk_allgather 2(P-1)                    2(P-1) * 4k
topk_a2a       3(P-1)                    (P-1)/P * 4(2Ps + Pc)
gtopk          2 log2 P + 2(P-1)         2 log2(P) * 4k + (P-1) * 8 ceil(k/P)
topk_balanced  2(P-1)                    (P-1) * 4(2C + W)
oktopk         9(P-1)                    (P-1) * 4(2C + W' + 1) + the histograms
============== ========================= ==============================

topk_a2a splits the bucket into P shards of c = ceil(d/P) entries (padding included)
and sends s = ceil(k/P) pair slots to each (``a2a_bytes``); for d and k multiples of P
this is (P-1)/P * 4(2k + d). Here k = round(density * d), at least 1.

topk_balanced and oktopk send each worker's pairs to hashed owners in C slots an owner
(``owner_slots``: k/P plus six standard deviations plus 8), (index, value) packed in
one int32 all-to-all; each owner's reduced shard of c = ceil(d/P) entries comes back by
one all-gather of W words (``result_words``: the smallest of 2R pairs, a bitmap of c
bits plus R values, or the whole shard of c values; R the slots of the returned entries:
``union_slots`` for topk_balanced, ``owner_slots`` of the global k for oktopk).
oktopk's global top-k adds ``len(balanced.RADIX_DIGITS)`` all-reduces of a histogram
(2(P-1) messages each) and an all-gather of one count.

Each ``topk.exchanges.Exchange`` names its formula here as its ``cost``; the tests hold
every formula against the compiled program's bytes (``comm.hlo``).

Example:
    >>> from sparsecomm_jax.topk import costs
    >>> costs.allgather_cost(1000, 0.01, 4)  # 6 messages, 3 x 10 values and indices
    (6, 240)

References:
    Peng et al., "TopKA2A", ICPP 2024; Shi et al., "gTop-k", ICDCS 2019; Wang et al.,
    "Zen", OSDI 2025; Li and Hoefler, "Ok-Topk", PPoPP 2022.
"""

from __future__ import annotations

import math

from sparsecomm_jax.topk.balanced import RADIX_DIGITS

SPREAD_SIGMAS = 6  # an owner's slots above its mean share, in standard deviations
RESULT_FORMS = ("shard", "bitmap", "pairs")  # ties go to the earlier form


def _k(size: int, density: float) -> int:
    """k = round(density * size), at least 1 and at most the size."""
    return min(size, max(1, round(density * size)))


def allgather_cost(size: int, density: float, workers: int) -> tuple[float, float]:
    """TopK-AllGather: every worker's k values and k indices to every worker."""
    p = workers
    return (2 * (p - 1), 2 * (p - 1) * 4 * _k(size, density)) if p > 1 else (0, 0.0)


def a2a_cost(size: int, density: float, workers: int) -> tuple[float, float]:
    """TopKA2A: one all-to-all of values and one of indices, an all-gather of shards."""
    p = workers
    return (3 * (p - 1), a2a_bytes(size, density, p)) if p > 1 else (0, 0.0)


def a2a_bytes(size: int, density: float, workers: int) -> float:
    """Bytes per worker of topk_a2a on a bucket of ``size`` entries, as compiled, for any
    size: an all-to-all of s = ceil(k/P) (value, index) slots per shard, k = round(density
    * size) (``topk.shards.shard_slots``), and an all-gather of P shards of ceil(size/P)."""
    p, k = workers, _k(size, density)
    return (p - 1) / p * 4 * (2 * p * math.ceil(k / p) + p * math.ceil(size / p))


def gtopk_cost(size: int, density: float, workers: int) -> tuple[float, float]:
    """gTop-k: log2 P rounds, each a permute of k values and k indices; then, as
    compiled under ``check_vma`` (shard_map's default), the merged list every worker
    holds is typed replicated by a tiled all-gather of its values and indices, ceil(k/P)
    of each from every worker (``topk.collectives.gtopk_lists``)."""
    p, k = workers, _k(size, density)
    if p == 1:
        return 0, 0.0
    rounds = 2 * math.log2(p), 2 * math.log2(p) * 4 * k
    replicate = 2 * (p - 1), (p - 1) * 2 * 4 * math.ceil(k / p)
    return rounds[0] + replicate[0], rounds[1] + replicate[1]


def crossover_density(workers: int) -> float:
    """Density above which topk_a2a sends fewer bytes than topk_allgather: 1/(2(P-1))."""
    return 1 / (2 * (workers - 1))


# ------------------------------------------------------------------ balanced owners


def owner_slots(entries: int, workers: int, factor: float | None = None) -> int:
    """Slots for one worker's share of ``entries`` (index, value) pairs spread over
    ``workers`` owners by a hash: the mean share plus ``SPREAD_SIGMAS`` standard
    deviations of a binomial share plus 8, or ``factor`` times the mean share; at
    least 1, at most ``entries``.

    Example:
        >>> owner_slots(250_000, 32)   # 7,812.5 on average
        8351
        >>> owner_slots(250_000, 32, factor=1.25)
        9766
    """
    share = entries / workers
    slots = share * factor if factor else share + SPREAD_SIGMAS * math.sqrt(share) + 8
    return max(1, min(entries, math.ceil(slots)))


def union_slots(k: int, size: int, workers: int, factor: float | None = None) -> int:
    """Slots for the nonzeros of one owner's reduced shard in topk_balanced: the union
    of P workers' selections of k of ``size`` entries, counted as if independent, plus
    the spread of ``owner_slots``; never more than the shard or than P workers' slots
    can fill (real selections overlap more than independent ones, so need fewer)."""
    width = -(-size // workers)
    union = width * (1 - (1 - k / size) ** workers)
    spread = SPREAD_SIGMAS * math.sqrt(union) + 8
    return max(1, min(width, workers * owner_slots(k, workers, factor), math.ceil(union + spread)))


def result_form(width: int, slots: int) -> str:
    """How an owner's shard of ``width`` entries, ``slots`` of them to send, comes back:
    the ``RESULT_FORMS`` with the fewest words (``result_words``)."""
    return min(RESULT_FORMS, key=lambda form: result_words(form, width, slots))


def result_words(form: str, width: int, slots: int) -> int:
    """32-bit words an owner sends of its shard in ``form``: ``pairs`` 2 a slot,
    ``bitmap`` a bit an entry plus a value a slot, ``shard`` the whole shard."""
    return {"pairs": 2 * slots, "bitmap": -(-width // 32) + slots, "shard": width}[form]


def balanced_cost(
    size: int, density: float, workers: int, factor: float | None = None
) -> tuple[float, float]:
    """topk_balanced: an all-to-all of C packed pairs an owner, an all-gather of the
    reduced shards in their smallest form."""
    p, k = workers, _k(size, density)
    if p == 1:
        return (0, 0.0)
    width, slots = -(-size // p), owner_slots(k, p, factor)
    union = union_slots(k, size, p, factor)
    words = 2 * slots + result_words(result_form(width, union), width, union)
    return (2 * (p - 1), (p - 1) * 4 * words)


def oktopk_cost(
    size: int, density: float, workers: int, factor: float | None = None
) -> tuple[float, float]:
    """oktopk: topk_balanced's all-to-all; the global threshold's histogram all-reduces
    and the all-gather of each worker's count of entries at it; an all-gather of the
    global top-k's entries of each shard in their smallest form."""
    p, k = workers, _k(size, density)
    if p == 1:
        return (0, 0.0)
    width, slots = -(-size // p), owner_slots(k, p, factor)
    top = min(width, slots)
    words = 2 * slots + 1 + result_words(result_form(width, top), width, top)
    histograms = sum(2 * (p - 1) / p * 4 * 2**bits for bits in RADIX_DIGITS)
    messages = 3 * (p - 1) + len(RADIX_DIGITS) * 2 * (p - 1)
    return (messages, (p - 1) * 4 * words + histograms)
