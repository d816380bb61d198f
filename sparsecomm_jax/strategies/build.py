"""``make_train_step``: a strategy's step, state and batch placer, checked once.

Every rule about what may be combined lives here, checked before anything is traced;
the command line only turns the ``ValueError`` into one line.

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

import concurrent.futures
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from sparsecomm_jax import aggregators, runtime
from sparsecomm_jax.comm import wire
from sparsecomm_jax.embedding import layouts, row_optimizers, update
from sparsecomm_jax.embedding.dense import DENSE
from sparsecomm_jax.embedding.layout import Layout
from sparsecomm_jax.embedding.tables import (
    Table,
    TablePaths,
    find_tables,
    table_mask,
    table_name,
)
from sparsecomm_jax.embedding.update import TableUpdate
from sparsecomm_jax.errors import NO_VALUE, ArgumentError, few
from sparsecomm_jax.schedule import priority
from sparsecomm_jax.step import placement
from sparsecomm_jax.step.placement import PlacedBatch
from sparsecomm_jax.step.state import Batch, LossFn, PyTree, StepContext, TrainState, TrainStep
from sparsecomm_jax.strategies.registry import STRATEGIES, Strategy, StrategyName, parse_strategy
from sparsecomm_jax.topk.selectors import DEFAULT_DENSITY

NONFINITE = ("skip", "error", "off")


# ---------------------------------------------------------------- the engines


def jit_step(ctx: StepContext, strategy: Strategy) -> TrainStep:
    """``jax.jit`` of the strategy's step over ``ctx.mesh``, its state and batch placer."""
    if strategy.serial is not None and not ctx.overlap:  # the pipeline could only lose
        strategy = strategy.serial
    state, specs = placement.place_state(ctx, pad=strategy.any_layout)
    step = strategy.step(ctx, specs)
    policies = (
        [(strategy.capacity, ctx.tables)]
        if strategy.capacity is not None
        else placement.layout_policies(ctx)
    )
    capacity = placement.capacity_fn(ctx, policies) if policies else None
    scannable = strategy.scannable  # a pipelined step carries rows, looks ahead
    return TrainStep(
        step=DonatingStep(jax.jit(step, donate_argnums=0)),
        state=state,
        place_batch=placement.batch_placer(ctx, policies, strategy.lookahead, capacity),
        steps=DonatingStep(jax.jit(scan_steps(step), donate_argnums=0), stacked=True)
        if scannable
        else one_step_a_call(strategy, "steps"),
        place_steps=placement.steps_placer(ctx, capacity)
        if scannable
        else one_step_a_call(strategy, "place_steps"),
        scannable=scannable,
        host_params=placement.host_params_of(ctx),
        strategy=strategy.name,
        lookahead=strategy.lookahead,
        capacity_slots=_capacity_slots(ctx, policies),
        runs_as=strategy.name,
        stored_together=placement.stored_together(ctx),
    )


def scan_steps(step: Callable) -> Callable:
    """``steps(state, placed) -> (state, losses)``: ``step`` run on each batch of
    ``placed`` in turn (its data stacked along a leading step axis, one capacity for
    all), as one ``lax.scan``: one program call for several steps, the same arithmetic
    (to float rounding: XLA compiles the loop body on its own and may fuse it otherwise).

    Args:
      step: ``step(state, placed_batch) -> (state, loss)`` (not yet jitted).

    Returns:
      The scanned step; ``losses`` holds one loss per step.

    Example:
        >>> import jax.numpy as jnp
        >>> from sparsecomm_jax.step.placement import PlacedBatch
        >>> add = lambda state, batch: (state + batch.data["x"].sum(), state)
        >>> scan_steps(add)(jnp.float32(0), PlacedBatch({"x": jnp.ones((3, 2))}))
        (Array(6., dtype=float32), Array([0., 2., 4.], dtype=float32))
    """

    def steps(state: TrainState, placed: PlacedBatch):
        def one(state, data):  # data: one step's batch, [B, ...] per key
            return step(state, PlacedBatch(data, placed.capacity))

        return jax.lax.scan(one, state, placed.data)  # placed.data: [S, B, ...] per key

    return steps


def one_step_a_call(strategy: Strategy, what: str) -> Callable:
    """``ts.steps`` or ``ts.place_steps`` of a strategy that runs one step a call: a
    function that says so (``ValueError``) when called."""

    def refuse(*args, **kwargs):
        raise ValueError(
            f"ts.{what}: strategy {strategy.name!r} runs one step a program call "
            f"({strategy.why_one_step_a_call()}); call ts.step(state, "
            "ts.place_batch(batch)) once a step (ts.scannable is False)"
        )

    return refuse


