"""Train steps by name: the strategy registry and ``make_train_step``.

A strategy name has two parts, ``TABLES+AGGREGATOR``: how embedding tables travel (a
``Strategy`` record of ``STRATEGIES``: ``dense``, ``embrace``, ...) and how the
data-parallel gradients are reduced (an aggregator of ``aggregators.AGGREGATORS``:
``dense`` = ``pmean``, ``topk_a2a``, ...). ``"embrace"`` means ``embrace+dense`` and
``"topk_a2a"`` means ``dense+topk_a2a``.

Adding a table strategy is one ``Strategy`` entry in ``STRATEGIES`` plus its body (see
``bodies``) and a test; names, validation and the command line's choices follow.

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

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import bodies, embedding, pipeline, placement, rowgrad, rowwise, runtime
from sparsecomm_jax.aggregators import AGGREGATORS
from sparsecomm_jax.placement import (
    CapacityPolicy,
    first_replica,
    loss_value,
    next_power_of_two,
    worker_ids,
)
from sparsecomm_jax.step import (
    Batch,
    LossFn,
    PyTree,
    StepContext,
    TablePaths,
    TrainState,
    TrainStep,
    named_tables,
    table_mask,
)

__all__ = [
    "STRATEGIES",
    "Strategy",
    "TrainState",
    "TrainStep",
    "first_replica",
    "loss_value",
    "make_train_step",
    "parse_strategy",
    "place_for_step",
    "strategy_names",
]


class Strategy(NamedTuple):
    """How one table strategy builds its step.

    Attributes:
      name: the registry key.
      body: ``body(ctx) -> step body`` (see ``bodies``).
      layout: how tables are sharded: ``"column"``, ``"row"``, or ``None`` (replicated).
      capacity: the host-side sizing of static buffers per batch, or ``None``.
      lookahead: how many of the next steps' batches a step reads (pipelined), else 0.
      needs_tables: the strategy needs at least one embedding table.
      combines: it takes a sparse aggregator for the dense layers (``embrace+topk_a2a``).
      engine: ``"shard_map"`` (``jax.jit`` of ``jax.shard_map``) or ``"pmap"``.
      row_updates: it can update tables row-sparsely (``table_optimizer``).
    """

    name: str
    body: Callable[[StepContext], bodies.Body]
    layout: str | None = None
    capacity: CapacityPolicy | None = None
    lookahead: int = 0
    needs_tables: bool = False
    combines: bool = True
    engine: str = "shard_map"
    row_updates: bool = False


def _rowwise_need(ctx: StepContext, batch: Batch) -> int:
    workers = worker_ids(ctx, batch)
    return max(embedding.rowwise_capacity(workers, v, ctx.num_workers) for v in ctx.vocabs)


ROWWISE_CAPACITY = CapacityPolicy(_rowwise_need, "distinct rows from one owner", next_power_of_two)


def _embrace(ctx: StepContext) -> bodies.Body:
    if ctx.table_optimizer is not None:
        return bodies.row_update_body(ctx, bodies.column_layout)
    return bodies.sharded_table_body(ctx, bodies.column_ops)


def _embrace_rowwise(ctx: StepContext) -> bodies.Body:
    if ctx.table_optimizer is not None:
        return bodies.row_update_body(ctx, bodies.row_layout)
    return bodies.sharded_table_body(ctx, bodies.row_ops)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("dense_pmap", bodies.data_parallel_body, combines=False, engine="pmap"),
        Strategy("dense", bodies.data_parallel_body),
        Strategy(
            "sparse_allgather",
            bodies.sparse_allgather_body,
            needs_tables=True,
            combines=False,
            row_updates=True,
        ),
        Strategy("embrace", _embrace, "column", bodies.DEDUP, needs_tables=True, row_updates=True),
        Strategy(
            "embrace_rowwise",
            _embrace_rowwise,
            layout="row",
            capacity=ROWWISE_CAPACITY,
            needs_tables=True,
            row_updates=True,
        ),
        Strategy(
            "embrace_2d",
            bodies.embrace_2d_body,
            layout="column",
            capacity=pipeline.PRIORITY_CAPACITY,
            lookahead=pipeline.LOOKAHEAD,
            needs_tables=True,
            row_updates=True,
        ),
    )
}


# ---------------------------------------------------------------- the builders


def shard_map_step(ctx: StepContext, strategy: Strategy) -> TrainStep:
    """``jax.jit(jax.shard_map(body))`` over ``ctx.mesh``, its state and batch placer."""
    state, state_specs = placement.place_state(ctx, strategy.layout)
    body = strategy.body(ctx)

    def step(state, batch):
        batch_specs = placement.placed_specs(batch, ctx.axis_name, ctx.replicated_keys)
        fn = jax.shard_map(
            body,
            mesh=ctx.mesh,
            in_specs=(state_specs, batch_specs),
            out_specs=(state_specs, P()),
            check_vma=CHECK_VMA,
        )
        return fn(state, batch)

    return TrainStep(
        step=jax.jit(step, donate_argnums=0),
        state=state,
        place_batch=placement.batch_placer(ctx, strategy.capacity, strategy.lookahead),
        host_params=lambda s: jax.tree.map(runtime.to_host, s.params),
        strategy=strategy.name,
        lookahead=strategy.lookahead,
    )


class PmapStep(NamedTuple):
    """A ``jax.pmap`` step that returns the loss as one scalar, like every other step
    (the per-device copies are equal after ``pmean``); ``lower`` is the pmap's."""

    pmapped: Callable

    def __call__(self, state: TrainState, batch: placement.PlacedBatch):
        state, loss = self.pmapped(state, batch)
        return state, loss.addressable_data(0).reshape(())

    def lower(self, *args, **kwargs):
        return self.pmapped.lower(*args, **kwargs)


