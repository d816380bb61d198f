"""Train-step builders: one ``make_train_step`` for every communication strategy.

A *model* here is a pure loss ``loss_fn(params, batch, emb) -> scalar``: the mean loss
over the examples of ``batch``, where ``emb`` (an ``EmbeddingOps``) does every
embedding-table access, so strategies can swap a replicated table for a sharded one
without model-specific code. A *batch* is a flat dict of arrays whose leading axis is
the global batch, except the keys in ``replicated_keys`` that every worker sees whole.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from sparsecomm_jax import runtime, train
    >>> mesh = runtime.data_mesh()
    >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> ts = train.make_train_step(loss, optax.sgd(0.1), mesh, {"w": jnp.zeros((3, 1))})
    >>> n = len(jax.devices())
    >>> batch = ts.place_batch({"x": jnp.ones((n, 3)), "y": jnp.ones((n, 1))})
    >>> state, loss_value = ts.step(ts.state, batch)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import embedding, runtime
from sparsecomm_jax.aggregators import AGGREGATORS, Aggregator
from sparsecomm_jax.embedding import DENSE_EMBEDDING, EmbeddingOps

PyTree = Any
Batch = dict[str, Any]


LossFn = Callable[[PyTree, Batch, EmbeddingOps], jax.Array]


class TrainState(NamedTuple):
    """Everything a step reads and writes (a plain pytree: jit, shard, checkpoint).

    Attributes:
      params: model parameters (sharded tables hold only this worker's shard).
      opt_state: the optax optimizer state.
      agg_state: the gradient aggregator's state (error-feedback residuals), or ``()``.
      carry: what a pipelined step hands to the next (``embrace_2d``: the embedding rows
        of the next batch), ``()`` otherwise and before the first step.
    """

    params: PyTree
    opt_state: PyTree
    agg_state: PyTree
    carry: PyTree = ()  # pipelined strategies: rows of the next batch, fetched early


class TrainStep(NamedTuple):
    """A built strategy.

    Attributes:
      step: ``step(state, placed_batch) -> (state, loss)``, a ``jax.jit`` or ``jax.pmap``
        function (so ``step.lower(...)`` gives its program); ``loss`` is the mean loss
        over the global batch (one copy per device under ``pmap``: see ``loss_value``).
      state: the initial ``TrainState``, placed on the devices.
      place_batch: host batch (global, identical on every process) -> device batch;
        validates it first.
      host_params: ``state -> params`` as ordinary numpy arrays (sharded tables
        gathered back to V x D).
      strategy: the strategy's name.
      lookahead: 1 when ``place_batch(batch, next_batch)`` wants the next step's batch
        too (``embrace_2d``; ``None`` at the last step), else 0.
    """

    step: Callable[[TrainState, Any], tuple[TrainState, jax.Array]]
    state: TrainState
    place_batch: Callable[..., Any]
    host_params: Callable[[TrainState], PyTree]
    strategy: str
    lookahead: int = 0


class Setup(NamedTuple):
    """What every strategy builder receives (validated by ``make_train_step``)."""

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    mesh: Mesh
    params: PyTree
    axis_name: str
    replicated_keys: tuple[str, ...]
    table_mask: PyTree  # bool per parameter leaf: is it an embedding table?
    vocabs: tuple[int, ...]  # distinct table vocabularies V (empty without tables)
    id_keys: tuple[str, ...] | None  # batch keys holding token ids (None: integer keys)
    capacity: int | None  # row-wise slots per bucket (None: sized per batch)
    aggregator: Aggregator  # reduces the data-parallel gradients (dense: pmean)
    nonfinite: str  # "skip" (keep the state, NaN loss), "error" (the same; callers stop), "off"

    @property
    def num_workers(self) -> int:
        return runtime.mesh_axis_size(self.mesh, self.axis_name)


# ------------------------------------------------------------------ batch checks


def check_batch(batch: Batch, num_workers: int, replicated_keys: Sequence[str]) -> None:
    """Raises ``ValueError`` unless every sharded leaf's leading axis divides by P."""
    if not isinstance(batch, dict):
        raise ValueError(f"batch must be a dict of arrays, got {type(batch).__name__}")
    for key, x in batch.items():
        if key in replicated_keys:
            continue
        n = np.shape(x)[0] if np.ndim(x) else None
        if n is None or n % num_workers:
            raise ValueError(
                f"batch[{key!r}] has leading size {n}, which must be divisible by the "
                f"number of devices ({num_workers})"
            )


def id_leaves(batch: Batch, id_keys: Sequence[str] | None) -> dict[str, np.ndarray]:
    """The batch entries that hold token ids (all integer entries when not named)."""
    keys = [k for k in id_keys if k in batch] if id_keys is not None else batch
    return {
        k: np.asarray(batch[k])
        for k in keys
        if np.issubdtype(np.asarray(batch[k]).dtype, np.integer)
    }


def check_ids(batch: Batch, vocab: int, id_keys: Sequence[str] | None) -> None:
    """``ValueError`` for any token id outside [0, vocab): never a silent clamp."""
    for key, ids in id_leaves(batch, id_keys).items():
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(
                f"batch[{key!r}] has token ids in [{ids.min()}, {ids.max()}], outside the "
                f"vocabulary [0, {vocab})"
            )


def _batch_specs(batch: Batch, axis_name: str, replicated_keys: Sequence[str]) -> dict:
    return {k: P() if k in replicated_keys else P(axis_name) for k in batch}


# ----------------------------------------------------------------- tree helpers


def table_mask(params: PyTree, tables) -> PyTree:
    """Bool per leaf of ``params``: is it an embedding table?

    Args:
      params: the parameter pytree.
      tables: parameter paths (tuples of dict keys, e.g. ``("embed",)``) or a predicate
        ``tables(path, leaf) -> bool``.
    """
    paths = None if callable(tables) else {tuple(p) for p in tables}

    def is_table(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        return tables(keys, leaf) if paths is None else keys in paths

    mask = jax.tree_util.tree_map_with_path(is_table, params)
    if paths is not None:
        found = {
            tuple(getattr(k, "key", k) for k in path)
            for path, m in jax.tree_util.tree_leaves_with_path(mask)
            if m
        }
        if missing := paths - found:
            raise ValueError(f"embedding paths {sorted(missing)} are not in the parameters")
    return mask


def split_tables(tree: PyTree, mask: PyTree) -> tuple[PyTree, PyTree]:
    """``(tables, rest)``: two copies of ``tree`` with ``None`` where the other lives."""
    tables = jax.tree.map(lambda x, m: x if m else None, tree, mask)
    rest = jax.tree.map(lambda x, m: None if m else x, tree, mask)
    return tables, rest


def merge_tables(tables: PyTree, rest: PyTree, mask: PyTree) -> PyTree:
    """Inverse of ``split_tables``."""
    return jax.tree.map(
        lambda m, t, r: t if m else r, mask, tables, rest, is_leaf=lambda x: x is None
    )


# ------------------------------------------------------------------- the steps


def apply_optimizer(optimizer: optax.GradientTransformation, grads, opt_state, params):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _all_finite(setup: Setup, tree) -> jax.Array:
    """True on every worker when no worker has a NaN or Inf in ``tree``."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    local = jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
    return jax.lax.pmin(local.astype(jnp.int32), setup.axis_name) == 1


def finish_step(setup: Setup, state: TrainState, grads, loss, agg_state=None, carry=()):
    """Optimizer step; with ``nonfinite`` on, a step whose mean gradient or new residuals
    hold NaN/Inf on any worker leaves the state as it was and reports a NaN loss."""
    params, opt_state = apply_optimizer(setup.optimizer, grads, state.opt_state, state.params)
    agg_state = state.agg_state if agg_state is None else agg_state
    new = TrainState(params, opt_state, agg_state, carry)
    loss = jax.lax.pmean(loss, setup.axis_name)
    if setup.nonfinite == "off":
        return new, loss
    ok = _all_finite(setup, (grads, agg_state))
    keep = TrainState(state.params, state.opt_state, state.agg_state, carry)
    new = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, keep)
    return new, jnp.where(ok, loss, jnp.nan)


def aggregate(setup: Setup, grads, agg_state):
    """``setup.aggregator`` on local gradients; its state is stored per worker with a
    leading axis of 1 inside ``shard_map`` (global: one slice per worker)."""
    local = jax.tree.map(lambda x: x[0], agg_state)
    mean, local = setup.aggregator.update(grads, local)
    return mean, jax.tree.map(lambda x: x[None], local)


def dense_body(setup: Setup) -> Callable:
    """Data-parallel step: local gradients, all of them through the aggregator
    (``pmean`` for ``dense``, top-k with error feedback for the sparse ones)."""

    def body(state: TrainState, batch: Batch):
        loss, grads = jax.value_and_grad(setup.loss_fn)(state.params, batch, DENSE_EMBEDDING)
        mean, agg_state = aggregate(setup, grads, state.agg_state)
        return finish_step(setup, state, mean, loss, agg_state)

    return body


def sharded_table_body(setup: Setup, make_ops: Callable[[Batch], EmbeddingOps]) -> Callable:
    """EmbRace step: tables sharded (their lookups exchange rows by all-to-all), dense
    layers data-parallel through the aggregator (``pmean``, or top-k).

    Autodiff through the lookup's collectives already brings each owner the *sum* over
    workers of its shard's gradient; dividing by P gives the mean, as ``pmean`` does for
    the dense layers. (Never ``psum`` the loss before ``grad``: that multiplies by P.)
    """

    def body(state: TrainState, batch):
        emb, data = make_ops(batch), getattr(batch, "data", batch)
        loss, grads = jax.value_and_grad(setup.loss_fn)(state.params, data, emb)
        tables, rest = split_tables(grads, setup.table_mask)
        tables = jax.tree.map(lambda g: g / setup.num_workers, tables)
        rest, agg_state = aggregate(setup, rest, state.agg_state)
        grads = merge_tables(tables, rest, setup.table_mask)
        return finish_step(setup, state, grads, loss, agg_state)

    return body


def sparse_allgather_body(setup: Setup) -> Callable:
    """Replicated tables, sparse gradients: all-gather (id, row) pairs, scatter-add."""

    def body(state: TrainState, batch: Batch):
        loss, grads = embedding.sparse_table_grads(
            setup.loss_fn, state.params, batch, setup.table_mask, setup.axis_name
        )
        return finish_step(setup, state, grads, loss)

    return body


# ---------------------------------------------------------------- the builders


def _param_specs(setup: Setup, layout: str | None) -> PyTree:
    spec = embedding.table_spec(layout, setup.axis_name) if layout else P()
    return jax.tree.map(lambda m: spec if m else P(), setup.table_mask)


def _opt_specs(setup: Setup, opt_state, param_specs) -> PyTree:
    return optax.tree_map_params(
        setup.optimizer,
        lambda _, spec: spec,
        opt_state,
        param_specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )


def _place_state(setup: Setup, layout: str | None):
    """Initial state on the devices, and its ``PartitionSpec`` tree."""
    specs = _param_specs(setup, layout)
    host = jax.tree.map(np.asarray, setup.params)
    if layout:
        for name, table in _tables(host, setup.table_mask):
            embedding.check_divisible(table.shape, layout, setup.num_workers, name)
    opt_state = jax.tree.map(np.asarray, setup.optimizer.init(host))
    agg_state = _initial_agg_state(setup, host, layout)
    state = TrainState(host, opt_state, agg_state)
    agg_specs = jax.tree.map(lambda _: P(setup.axis_name), agg_state)
    state_specs = TrainState(specs, _opt_specs(setup, opt_state, specs), agg_specs)
    placed = jax.tree.map(
        lambda x, s: runtime.put_global(x, setup.mesh, s),
        state,
        state_specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    return placed, state_specs


def _initial_agg_state(setup: Setup, host_params, layout: str | None):
    """Zeros of the aggregator's state, one slice per worker: global [P, *shape]."""
    reduced = split_tables(host_params, setup.table_mask)[1] if layout else host_params
    shapes = jax.eval_shape(setup.aggregator.init, reduced)
    return jax.tree.map(lambda s: np.zeros((setup.num_workers, *s.shape), s.dtype), shapes)


def _check_host_batch(setup: Setup, batch: Batch) -> None:
    check_batch(batch, setup.num_workers, setup.replicated_keys)
    if setup.vocabs:
        check_ids(batch, min(setup.vocabs), setup.id_keys)


def _put_batch(setup: Setup, batch: Batch) -> dict:
    _check_host_batch(setup, batch)
    specs = _batch_specs(batch, setup.axis_name, setup.replicated_keys)
    return {k: runtime.put_global(np.asarray(v), setup.mesh, specs[k]) for k, v in batch.items()}


def _place_fn(setup: Setup, capacity_fn=None, lookahead: int = 0) -> Callable[..., Any]:
    def place(batch: Batch, next_batch: Batch | None = None):
        data = _put_batch(setup, batch)
        if lookahead:
            if next_batch is None:
                return CapacityBatch(data, 0, None)
            return CapacityBatch(
                data, capacity_fn(batch, next_batch), _put_batch(setup, next_batch)
            )
        return CapacityBatch(data, capacity_fn(batch)) if capacity_fn else data

    return place


def _batch_in_specs(batch, axis_name, replicated_keys):
    if isinstance(batch, CapacityBatch):
        nxt = None if batch.next is None else _batch_specs(batch.next, axis_name, replicated_keys)
        data = _batch_specs(batch.data, axis_name, replicated_keys)
        return CapacityBatch(data, batch.capacity, nxt)
    return _batch_specs(batch, axis_name, replicated_keys)


def build_sharded(
    setup: Setup, name: str, body, layout=None, capacity_fn=None, lookahead: int = 0
) -> TrainStep:
    """A ``jax.jit(jax.shard_map(body))`` strategy (every strategy except ``dense_pmap``)."""
    state, state_specs = _place_state(setup, layout)
    state_specs = state_specs._replace(carry=P(setup.axis_name))  # per-worker rows

    def step(state, batch):
        batch_specs = _batch_in_specs(batch, setup.axis_name, setup.replicated_keys)
        fn = jax.shard_map(
            body,
            mesh=setup.mesh,
            in_specs=(state_specs, batch_specs),
            out_specs=(state_specs, P()),
            check_vma=False,
        )
        return fn(state, batch)

    return TrainStep(
        step=jax.jit(step, donate_argnums=0),
        state=state,
        place_batch=_place_fn(setup, capacity_fn, lookahead),
        host_params=lambda s: jax.tree.map(runtime.to_host, s.params),
        strategy=name,
        lookahead=lookahead,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CapacityBatch:
    """A placed batch with a capacity (static: one program per value) and, for
    pipelined strategies, the next step's batch (``None`` at the last step)."""

    data: dict = dataclasses.field(metadata=dict(static=False))
    capacity: int = dataclasses.field(metadata=dict(static=True))
    next: dict | None = dataclasses.field(default=None, metadata=dict(static=False))


def _rowwise_need(setup: Setup, batch: Batch) -> int:
    workers = worker_ids(batch, setup)
    return max(embedding.rowwise_capacity(workers, v, setup.num_workers) for v in setup.vocabs)


def _capacity_fn(
    setup: Setup, need_fn=_rowwise_need, what="distinct rows from one owner", grow=None
):
    """Capacity per batch: fixed (error when too small) or grown when a batch needs more
    (never shrinks, so a run compiles a handful of programs at most). ``grow(need)``
    gives the new capacity: the next power of two by default."""
    grow = grow or (lambda need: 1 << max(3, (need - 1).bit_length()))
    current = [0]

    def capacity(*batches) -> int:
        need = need_fn(setup, *batches)
        if setup.capacity is not None:
            if need > setup.capacity:
                raise ValueError(
                    f"capacity={setup.capacity} is too small: this batch needs {need} "
                    f"{what}; pass a larger capacity or None (auto)"
                )
            return setup.capacity
        if need > current[0] or not current[0]:
            current[0] = max(current[0], grow(need))
        return current[0]

    return capacity


def _grow_by_quarter(need: int) -> int:
    """25% headroom, in multiples of 8: the first chunk stays close to what it carries."""
    return max(8, -(-int(need * 1.25) // 8) * 8)


def _tables(params: PyTree, mask: PyTree) -> list[tuple[str, Any]]:
    """``(name, leaf)`` of every table, ``name`` like ``"embed"`` or ``"dec/embed"``."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return [
        ("/".join(str(getattr(k, "key", k)) for k in path), leaf)
        for (path, leaf), m in zip(leaves, jax.tree.leaves(mask), strict=True)
        if m
    ]


def worker_ids(batch: Batch, setup: Setup) -> list[np.ndarray]:
    """The ids each worker's slice of ``batch`` holds (replicated ids go to all)."""
    per_worker: list[list[np.ndarray]] = [[] for _ in range(setup.num_workers)]
    for key, ids in id_leaves(batch, setup.id_keys).items():
        parts = (
            [ids] * setup.num_workers
            if key in setup.replicated_keys
            else np.split(ids, setup.num_workers)
        )
        for acc, part in zip(per_worker, parts, strict=True):
            acc.append(part.ravel())
    return [np.concatenate(p) if p else np.zeros(0, np.int32) for p in per_worker]


def _make_dense_pmap(setup: Setup) -> TrainStep:
    """``dense_pmap``: the classic ``jax.pmap`` + ``lax.pmean`` baseline."""
    devices = list(setup.mesh.devices.flat)
    local = [d for d in devices if d.process_index == jax.process_index()]
    num, first = len(devices), devices.index(local[0])

    def place(batch: Batch) -> Batch:
        _check_host_batch(setup, batch)
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            if k in setup.replicated_keys:
                out[k] = np.broadcast_to(v, (len(local), *v.shape))
            else:
                out[k] = v.reshape(num, -1, *v.shape[1:])[first : first + len(local)]
        return out

    state = TrainState(setup.params, setup.optimizer.init(setup.params), ())
    state = jax.tree.map(
        lambda x: np.broadcast_to(np.asarray(x), (len(local), *np.shape(x))), state
    )
    body = dense_body(setup)
    return TrainStep(
        step=jax.pmap(body, axis_name=setup.axis_name, devices=devices, donate_argnums=0),
        state=state,
        place_batch=place,
        host_params=lambda s: jax.tree.map(first_replica, s.params),
        strategy="dense_pmap",
    )


def place_for_step(ts: TrainStep, batch_at: Callable[[int], Batch], step: int, steps: int):
    """The placed batch of ``step`` of a ``steps``-step run, with the next step's batch
    for pipelined strategies (``ts.lookahead``; none at the last step)."""
    if ts.lookahead and step + 1 < steps:
        return ts.place_batch(batch_at(step), batch_at(step + 1))
    return ts.place_batch(batch_at(step))


def first_replica(x) -> np.ndarray:
    """One replica of a ``pmap``-stacked array (numpy or device), as numpy."""
    if isinstance(x, np.ndarray):
        return x[0]
    return np.asarray(x.addressable_data(0)).reshape(x.shape[1:])


def loss_value(loss: jax.Array) -> float:
    """The step's loss as a float (``pmap`` returns one copy per local device)."""
    return float(np.asarray(loss.addressable_data(0)).reshape(-1)[0])


def _make_embrace_2d(setup: Setup) -> TrainStep:
    """``embrace_2d``: the pipelined step of ``pipeline`` (which builds on this module)."""
    from sparsecomm_jax import pipeline

    capacity = _capacity_fn(
        setup, pipeline.priority_need, "high-priority positions", _grow_by_quarter
    )
    return build_sharded(
        setup,
        "embrace_2d",
        pipeline.embrace_2d_body(setup),
        layout="column",
        capacity_fn=capacity,
        lookahead=1,
    )


def _needs_tables(name: str, build: Callable[[Setup], TrainStep]) -> Callable:
    def checked(setup: Setup) -> TrainStep:
        if not setup.vocabs:
            raise ValueError(
                f"strategy {name!r} needs embedding tables: pass embedding_paths "
                "(parameter paths or a predicate) that name at least one V x D table"
            )
        return build(setup)

    return checked


STRATEGIES: dict[str, Callable[[Setup], TrainStep]] = {
    "dense_pmap": _make_dense_pmap,
    "dense": lambda s: build_sharded(s, "dense", dense_body(s)),
    "sparse_allgather": _needs_tables(
        "sparse_allgather",
        lambda s: build_sharded(s, "sparse_allgather", sparse_allgather_body(s)),
    ),
    "embrace": _needs_tables(
        "embrace",
        lambda s: build_sharded(
            s,
            "embrace",
            sharded_table_body(s, lambda b: embedding.column_ops(s.axis_name)),
            layout="column",
        ),
    ),
    "embrace_rowwise": _needs_tables(
        "embrace_rowwise",
        lambda s: build_sharded(
            s,
            "embrace_rowwise",
            sharded_table_body(s, lambda b: embedding.row_ops(s.axis_name, b.capacity)),
            layout="row",
            capacity_fn=_capacity_fn(s),
        ),
    ),
    "embrace_2d": _needs_tables("embrace_2d", lambda s: _make_embrace_2d(s)),
}


NONFINITE = ("skip", "error", "off")


def check_arguments(loss_fn, optimizer, mesh, params) -> None:
    """``ValueError`` for arguments of the wrong kind, before anything is traced."""
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ValueError("optimizer must be an optax GradientTransformation (init, update)")
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ValueError("params has no arrays")
    for path, x in leaves:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} must be a floating-point array, "
                f"got {type(x).__name__} of dtype {dtype}"
            )


def parse_strategy(strategy: str) -> tuple[str, str]:
    """``"embrace+topk_a2a"`` -> ``("embrace", "topk_a2a")``; ``"topk_a2a"`` ->
    ``("dense", "topk_a2a")``; ``"embrace"`` -> ``("embrace", "dense")``.

    The first part says how embedding tables travel, the second how the data-parallel
    gradients are reduced.
    """
    base, _, agg = strategy.partition("+")
    if not agg and base in AGGREGATORS and base not in STRATEGIES:
        base, agg = "dense", base
    agg = agg or "dense"
    if base not in STRATEGIES or agg not in AGGREGATORS:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {strategy_names()}")
    if agg != "dense" and base in ("dense_pmap", "sparse_allgather"):
        raise ValueError(f"strategy {base!r} cannot be combined with an aggregator ({agg!r})")
    return base, agg


def strategy_names() -> list[str]:
    """Every accepted ``strategy`` name."""
    sparse = [a for a in AGGREGATORS if a != "dense"]
    tables = ("embrace", "embrace_rowwise", "embrace_2d")
    return [*STRATEGIES, *sparse, *(f"{t}+{a}" for t in tables for a in sparse)]


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    params: PyTree,
    strategy: str = "dense",
    *,
    axis_name: str = "data",
    replicated_keys: Sequence[str] = (),
    embedding_paths: Sequence[Sequence[str]] | Callable[..., bool] = (),
    id_keys: Sequence[str] | None = None,
    capacity: int | None = None,
    density: float = 1.0,
    nonfinite: str = "skip",
    **aggregator_options: Any,
) -> TrainStep:
    """Builds the train step of ``strategy`` and its initial state.

    Strategies (``strategy_names()``): ``dense_pmap`` (``pmap`` + ``pmean``), ``dense``
    (the same with ``shard_map``), ``sparse_allgather`` (replicated tables, all-gather
    of sparse rows), ``embrace`` (column-sharded tables, all-to-all), ``embrace_rowwise``
    (row-sharded tables, de-duplicated all-to-all); ``topk_allgather``, ``topk_a2a``,
    ``gtopk`` (top-k with error feedback for all gradients); and ``embrace+topk_a2a``
    etc. (sharded tables, top-k for the dense layers).

    Args:
      loss_fn: ``loss_fn(params, batch, emb) -> scalar``, mean over the batch's examples.
      optimizer: any optax optimizer; applied to the mean gradient (to each shard by
        its owner under sharded strategies, which is exactly equivalent).
      mesh: a mesh with axis ``axis_name`` (see ``runtime.data_mesh``).
      params: initial parameters (host or device arrays, unsharded).
      strategy: one of ``strategy_names()``.
      axis_name: the data-parallel mesh axis.
      replicated_keys: batch keys every worker sees whole (e.g. shared negatives).
      embedding_paths: which parameters are V x D embedding tables: paths like
        ``[("embed",)]`` or a predicate ``(path, leaf) -> bool``.
      id_keys: batch keys holding token ids (checked to lie in [0, V)); default: every
        integer entry of the batch when there are tables.
      capacity: ``embrace_rowwise`` slots per (worker, owner) bucket; ``None`` sizes it
        per batch (powers of two, a new program when it grows); a fixed value too small
        for a batch raises ``ValueError`` before anything runs.
      density: fraction of each fused bucket that top-k aggregators send, in (0, 1].
      nonfinite: what a step does when a gradient or residual holds NaN/Inf on any
        worker: ``"skip"`` and ``"error"`` keep the previous state (parameters, optimizer
        state, residuals untouched) and report a NaN loss, so the caller counts the
        step or stops naming it (``experiments.train`` does); ``"off"`` checks nothing.
      **aggregator_options: passed to the aggregator (``selector``, ``bucket_bytes``).

    Returns:
      A ``TrainStep``: ``state, loss = ts.step(state, ts.place_batch(batch))``.

    Raises:
      ValueError: unknown strategy, axis not in the mesh, embedding strategy without
        tables, table not divisible by P, bad capacity or density.
    """
    base, agg_name = parse_strategy(strategy)
    check_arguments(loss_fn, optimizer, mesh, params)
    num = runtime.mesh_axis_size(mesh, axis_name)
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
    if agg_name == "gtopk" and num & (num - 1):
        raise ValueError(f"gtopk needs a power-of-two number of devices, got {num}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    aggregator = AGGREGATORS[agg_name](density, axis_name, **aggregator_options)
    mask = table_mask(params, embedding_paths)
    vocabs = tuple(sorted({int(np.shape(t)[0]) for _, t in _tables(params, mask)}))
    setup = Setup(
        loss_fn, optimizer, mesh, params, axis_name, tuple(replicated_keys), mask, vocabs,
        None if id_keys is None else tuple(id_keys), capacity, aggregator, nonfinite,
    )  # fmt: skip
    built = STRATEGIES[base](setup)
    return built._replace(strategy=strategy)