def _capacity_slots(ctx: StepContext, policies) -> tuple:
    """Per table of ``ctx.tables`` (the order of a batch's capacity), its name and what a
    slot of its capacity holds."""
    what = {t.index: policy.what for policy, tables in policies for t in tables}
    return tuple((t.name, what.get(t.index, "none")) for t in ctx.tables)


def check_step_call(state: TrainState, batch: Any, stacked: bool = False) -> None:
    """``ValueError`` for a step called on a state an earlier call took (the step
    donates its state's buffers to the new one), on a batch ``place_batch`` did not
    place, or (``stacked``: ``ts.steps``) on one step's batch, and the reverse:
    mistakes the runtime would otherwise meet deep in a call, crash on, or run as
    something else."""
    one = "ts.step(state, ts.place_batch(host_batch))"
    several = "ts.steps(state, ts.place_steps(host_batches))"
    if not isinstance(batch, PlacedBatch):
        raise ValueError(
            f"batch must be placed first: {several if stacked else one} (a PlacedBatch; "
            f"got {type(batch).__name__})"
        )
    if bool(batch.steps) != stacked:
        made_by = "place_steps" if batch.steps else "place_batch"
        raise ValueError(
            f"this batch holds {batch.steps or 1} step(s) ({made_by}): call "
            f"{several if batch.steps else one}"
        )
    if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state)):
        raise ValueError(
            "this state was donated to an earlier step (its buffers became that step's "
            "result): pass the state the last ts.step returned"
        )


class DonatingStep(NamedTuple):
    """A ``jax.jit`` step that donates its state: each call is checked first
    (``check_step_call``); ``lower`` is the jit's."""

    jitted: Callable
    stacked: bool = False  # ``TrainStep.steps``: batches of several steps

    def __call__(self, state: TrainState, batch: PlacedBatch):
        check_step_call(state, batch, self.stacked)
        return self.jitted(state, batch)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)


class PmapStep(NamedTuple):
    """A ``jax.pmap`` step that returns the loss as one scalar, like every other step
    (the per-device copies are equal after ``pmean``); ``lower`` is the pmap's."""

    pmapped: Callable

    def __call__(self, state: TrainState, batch: placement.PlacedBatch):
        check_step_call(state, batch)
        state, loss = self.pmapped(state, batch)
        return state, loss.addressable_data(0).reshape(())

    def lower(self, *args, **kwargs):
        return self.pmapped.lower(*args, **kwargs)


def pmap_step(ctx: StepContext, strategy: Strategy) -> TrainStep:
    """The classic ``jax.pmap`` + ``lax.pmean`` baseline (``dense_pmap``)."""
    devices = list(ctx.mesh.devices.flat)
    num_local = sum(d.process_index == jax.process_index() for d in devices)
    state = TrainState(ctx.params, ctx.optimizer.init(ctx.params), ())
    body = strategy.step(ctx)
    return TrainStep(
        step=PmapStep(jax.pmap(body, ctx.axis_name, devices=devices, donate_argnums=0)),
        state=placement.stack_per_device(state, num_local),
        place_batch=placement.pmap_placer(ctx),
        steps=one_step_a_call(strategy, "steps"),
        place_steps=one_step_a_call(strategy, "place_steps"),
        host_params=placement.replica_params,
        strategy=strategy.name,
        per_device_state=True,
        runs_as=strategy.name,
    )


ENGINES = {"shard_map": jit_step, "pmap": pmap_step}


def place_for_step(ts: TrainStep, batch_at: Callable[[int], Batch], step: int, steps: int):
    """The placed batch of ``step`` of a ``steps``-step run, with the next
    ``ts.lookahead`` steps' batches for pipelined strategies (none at the last step)."""
    if ts.lookahead and step + 1 < steps:
        # near the end the last batch stands in for those past it: one program shape
        ahead = [min(s, steps - 1) for s in range(step + 1, step + 1 + ts.lookahead)]
        return ts.place_batch(batch_at(step), *(batch_at(s) for s in ahead))
    return ts.place_batch(batch_at(step))


