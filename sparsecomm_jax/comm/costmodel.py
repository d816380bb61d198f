"""The alpha-beta link model: what a collective costs, calibration, the dense costs.

A collective among P workers costs ``messages * alpha + bytes_sent * beta`` per worker,
with ``bytes_sent`` as in ``hlo`` and the message counts of the standard algorithms
(ring all-reduce 2(P-1), all-gather and reduce-scatter and all-to-all P-1, permute 1).
The dense all-reduce of d float32 entries sends 2(P-1)/P * 4d bytes in 2(P-1) messages
(``dense_cost``); the flat mean a table strategy sends in the wire's codec,
``flat_mean_cost``. Each top-k exchange owns its formula (``topk.costs``), and
``topk.exchanges.choose`` prices a bucket on a ``Link`` with them.

A link may also carry ``local``, the measured seconds of each strategy's local work
(selection, residual, scatter-add) as a line in the bucket size
(``topk.local_cost.measure_local_work``): a strategy's time is then its communication
plus its local work, so the choice is the shortest step, not the fewest bytes.

Example:
    >>> from sparsecomm_jax.comm import costmodel
    >>> costmodel.dense_cost(1000, 1.0, 4)  # 6 messages, 3/2 of the gradient's bytes
    (6, 6000.0)
"""

from __future__ import annotations

import statistics
import time
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


def dense_cost(size: int, density: float, workers: int) -> tuple[float, float]:
    """``(messages, bytes per worker)`` of the ring all-reduce of ``size`` float32
    (``density`` is unread: the signature of every exchange's ``cost``)."""
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