def pmap_step(ctx: StepContext, strategy: Strategy) -> TrainStep:
    """The classic ``jax.pmap`` + ``lax.pmean`` baseline (``dense_pmap``)."""
    devices = list(ctx.mesh.devices.flat)
    num_local = sum(d.process_index == jax.process_index() for d in devices)
    state = TrainState(ctx.params, ctx.optimizer.init(ctx.params), ())
    return TrainStep(
        step=PmapStep(
            jax.pmap(strategy.body(ctx), ctx.axis_name, devices=devices, donate_argnums=0)
        ),
        state=placement.stack_per_device(state, num_local),
        place_batch=placement.pmap_placer(ctx),
        host_params=lambda s: jax.tree.map(first_replica, s.params),
        strategy=strategy.name,
        per_device_state=True,
    )


CHECK_VMA = True  # shard_map checks that every P() output is really replicated

ENGINES = {"shard_map": shard_map_step, "pmap": pmap_step}


def place_for_step(ts: TrainStep, batch_at: Callable[[int], Batch], step: int, steps: int):
    """The placed batch of ``step`` of a ``steps``-step run, with the next
    ``ts.lookahead`` steps' batches for pipelined strategies (none at the last step)."""
    if ts.lookahead and step + 1 < steps:
        # near the end the last batch stands in for those past it: one program shape
        ahead = [min(s, steps - 1) for s in range(step + 1, step + 1 + ts.lookahead)]
        return ts.place_batch(batch_at(step), *(batch_at(s) for s in ahead))
    return ts.place_batch(batch_at(step))


# ------------------------------------------------------------------- names


NONFINITE = ("skip", "error", "off")


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
    if agg != "dense" and not STRATEGIES[base].combines:
        raise ValueError(f"strategy {base!r} cannot be combined with an aggregator ({agg!r})")
    return base, agg


def strategy_names() -> list[str]:
    """Every accepted ``strategy`` name."""
    sparse = [a for a in AGGREGATORS if a != "dense"]
    tables = [s.name for s in STRATEGIES.values() if s.needs_tables and s.combines]
    return [*STRATEGIES, *sparse, *(f"{t}+{a}" for t in tables for a in sparse)]


# -------------------------------------------------------------- the entry point


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


def _check_options(agg_name: str, num: int, capacity, nonfinite) -> None:
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
    if agg_name == "gtopk" and num & (num - 1):
        raise ValueError(f"gtopk needs a power-of-two number of devices, got {num}")
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")


def _check_tables(strategy: Strategy, vocabs: tuple[int, ...]) -> None:
    if strategy.needs_tables and not vocabs:
        raise ValueError(
            f"strategy {strategy.name!r} needs embedding tables: pass embedding_paths "
            "(parameter paths or a predicate) that name at least one V x D table"
        )