def placed_batches(
    ts: TrainStep, batch_at: Callable[[int], Batch], start: int, steps: int
) -> Iterator[PlacedBatch]:
    """The placed batches of steps ``start .. steps - 1`` (``place_for_step``), each
    made on a host thread while the step before it runs: when batch ``t`` is handed
    out, batch ``t + 1`` is already being read, checked, sized and placed (double
    buffering), so the step path never waits on the host unless placing takes longer
    than a step. Batches are placed in step order on one thread; an error placing a
    batch is raised when that batch is asked for.

    Args:
      ts: the train step (its ``place_batch``).
      batch_at: step -> host batch; called from one thread, as ``place_for_step`` asks
        (with a lookahead, also for the steps ahead of each one).
      start: the first step.
      steps: the run's number of steps.

    Returns:
      An iterator of ``PlacedBatch``; closing it (or leaving a ``for`` loop early) waits
      for the batch in flight and drops it.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from sparsecomm_jax import make_train_step, runtime
        >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
        >>> ts = make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(),
        ...                      {"w": jnp.zeros((3, 1))})
        >>> n = len(jax.devices())
        >>> batch_at = lambda step: {"x": jnp.full((n, 3), step), "y": jnp.ones((n, 1))}
        >>> state = ts.state
        >>> for batch in placed_batches(ts, batch_at, 0, 3):
        ...     state, loss_value = ts.step(state, batch)  # the next batch placed meanwhile
        >>> ts.host_params(state)["w"].shape
        (3, 1)
    """
    place = functools.partial(place_for_step, ts, batch_at, steps=steps)
    return _placed_ahead(place, range(start, steps))


def _placed_ahead(place: Callable[[Any], PlacedBatch], items: Sequence) -> Iterator[PlacedBatch]:
    """``place(item)`` for each of ``items`` in order on one host thread, the next one
    placed while the caller uses the one before (double buffering)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="place-batch") as pool:
        pending = pool.submit(place, items[0]) if items else None
        for i in range(len(items)):
            batch = pending.result()
            pending = pool.submit(place, items[i + 1]) if i + 1 < len(items) else None
            yield batch


def call_plan(
    start: int, steps: int, size: int, ends: Callable[[int], bool] = lambda step: False
) -> list[tuple[int, int]]:
    """The program calls of steps ``start .. steps - 1`` as ``(first step, steps)``:
    ``size`` steps a call (``TrainStep.steps``) where none of them but the last ends a
    call (``ends(step)``: the caller must see the state after ``step``, to save or
    evaluate it), else one step (``TrainStep.step``). So a run uses at most two call
    sizes (a program each, for each (state, batch) structure), and every step ``ends``
    names is the last of its call.

    Args:
      start: the first step.
      steps: the run's number of steps.
      size: steps a call (1: one call a step).
      ends: whether the state after a step must be seen before the next step starts.

    Returns:
      The calls in step order; their steps are ``start .. steps - 1``, each once.

    Example:
        >>> call_plan(0, 10, 4, ends=lambda step: step == 5)
        [(0, 4), (4, 1), (5, 1), (6, 4)]
    """
    if size < 1:
        raise ValueError(f"a call runs one step or more, got size={size}")
    calls, first = [], start
    while first < steps:
        fits = first + size <= steps and not any(ends(s) for s in range(first, first + size - 1))
        calls.append((first, size if fits else 1))
        first += calls[-1][1]
    return calls


def place_for_call(
    ts: TrainStep, batch_at: Callable[[int], Batch], call: tuple[int, int], steps: int
) -> PlacedBatch:
    """The placed batch of one call of ``call_plan``: ``place_for_step``'s for a call
    of one step, the call's batches stacked by ``ts.place_steps`` for several."""
    first, size = call
    if size == 1:
        return place_for_step(ts, batch_at, first, steps)
    return ts.place_steps([batch_at(s) for s in range(first, first + size)])


