"""How a model reads its tables, and how a step finds out what it reads.

A model is a pure loss ``loss_fn(params, batch, emb)``: every table access goes through
``emb``, an ``EmbeddingOps`` (``lookup``, ``lookup_shared``, ``attend``), so a strategy can
serve rows from a sharded table without model code. ``PLAIN`` reads a whole table.

A step learns what the loss reads by running it with recording ops (``logged_reads``):
every access is logged as a ``Read`` (its kind, the table's leaf index, its ids), with
the loss computed on zero rows and discarded (XLA removes it). The step then fetches
those rows through the tables' layouts, and answers the loss's accesses with them.
``host_reads`` does the same on the host for a whole batch, split per worker: what the
capacity planning of the layouts reads.

Example:
    >>> import jax.numpy as jnp
    >>> from sparsecomm_jax.embedding import access
    >>> table = jnp.arange(6.0).reshape(3, 2)
    >>> access.PLAIN.lookup(table, jnp.array([2, 0])).tolist()
    [[4.0, 5.0], [0.0, 1.0]]
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jax_core

PyTree = Any
LOOKUP, SHARED, ATTEND = "lookup", "lookup_shared", "attend"


class EmbeddingOps(NamedTuple):
    """How a model touches its embedding tables; strategies swap the implementation.

    Attributes:
      lookup: ``lookup(table, ids) -> rows``: rows ``[*ids.shape, D]`` of ``table``
        for this worker's ``ids``.
      attend: ``attend(table, h) -> logits``: ``h @ table.T`` (tied output softmax).
      lookup_shared: like ``lookup`` for ids that every worker holds identically
        (shared negative samples); sharded strategies exchange them more cheaply.
    """

    lookup: Callable[[jax.Array, jax.Array], jax.Array]
    attend: Callable[[jax.Array, jax.Array], jax.Array]
    lookup_shared: Callable[[jax.Array, jax.Array], jax.Array]


def _take(table, ids):
    return jnp.take(table, ids, axis=0)


PLAIN = EmbeddingOps(lookup=_take, attend=lambda t, h: h @ t.T, lookup_shared=_take)


class Read(NamedTuple):
    """One table access of a loss.

    Attributes:
      kind: ``LOOKUP`` (this worker's ids), ``SHARED`` (ids every worker holds
        identically) or ``ATTEND`` (the whole table, ``h @ table.T``).
      table: the table's leaf index.
      ids: int[...] the ids read (``None`` for ``ATTEND``).
    """

    kind: str
    table: int
    ids: Any


def recording_ops(
    params, mask, log: list, supply, attend_error: str = "", attend: Callable | None = None
) -> EmbeddingOps:
    """``EmbeddingOps`` that log every table access as a ``Read`` and return
    ``supply(read, table)`` as the rows.

    ``attend`` computes ``attend(table, h)``, by default ``h @ table.T``. Tables are
    recognised by identity among the leaves of ``params`` flagged in ``mask``; a leaf
    that is not flagged (a table the step keeps data parallel) is read plainly, not
    logged. With ``attend_error``, ``attend`` raises ``ValueError(attend_error)``
    (strategies that cannot serve it).
    """
    attend_fn = attend or (lambda t, h: h @ t.T)
    leaves, flags = jax.tree.leaves(params), jax.tree.leaves(mask)
    index = {id(x): i for i, (x, f) in enumerate(zip(leaves, flags, strict=True)) if f}
    plain = {id(x) for x, f in zip(leaves, flags, strict=True) if not f}

    def which(table) -> int:
        if id(table) not in index:
            raise ValueError(
                "a lookup read an array that is not one of the embedding tables: pass the "
                "table parameter itself to emb.lookup / emb.attend"
            )
        return index[id(table)]

    def access(kind):
        def fn(table, ids):
            if id(table) in plain:
                return _take(table, ids)
            read = Read(kind, which(table), ids)
            log.append(read)
            return supply(read, table)

        return fn

    def attend_logged(table, h):
        if id(table) in plain:
            return h @ table.T
        if attend_error:
            raise ValueError(attend_error)
        log.append(Read(ATTEND, which(table), None))
        return attend_fn(table, h)

    return EmbeddingOps(lookup=access(LOOKUP), attend=attend_logged, lookup_shared=access(SHARED))


def logged_reads(
    loss_fn, params, batch, mask, widths: dict[int, int], attend_error="", attend=None
) -> list[Read]:
    """The table accesses ``loss_fn`` makes on ``batch``, with their (traced) ids.

    The loss itself is computed on zero rows and discarded (XLA removes it); only the
    ids remain. ``widths``: table index -> full row width D; ``attend``: as in
    ``recording_ops`` (sharded tables need theirs).
    """
    log: list[Read] = []

    def zeros(read, table):
        return jnp.zeros((*read.ids.shape, widths[read.table]), table.dtype)

    loss_fn(params, batch, recording_ops(params, mask, log, zeros, attend_error, attend))
    return log


_READS: collections.OrderedDict = collections.OrderedDict()  # the latest reads programs
_READS_LOCK = threading.Lock()  # batches are planned on a host thread beside the step


def traced_reads(
    loss_fn, params, batch, mask, widths: dict[int, int], vocabs: dict[int, int], attend_error=""
) -> list[Read]:
    """``logged_reads`` without running the model's Python again: the ids of every read
    computed by a program traced once per loss, parameter and batch shapes (a
    ``ClosedJaxpr`` of the loss on zero rows, of which XLA keeps only the ids), and
    evaluated on ``params`` and ``batch`` (arrays or tracers, inside ``shard_map`` or
    ``vmap`` alike).

    Args:
      loss_fn, params, batch, mask, widths: as ``logged_reads``.
      vocabs: table index -> its full V (a full softmax's logits are V wide).
      attend_error: as ``recording_ops`` (raised when the loss reads a table whole).
    """
    leaves, treedef = jax.tree.flatten((params, batch))
    shapes = tuple(jax.typeof(x) for x in leaves)  # shapes, dtypes, varying axes
    flags = tuple(bool(f) for f in jax.tree.leaves(mask))
    key = (loss_fn, treedef, shapes, flags, tuple(widths.items()), tuple(vocabs.items()))
    key += (attend_error,)
    with _READS_LOCK:
        if key not in _READS:
            _READS[key] = _reads_program(
                loss_fn, treedef, shapes, mask, widths, vocabs, attend_error
            )
            while len(_READS) > 64:
                _READS.popitem(last=False)
        _READS.move_to_end(key)
        kinds, program = _READS[key]
    ids = iter(program(*leaves))
    return [Read(kind, table, None if kind == ATTEND else next(ids)) for kind, table in kinds]


def _reads_program(loss_fn, treedef, shapes, mask, widths, vocabs, attend_error):
    """``(kinds, fn)``: each read's ``(kind, table)`` and ``fn(*leaves) -> ids`` (the
    evaluation of a jaxpr traced here once)."""
    kinds: list[tuple[str, int]] = []

    def ids_of(*leaves):
        params, batch = treedef.unflatten(leaves)
        p_leaves = jax.tree.leaves(params)
        table_of = {id(p_leaves[i]): i for i in widths}

        def attend(table, h):  # logits of the right width; the value is never used
            return jnp.zeros((*h.shape[:-1], vocabs[table_of[id(table)]]), h.dtype)

        reads = logged_reads(loss_fn, params, batch, mask, widths, attend_error, attend)
        kinds[:] = [(r.kind, r.table) for r in reads]
        return [r.ids for r in reads if r.kind != ATTEND]

    program = jax_core.jaxpr_as_fun(jax.make_jaxpr(ids_of)(*shapes))
    return tuple(kinds), program


def param_dependent_tables(loss_fn, params, batch, mask) -> frozenset[int]:
    """The tables some of whose read ids are computed from the parameters (a model that
    picks rows by a learned score): planning them on the host, where the model runs on
    zeros, cannot see those ids. Found once per model and shapes from the dependences
    of the traced reads program (which outputs need which parameter leaves).

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"embed": jnp.zeros((8, 2)), "score": jnp.zeros(8)}
        >>> def loss(p, b, ops):  # ids shifted by a learned argmax
        ...     return ops.lookup(p["embed"], b["x"] + jnp.argmax(p["score"])).sum()
        >>> mask = {"embed": True, "score": False}
        >>> param_dependent_tables(loss, params, {"x": jnp.zeros(4, int)}, mask)
        frozenset({0})
    """
    reads, num_params, _ = _read_dependences(*_signature(loss_fn, params, batch, mask))
    return frozenset(t for t, used, _ in reads if any(used[:num_params]))


def key_tables(loss_fn, params, batch, mask, direct: bool = False) -> dict[str, frozenset[int]]:
    """Batch key -> the tables whose read ids it feeds (the ids a key holds may be cut or
    reshaped on the way; keys that feed no table, labels say, are absent). Found once
    per model and shapes from the dependences of the traced reads program.

    With ``direct``, only the tables a key's values reach unchanged (reshaped, cut,
    joined, cast, broadcast): its values are those tables' ids. A key the model computes
    ids from (an offset added, a hash taken, a float bucketized) feeds them, but not
    directly: its own values need not lie in the table.

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"items": jnp.zeros((6, 2)), "users": jnp.zeros((9, 2))}
        >>> def loss(p, b, ops):
        ...     u, i = ops.lookup(p["users"], b["user"]), ops.lookup(p["items"], b["item"])
        ...     return ((u * i).sum(-1) - b["label"]).mean()
        >>> batch = {"user": jnp.zeros(4, int), "item": jnp.zeros(4, int), "label": jnp.zeros(4)}
        >>> key_tables(loss, params, batch, {"items": True, "users": True})
        {'item': frozenset({0}), 'user': frozenset({1})}
    """
    signature = _signature(loss_fn, params, batch, mask)
    reads, num_params, batch_keys = _read_dependences(*signature)
    found: dict[str, set[int]] = {}
    for table, used, unchanged in reads:
        for key, u in zip(batch_keys, (unchanged if direct else used)[num_params:], strict=True):
            if u:
                found.setdefault(key, set()).add(table)
    return {k: frozenset(v) for k, v in sorted(found.items())}


def whole_table_reads(loss_fn, params, batch, mask) -> frozenset[int]:
    """The tables flagged in ``mask`` that the loss reads whole (``emb.attend``: a tied
    or full softmax). Their whole-table all-gather and its gradient's reduce-scatter
    travel in float32 whatever the wire (the softmax is differentiated through the
    gather). Found by abstract evaluation: nothing is computed.

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"embed": jnp.zeros((8, 2))}
        >>> def loss(p, b, emb):
        ...     return emb.attend(p["embed"], emb.lookup(p["embed"], b["x"])).sum()
        >>> whole_table_reads(loss, params, {"x": jnp.zeros(4, int)}, {"embed": True})
        frozenset({0})
    """
    leaves, flags = jax.tree.leaves(params), jax.tree.leaves(mask)
    widths = {i: np.shape(x)[1] for i, (x, f) in enumerate(zip(leaves, flags, strict=True)) if f}
    found: set[int] = set()

    def reads(params, batch):
        logged = logged_reads(loss_fn, params, batch, mask, widths)
        found.update(r.table for r in logged if r.kind == ATTEND)
        return 0

    jax.eval_shape(reads, params, batch)
    return frozenset(found)


def read_outside(loss_fn, params, batch, mask) -> frozenset[int]:
    """The tables flagged in ``mask`` whose values the loss uses other than through
    ``emb`` (``table[ids]``, ``jnp.take``, a plain ``flax.nnx.Embed`` or ``linen.Embed``,
    a penalty on the whole table): a step that serves rows from sharded tables would
    hand such a read a worker's shard, not the table, and train on wrong numbers. Found
    once per model and shapes: the loss traced with every ``emb`` access answered by
    zeros, so a table's value reaches the loss only by such a read.

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"embed": jnp.zeros((8, 2)), "w": jnp.zeros(2)}
        >>> def loss(p, b, emb):  # the table indexed directly, not through emb
        ...     return (p["embed"][b["x"]] @ p["w"]).sum()
        >>> read_outside(loss, params, {"x": jnp.zeros(4, int)}, {"embed": True, "w": False})
        frozenset({0})
    """
    return _outside(*_signature(loss_fn, params, batch, mask))


@functools.lru_cache(maxsize=16)
def _outside(loss_fn, treedef, shapes, flags, num_params) -> frozenset[int]:
    shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    params_shapes = treedef.unflatten(shapes)[0]
    mask = jax.tree.structure(params_shapes).unflatten(flags)
    p_leaves = jax.tree.leaves(params_shapes)
    flagged = [i for i, f in enumerate(flags) if f]

    def loss_of(*leaves):
        params, batch = treedef.unflatten(leaves)
        mine = jax.tree.leaves(params)

        def zeros(read, table):  # of the table's width and dtype, not of its values
            return jnp.zeros((*read.ids.shape, table.shape[1]), table.dtype)

        def attend(table, h):
            vocab = next(p_leaves[i].shape[0] for i in flagged if mine[i] is table)
            return jnp.zeros((*h.shape[:-1], vocab), h.dtype)

        ops = recording_ops(params, mask, [], zeros, "", attend)
        return jax.tree.leaves(loss_fn(params, batch, ops))

    jaxpr = jax.make_jaxpr(loss_of)(*shapes).jaxpr
    _, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return frozenset(i for i in flagged if used[i])


def _signature(loss_fn, params, batch, mask) -> tuple:
    """The hashable description of a reads program: loss, tree, each leaf's ``(shape,
    dtype)`` as plain tuples (asked for every batch placed: cheap to build and hash),
    table flags."""
    leaves, treedef = jax.tree.flatten((params, batch))
    shapes = tuple((np.shape(x), x.dtype) for x in leaves)
    flags = tuple(bool(f) for f in jax.tree.leaves(mask))
    return loss_fn, treedef, shapes, flags, len(jax.tree.leaves(params))


@functools.lru_cache(maxsize=16)
def _read_dependences(loss_fn, treedef, shapes, flags, num_params):
    """``(reads, num_params, batch keys)``: per read of a table by ids (in call order)
    ``(table, used, unchanged)``, ``used`` a bool per input leaf (parameters, then the
    batch's) that its ids depend on, ``unchanged`` the same for the leaves whose values
    reach the ids unchanged (``_unchanged_sources``); the batch keys of the batch
    leaves, in order."""
    shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    params_shapes, batch_shapes = treedef.unflatten(shapes)
    mask = jax.tree.structure(params_shapes).unflatten(flags)
    p_leaves = jax.tree.leaves(params_shapes)
    widths = {i: s.shape[1] for i, (s, f) in enumerate(zip(p_leaves, flags, strict=True)) if f}
    vocabs = {i: s.shape[0] for i, (s, f) in enumerate(zip(p_leaves, flags, strict=True)) if f}
    tables: list[int] = []

    def ids_of(*leaves):
        params, batch = treedef.unflatten(leaves)
        table_of = {id(x): i for i, x in enumerate(jax.tree.leaves(params)) if i in widths}

        def attend(table, h):
            return jnp.zeros((*h.shape[:-1], vocabs[table_of[id(table)]]), h.dtype)

        reads = logged_reads(loss_fn, params, batch, mask, widths, "", attend)
        tables[:] = [r.table for r in reads if r.kind != ATTEND]
        return [r.ids for r in reads if r.kind != ATTEND]

    jaxpr = jax.make_jaxpr(ids_of)(*shapes).jaxpr
    sources = _unchanged_sources(jaxpr)
    reads = []
    for j, table in enumerate(tables):
        _, used = pe.dce_jaxpr(jaxpr, [k == j for k in range(len(tables))])
        unchanged = sources[j]
        reads.append((table, tuple(used), tuple(i in unchanged for i in range(len(used)))))
    paths = jax.tree_util.tree_leaves_with_path(batch_shapes)
    keys = tuple(str(getattr(path[0], "key", path[0])) for path, _ in paths)
    return tuple(reads), num_params, keys


# Primitives that move values without changing them: what comes out is some of what went
# in, rearranged (the operands that carry values; the rest are indices or shapes).
_MOVES = {
    "reshape": 1,
    "squeeze": 1,
    "expand_dims": 1,
    "broadcast_in_dim": 1,
    "transpose": 1,
    "rev": 1,
    "slice": 1,
    "dynamic_slice": 1,
    "convert_element_type": 1,
    "copy": 1,
    "copy_p": 1,
    "concatenate": None,  # every operand
}
_CALLS = ("pjit", "closed_call", "core_call")


def _unchanged_sources(jaxpr) -> list[frozenset[int]]:
    """Per output of ``jaxpr``, the inputs whose values reach it unchanged: through
    ``_MOVES`` alone (and calls of inner jaxprs made of them). An output computed from an
    input (``x + 1``, ``x % V``) does not count it."""
    held: dict = {v: frozenset({i}) for i, v in enumerate(jaxpr.invars)}

    def of(v) -> frozenset[int]:
        return frozenset() if isinstance(v, jax_core.Literal) else held.get(v, frozenset())

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CALLS and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's jaxpr
            outs = [
                frozenset().union(*(of(eqn.invars[i]) for i in s))
                for s in _unchanged_sources(inner)
            ]
        elif name in _MOVES:
            count = _MOVES[name] or len(eqn.invars)
            outs = [frozenset().union(*(of(v) for v in eqn.invars[:count]))] * len(eqn.outvars)
        else:
            outs = [frozenset()] * len(eqn.outvars)
        held.update(zip(eqn.outvars, outs, strict=True))
    return [of(v) for v in jaxpr.outvars]


def answered_loss(loss_fn, mask, attend: Callable | None = None, attend_error: str = ""):
    """``loss(params, batch, rows)``: ``loss_fn`` with its lookups answered, in call
    order, by ``rows`` (rows fetched before, so the loss is differentiated with respect
    to them, not to the tables)."""

    def loss(params, batch, rows):
        pending = iter(rows)
        ops = recording_ops(params, mask, [], lambda *_: next(pending), attend_error, attend)
        return loss_fn(params, batch, ops)

    return loss


# ------------------------------------------------------------------- host side


HostReads = dict[int, tuple[np.ndarray, np.ndarray]]  # table -> (int[P, n], int[m])


def host_reads(
    loss_fn, params, mask, replicated_keys: Sequence[str], workers: int
) -> Callable[[dict], HostReads]:
    """A host function ``batch -> {table index: (lookup ids int[P, n], shared ids
    int[m])}``: every read of every table by each worker's slice of ``batch`` (a tied
    table read by inputs, targets and negatives counts each read), from one jitted
    program where the model runs on zeros (XLA keeps only the ids). Cached per model,
    parameter shapes and workers.

    Example: a tied LM with tokens int[B, T+1] reads ``embed`` 2 * B/P * T times per
    worker by lookup, plus the negatives once (shared).
    """
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    leaves, treedef = jax.tree.flatten(shapes)
    flags = tuple(bool(f) for f in jax.tree.leaves(mask))
    return _host_reads(loss_fn, treedef, tuple(leaves), flags, tuple(replicated_keys), workers)


@functools.lru_cache(maxsize=16)
def _host_reads(loss_fn, treedef, leaves, flags, replicated_keys, workers):
    shapes = treedef.unflatten(leaves)
    mask = treedef.unflatten(flags)
    widths = {i: s.shape[1] for i, (s, f) in enumerate(zip(leaves, flags, strict=True)) if f}
    vocabs = {i: s.shape[0] for i, (s, f) in enumerate(zip(leaves, flags, strict=True)) if f}

    def one_worker(batch):
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        found: dict[int, tuple[list, list]] = {}
        for read in traced_reads(loss_fn, zeros, batch, mask, widths, vocabs):
            if read.kind != ATTEND:
                found.setdefault(read.table, ([], []))[read.kind == SHARED].append(
                    read.ids.reshape(-1)
                )
        return {i: tuple(_cat(x) for x in pair) for i, pair in found.items()}

    @jax.jit
    def reads(batch):
        axes = {k: None if k in replicated_keys else 0 for k in batch}
        split = {
            k: v if k in replicated_keys else v.reshape(workers, len(v) // workers, *v.shape[1:])
            for k, v in batch.items()
        }
        out = jax.vmap(one_worker, in_axes=(axes,))(split)
        return {i: (look, shared[0]) for i, (look, shared) in out.items()}

    def on_host(batch):
        data = jax.device_put(
            {k: np.asarray(v) for k, v in batch.items()}, jax.local_devices(backend="cpu")[0]
        )
        return jax.tree.map(np.asarray, reads(data))

    return on_host


def _cat(parts: list):
    return jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.int32)


def every_id(reads: HostReads) -> dict[int, np.ndarray]:
    """Table index -> every id a batch reads (all workers, shared ids too)."""
    return {
        i: np.concatenate([look.ravel(), shared.ravel()]) for i, (look, shared) in reads.items()
    }
