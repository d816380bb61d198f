"""How a fused bucket's top-k selection travels: the exchanges, each a value that owns
its facts.

An ``Exchange`` is one way a worker's selection of a bucket reaches every worker summed
(``make``: the device code, ``parts -> (total, kept)``), what it costs one worker
(``cost``: messages and bytes, its formula in ``topk.costs``, which matches the
compiled program to the byte), and the local work it does besides (``local``: selection,
residual and sums with the collectives stood in for, timed by ``topk.local_cost`` for the
cost model). ``EXCHANGES`` is the registry; ``adaptive`` chooses per bucket among the
exchanges marked ``menu``. Each exchange is also an aggregator: ``sparsecomm_jax.aggregators``
wraps it in error feedback and fusion, and its ``AGGREGATORS`` holds an entry for every
exchange registered here (``register`` is the one step that adds both).

Example:
    >>> from sparsecomm_jax.topk import exchanges
    >>> exchanges.messages_and_bytes("topk_allgather", 1000, 0.01, 4)
    (6, 240)
    >>> exchanges.menu()
    ('dense', 'topk_allgather', 'topk_a2a', 'topk_balanced', 'oktopk')

References:
    Peng et al., "TopKA2A", ICPP 2024; Shi et al., "gTop-k", ICDCS 2019; Wang et al.,
    "Zen", OSDI 2025; Li and Hoefler, "Ok-Topk", PPoPP 2022.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparsecomm_jax.comm import costmodel, fusion
from sparsecomm_jax.comm.costmodel import Link
from sparsecomm_jax.errors import ArgumentError
from sparsecomm_jax.topk import balanced, collectives, costs, selectors, shards
from sparsecomm_jax.topk.selectors import Selector

ExchangeFn = Callable  # parts -> (total float[d], kept per part)[, every]


class Exchange(NamedTuple):
    """One way a bucket's selection travels (see the module doc).

    Attributes:
      name: its registry key (also its aggregator's name).
      make: ``make(density, axis_name, selector) -> exchange``; ``exchange(parts)``
        (inside ``shard_map``) returns ``(total, kept)``: the sum over the workers of
        what they sent, float[d] for the bucket's d entries (``parts``, 1-D), and what
        this worker keeps in its residual, one array per part. With ``carries``,
        ``exchange(parts, extra)`` also returns every worker's float32 ``extra``.
      cost: ``cost(size, density, P) -> (messages, bytes per worker)``.
      local: ``local(size, density, P) -> fn``: the exchange's local work on one
        worker with its collectives stood in for, jitted ``float32[size] -> outputs``
        (``None``: none worth timing).
      menu: ``adaptive`` chooses among it.
      carries: its ``exchange`` can carry a worker's scalars (``update_carrying``).
      defers: its ``exchange`` returns ``(total, kept, deferred)``: int32[] ``deferred``
        counts the entries it could not send this step for want of a static slot (they
        are in ``kept``, or in an owner's), for ``aggregators.error_feedback`` to count.
      options: the keyword options ``make`` takes besides the three (each checked by
        ``make``, which raises ``errors.ArgumentError`` naming it).
      workers: ``workers(P) -> problem or None``: what it needs of the device count
        (gTop-k's pairwise rounds: a power of two).
    """

    name: str
    make: Callable[[float, str, Selector], ExchangeFn]
    cost: Callable[[int, float, int], tuple[float, float]]
    local: Callable[[int, float, int], Callable] | None = None
    menu: bool = False
    carries: bool = False
    defers: bool = False
    options: tuple[str, ...] = ()
    workers: Callable[[int], str | None] = lambda workers: None


def power_of_two(workers: int) -> str | None:
    """What gTop-k's pairwise rounds need of P: a power of two (``None``: it is one)."""
    return None if workers & (workers - 1) == 0 else "needs a power-of-two number of devices"


def check_capacity_factor(factor: float | None) -> None:
    """``ArgumentError`` unless ``factor`` is ``None`` or a finite number >= 1."""
    if factor is None:
        return
    ok = isinstance(factor, int | float) and not isinstance(factor, bool)
    if not (ok and math.isfinite(factor) and factor >= 1):
        raise ArgumentError(
            "capacity_factor",
            factor,
            "must be a number >= 1 (an owner's slots over its "
            "mean share), or None (the mean plus six standard deviations)",
        )


# ------------------------------------------------------------------ the exchanges


def _on_flat(exchange: Callable) -> Callable:
    """An exchange of parts from ``exchange(flat)`` on their concatenation."""

    def on_parts(parts):
        total, kept = exchange(jnp.concatenate(parts))
        return total, fusion.split(kept, [p.shape[0] for p in parts])

    return on_parts


def dense_exchange(density: float, axis_name: str, selector: Selector = selectors.AUTO):
    """``parts -> (total, kept)`` sending everything: ``psum``, nothing kept."""
    return _on_flat(lambda flat: (jax.lax.psum(flat, axis_name), jnp.zeros_like(flat)))


def allgather_exchange(density: float, axis_name: str, selector: Selector = selectors.AUTO):
    """``parts -> (total, kept)`` of TopK-AllGather: every worker's k (value, index)
    pairs to every worker, scatter-added."""

    def exchange(parts, extra=None):
        d = sum(p.shape[0] for p in parts)
        k = selectors.num_selected(density, d)
        values, indices, kept = selectors.select_parts(selector, parts, k)
        if extra is None:
            return collectives.topk_allgather(values, indices, d, axis_name), kept
        total, every = collectives.topk_allgather_carrying(values, indices, d, axis_name, extra)
        return total, kept, every

    return exchange


def a2a_exchange(density: float, axis_name: str, selector: Selector = selectors.AUTO):
    """``parts -> (total, kept)`` of TopKA2A, any length: k entries in all, split over
    the P shards by their real entries (``topk.shards.shard_slots``)."""

    def exchange(parts):
        num, d = jax.lax.axis_size(axis_name), sum(p.shape[0] for p in parts)
        k = selectors.num_selected(density, d)
        values, local, kept = shards.shard_select_parts(selector, parts, k, num)
        size = num * -(-d // num)  # the shards of ceil(d/P), padding included
        total = collectives.topk_a2a(values, local, size, axis_name)  # values: [P, k/P]
        return shards.from_shards(total.reshape(num, -1), d), kept

    return exchange


def gtopk_exchange(density: float, axis_name: str, selector: Selector = selectors.AUTO):
    """``parts -> (total, kept)`` of gTop-k (P a power of two); ``selector`` picks each
    worker's first k, the merges re-select exactly."""

    def exchange(parts):
        d = sum(p.shape[0] for p in parts)
        k = selectors.num_selected(density, d)  # collectives.gtopk_lists checks P
        values, indices, kept = selectors.select_parts(selector, parts, k)
        values, indices, left_v, left_i = collectives.gtopk_lists(values, indices, k, axis_name)
        return selectors.densify(values, indices, d), selectors.add_to_parts(kept, left_v, left_i)

    return exchange


def balanced_exchange(
    density: float,
    axis_name: str,
    selector: Selector = selectors.AUTO,
    capacity_factor: float | None = None,
):
    """``parts -> (total, kept, deferred)`` of topk_balanced: each worker's k pairs to
    hashed owners by one all-to-all, each owner's sum back to every worker by one
    all-gather of its nonzeros in the smallest form (``topk.balanced``). ``total`` is
    the sum of what every worker sent; ``capacity_factor`` sizes an owner's slots
    (``topk.costs.owner_slots``)."""
    check_capacity_factor(capacity_factor)

    def exchange(parts):
        comm, num = balanced.Comm.over(axis_name), jax.lax.axis_size(axis_name)
        return owner_sum(parts, density, num, selector, capacity_factor, comm)

    return exchange


def oktopk_exchange(
    density: float,
    axis_name: str,
    selector: Selector = selectors.AUTO,
    capacity_factor: float | None = None,
):
    """``parts -> (total, kept, deferred)`` of oktopk: topk_balanced's all-to-all to
    hashed owners, then the global top-k of the owners' sums (``topk.balanced``'s radix
    search), and only those back to every worker. ``total`` is the k entries of largest
    magnitude of the sum of what every worker selected; each worker keeps in its
    residual what it selected of the rest."""
    check_capacity_factor(capacity_factor)

    def exchange(parts):
        comm, num = balanced.Comm.over(axis_name), jax.lax.axis_size(axis_name)
        return owner_sum(parts, density, num, selector, capacity_factor, comm, global_k=True)

    return exchange


def owner_sum(
    parts,
    density: float,
    workers: int,
    selector: Selector,
    factor: float | None,
    comm: balanced.Comm,
    global_k: bool = False,
):
    """topk_balanced (``global_k``: oktopk) on ``parts`` with the collectives of
    ``comm``: ``(total, kept, deferred)``."""
    d = sum(p.shape[0] for p in parts)
    k = selectors.num_selected(density, d)
    values, indices, kept = selectors.select_parts(selector, parts, k)
    h = balanced.OwnerHash(d, workers)
    slots = costs.owner_slots(k, workers, factor)
    routed = balanced.route(h, values, indices, slots)
    shard = balanced.reduce_at_owners(h, routed.sends, comm)  # float32[s]: this owner's sum
    if global_k:  # the k largest of all owners' sums, at most the slots of one owner's
        chosen = balanced.global_top(shard, k, comm, arrived=workers * slots)
        back_slots = min(h.width, slots)
    else:  # every nonzero: the union of the selections
        chosen, back_slots = shard != 0, costs.union_slots(k, d, workers, factor)
    form = costs.result_form(h.width, back_slots)
    back = balanced.send_back(h, shard, chosen, form, back_slots, comm)
    # what stays: the unselected, and each pair of this worker's that did not arrive in
    # the result (no slot on the way, not chosen at its owner, no slot on the way back)
    arrived = routed.fits & (jnp.take(back.total, indices) != 0)
    kept = selectors.add_to_parts(kept, jnp.where(arrived, 0.0, values), indices)
    return back.total, kept, routed.deferred + back.deferred


# ------------------------------------------------------------------ local work


def allgather_local(size: int, density: float, workers: int) -> Callable:
    """TopK-AllGather's local work: selection and residual, and the scatter-add of P
    workers' pairs (the all-gather stood in for by tiling the own selection P times)."""
    k = selectors.num_selected(density, size)

    def work(x):
        values, indices, kept = selectors.select_with_residual(selectors.AUTO, x, k)
        gathered = (jnp.tile(values, workers), jnp.tile(indices, workers))
        return selectors.densify(*gathered, size), kept

    return jax.jit(work)


def a2a_local(size: int, density: float, workers: int) -> Callable:
    """TopKA2A's local work: the per-shard selection and residual, and the sum of the
    P pieces of one shard (the all-to-all stood in for by the own pieces)."""
    k = selectors.num_selected(density, size)

    def work(x):
        values, local, kept = shards.shard_select(selectors.AUTO, x, k, workers)  # [P, k/P]
        return selectors.densify(values, local, -(-size // workers)), kept

    return jax.jit(work)


def balanced_local(size: int, density: float, workers: int) -> Callable:
    """topk_balanced's local work: selection, routing, the owner's sum, the way back's
    packing and unpacking (its collectives stood in for: ``balanced.Comm.stand_in``)."""
    comm = balanced.Comm.stand_in(workers)
    return jax.jit(lambda x: owner_sum([x], density, workers, selectors.AUTO, None, comm)[:2])


def oktopk_local(size: int, density: float, workers: int) -> Callable:
    """oktopk's local work: as ``balanced_local``, and the global top-k's histograms."""
    comm = balanced.Comm.stand_in(workers)
    work = lambda x: owner_sum([x], density, workers, selectors.AUTO, None, comm, True)  # noqa: E731
    return jax.jit(lambda x: work(x)[:2])


# ------------------------------------------------------------------ the registry

DENSE = Exchange("dense", dense_exchange, costmodel.dense_cost, menu=True)
ALLGATHER = Exchange(
    "topk_allgather",
    allgather_exchange,
    costs.allgather_cost,
    allgather_local,
    menu=True,
    carries=True,
)
A2A = Exchange("topk_a2a", a2a_exchange, costs.a2a_cost, a2a_local, menu=True)
GTOPK = Exchange("gtopk", gtopk_exchange, costs.gtopk_cost, workers=power_of_two)
BALANCED = Exchange(
    "topk_balanced",
    balanced_exchange,
    costs.balanced_cost,
    balanced_local,
    menu=True,
    defers=True,
    options=("capacity_factor",),
)
OKTOPK = Exchange(
    "oktopk",
    oktopk_exchange,
    costs.oktopk_cost,
    oktopk_local,
    menu=True,
    defers=True,
    options=("capacity_factor",),
)

#: The exchanges by name: the library's, and any registered (``register``).
EXCHANGES: dict[str, Exchange] = {
    x.name: x for x in (DENSE, ALLGATHER, A2A, GTOPK, BALANCED, OKTOPK)
}


def register(exchange: Exchange) -> Exchange:
    """Adds ``exchange`` to ``EXCHANGES`` under its name (one of that name is
    replaced); returns it. From then on it is also an aggregator
    (``aggregators.AGGREGATORS[name]``, and the strategies ``name`` and
    ``TABLES+name``), and ``adaptive`` built afterwards chooses among it too where it
    is marked ``menu`` (``menu()`` is read when an ``adaptive`` step is traced).

    Raises:
      ValueError: not an ``Exchange``, or an empty name.
    """
    if not isinstance(exchange, Exchange) or not exchange.name:
        raise ValueError(f"register takes an Exchange with a name, got {exchange!r}")
    EXCHANGES[exchange.name] = exchange
    return exchange


def menu() -> tuple[str, ...]:
    """The names ``adaptive`` chooses among: the exchanges marked ``menu``."""
    return tuple(name for name, x in EXCHANGES.items() if x.menu)


def get(name: str | Exchange) -> Exchange:
    """The exchange called ``name`` (a value is returned as it is).

    Raises:
      ValueError: an unknown name (the message lists ``EXCHANGES``).
    """
    if isinstance(name, Exchange):
        return name
    if name not in EXCHANGES:
        raise ValueError(f"unknown exchange {name!r}; choose one of {list(EXCHANGES)}")
    return EXCHANGES[name]


def messages_and_bytes(name: str, size: int, density: float, workers: int):
    """``(messages, bytes per worker)`` of one exchange of ``size`` float32 entries."""
    return get(name).cost(size, density, workers)


def exchange_time(name: str, size: int, density: float, workers: int, link: Link) -> float:
    """Modelled seconds to exchange one bucket of ``size`` entries by ``name``:
    communication, plus local work when ``link.local`` is set."""
    messages, nbytes = messages_and_bytes(name, size, density, workers)
    local = link.local.seconds(name, size) if link.local else 0.0
    return messages * link.alpha + nbytes * link.beta + local


def choose(
    size: int, density: float, workers: int, link: Link, choices: Sequence[str] | None = None
) -> str:
    """The cheapest exchange for one bucket among ``choices`` (default ``menu()``; ties
    go to the earlier choice).

    Example:
        >>> link = Link(alpha=50e-6, beta=1 / 1.25e9)   # 10 Gbit/s
        >>> choose(25_000_000, 0.01, 32, link)
        'oktopk'
        >>> choose(25_000_000, 0.01, 32, link, ("dense", "topk_allgather", "topk_a2a"))
        'topk_allgather'
    """
    names = menu() if choices is None else choices
    return min(names, key=lambda s: exchange_time(s, size, density, workers, link))