def placed_calls(
    ts: TrainStep, batch_at: Callable[[int], Batch], calls: Sequence[tuple[int, int]], steps: int
) -> Iterator[PlacedBatch]:
    """The placed batches of ``calls`` (``call_plan``; ``place_for_call``), each made on
    a host thread while the call before it runs, as ``placed_batches`` does for single
    steps.

    Args:
      ts: the train step (its ``place_batch`` and ``place_steps``).
      batch_at: step -> host batch; called from one thread, in step order.
      calls: ``(first step, steps)`` of each call.
      steps: the run's number of steps.

    Returns:
      An iterator of ``PlacedBatch``, one per call: run a call of one step with
      ``ts.step``, of several with ``ts.steps``.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from sparsecomm_jax import make_train_step, runtime
        >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
        >>> ts = make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(),
        ...                      {"w": jnp.zeros((3, 1))})
        >>> n = len(jax.devices())
        >>> batch_at = lambda step: {"x": jnp.full((n, 3), step), "y": jnp.ones((n, 1))}
        >>> calls = call_plan(0, 5, 4)  # [(0, 4), (4, 1)]
        >>> state, losses = ts.state, []
        >>> for (first, size), batch in zip(calls, placed_calls(ts, batch_at, calls, 5)):
        ...     state, loss = (ts.steps if size > 1 else ts.step)(state, batch)
        ...     losses += [float(x) for x in jnp.ravel(loss)]
        >>> len(losses)
        5
    """
    place = functools.partial(place_for_call, ts, batch_at, steps=steps)
    return _placed_ahead(place, list(calls))


# ------------------------------------------------------------------ the checks


def check_arguments(loss_fn, optimizer, mesh, params) -> None:
    """``ArgumentError`` for arguments of the wrong kind, before anything is traced."""
    if not callable(loss_fn):
        raise ArgumentError("loss_fn", NO_VALUE, f"must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ArgumentError(
            "optimizer",
            NO_VALUE,
            "must be an optax GradientTransformation (init, update), got "
            f"{type(optimizer).__name__}",
        )
    if not isinstance(mesh, Mesh):
        raise ArgumentError(
            "mesh", NO_VALUE, f"must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        )
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ArgumentError("params", NO_VALUE, "has no arrays")
    for path, x in leaves:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ArgumentError(
                "params",
                NO_VALUE,
                f"{jax.tree_util.keystr(path)} must be a floating-point array, got "
                f"{type(x).__name__} of dtype {dtype}",
            )


def check_options(name: StrategyName, num: int, capacity, nonfinite) -> None:
    """The options every strategy takes."""
    if capacity is not None and not (isinstance(capacity, int) and capacity >= 1):
        raise ArgumentError(
            "capacity", capacity, "must be an integer >= 1, or None (sized per batch)"
        )
    if problem := aggregators.AGGREGATORS[name.aggregator].workers(num):
        raise ArgumentError("strategy", str(name), f"{problem}, got {num}")
    if nonfinite not in NONFINITE:
        raise ArgumentError("nonfinite", nonfinite, f"must be one of {list(NONFINITE)}")


def check_table_update(name: StrategyName, table_update: TableUpdate, comm_dtype: str) -> None:
    """The rules of the table update and the wire dtype (one place for all callers)."""
    wire.wire_dtype(comm_dtype)  # a known name
    strategy = name.strategy
    if table_update is update.ROWS and not strategy.row_updates:
        rows = [s.name for s in STRATEGIES.values() if s.row_updates]
        raise ArgumentError(
            "table_update",
            "rows",
            f"needs a strategy among {rows}; $strategy updates no table row-sparsely",
            strategy=str(name),
        )
    if comm_dtype == "float32":
        return
    if table_update is not update.ROWS or aggregators.AGGREGATORS[name.aggregator].sparse:
        raise ArgumentError(
            "comm_dtype",
            comm_dtype,
            "needs the row-sparse table update ($table_update) and the dense all-reduce (no top-k)",
            table_update="rows",
        )
    if not strategy.narrow_wire:
        raise ArgumentError(
            "comm_dtype",
            comm_dtype,
            f"is not available for {strategy.name}; use $comm_dtype",
            comm_dtype="float32",
        )


def place_tables(
    tables: tuple[Table, ...],
    table_layouts: Mapping[Any, str | Layout] | None,
    name: StrategyName,
) -> tuple[Table, ...]:
    """``tables`` with the layouts ``table_layouts`` gives them (by path or name); a
    data-parallel layout (``"dense"``) makes a table an ordinary parameter of the step,
    its gradient dense and in the dense layers' all-reduce.

    Raises:
      ArgumentError: not a mapping, a path that names no table, a table named twice, an
        unknown layout, or a strategy whose step reads every table through one layout.
    """
    if table_layouts is None or (isinstance(table_layouts, Mapping) and not table_layouts):
        return tables
    if not isinstance(table_layouts, Mapping):
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            "must be a mapping {table path: layout}, e.g. "
            '{"params/user/embedding": "row"} (a planner Plan\'s .layouts()), got '
            f"{type(table_layouts).__name__}",
        )
    strategy = name.strategy
    if not strategy.any_layout:
        mixed = [s.name for s in STRATEGIES.values() if s.any_layout]
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"needs a strategy among {mixed}; $strategy reads every table through one layout",
            strategy=str(name),
        )
    names = [table_name(p) for p in table_layouts]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"names {few(twice)} more than once (a path as keys and as 'a/b/c' names one "
            "table): give each table one layout",
        )
    if bad := sorted({str(x) for x in table_layouts.values() if not layouts.known(x)}):
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"names unknown layouts {few(bad)}; choose among {list(layouts.LAYOUTS)}",
        )
    chosen = {name: layouts.get(x) for name, x in zip(names, table_layouts.values(), strict=True)}
    if unknown := sorted(set(chosen) - {t.name for t in tables}):
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"names {few(unknown)}, which are not embedding tables; the tables: "
            f"{few([t.name for t in tables])}",
        )
    return tuple(t._replace(layout=chosen.get(t.name, t.layout)) for t in tables)


