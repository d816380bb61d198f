"""``make_train_step``: a strategy's step, state and batch placer, checked once.

The arguments are checked by ``strategies.rules`` (before anything is traced), gathered
into a ``StepContext`` and built by the strategy's engine (``strategies.engines``);
``strategies.feeding`` places the batches. The command line only turns an
``ArgumentError`` into one line.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from sparsecomm_jax import make_train_step, runtime
    >>> mesh = runtime.data_mesh()
    >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> ts = make_train_step(loss, optax.sgd(0.1), mesh, {"w": jnp.zeros((3, 1))})
    >>> n = len(jax.devices())
    >>> batch = ts.place_batch({"x": jnp.ones((n, 3)), "y": jnp.ones((n, 1))})
    >>> state, loss_value = ts.step(ts.state, batch)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from sparsecomm_jax import nnx_tables, runtime
from sparsecomm_jax.comm import wire
from sparsecomm_jax.embedding.dense import DENSE
from sparsecomm_jax.embedding.layout import Layout
from sparsecomm_jax.embedding.tables import (
    TablePaths,
    bind_tables,
    find_tables,
    table_mask,
)
from sparsecomm_jax.embedding.update import TableUpdate
from sparsecomm_jax.step.state import LossFn, PyTree, StepContext, TrainStep
from sparsecomm_jax.strategies.engines import ENGINES
from sparsecomm_jax.strategies.registry import StrategyName, parse_strategy
from sparsecomm_jax.strategies.rules import (
    check_arguments,
    check_options,
    check_replicas,
    check_table_update,
    choose_table_update,
    make_aggregator,
    place_tables,
    resolve_id_keys,
)
from sparsecomm_jax.topk.selectors import DEFAULT_DENSITY


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    params: PyTree,
    strategy: str | StrategyName = "dense",
    *,
    axis_name: str = "data",
    replicated_keys: Sequence[str] = (),
    embedding_paths: TablePaths = (),
    id_keys: Sequence[str] | Mapping[str, Any] | None = None,
    capacity: int | None = None,
    density: float = DEFAULT_DENSITY,
    nonfinite: str = "skip",
    table_update: str | TableUpdate = "auto",
    comm_dtype: str | wire.Wire = "float32",
    table_layouts: Mapping[Any, str | Layout] | None = None,
    collectives_overlap: bool | None = None,
    replicas: int = 1,
    replica_sync: str = "auto",
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
      loss_fn: ``loss_fn(params, batch, emb) -> scalar``, mean over the batch's examples;
        with an NNX model, ``loss_fn(model, batch)`` as flax's NNX guides write it.
      optimizer: any optax optimizer; it runs on global arrays (a sharded table's
        gradient is summed over its shards by any transform that reduces over the tree).
      mesh: a mesh with axis ``axis_name`` (see ``runtime.data_mesh``).
      params: initial parameters (host or device arrays, unsharded), or a flax
        ``nnx.Module`` (``nnx_tables``: its ``nnx.Embed`` tables found and sharded, the
        module unchanged; ``ts.module(state)`` gives it back trained).
      strategy: one of ``strategy_names()`` (or a ``StrategyName``).
      axis_name: the data-parallel mesh axis.
      replicated_keys: batch keys every worker sees whole (e.g. shared negatives).
      embedding_paths: which parameters are V x D embedding tables: paths like
        ``[("embed",)]`` (a string: the path as a table's name, keys joined by ``/``)
        or a predicate ``(path, leaf) -> bool``.
      id_keys: which batch keys hold ids, each checked to lie in [0, V) of its table:
        default every integer key that feeds a table in the loss (found from it; a
        label is left alone); a tuple of keys; or ``{key: table path}`` (a path like
        ``("params", "user_embed", "embedding")`` or ``"params/user_embed/embedding"``,
        or a list of them), which also checks nothing else.
      capacity: slots of a layout's static buffers per table (``embrace_rowwise``: per
        (worker, owner) bucket; ``embrace``: distinct rows per worker; ``embrace_2d``:
        first-chunk positions, or as ``embrace`` where it runs as ``embrace``); ``None``
        sizes them per batch (a new program when one grows); a fixed value too small
        for a batch raises ``ValueError``.
      density: fraction of each fused bucket that top-k aggregators send, in (0, 1]
        (default ``topk.selectors.DEFAULT_DENSITY``, 0.01, as ``--density``).
      nonfinite: what a step does when a gradient, a residual or the loss holds NaN/Inf
        on any worker: ``"skip"`` and ``"error"`` keep the previous state (parameters,
        optimizer state, residuals untouched) and report a NaN loss, so the caller counts the
        step or stops naming it (``experiments.train`` does); ``"off"`` checks nothing.
      table_update: ``"auto"`` (``"rows"`` where the strategy updates rows and that is
        exact for ``optimizer``: a row whose gradient is zero keeps its value and state,
        as under SGD, Adagrad, clipping by global norm, schedules, ``lazy_adam``; else
        ``"dense"``), ``"dense"`` (a dense gradient per table shard, every row updated;
        exact for any optimizer) or ``"rows"`` (the optimizer on the rows a step reads
        only, O(tokens x D); Adam and momentum then move only the rows a step reads, as
        PyTorch's ``SparseAdam``; see ``embedding.row_optimizers``), or a
        ``TableUpdate`` value. ``ts.table_update`` names the one chosen.
      comm_dtype: the precision on the wire (``comm.wire``): one codec for every
        exchange (``"bfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``: FP8 with a
        float32 scale per row), or each exchange's own,
        ``"forward=float8_e4m3fn,backward=bfloat16,dense=bfloat16"`` (the rows of the
        lookups, their gradients, the dense layers' mean; unnamed ones float32), or a
        ``comm.wire.Wire``. Every sum is taken in float32. A narrow wire needs
        ``table_update="rows"``: ``"auto"`` picks it where that update is exact for
        ``optimizer`` and refuses otherwise (pass ``"rows"`` to train Adam lazily so);
        a top-k aggregator keeps ``dense`` float32.
      table_layouts: a layout per table, ``{table path: layout}`` (a path like
        ``("params", "user_embed", "embedding")`` or ``"params/user_embed/embedding"``;
        a layout ``"column"``, ``"row"``, ``"replicated"``, ``"table"``, a ``Layout``
        value, or ``"dense"``: an ordinary parameter, its gradient in the dense
        all-reduce), for ``sparse_allgather``, ``embrace``, ``embrace_rowwise`` and
        ``embrace_2d`` (its column-wise tables pipelined, the others read within each
        step as ``embrace`` reads them); the tables it leaves out keep the strategy's
        layout. A planner's plan
        (``planner.plan_tables``) is such a mapping.
      collectives_overlap: whether the step's collectives can run beside its compute;
        ``None`` asks the platform (``runtime.collectives_overlap``: not on XLA:CPU).
        ``embrace_2d``'s pipelined schedule only pays where they can: without overlap
        ``embrace``'s step runs instead (every row in one exchange after the backward
        pass; the same losses to float rounding, no lookahead; ``embrace_2d``'s rules
        still hold: tables read by lookups only, column tables' D divisible by P), as
        it does where no table is column-wise, row-wise or hot (nothing to pipeline).
        ``True`` builds the pipelined program anyway (to study or test it on CPU).
      replicas: R, replica groups (2-D sparse parallelism, ``embedding.replica_groups``): the
        mesh's P devices split into R groups of G = P / R consecutive devices; each
        table is sharded over a group by its layout and replicated across the groups,
        its lookups exchanged within the group, its row gradients summed across the
        groups every step (exact). 1 (the default): every table over all P devices.
        For ``embrace``, ``embrace_rowwise``, ``sparse_allgather`` and ``embrace_2d``
        (its first chunks hold the rows any group reads next, summed across the groups
        before the early update).
      replica_sync: how the row gradients are summed across the groups: ``"rows"``
        (an all-gather of the touched rows), ``"shard"`` (an all-reduce of the dense
        shard) or ``"auto"`` (per table, the one of fewer bytes).
      **aggregator_options: passed to the aggregator (``selector``, ``bucket_bytes``).

    Returns:
      A ``TrainStep``: ``state, loss = ts.step(state, ts.place_batch(batch))``.

    Raises:
      ValueError: unknown strategy, axis not in the mesh, embedding strategy without
        tables, a column-wise table whose D does not divide by P under ``embrace_2d``
        (the others pad it), bad capacity or density, a combination the strategy cannot
        make.
    """
    name = parse_strategy(strategy)
    nnx_tables.refuse_nnx_optimizer(optimizer)
    split = None
    if nnx_tables.is_module(params):  # an NNX model: its tables found, its loss wrapped
        split = nnx_tables.split_model(params, loss_fn)
        embedding_paths, table_layouts = nnx_tables.step_tables(
            params, split, name, embedding_paths, table_layouts
        )
        loss_fn, params = split.loss_fn, split.params
    else:
        nnx_tables.check_tree_loss(loss_fn)
    ctx = make_context(
        loss_fn,
        optimizer,
        mesh,
        params,
        name,
        axis_name=axis_name,
        replicated_keys=replicated_keys,
        embedding_paths=embedding_paths,
        id_keys=id_keys,
        capacity=capacity,
        density=density,
        nonfinite=nonfinite,
        table_update=table_update,
        comm_dtype=comm_dtype,
        table_layouts=table_layouts,
        collectives_overlap=collectives_overlap,
        replicas=replicas,
        replica_sync=replica_sync,
        **aggregator_options,
    )
    built = ENGINES[name.strategy.engine](ctx, name.strategy)
    return built._replace(
        strategy=str(strategy),
        table_update=ctx.table_update.name,
        runs_as=str(name._replace(tables=built.runs_as)),  # the table half may differ
        module=None if split is None else nnx_tables.module_of(split, built.host_params),
    )


