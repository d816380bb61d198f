"""Gradient aggregators, optax-style: ``Aggregator(init, update)`` (and, for those that
can carry a step's scalars in their own collectives, ``update_carrying``).

Used inside ``shard_map`` bodies, with ``check_vma`` (``jax.shard_map``'s default) or
without: ``mean_grads, state = agg.update(grads, state)`` returns the mean gradient
over the ``axis_name`` workers, identical on every worker and typed replicated (so
``out_specs=P()`` accepts it). ``grads`` are each worker's own gradients: under
``check_vma`` take them with respect to ``vary(params)``, since ``jax.grad`` of a
``P()`` input is already summed over the workers. State is a NamedTuple of arrays kept
per worker: ``per_worker(agg, P)`` holds it with a leading worker axis, passed with
``state_spec()``, so every worker's residual is visible.

Error-feedback aggregators (``topk_allgather``, ``topk_a2a``, ``gtopk``,
``topk_balanced``, ``oktopk``, ``adaptive``) keep a
``residual`` per worker shaped like the gradients: ``acc = grad + residual``; what is not
sent stays in ``residual``. Leaves are fused into flat buckets, one
collective per bucket (``comm.fusion``). Conservation holds by construction, for any input:
``P * mean + sum_p residual_new_p == sum_p (grad_p + residual_old_p)``.

Example:
    >>> from sparsecomm_jax import aggregators
    >>> agg = aggregators.per_worker(aggregators.topk_a2a(0.01), num_workers=8)
    >>> # state = agg.init(params)  # residual leaves [8, ...], spec state_spec()
    >>> # in jax.shard_map(body, in_specs=(P(), state_spec(), P("data")), ...):
    >>> #   grads = jax.grad(loss)(aggregators.vary(params), batch)
    >>> #   mean, state = agg.update(grads, state)

References:
    Peng et al., "TopKA2A", ICPP 2024; Lin et al., "Deep Gradient Compression", 2018;
    Wang et al., "Zen", OSDI 2025; Li and Hoefler, "Ok-Topk", PPoPP 2022.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import costmodel, fusion, wire
from sparsecomm_jax.comm.vma import check_per_worker, vary
from sparsecomm_jax.errors import ArgumentError
from sparsecomm_jax.topk import exchanges, selectors
from sparsecomm_jax.topk.selectors import Selector

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "AggregatorKind",
    "EmptyState",
    "ErrorFeedbackState",
    "adaptive",
    "dense_allreduce",
    "error_feedback",
    "flat_allreduce",
    "gtopk",
    "oktopk",
    "per_worker",
    "state_spec",
    "topk_a2a",
    "topk_allgather",
    "topk_balanced",
    "vary",  # from comm.vma: each worker's own gradient inside a check_vma shard_map
]

PyTree = Any
DEFAULT_BUCKET_BYTES = 64 * 2**20


class Aggregator(NamedTuple):
    """A gradient-exchange strategy.

    Attributes:
      init: ``init(params) -> state`` (local shapes).
      update: ``update(grads, state) -> (mean_grads, state)``.
      update_carrying: ``update_carrying(grads, state, extra) -> (mean_grads, state,
        every, state_ok)``: ``update`` that also carries this worker's float32[k]
        ``extra`` to every worker within its own collectives (``every``: float32[P, k],
        replicated); ``state_ok``: bool[], the same on every worker: false when some
        worker's new state, or what it contributed to the mean, holds a NaN or Inf (a
        per-worker state's flag travels with ``extra``). ``flat_allreduce`` and
        ``topk_allgather`` have one.
        ``None`` when it cannot (a step then reduces its scalars by an all-reduce of
        their own).
    """

    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]
    update_carrying: Callable | None = None


class EmptyState(NamedTuple):
    """State of a stateless aggregator."""


def dense_allreduce(axis_name: str = "data") -> Aggregator:
    """Mean of the gradients by ``lax.pmean`` (ring all-reduce).

    Args:
      axis_name: the data-parallel mesh axis.

    Returns:
      An ``Aggregator`` with empty state.
    """

    def update(grads, state):
        check_per_worker(grads, axis_name)
        return jax.lax.pmean(grads, axis_name), state  # typed replicated

    return Aggregator(init=lambda params: EmptyState(), update=update)


def flat_allreduce(
    axis_name: str = "data", comm_dtype: str | wire.Codec | wire.Wire = "float32"
) -> Aggregator:
    """Mean of the gradients as one flat buffer: an all-to-all of 1/P slices, a float32
    sum, an all-gather of the sums (``comm.wire.psum``).

    The bytes of the ring all-reduce in ``comm_dtype`` (``"bfloat16"``: half of them;
    FP8: a quarter, plus a float32 scale per ``comm.wire.BLOCK`` entries), summed in
    float32 at each receiver, as two collectives of one operand each: over gloo (CPU) an
    all-reduce of many leaves runs one ring per leaf, each paying the link's round trips.

    Args:
      axis_name: the data-parallel mesh axis.
      comm_dtype: the codec on the wire, its name (a key of ``comm.wire.CODECS``), or
        a ``comm.wire.Wire`` or spec whose ``dense`` codec is taken.

    Returns:
      An ``Aggregator`` with empty state.
    """
    dtype = comm_dtype if isinstance(comm_dtype, wire.Codec) else wire.parse(comm_dtype).dense

    def update_carrying(grads, state, extra):
        check_per_worker(grads, axis_name)
        leaves, treedef = jax.tree.flatten(grads)
        bucket = list(range(len(leaves)))
        flat = (  # float[d] (one zero when there are no dense layers: extra still travels)
            fusion.pack([x.astype(jnp.float32) for x in leaves], bucket)
            if leaves
            else jnp.zeros(1, jnp.float32)
        )
        total, every = wire.psum_carrying(flat, extra, axis_name, dtype)
        out = fusion.unpack(total / jax.lax.axis_size(axis_name), leaves, bucket)
        return treedef.unflatten([out[i] for i in bucket]), state, every, jnp.array(True)

    def update(grads, state):
        if not jax.tree.leaves(grads):
            return grads, state
        mean, state, *_ = update_carrying(grads, state, jnp.zeros(0, jnp.float32))
        return mean, state

    return Aggregator(lambda params: EmptyState(), update, update_carrying)


class ErrorFeedbackState(NamedTuple):
    """Per-worker state of the top-k aggregators.

    Attributes:
      residual: what this worker has not sent yet, shaped like the gradients.
      deferred: int32[], for the exchanges with static slots (``topk_balanced``,
        ``oktopk``, ``adaptive``): how many selected entries this worker has had to
        keep for want of a slot since ``init``, counted up (each stayed in a residual
        and was sent later, never dropped); ``()`` for the others.
    """

    residual: PyTree
    deferred: Any = ()


def check_float_grads(grads: PyTree) -> None:
    """``ValueError`` naming the first non-floating-point gradient leaf."""
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        if not jnp.issubdtype(g.dtype, jnp.floating):
            name = jax.tree_util.keystr(path)
            raise ValueError(f"gradient {name} has dtype {g.dtype}; top-k needs floats")


def per_worker(agg: Aggregator, num_workers: int) -> Aggregator:
    """``agg`` with its state held per worker, as one global array per leaf.

    ``init(params)`` (outside ``shard_map``) gives the state with a leading axis of
    ``num_workers``: zeros, one slice per worker, so ``np.asarray`` and checkpoints see
    every worker's residual. Pass it with ``state_spec(axis_name)`` as in- and out-spec;
    inside the body ``update(grads, state)`` reads and returns this worker's [1, ...]
    slice.

    Args:
      agg: any aggregator (``topk_a2a(...)``, ...).
      num_workers: P, the size of the mesh axis.

    Returns:
      An ``Aggregator`` on per-worker state.

    Example:
        >>> import jax.numpy as jnp
        >>> agg = per_worker(topk_a2a(0.1), num_workers=8)
        >>> agg.init({"w": jnp.zeros(3)}).residual["w"].shape
        (8, 3)
    """

    def init(params):
        shapes = jax.eval_shape(agg.init, params)
        return jax.tree.map(lambda s: np.zeros((num_workers, *s.shape), s.dtype), shapes)

    def update(grads, state):
        slices = {x.shape[0] for x in jax.tree.leaves(state)}
        if slices - {1}:  # each worker must see its own [1, ...] slice
            workers = num_workers // max(slices)
            raise ValueError(
                f"per_worker(agg, num_workers={num_workers}) runs on a mesh axis of "
                f"{workers} workers (each sees {max(slices)} slices of the state): pass "
                f"num_workers={workers}, the size of the mesh axis"
            )
        local = jax.tree.map(lambda x: x[0], state)  # [1, ...] -> [...]
        mean, local = agg.update(grads, local)
        return mean, jax.tree.map(lambda x: x[None], local)

    return Aggregator(init=init, update=update)


def state_spec(axis_name: str = "data") -> P:
    """The ``PartitionSpec`` of ``per_worker`` state: one slice per worker along
    ``axis_name`` (a prefix for the whole state pytree in ``in_specs``/``out_specs``)."""
    return P(axis_name)


def _checked(density: float, selector: str | Selector) -> Selector:
    selectors.check_density(density)
    return selectors.get(selector)


def error_feedback(
    exchange: Callable,
    axis_name: str = "data",
    bucket_bytes=DEFAULT_BUCKET_BYTES,
    carries: bool = False,
    defers: bool = False,
) -> Aggregator:
    """An aggregator with error feedback around ``exchange`` (an ``Exchange``'s
    ``make(density, axis_name, selector)``): residual add, fusion, one ``exchange`` per
    bucket. Every top-k aggregator is one; a new exchange becomes an aggregator so.

    Args:
      exchange: see below.
      axis_name: the data-parallel mesh axis.
      bucket_bytes: fusion threshold (``None``: one bucket).
      carries: ``exchange`` takes an ``extra`` (see below).
      defers: ``exchange`` returns ``(total, kept, deferred)``, int32[] ``deferred`` the
        entries it kept for want of a slot; the state counts them up (``deferred``).

    Returns:
      An ``Aggregator`` whose state is an ``ErrorFeedbackState``.

    ``exchange(parts) -> (total, kept)``: ``parts`` are the bucket's flattened leaves,
    read as one vector of d entries; ``total`` is the sum over workers of what is sent
    (float[d]) and ``kept`` what this worker keeps in its residual, one array per part.
    With ``carries``, ``exchange(parts, extra) -> (total, kept, every)`` also carries
    float32[m] ``extra`` to every worker (float32[P, m]), and the aggregator gets an
    ``update_carrying``: the step's scalars and this worker's non-finite flag ride the
    last bucket's exchange. The flag is taken on ``acc = grad + residual``: every entry
    of ``acc`` is either sent or kept, so what a worker sends and what it keeps are
    both finite exactly when ``acc`` is.
    """

    def init(params):
        residual = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return ErrorFeedbackState(residual, jnp.zeros((), jnp.int32) if defers else ())

    def run(grads, state, extra=None):
        check_float_grads(grads)
        check_per_worker(grads, axis_name)
        leaves, treedef = jax.tree.flatten(grads)
        acc = [g + r for g, r in zip(leaves, treedef.flatten_up_to(state.residual), strict=True)]
        if extra is not None:  # + this worker's flag: is any entry of acc NaN or Inf?
            bad = [~jnp.all(jnp.isfinite(a)) for a in acc]
            bad = jnp.any(jnp.stack(bad)) if bad else jnp.array(False)
            extra = jnp.concatenate([extra.astype(jnp.float32), bad.astype(jnp.float32)[None]])
        num = jax.lax.axis_size(axis_name)
        buckets = fusion.plan_buckets([a.size for a in acc], bucket_bytes)
        mean, residual, every, deferred = {}, {}, None, jnp.zeros((), jnp.int32)
        for b, bucket in enumerate(buckets):
            parts = fusion.parts(acc, bucket)  # d entries in all
            if extra is not None and b == len(buckets) - 1:
                total, kept, every = exchange(parts, extra)
            elif defers:
                total, kept, late = exchange(parts)
                deferred = deferred + late
            else:
                total, kept = exchange(parts)
            mean.update(fusion.unpack(total / num, leaves, bucket))
            residual.update({i: kept[j].reshape(acc[i].shape) for j, i in enumerate(bucket)})
        if extra is not None and every is None:  # no gradients: the scalars travel alone
            every = jax.lax.all_gather(extra, axis_name, to="invarying")
        order = range(len(leaves))
        mean = treedef.unflatten([mean[i] for i in order])
        residual = treedef.unflatten([residual[i] for i in order])
        counts = defers and bool(jax.tree.leaves(state.deferred))  # a state built by hand: not
        counted = state.deferred + deferred if counts else state.deferred
        return mean, ErrorFeedbackState(residual, counted), every

    def update(grads, state):
        mean, state, _ = run(grads, state)
        return mean, state

    def update_carrying(grads, state, extra):
        mean, state, every = run(grads, state, extra)
        return mean, state, every[:, :-1], every[:, -1].sum() == 0  # the flags of acc

    return Aggregator(init, update, update_carrying if carries else None)


def of_exchange(
    exchange: str | exchanges.Exchange,
    density: float,
    axis_name: str = "data",
    selector: str | Selector = "auto",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    **options: Any,
) -> Aggregator:
    """The top-k aggregator of a registered exchange (``topk.exchanges.EXCHANGES``): its
    selection wrapped in error feedback and fusion (``error_feedback``), carrying the
    step's scalars where the exchange can (``Exchange.carries``) and counting what it
    defers (``Exchange.defers``). Every top-k aggregator is one; ``AGGREGATORS`` holds
    one for each registered exchange.

    Args:
      exchange: an ``Exchange`` or its name.
      density: fraction of each bucket sent, in (0, 1].
      axis_name: the data-parallel mesh axis.
      selector: a ``topk.selectors.Selector`` or its name in ``SELECTORS``.
      bucket_bytes: fusion threshold (``None``: one bucket).
      **options: the exchange's own options (``Exchange.options``, e.g.
        ``capacity_factor``).

    Returns:
      An ``Aggregator`` whose state is an ``ErrorFeedbackState``.

    Raises:
      ArgumentError: an option the exchange does not take, or a value it refuses.

    Example:
        >>> of_exchange("topk_a2a", 0.01).init({"w": jnp.zeros(3)}).residual["w"].shape
        (3,)
    """
    exchange = exchanges.get(exchange)
    if unknown := sorted(set(options) - set(exchange.options)):
        raise ArgumentError(
            unknown[0],
            options[unknown[0]],
            f"is no option of {exchange.name}; it takes {list(exchange.options) or 'none'}",
        )
    made = exchange.make(density, axis_name, _checked(density, selector), **options)
    return error_feedback(
        made, axis_name, bucket_bytes, carries=exchange.carries, defers=exchange.defers
    )


def topk_allgather(
    density: float,
    axis_name: str = "data",
    selector: str | Selector = "auto",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
) -> Aggregator:
    """Top-k with error feedback; pairs exchanged by all-gather (the common baseline).

    Args:
      density: fraction of each bucket sent, in (0, 1].
      axis_name: the data-parallel mesh axis.
      selector: a ``topk.selectors.Selector`` or its name in ``SELECTORS``; the default
        ``"auto"`` is exact and the fastest on the platform, ``"exact"`` is
        ``lax.top_k`` (the reference).
      bucket_bytes: fusion threshold (``None``: one bucket).

    Returns:
      An ``Aggregator`` whose state is an ``ErrorFeedbackState``.
    """
    return of_exchange(exchanges.ALLGATHER, density, axis_name, selector, bucket_bytes)


def topk_a2a(
    density: float,
    axis_name: str = "data",
    selector: str | Selector = "auto",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
) -> Aggregator:
    """TopKA2A: k = round(density * d) entries per bucket, as ``topk_allgather``, split
    over P contiguous shards by their real entries (``topk.shards.shard_slots``); one
    all-to-all of ceil(k/P) pairs per shard, local sum, tiled all-gather.

    Args: as ``topk_allgather``.

    Returns:
      An ``Aggregator`` whose state is an ``ErrorFeedbackState``.
    """
    # No update_carrying: its dense result is one tiled all-gather; scalars appended to
    # each share would make it strided, a copy of the whole gradient per step (measured
    # 1.2-1.3x the step on one process) to save one small all-reduce.
    return of_exchange(exchanges.A2A, density, axis_name, selector, bucket_bytes)


def gtopk(
    density: float,
    axis_name: str = "data",
    selector: str | Selector = "auto",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
) -> Aggregator:
    """gTop-k: log2(P) pairwise merge rounds; entries a merge drops go back to the
    residual of one rank of the group that merged. P must be a power of two.

    Args:
      density: fraction of each bucket kept, in (0, 1].
      axis_name: the data-parallel mesh axis.
      selector: how each worker selects its first k (as ``topk_allgather``).
      bucket_bytes: fusion threshold (``None``: one bucket).

    Returns:
      An ``Aggregator`` whose state is an ``ErrorFeedbackState``.
    """
    return of_exchange(exchanges.GTOPK, density, axis_name, selector, bucket_bytes)


def topk_balanced(
    density: float,
    axis_name: str = "data",
    selector: str | Selector = "auto",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    capacity_factor: float | None = None,
) -> Aggregator:
    """Zen's sparse all-reduce: each worker's k = round(density * d) entries of a
    bucket go to P owners chosen by a hash of the index (one all-to-all); each owner
    sums its shard; the shards' nonzeros come back to every worker (one all-gather, as
    (index, value) pairs, a bitmap and values, or dense: whichever is smallest for the
    bucket, chosen when the step is built). The mean is the sum of what every worker
    selected over P, exactly up to the order of float additions, unless an owner gets
    more pairs than its static slots (``state.deferred`` counts them; they stay in a
    residual and are sent later, never dropped). See ``topk.balanced``.

    Args:
      density: fraction of each bucket a worker selects, in (0, 1].
      axis_name: the data-parallel mesh axis.
      selector: how each worker selects its k (as ``topk_allgather``).
      bucket_bytes: fusion threshold (``None``: one bucket).
      capacity_factor: an owner's slots as a multiple of its mean share k/P, >= 1
        (``None``: the mean plus six standard deviations plus 8,
        ``topk.costs.owner_slots``).

    Returns:
      An ``Aggregator`` whose state is an ``ErrorFeedbackState`` with ``deferred``.

    Example:
        >>> agg = topk_balanced(0.01)
        >>> agg.init({"w": jnp.zeros(3)}).deferred.tolist()
        0

    References:
        Wang et al., "Zen: Near-Optimal Sparse Tensor Synchronization for Distributed
        DNN Training", OSDI 2025.
    """
    options = {"capacity_factor": capacity_factor}
    return of_exchange(exchanges.BALANCED, density, axis_name, selector, bucket_bytes, **options)


def oktopk(
    density: float,
    axis_name: str = "data",
    selector: str | Selector = "auto",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    capacity_factor: float | None = None,
) -> Aggregator:
    """Ok-Topk's sparse all-reduce: ``topk_balanced``'s split and reduce at hashed
    owners, then the global top-k of the owners' sums, exact (a radix search for the
    k-th largest magnitude, one small all-reduce of a histogram a digit), and an
    all-gather of only those k entries. The mean is the k entries of largest magnitude
    of the sum of the workers' selections, over P; each worker keeps in its residual
    what it selected of the rest (as in Ok-Topk: every residual stays its own worker's).

    How it differs: ``gtopk`` also sends a global k, but re-selects k at each of log2 P
    pairwise merges (an entry can be dropped by a merge that a full sum would keep),
    and puts what a merge drops back into one worker's residual; ``topk_a2a`` and
    ``topk_balanced`` send the whole sum of the selections (up to P k entries).

    Args: as ``topk_balanced`` (``capacity_factor`` also sizes the k/P global entries an
      owner returns).

    Returns:
      An ``Aggregator`` whose state is an ``ErrorFeedbackState`` with ``deferred``.

    Example:
        >>> agg = oktopk(0.01)
        >>> sorted(agg.init({"w": jnp.zeros(3)})._asdict())
        ['deferred', 'residual']

    References:
        Li and Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning",
        PPoPP 2022.
    """
    options = {"capacity_factor": capacity_factor}
    return of_exchange(exchanges.OKTOPK, density, axis_name, selector, bucket_bytes, **options)


def adaptive(
    density: float,
    axis_name: str = "data",
    link: costmodel.Link | None = None,
    selector: str | Selector = "auto",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
) -> Aggregator:
    """Per fused bucket, the cheapest exchange of ``topk.exchanges.menu()`` (dense,
    topk_allgather, topk_a2a, ...) under the alpha-beta model of ``link`` (chosen when
    the step is traced: bucket size, density and P are static). Beyond both papers:
    small or dense-ish buckets go dense, large sparse ones by whichever sparse exchange
    the model favours; a bucket too small to keep one entry at ``density`` goes dense.

    Args:
      density: fraction of each bucket the sparse choices send, in (0, 1].
      axis_name: the data-parallel mesh axis.
      link: the calibrated link (``costmodel.calibrate``); default 10 Gbit/s, 50 us.
      selector: top-k selection for the sparse choices.
      bucket_bytes: fusion threshold (``None``: one bucket).

    Returns:
      An ``Aggregator`` whose state is an ``ErrorFeedbackState``.
    """
    selector = _checked(density, selector)
    link = link or costmodel.Link.from_bandwidth(10.0)

    def exchange(parts):
        num, d = jax.lax.axis_size(axis_name), sum(p.shape[0] for p in parts)
        # a sparse exchange carries k = round(density d) >= 1 entries: smaller buckets go dense
        choices = exchanges.menu() if round(density * d) >= 1 else (exchanges.DENSE.name,)
        chosen = exchanges.get(exchanges.choose(d, density, num, link, choices))
        out = chosen.make(density, axis_name, selector)(parts)
        return out if chosen.defers else (*out, jnp.zeros((), jnp.int32))

    return error_feedback(exchange, axis_name, bucket_bytes, defers=True)


def _dense(density: float, axis_name: str = "data", **_: Any) -> Aggregator:
    return dense_allreduce(axis_name)


class AggregatorKind(NamedTuple):
    """An entry of ``AGGREGATORS``: how to build an aggregator by name, and its facts.
    Called like its constructor: ``AGGREGATORS["topk_a2a"](0.01, "data")``.

    Attributes:
      build: ``build(density, axis_name, **options) -> Aggregator``.
      sparse: it sends a top-k selection with error feedback: it reads ``density``,
        ``selector`` and ``bucket_bytes`` (the dense mean reads none of them).
      link: it prices its choices on a cost-model ``link`` (``adaptive``).
      workers: ``workers(P) -> problem or None``: what it needs of the device count
        (gTop-k's pairwise rounds: a power of two).
      flat: the plain mean: beside a table strategy the dense layers' mean travels as
        one flat buffer in the wire's dtype (``flat_allreduce``) instead.
      options: the keyword options of its own it takes (``capacity_factor``).
    """

    build: Callable[..., Aggregator]
    sparse: bool = True
    link: bool = False
    workers: Callable[[int], str | None] = lambda workers: None
    flat: bool = False
    options: tuple[str, ...] = ()

    def __call__(self, density: float, axis_name: str = "data", **options: Any) -> Aggregator:
        return self.build(density, axis_name, **options)


def kind_of(exchange: exchanges.Exchange) -> AggregatorKind:
    """The ``AGGREGATORS`` entry of a top-k exchange: ``of_exchange`` on it, with its
    facts (the devices it needs, its options)."""
    return AggregatorKind(
        functools.partial(of_exchange, exchange.name),
        workers=exchange.workers,
        options=exchange.options,
    )


class Aggregators(MutableMapping):
    """The aggregators by name (``AGGREGATORS``): the dense mean, one entry per top-k
    exchange of ``topk.exchanges.EXCHANGES`` (registering an exchange makes its
    aggregator, ``kind_of``), then ``adaptive`` and any entry set by hand
    (``AGGREGATORS[name] = AggregatorKind(...)``, which also replaces an exchange's)."""

    FIRST = "dense"  # the plain mean leads the names (``strategy_names()``)

    def __init__(self, own: dict[str, AggregatorKind]):
        self._own = dict(own)

    def __getitem__(self, name: str) -> AggregatorKind:
        if name in self._own:
            return self._own[name]
        if name in exchanges.EXCHANGES:
            return kind_of(exchanges.EXCHANGES[name])
        raise KeyError(name)

    def __setitem__(self, name: str, kind: AggregatorKind) -> None:
        self._own[name] = kind

    def __delitem__(self, name: str) -> None:
        del self._own[name]

    def __iter__(self):
        yield from (n for n in self._own if n == self.FIRST)
        yield from (n for n in exchanges.EXCHANGES if n not in self._own)
        yield from (n for n in self._own if n != self.FIRST)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"Aggregators({list(self)})"


#: The aggregators by name: the second half of a strategy name (``embrace+topk_a2a``).
AGGREGATORS = Aggregators(
    {
        "dense": AggregatorKind(_dense, sparse=False, flat=True),
        "adaptive": AggregatorKind(adaptive, link=True),
    }
)
