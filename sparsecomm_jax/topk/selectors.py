"""Top-k selectors as values: which k entries of a gradient bucket to send.

A ``Selector`` is a value, like an optax transform: ``EXACT`` (``lax.top_k``, the
reference), ``RADIX`` (the same entries by bitwise counting, no sort), ``THRESHOLD``
(DGC's sampled threshold, approximate) and ``AUTO`` (the default: exact and the fastest
on the platform). ``SELECTORS`` maps their names to them and ``get`` turns a name from a
command line into the value, once.

Every selection has a fixed size (so collectives have static shapes) and takes each
index at most once; padding entries carry value 0 at index 0. ``densify`` scatter-adds a
selection back, so ``x - densify(selection)`` is what error feedback keeps. The
functions below take a selector and return the selection with that residual:

- ``select`` / ``select_with_residual``: one vector;
- ``select_parts``: the concatenation of a bucket's leaves, the residual per leaf;
- ``select_rows``: k per row of a matrix (TopKA2A's per-shard selection);
- ``add_to_parts``: values added back into a bucket's leaves.

On CPU with float32 input, a selector with ``host=True`` (``AUTO``) runs them in the
host kernel (``hostkernel``: a sampled band, then an exact finish on the band, residual
written over the input in the same pass); ``host_dispatch`` is the one place that
decides. The exact selectors agree entry for entry: the k largest magnitudes, and among
equal magnitudes the lower index first (the rule of ``lax.top_k``); NaN ranks above inf,
and -0.0 ties with 0.0.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.topk import selectors
    >>> vals, idx = selectors.select(selectors.EXACT, jnp.array([0.1, -3.0, 2.0, 0.5]), k=2)
    >>> idx.tolist(), vals.tolist()
    ([1, 2], [-3.0, 2.0])

References:
    Lin et al., "Deep Gradient Compression", ICLR 2018 (sampled threshold, error feedback).
    Alabi et al., "Fast K-selection algorithms for GPUs", JEA 2012 (radix select).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsecomm_jax.topk import hostkernel
from sparsecomm_jax.topk.hostkernel import check_k

Selection = tuple[jax.Array, jax.Array]  # values float[k], indices int32[k]


class Selector(NamedTuple):
    """How the k entries of largest magnitude of a vector are found.

    Attributes:
      name: its key in ``SELECTORS`` (what ``--selector`` names).
      topk: ``topk(x, k) -> (values, indices)`` for ``x`` float[d], in ``lax`` ops (every
        platform); indices int32.
      exact: whether it returns exactly the k largest magnitudes.
      host: whether, on CPU with float32 input, the host kernel does the work instead
        (the same entries as ``EXACT``, with the residual fused into the same pass).
    """

    name: str
    topk: Callable[[jax.Array, int], Selection]
    exact: bool = True
    host: bool = False


# ------------------------------------------------------------------ the basics


# The fraction of each bucket top-k strategies send unless told: the same from Python
# (``make_train_step``) and from the command line (``--density``).
DEFAULT_DENSITY = 0.01


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


def densify(values, indices, size: int):
    """Scatter-add a selection into a dense float[size] vector (repeated indices add)."""
    return jnp.zeros((size,), values.dtype).at[indices.reshape(-1)].add(values.reshape(-1))


def magnitude_keys(x):
    """``|x|`` as int32 keys that order like the magnitudes (any float dtype: 16-bit
    inputs are widened to float32 first, which keeps their order)."""
    return jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.int32)


# ---------------------------------------------------------------- the selectors


def exact_topk(x, k: int) -> Selection:
    """The k entries of largest magnitude (``lax.top_k``), ties to the lower index."""
    _, idx = jax.lax.top_k(jnp.abs(x), k)
    return x[idx], idx.astype(jnp.int32)


def kth_largest_bits(a, k: int):
    """The bit pattern of the k-th largest of ``a`` (int32 keys of ``magnitude_keys``):
    31 counting passes, one per bit."""

    def try_bit(i, t):
        candidate = t | jnp.left_shift(jnp.int32(1), 30 - i)
        return jnp.where(jnp.sum(a >= candidate) >= k, candidate, t)

    zero = jnp.zeros_like(a[0])  # int32, varying like a inside shard_map
    return jax.lax.fori_loop(0, 31, try_bit, zero)


def radix_topk(x, k: int) -> Selection:
    """Exact top-k by magnitude without sorting: the k-th largest magnitude bit by bit
    (``kth_largest_bits``), then every entry above it and, in index order, as many equal
    to it as make k. The same entries as ``exact_topk`` in index order; O(31 d) work
    where a top-k with large k sorts.

    Example:
        >>> vals, idx = radix_topk(jnp.array([0.1, -3.0, 2.0, 0.5]), k=2)
        >>> idx.tolist(), vals.tolist()
        ([1, 2], [-3.0, 2.0])
    """
    a = magnitude_keys(x)  # int32[d], ordered like |x|
    t = kth_largest_bits(a, k)
    above, tied = a > t, a == t
    need = k - jnp.sum(above)  # how many of the tied entries complete the k
    keep = above | (tied & (jnp.cumsum(tied) <= need))
    (idx,) = jnp.nonzero(keep, size=k, fill_value=0)
    return x[idx], idx.astype(jnp.int32)


def threshold_topk(x, k: int, sample: int = 4096) -> Selection:
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


def fastest_lax_topk(x, k: int) -> Selection:
    """``lax.top_k`` while k is small against d, else ``radix_topk`` (the crossover
    measured with XLA:CPU at d = 8M lies between densities 0.01 and 0.2)."""
    return exact_topk(x, k) if 50 * k <= x.shape[-1] else radix_topk(x, k)


EXACT = Selector("exact", exact_topk)
RADIX = Selector("radix", radix_topk)
THRESHOLD = Selector("threshold", threshold_topk, exact=False)
AUTO = Selector("auto", fastest_lax_topk, host=True)

SELECTORS: dict[str, Selector] = {s.name: s for s in (AUTO, EXACT, THRESHOLD, RADIX)}
DEFAULT = AUTO


def get(selector: str | Selector) -> Selector:
    """The ``Selector`` named ``selector`` (a ``Selector`` is returned as it is).

    Raises:
      ValueError: an unknown name (the message lists ``SELECTORS``).
    """
    if isinstance(selector, Selector):
        return selector
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {tuple(SELECTORS)}, got {selector!r}")
    return SELECTORS[selector]


# ------------------------------------------------------- the host kernel, one dispatch


def host_dispatch(selector: Selector, arrays: Sequence, kernel: Callable, generic: Callable):
    """A selection by the host kernel or by ``generic(topk, *arrays)``.

    ``kernel(*arrays)`` on CPU when ``selector.host`` and every array is float32 (see
    ``hostkernel.dispatch``); elsewhere ``generic`` with the selector's own ``topk``, or,
    on the other platforms of a program that uses the kernel on CPU, with ``lax.top_k``
    (the accelerators' own selection). Either way the same entries.
    """
    if not selector.host:
        return generic(selector.topk, *arrays)
    return hostkernel.dispatch(
        arrays,
        kernel,
        functools.partial(generic, selector.topk),
        elsewhere=functools.partial(generic, exact_topk),
        usable=all(a.dtype == jnp.float32 for a in arrays),
    )


def _with_residual(topk, x, k):
    values, indices = topk(x, k)
    return values, indices, x - densify(values, indices, x.shape[0])


def select(selector: Selector, x, k: int) -> Selection:
    """``(values, indices)`` of ``selector`` on float[d] ``x``.

    Raises:
      ValueError: k outside [1, d] (before anything runs, so no kernel sees it).
    """
    check_k(k, x.shape[-1])
    return host_dispatch(
        selector, [x], lambda v: hostkernel.topk(v, k)[:2], lambda topk, v: topk(v, k)
    )


def select_with_residual(selector: Selector, x, k: int):
    """``(values, indices, residual)``: ``select`` and what it leaves,
    ``x - densify(values, indices, d)`` (by the host kernel: written in the same pass,
    zero where taken; the same numbers for finite x)."""
    check_k(k, x.shape[-1])
    return host_dispatch(
        selector,
        [x],
        lambda v: hostkernel.topk(v, k, True),
        lambda topk, v: _with_residual(topk, v, k),
    )


def split_like(flat, parts) -> list:
    """``flat`` cut into pieces of the lengths of ``parts`` (1-D)."""
    return jnp.split(flat, list(itertools.accumulate(p.shape[0] for p in parts[:-1])))


def select_parts(selector: Selector, parts, k: int):
    """``select_with_residual`` of the concatenation of ``parts`` (1-D), the residual
    returned per part. By the host kernel the parts are read where they are and each
    residual is written over its part (no concatenated copy).

    Returns:
      ``(values, indices, residuals)``: indices into the concatenation, one residual
      per part.
    """
    check_k(k, sum(p.shape[0] for p in parts))

    def generic(topk, *ps):
        values, indices, kept = _with_residual(topk, jnp.concatenate(ps), k)
        return values, indices, split_like(kept, ps)

    return host_dispatch(selector, parts, lambda *ps: hostkernel.topk_parts(ps, k), generic)


def _rows_with_residual(topk, x, k):
    values, local = jax.vmap(lambda row: topk(row, k))(x)
    rest = jax.vmap(lambda row, a, i: row - densify(a, i, row.shape[0]))(x, values, local)
    return values, local, rest


def select_rows(selector: Selector, x, k: int):
    """``k`` entries of each row of float[R, n] ``x`` and the residual:
    ``(values [R, k], row-local indices [R, k], residual float[R, n])``."""
    check_k(k, x.shape[-1])
    return host_dispatch(
        selector,
        [x],
        lambda v: hostkernel.topk(v, k, True),
        lambda topk, v: _rows_with_residual(topk, v, k),
    )


def select_parts_rows(selector: Selector, parts, k: int, rows: int):
    """``select_rows`` of the concatenation of ``parts`` cut into ``rows`` equal rows,
    the residual returned per part (by the host kernel without concatenating)."""
    check_k(k, sum(p.shape[0] for p in parts) // rows)

    def generic(topk, *ps):
        flat = jnp.concatenate(ps)
        values, local, rest = _rows_with_residual(topk, flat.reshape(rows, -1), k)
        return values, local, split_like(rest.reshape(-1), ps)

    return host_dispatch(selector, parts, lambda *ps: hostkernel.topk_parts(ps, k, rows), generic)


def add_to_parts(parts, values, indices) -> list:
    """``parts`` (1-D, read as one vector) with ``values`` added at ``indices`` into
    their concatenation (repeated indices add up); on CPU (float32) by the host kernel,
    over the parts' buffers."""

    return hostkernel.dispatch(
        parts,
        lambda *ps: hostkernel.add_parts(ps, values, indices),
        lambda *ps: split_like(jnp.concatenate(ps).at[indices].add(values), ps),
        usable=all(a.dtype == jnp.float32 for a in (values, *parts)),
    )
