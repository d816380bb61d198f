"""Alpha-beta cost model of every strategy; calibration; per-bucket strategy choice.

A collective among P workers costs ``messages * alpha + bytes_sent * beta`` per worker,
with ``bytes_sent`` as in ``hlo`` and the message counts of the standard algorithms
(ring all-reduce 2(P-1), all-gather and reduce-scatter and all-to-all P-1, permute 1).
For a gradient of d float32 entries and k = density * d:

============== ========================= ==============================
strategy       messages                  bytes per worker
============== ========================= ==============================
dense          2(P-1)                    2(P-1)/P * 4d
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
oktopk's global top-k adds ``len(RADIX_DIGITS)`` all-reduces of a histogram (2(P-1)
messages each) and an all-gather of one count. These formulas
(``dense_cost``, ``allgather_cost``, ...) are the one home of the volumes: each
exchange of ``topk.exchanges`` names its own, and ``hlo`` checks them against the
compiled programs.

A link may also carry ``local``, the measured seconds of each strategy's local work
(selection, residual, scatter-add) as a line in the bucket size
(``topk.local_cost.measure_local_work``): a strategy's time is then its communication plus its local
work, so the choice is the shortest step, not the fewest bytes.

Example:
    >>> from sparsecomm_jax.comm import costmodel
    >>> costmodel.allgather_cost(1000, 0.01, 4)  # 6 messages, 3 x 10 values and indices
    (6, 240)
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.comm import hlo, wire

_MESSAGES = {
    "all-reduce": lambda p: 2 * (p - 1),
    "all-gather": lambda p: p - 1,
    "reduce-scatter": lambda p: p - 1,
    "all-to-all": lambda p: p - 1,
    "collective-permute": lambda p: 1,
}


class LocalWork(NamedTuple):
    """Seconds of each strategy's local work on one bucket: ``fixed + per_entry * size``.

    Attributes:
      lines: ``{strategy: (fixed seconds, seconds per entry)}``; strategies not in it
        cost nothing locally (dense: its additions are inside the timed all-reduce).
    """

    lines: dict[str, tuple[float, float]]

    def seconds(self, strategy: str, size: int) -> float:
        fixed, per_entry = self.lines.get(strategy, (0.0, 0.0))
        return fixed + per_entry * size


class Link(NamedTuple):
    """Latency per message (s) and time per byte (s/B) of one worker's link, and
    optionally the measured local work of each strategy."""

    alpha: float
    beta: float
    local: LocalWork | None = None

    @classmethod
    def from_bandwidth(cls, gbit_per_s: float, alpha: float = 50e-6) -> Link:
        """A link of ``gbit_per_s`` Gbit/s and ``alpha`` seconds per message."""
        return cls(alpha, 8 / (gbit_per_s * 1e9))


def collective_time(c: hlo.Collective, link: Link) -> float:
    """Modelled seconds of one compiled collective."""
    if c.group_size <= 1:
        return 0.0
    return _MESSAGES[c.kind](c.group_size) * link.alpha + c.bytes_sent * link.beta


def program_time(colls: Sequence[hlo.Collective], link: Link) -> float:
    """Modelled communication seconds of a compiled program (collectives in sequence;
    those of a ``conditional``'s branches left out, as ``hlo.total_bytes`` does)."""
    return sum(collective_time(c, link) for c in colls if not c.conditional)


def _k(size: int, density: float) -> int:
    """k = round(density * size), at least 1 and at most the size."""
    return min(size, max(1, round(density * size)))


def dense_cost(size: int, density: float, workers: int) -> tuple[float, float]:
    """``(messages, bytes per worker)`` of the ring all-reduce of ``size`` float32."""
    p = workers
    return (2 * (p - 1), 2 * (p - 1) / p * 4 * size) if p > 1 else (0, 0.0)


def flat_mean_cost(
    size: int, workers: int, codec: wire.Codec = wire.FLOAT32, extra: int = 0
) -> tuple[float, float]:
    """``(messages, bytes per worker)`` of the dense mean a table strategy sends as one
    flat buffer (``aggregators.flat_allreduce``): ``size`` entries padded to ``d'``
    (``wire.padded``: a multiple of P blocks), an all-to-all of the P-1 slices of d'/P
    entries it does not own, and an all-gather of its slice's sums with ``extra``
    float32 scalars (the step's loss and flags) as raw bits: ``(P-1) B(d'/P) + (P-1)
    (B(d'/P) + 4 extra)`` bytes, B the codec's bytes (``wire.flat_bytes``: FP8 one byte a
    value and a float32 scale per ``wire.BLOCK``).

    Example:
        >>> flat_mean_cost(1024, 4, wire.E4M3)  # 2 blocks a worker: 3 x 264 out, 3 x 264 back
        (6, 1584.0)
    """
    p = workers
    if p == 1:
        return 0, 0.0
    d = wire.padded(size, p, codec)
    share = wire.flat_bytes(d // p, codec)
    return 2 * (p - 1), float((p - 1) * share + (p - 1) * (share + 4 * extra))


def allgather_cost(size: int, density: float, workers: int) -> tuple[float, float]:
    """TopK-AllGather: every worker's k values and k indices to every worker."""
    p = workers
    return (2 * (p - 1), 2 * (p - 1) * 4 * _k(size, density)) if p > 1 else (0, 0.0)


def a2a_cost(size: int, density: float, workers: int) -> tuple[float, float]:
    """TopKA2A: one all-to-all of values and one of indices, an all-gather of shards."""
    p = workers
    return (3 * (p - 1), a2a_bytes(size, density, p)) if p > 1 else (0, 0.0)


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


def a2a_bytes(size: int, density: float, workers: int) -> float:
    """Bytes per worker of topk_a2a on a bucket of ``size`` entries, as compiled, for any
    size: an all-to-all of s = ceil(k/P) (value, index) slots per shard, k = round(density
    * size) (``topk.shards.shard_slots``), and an all-gather of P shards of ceil(size/P)."""
    p, k = workers, _k(size, density)
    return (p - 1) / p * 4 * (2 * p * math.ceil(k / p) + p * math.ceil(size / p))


# ------------------------------------------------------------------ balanced owners

SPREAD_SIGMAS = 6  # an owner's slots above its mean share, in standard deviations
RADIX_DIGITS = (11, 11, 9)  # oktopk's threshold search: bits a round, of 31-bit keys
RESULT_FORMS = ("shard", "bitmap", "pairs")  # ties go to the earlier form


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


def crossover_density(workers: int) -> float:
    """Density above which topk_a2a sends fewer bytes than topk_allgather: 1/(2(P-1))."""
    return 1 / (2 * (workers - 1))


def fit(points: Sequence[tuple[float, float, float]]) -> Link:
    """Least-squares ``(alpha, beta)`` from ``(messages, bytes, seconds)`` points
    (clipped at zero)."""
    n = len(points)
    if n < 2:
        raise ValueError("fit needs at least two timed points")
    sxx = sum(m * m for m, _, _ in points)
    sxy = sum(m * b for m, b, _ in points)
    syy = sum(b * b for _, b, _ in points)
    sxt = sum(m * t for m, _, t in points)
    syt = sum(b * t for _, b, t in points)
    det = sxx * syy - sxy * sxy
    if abs(det) < 1e-30:  # all points have the same messages/bytes ratio
        return Link(0.0, sum(t for _, _, t in points) / max(sum(b for _, b, _ in points), 1))
    alpha = (sxt * syy - syt * sxy) / det
    beta = (syt * sxx - sxt * sxy) / det
    return Link(max(alpha, 0.0), max(beta, 0.0))


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(fixed, slope)`` through ``(x, y)`` points, both clipped at zero
    (one point, or all at one x: through the origin)."""
    n, sx = len(points), sum(x for x, _ in points)
    sy, sxx = sum(y for _, y in points), sum(x * x for x, _ in points)
    sxy = sum(x * y for x, y in points)
    det = n * sxx - sx * sx
    if det <= 1e-12 * max(sxx, 1.0):
        return 0.0, sy / max(sx, 1e-30)
    slope = max((n * sxy - sx * sy) / det, 0.0)
    return max((sy - slope * sx) / n, 0.0), slope


def median_seconds(fn, *args, repeats: int = 5) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` calls after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def calibrate(mesh, axis_name: str = "data", sizes=(1 << 10, 1 << 16, 1 << 20), repeats=5):
    """Fits ``Link`` from timed all-reduces of a few sizes on ``mesh`` (the current
    cluster: simulated devices, processes, or the emulated network). Each time is the
    mean over the processes (``runtime.agreed_mean``), so every process fits the same
    link and makes the same choices on it. Call it on every process.

    Returns:
      ``(link, points)`` with points ``(messages, bytes, median seconds)``.
    """
    p = runtime.mesh_axis_size(mesh, axis_name)
    fn = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, axis_name),
            mesh=mesh,
            in_specs=P(axis_name),
            out_specs=P(axis_name),
            check_vma=False,
        )
    )
    points = []
    for n in sizes:
        x = runtime.put_global(np.ones((p * n,), np.float32), mesh, P(axis_name))
        seconds = runtime.agreed_mean(median_seconds(fn, x, repeats=repeats))
        points.append((2 * (p - 1), 2 * (p - 1) / p * 4 * n, seconds))
    return fit(points), points


# Names that moved to ``topk.exchanges`` (0.3): the exchanges own their costs now.
_MOVED = {
    "messages_and_bytes": "messages_and_bytes",
    "strategy_time": "exchange_time",
    "choose": "choose",
    "CHOICES": "menu",
}


def __getattr__(name: str):
    """The names that moved to ``topk.exchanges``, with a ``DeprecationWarning`` (kept
    for one version)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"costmodel.{name} moved to sparsecomm_jax.topk.exchanges.{_MOVED[name]}",
        DeprecationWarning,
        stacklevel=2,
    )
    moved = getattr(importlib.import_module("sparsecomm_jax.topk.exchanges"), _MOVED[name])
    return moved() if name == "CHOICES" else moved  # the menu is a function now