def resolve_id_keys(
    id_keys: Sequence[str] | Mapping[str, Any] | None, tables: Sequence[Table]
) -> tuple[str, ...] | dict[str, tuple[int, ...]] | None:
    """``id_keys`` as the step keeps it: ``None``, a tuple of keys, or key -> the leaf
    indices of its tables (a table named by its path, a tuple of keys or ``"a/b/c"``, or
    several of them).

    Raises:
      ArgumentError: not keys, or a table path that names no embedding table (the
        message lists them).
    """
    if id_keys is None or isinstance(id_keys, str):
        return None if id_keys is None else (id_keys,)
    if not isinstance(id_keys, Mapping):
        if not isinstance(id_keys, Sequence | set | frozenset) or not all(
            isinstance(k, str) for k in id_keys
        ):
            raise ArgumentError(
                "id_keys",
                id_keys,
                "must be batch keys (a tuple of strings) or {key: table path}, or None",
            )
        return tuple(id_keys)
    index = {t.name: t.index for t in tables}

    def table(path) -> int:
        name = table_name(path)
        if name not in index:
            raise ArgumentError(
                "id_keys",
                NO_VALUE,
                f"maps a key to {name!r}, which is not an embedding table; the tables: "
                f"{few(sorted(index))}",
            )
        return index[name]

    def tables_of(paths) -> tuple[int, ...]:
        several = isinstance(paths, list) or (
            isinstance(paths, tuple) and paths and not isinstance(paths[0], str)
        )
        return tuple(table(p) for p in paths) if several else (table(paths),)

    return {key: tables_of(paths) for key, paths in id_keys.items()}


def choose_table_update(
    requested: str | TableUpdate,
    name: StrategyName,
    optimizer,
    params,
    tables: PyTree,
    comm_dtype: str,
) -> TableUpdate:
    """The ``TableUpdate`` of ``requested``: ``"auto"`` is ``ROWS`` where the strategy
    updates rows and the row-sparse update equals the dense one for ``optimizer`` on
    every table (``row_optimizers.untouched_rows_stay``, probed on small trees shaped
    like ``params``; ``tables`` marks the table leaves), where ``optimizer`` is defined
    on rows (``lazy_adam``) or where ``comm_dtype`` needs it; else ``DENSE``."""
    if not (isinstance(requested, str) and requested == "auto"):
        return update.get(requested)
    if not name.strategy.row_updates or not any(jax.tree.leaves(tables)):
        return update.DENSE
    if comm_dtype != "float32" or row_optimizers.is_lazy(optimizer, params):
        return update.ROWS
    exact = row_optimizers.untouched_rows_stay(optimizer, params, tables)
    return update.ROWS if exact else update.DENSE


def make_aggregator(name: StrategyName, axis_name: str, density: float, comm_dtype: str, **options):
    """The aggregator of the dense layers: the named one; a table strategy's ``dense``
    mean travels as one flat buffer in ``comm_dtype`` (``aggregators.flat_allreduce``)."""
    kind = aggregators.AGGREGATORS[name.aggregator]
    if not kind.sparse and not name.strategy.layout.data_parallel:
        return aggregators.flat_allreduce(axis_name, comm_dtype)
    return aggregators.AGGREGATORS[name.aggregator](density, axis_name, **options)