def make_context(
    loss_fn,
    optimizer,
    mesh,
    params,
    name: StrategyName,
    *,
    axis_name: str = "data",
    replicated_keys: Sequence[str] = (),
    embedding_paths: TablePaths = (),
    id_keys: Sequence[str] | Mapping[str, Any] | None = None,
    capacity: int | None = None,
    density: float = DEFAULT_DENSITY,
    nonfinite: str = "skip",
    table_update: str | TableUpdate = "auto",
    comm_dtype: str | wire.Wire = "float32",
    table_layouts: Mapping[Any, str | Layout] | None = None,
    collectives_overlap: bool | None = None,
    replicas: int = 1,
    replica_sync: str = "auto",
    **aggregator_options: Any,
) -> StepContext:
    """Every argument of ``make_train_step`` checked, as the ``StepContext`` a step is
    built from (``ValueError`` naming what is wrong, before anything is traced)."""
    check_arguments(loss_fn, optimizer, mesh, params)
    num = runtime.mesh_axis_size(mesh, axis_name)
    check_options(name, num, capacity, nonfinite)
    check_replicas(name, replicas, num, replica_sync)
    replica_axis, batch_axes = None, axis_name
    if replicas > 1:  # R groups of G devices: tables sharded in a group, replicated across
        mesh = runtime.replica_mesh(mesh, axis_name, replicas)
        replica_axis, batch_axes = runtime.REPLICA_AXIS, (runtime.REPLICA_AXIS, axis_name)
    group = num // replicas
    named = table_mask(params, embedding_paths)
    chosen = wire.parse(comm_dtype)
    table_update = choose_table_update(table_update, name, optimizer, params, named, chosen)
    check_table_update(name, table_update, chosen)
    aggregator = make_aggregator(name, batch_axes, density, chosen, **aggregator_options)
    id_tables = find_tables(params, named, DENSE)
    layout = name.strategy.layout
    mask = jax.tree.map(lambda _: False, named) if layout.data_parallel else named
    tables = place_tables(find_tables(params, mask, layout), table_layouts, name)
    if dense := {t.index for t in tables if t.layout.data_parallel}:  # ordinary parameters
        tables = tuple(t for t in tables if not t.layout.data_parallel)
        leaves, treedef = jax.tree.flatten(mask)
        mask = treedef.unflatten([f and i not in dense for i, f in enumerate(leaves)])
    tables = bind_tables(tables, group)  # e.g. table-wise owners
    for storage in {t.layout.storage for t in tables if t.layout.storage is not None}:
        if storage.check is not None:  # tables stored together: the optimizer must agree
            storage.check(optimizer, params, group)
    if name.strategy.needs_tables and not tables and not dense:  # all "dense": data parallel
        raise ValueError(
            f"strategy {name.tables!r} needs embedding tables: pass embedding_paths "
            "(parameter paths or a predicate) that name at least one V x D table"
        )
    return StepContext(
        loss_fn=loss_fn,
        optimizer=optimizer,
        mesh=mesh,
        params=params,
        axis_name=axis_name,
        replicated_keys=tuple(replicated_keys),
        tables=tables,
        table_mask=mask,
        id_tables=id_tables,
        id_keys=resolve_id_keys(id_keys, id_tables),
        capacity=capacity,
        aggregator=aggregator,
        nonfinite=nonfinite,
        table_update=table_update,
        wire=chosen,
        overlap=(
            runtime.collectives_overlap(mesh)
            if collectives_overlap is None
            else bool(collectives_overlap)
        ),
        replica_axis=replica_axis,
        replica_sync=replica_sync,
    )