def _check_row_updates(strategy: Strategy, agg_name: str, table_optimizer, comm_dtype) -> None:
    rowgrad.wire_dtype(comm_dtype)  # a known name
    if table_optimizer is not None and not strategy.row_updates:
        names = [s.name for s in STRATEGIES.values() if s.row_updates]
        raise ValueError(f"table_optimizer works with {names}, not {strategy.name!r}")
    rowwise.check_transform(table_optimizer)
    if comm_dtype != "float32" and (table_optimizer is None or agg_name != "dense"):
        raise ValueError(
            f"comm_dtype={comm_dtype!r} needs the row-sparse table update "
            "(table_optimizer, e.g. rowwise.sgd) and the dense all-reduce (no top-k)"
        )


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    params: PyTree,
    strategy: str = "dense",
    *,
    axis_name: str = "data",
    replicated_keys: Sequence[str] = (),
    embedding_paths: TablePaths = (),
    id_keys: Sequence[str] | None = None,
    capacity: int | None = None,
    density: float = 1.0,
    nonfinite: str = "skip",
    table_optimizer: rowwise.RowTransform | None = None,
    comm_dtype: str = "float32",
    **aggregator_options: Any,
) -> TrainStep:
    """Builds the train step of ``strategy`` and its initial state.

    Strategies (``strategy_names()``): ``dense_pmap`` (``pmap`` + ``pmean``), ``dense``
    (the same with ``shard_map``), ``sparse_allgather`` (replicated tables, all-gather
    of sparse rows), ``embrace`` (column-sharded tables, all-to-all), ``embrace_rowwise``
    (row-sharded tables, de-duplicated all-to-all), ``embrace_2d`` (pipelined embrace);
    ``topk_allgather``, ``topk_a2a``, ``gtopk``, ``adaptive`` (top-k with error
    feedback for all gradients); and ``embrace+topk_a2a`` etc. (sharded tables, top-k
    for the dense layers).

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
      capacity: ``embrace_rowwise`` slots per (worker, owner) bucket, ``embrace_2d``
        high-priority positions; ``None`` sizes it per batch (a new program when it
        grows); a fixed value too small for a batch raises ``ValueError``.
      density: fraction of each fused bucket that top-k aggregators send, in (0, 1].
      nonfinite: what a step does when a gradient or residual holds NaN/Inf on any
        worker: ``"skip"`` and ``"error"`` keep the previous state (parameters, optimizer
        state, residuals untouched) and report a NaN loss, so the caller counts the
        step or stops naming it (``experiments.train`` does); ``"off"`` checks nothing.
      table_optimizer: a ``rowwise.RowTransform`` (``sgd``, ``adagrad``, ``lazy_adam``;
        strategies with ``row_updates``): only the rows a step reads change, O(tokens x D),
        ``optimizer`` updates the rest; ``None``: ``optimizer`` updates tables densely.
      comm_dtype: ``"bfloat16"`` sends rows, row gradients, shared negatives and the
        dense all-reduce in bfloat16, summed in float32 (needs ``table_optimizer``).
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
    _check_options(agg_name, num, capacity, nonfinite)
    _check_row_updates(STRATEGIES[base], agg_name, table_optimizer, comm_dtype)
    aggregator = AGGREGATORS[agg_name](density, axis_name, **aggregator_options)
    if agg_name == "dense" and table_optimizer is not None:  # one flat buffer (comm_dtype)
        aggregator = rowgrad.wire_mean(axis_name, rowgrad.wire_dtype(comm_dtype))
    mask = table_mask(params, embedding_paths)
    vocabs = tuple(sorted({int(np.shape(t)[0]) for _, _, t in named_tables(params, mask)}))
    _check_tables(STRATEGIES[base], vocabs)
    ctx = StepContext(
        loss_fn=loss_fn,
        optimizer=optimizer,
        mesh=mesh,
        params=params,
        axis_name=axis_name,
        replicated_keys=tuple(replicated_keys),
        table_mask=mask,
        vocabs=vocabs,
        id_keys=None if id_keys is None else tuple(id_keys),
        capacity=capacity,
        aggregator=aggregator,
        nonfinite=nonfinite,
        table_optimizer=table_optimizer,
        comm_dtype=comm_dtype,
    )
    built = ENGINES[STRATEGIES[base].engine](ctx, STRATEGIES[base])
    return built._replace(strategy=strategy)