# -------------------------------------------------------------- the entry point


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
    comm_dtype: str = "float32",
    table_layouts: Mapping[Any, str | Layout] | None = None,
    collectives_overlap: bool | None = None,
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
      optimizer: any optax optimizer; it runs on global arrays (a sharded table's
        gradient is summed over its shards by any transform that reduces over the tree).
      mesh: a mesh with axis ``axis_name`` (see ``runtime.data_mesh``).
      params: initial parameters (host or device arrays, unsharded).
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
      comm_dtype: ``"bfloat16"`` sends rows, row gradients, shared negatives and the
        dense all-reduce in bfloat16, summed in float32 (needs ``table_update="rows"``).
      table_layouts: a layout per table, ``{table path: layout}`` (a path like
        ``("params", "user_embed", "embedding")`` or ``"params/user_embed/embedding"``;
        a layout ``"column"``, ``"row"``, ``"replicated"``, ``"table"``, a ``Layout``
        value, or ``"dense"``: an ordinary parameter, its gradient in the dense
        all-reduce), for ``sparse_allgather``, ``embrace`` and ``embrace_rowwise``; the
        tables it leaves out keep the strategy's layout. A planner's plan
        (``planner.plan_tables``) is such a mapping.
      collectives_overlap: whether the step's collectives can run beside its compute;
        ``None`` asks the platform (``priority.collectives_overlap``: not on XLA:CPU).
        ``embrace_2d``'s pipelined schedule only pays where they can: without overlap
        ``embrace``'s step runs instead (every row in one exchange after the backward
        pass; the same losses to float rounding, no lookahead; ``embrace_2d``'s rules
        still hold: tables read by lookups only, sizes divisible by P). ``True`` builds
        the pipelined program anyway (to study or test it on CPU).
      **aggregator_options: passed to the aggregator (``selector``, ``bucket_bytes``).

    Returns:
      A ``TrainStep``: ``state, loss = ts.step(state, ts.place_batch(batch))``.

    Raises:
      ValueError: unknown strategy, axis not in the mesh, embedding strategy without
        tables, a table not divisible by P under a pipelined strategy (the others pad
        it), bad capacity or density, a combination the strategy cannot make.
    """
    name = parse_strategy(strategy)
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
        **aggregator_options,
    )
    built = ENGINES[name.strategy.engine](ctx, name.strategy)
    return built._replace(
        strategy=str(strategy),
        table_update=ctx.table_update.name,
        runs_as=str(name._replace(tables=built.runs_as)),  # the table half may differ
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
    comm_dtype: str = "float32",
    table_layouts: Mapping[Any, str | Layout] | None = None,
    collectives_overlap: bool | None = None,
    **aggregator_options: Any,
) -> StepContext:
    """Every argument of ``make_train_step`` checked, as the ``StepContext`` a step is
    built from (``ValueError`` naming what is wrong, before anything is traced)."""
    check_arguments(loss_fn, optimizer, mesh, params)
    num = runtime.mesh_axis_size(mesh, axis_name)
    check_options(name, num, capacity, nonfinite)
    named = table_mask(params, embedding_paths)
    table_update = choose_table_update(table_update, name, optimizer, params, named, comm_dtype)
    check_table_update(name, table_update, comm_dtype)
    aggregator = make_aggregator(name, axis_name, density, comm_dtype, **aggregator_options)
    id_tables = find_tables(params, named, DENSE)
    layout = name.strategy.layout
    mask = jax.tree.map(lambda _: False, named) if layout.data_parallel else named
    tables = place_tables(find_tables(params, mask, layout), table_layouts, name)
    if dense := {t.index for t in tables if t.layout.data_parallel}:  # ordinary parameters
        tables = tuple(t for t in tables if not t.layout.data_parallel)
        leaves, treedef = jax.tree.flatten(mask)
        mask = treedef.unflatten([f and i not in dense for i, f in enumerate(leaves)])
    for bind in {t.layout.bind for t in tables if t.layout.bind is not None}:
        tables = bind(tables, num)  # e.g. table-wise owners
    for storage in {t.layout.storage for t in tables if t.layout.storage is not None}:
        if storage.check is not None:  # tables stored together: the optimizer must agree
            storage.check(optimizer, params, num)
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
        wire=wire.wire_dtype(comm_dtype),
        overlap=(
            priority.collectives_overlap(mesh)
            if collectives_overlap is None
            else bool(collectives_overlap)
        ),
    )
