"""Where state and batches live: partition specs, host-side batch checks and placement,
and the sizing of a step's static buffers from each batch.

Planning happens here, on the host, before a step runs: which keys are sharded, that
every id lies in its table, how many slots each table's buffers need (each layout's
``capacity`` policy, or the pipelined step's). The step bodies only move data.

Example:
    >>> import numpy as np
    >>> from sparsecomm_jax.step import placement
    >>> placement.check_ids({"tokens": np.array([[1, 12]])}, {"tokens": [("embed", 10)]})
    Traceback (most recent call last):
    ...
    ValueError: batch['tokens'] has ids in [1, 12], outside [0, 10) of table embed
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.embedding import access
from sparsecomm_jax.embedding.layout import CapacityPolicy, Layout, check_divisible, cut_spec
from sparsecomm_jax.embedding.row_optimizers import map_params
from sparsecomm_jax.embedding.tables import replace_leaves
from sparsecomm_jax.errors import few
from sparsecomm_jax.step.form import cut_leaves, packs, store_leaves
from sparsecomm_jax.step.state import Batch, PyTree, StepContext, TrainState

# ------------------------------------------------------------------ batch checks


def check_batch(batch: Batch, num_workers: int, replicated_keys: Sequence[str]) -> None:
    """Raises ``ValueError`` unless every sharded leaf's leading axis is a positive
    multiple of P (a batch of no examples has no mean loss)."""
    if not isinstance(batch, dict):
        raise ValueError(f"batch must be a dict of arrays, got {type(batch).__name__}")
    for key, x in batch.items():
        if key in replicated_keys:
            continue
        n = np.shape(x)[0] if np.ndim(x) else None
        if n == 0:
            raise ValueError(f"batch[{key!r}] has no examples (leading size 0)")
        if n is None or n % num_workers:
            raise ValueError(
                f"batch[{key!r}] has leading size {n}, which must be divisible by the "
                f"number of devices ({num_workers})"
            )


def check_ids(
    batch: Batch, ranges: dict[str, list[tuple[str, int]]], hint: str = "", named: bool = False
) -> None:
    """``ValueError`` for any id outside its table: never a silent clamp.

    Args:
      batch: the host batch.
      ranges: batch key -> the ``(table name, V)`` of each table it feeds; its ids
        must lie in [0, V) of the smallest.
      hint: added to the error (how to name the keys).
      named: the keys were named as ids (``id_keys``), so a key of floats is an error;
        else a float key is one the ids are computed from (bucketized, or a mask) and
        is not checked.
    """
    for key, tables in ranges.items():
        ids = np.asarray(batch[key])
        if not ids.size:
            continue
        name, vocab = min(tables, key=lambda t: t[1])
        if not np.issubdtype(ids.dtype, np.integer):
            if not named:  # a float key the ids are computed from (bucketized, a mask)
                continue
            raise ValueError(
                f"batch[{key!r}] holds {ids.dtype} values but feeds table {name} as ids; "
                f"give it an integer array (e.g. .astype(np.int32)){hint}"
            )
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(
                f"batch[{key!r}] has ids in [{ids.min()}, {ids.max()}], outside [0, {vocab}) "
                f"of table {name}{hint}"
            )


def id_ranges(ctx: StepContext, batch: Batch) -> tuple[dict[str, list[tuple[str, int]]], str]:
    """Batch key -> the ``(name, V)`` of the tables its ids are checked against, and a
    hint for the error.

    ``id_keys=None``: every key that feeds a table in the loss (``access.key_tables``),
    against the tables it feeds. Named keys: each against the tables ``id_keys`` maps it
    to, or those it feeds (a named key that feeds none: every table); and an integer key
    whose values reach a table's lookup unchanged (its values are that table's ids)
    must be named, whatever ``id_keys`` says. A key the model computes ids from (an
    offset, a hash) may be left out: the ids it makes are checked where they are read
    (``embedding.gradients``: the step is skipped, its loss +inf).

    Raises:
      ValueError: ``id_keys`` names a key the batch does not have (a misspelt key would
        turn the check off), or leaves out an integer key whose values are ids.
    """
    named = {t.index: (t.name, t.vocab) for t in ctx.id_tables}
    keys = ctx.id_keys
    if keys is not None and (missing := [k for k in keys if k not in batch]):
        raise ValueError(
            f"id_keys names {few(missing)}, which the batch does not have (its keys: "
            f"{few(sorted(batch))}); name the keys that hold token ids"
        )
    fed = _fed_tables(ctx, batch, named)
    if keys is None:
        return {k: [named[i] for i in fed[k]] for k in fed}, (
            " (name each key's table with id_keys={key: table path} if this key holds "
            "something else)"
        )
    direct = _fed_tables(ctx, batch, named, direct=True)
    integer = [k for k in direct if np.issubdtype(np.asarray(batch[k]).dtype, np.integer)]
    if left := [k for k in integer if k not in keys]:
        tables = sorted({named[i][0] for k in left for i in direct[k]})
        raise ValueError(
            f"id_keys leaves out {few(left)}, whose values the loss reads table(s) "
            f"{few(tables)} by: every key that holds a table's ids is checked against it; "
            "add them to id_keys"
        )
    if isinstance(keys, dict):
        mapped = {k: {*tables, *direct.get(k, ())} for k, tables in keys.items()}
    else:
        mapped = {k: fed.get(k, named) for k in keys}
    return {k: [named[i] for i in sorted(tables)] for k, tables in mapped.items()}, ""


def _fed_tables(
    ctx: StepContext, batch: Batch, named: dict, direct: bool = False
) -> dict[str, frozenset[int]]:
    """``access.key_tables`` of ``ctx``'s loss on ``batch``; a loss that cannot run on
    the batch because a key the model looks rows up by is not integer is a
    ``ValueError`` naming that key."""
    leaves, treedef = jax.tree.flatten(ctx.params)
    mask = treedef.unflatten([i in named for i in range(len(leaves))])
    try:
        return access.key_tables(ctx.loss_fn, ctx.params, batch, mask, direct)
    except (TypeError, ValueError) as e:  # e.g. float or bool ids where the model looks up
        odd = [k for k, v in batch.items() if not np.issubdtype(np.asarray(v).dtype, np.integer)]
        if not odd or "integer" not in str(e):
            raise
        culprits = [k for k in odd if _runs_with_integer(ctx.loss_fn, ctx.params, batch, mask, k)]
        raise ValueError(
            f"the loss cannot run on this batch ({e}); if the model looks up rows by "
            f"{few(culprits or odd)}, give them as integers (e.g. .astype(np.int32))"
        ) from e


def _runs_with_integer(loss_fn, params, batch: Batch, mask, key: str) -> bool:
    """Whether the loss's reads trace once ``batch[key]`` is made integer."""
    cast = {**batch, key: np.asarray(batch[key]).astype(np.int32)}
    try:
        access.key_tables(loss_fn, params, cast, mask)
    except (TypeError, ValueError):
        return False
    return True


def check_host_batch(ctx: StepContext, batch: Batch) -> None:
    """Every check a batch passes before it is placed."""
    check_batch(batch, ctx.num_workers, ctx.replicated_keys)
    if ctx.id_tables:
        check_ids(batch, *id_ranges(ctx, batch), named=ctx.id_keys is not None)


# ------------------------------------------------------------------- the batch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlacedBatch:
    """A batch on the devices, as every ``shard_map`` step body receives it.

    Attributes:
      data: the batch (sharded keys split over the workers, replicated keys whole).
      capacity: slots of the static buffers, one entry per table in table order (0:
        none), ``()`` when the step has none; static, so one program is compiled per
        value.
      next: the next step's batch for pipelined strategies (``None`` otherwise and at
        the last step).
      later: the batches of steps t+2, t+3, ... a pipelined strategy's lookahead asks
        for (as many as remain), soonest first.
      steps: 0 for one step's batch (``place_batch``), else the steps whose batches
        ``place_steps`` stacked along ``data``'s leading axis (for ``TrainStep.steps``).
    """

    data: dict = dataclasses.field(metadata=dict(static=False))
    capacity: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    next: dict | None = dataclasses.field(default=None, metadata=dict(static=False))
    later: tuple = dataclasses.field(default=(), metadata=dict(static=False))
    steps: int = dataclasses.field(default=0, metadata=dict(static=True))

    def slots(self, tables) -> dict[int, int]:
        """Table leaf index -> its slots (``tables`` in the order of ``capacity``)."""
        return {t.index: c for t, c in zip(tables, self.capacity, strict=False)}


def batch_specs(
    batch: Batch, axis_name: str | tuple[str, ...], replicated_keys: Sequence[str]
) -> dict:
    """``PartitionSpec`` per batch key: split along ``axis_name`` (with replica groups,
    the tuple of both axes) unless replicated."""
    return {k: P() if k in replicated_keys else P(axis_name) for k in batch}


def placed_specs(
    batch: PlacedBatch, axis_name: str | tuple[str, ...], replicated_keys: Sequence[str]
):
    """The ``PartitionSpec`` tree of a ``PlacedBatch``."""
    nxt = None if batch.next is None else batch_specs(batch.next, axis_name, replicated_keys)
    data = batch_specs(batch.data, axis_name, replicated_keys)
    later = tuple(batch_specs(b, axis_name, replicated_keys) for b in batch.later)
    return PlacedBatch(data, batch.capacity, nxt, later)


def put_batch(ctx: StepContext, batch: Batch) -> dict:
    """Checks a host batch and places it on ``ctx.mesh``."""
    check_host_batch(ctx, batch)
    specs = batch_specs(batch, ctx.batch_axes, ctx.replicated_keys)
    return {k: runtime.put_global(np.asarray(v), ctx.mesh, specs[k]) for k, v in batch.items()}


# ------------------------------------------------------------------- capacities


def layout_policies(
    ctx: StepContext, own: Callable[[Layout], CapacityPolicy | None] | None = None
) -> list[tuple[CapacityPolicy, tuple]]:
    """Each capacity policy of the tables' layouts with the tables it plans; ``own``
    (``own(layout) -> policy``, or ``None`` for the layout's own) plans the tables of
    some layouts a strategy's own way (``embrace_2d``'s carried tables:
    ``Pipelined.capacity``, a column table's first chunk, a row table's buckets for
    two batches)."""
    out: dict[str, tuple[CapacityPolicy, list]] = {}
    for t in ctx.tables:
        policy = t.layout.capacity
        if own is not None and (mine := own(t.layout)) is not None:
            policy = mine
        if policy is not None:
            out.setdefault(t.layout.name, (policy, []))[1].append(t)
    return [(policy, tuple(tables)) for policy, tables in out.values()]


def capacity_fn(
    ctx: StepContext, policies: list[tuple[CapacityPolicy, tuple]]
) -> Callable[..., tuple[int, ...]]:
    """``capacity(*batches) -> tuple`` (one entry per table of ``ctx.tables``): what
    each ``policy`` needs for the tables it plans, ``ctx.capacity`` when fixed
    (``ValueError`` when too small), else grown by the policy whenever a batch needs more
    (never shrinks). ``batches``: the step's batch, then those it looks ahead to."""
    current = dict.fromkeys((t.index for t in ctx.tables), 0)
    reads_of = access.host_reads(
        ctx.loss_fn, ctx.params, ctx.table_mask, ctx.replicated_keys, ctx.num_workers
    )
    group = ctx.group_size

    def capacity(*batches: Batch) -> tuple[int, ...]:
        reads = [reads_of(b) for b in batches]
        unseen = access.param_dependent_tables(ctx.loss_fn, ctx.params, batches[0], ctx.table_mask)
        for policy, tables in policies:
            needs: dict[int, int] = {}
            for mine in replica_groups(reads, ctx.num_replicas):  # each group's exchange
                for i, need in policy.need(mine, tables, group).items():
                    needs[i] = max(needs.get(i, 0), need)
            for t in tables:
                if t.index in unseen and policy.bound and t.index in reads[0]:
                    needs[t.index] = policy.bound(reads[0], t, group)
                    _warn_unseen(t.name, needs[t.index])
            current.update(grow_capacities(current, needs, ctx.capacity, policy))
        return tuple(current[t.index] for t in ctx.tables)

    return capacity


def replica_groups(reads: list[access.HostReads], replicas: int) -> list[list]:
    """The reads of each replica group: the step's batch's lookups split into
    ``replicas`` consecutive groups (a 2-D mesh's groups, replica-major), the shared ids
    in each; the batches it looks ahead to whole (a row any group reads next is sent
    first by every group: ``schedule.pipeline``). One group (a 1-D mesh) is ``[reads]``
    itself."""
    if replicas == 1:
        return [reads]

    def part(one: access.HostReads, r: int) -> access.HostReads:
        out = {}
        for i, (look, shared) in one.items():
            size = len(look) // replicas
            out[i] = (look[r * size : (r + 1) * size], shared)
        return out

    return [[part(reads[0], r), *reads[1:]] for r in range(replicas)]


def _warn_unseen(table: str, slots: int) -> None:
    warnings.warn(
        f"the ids the model reads of table {table} are computed from the parameters: "
        f"planned on the host, they cannot be seen, so it gets the {slots} slots any batch "
        "of this shape can need",
        stacklevel=4,
    )


def grow_capacities(
    current: dict[int, int], needs: dict[int, int], fixed: int | None, policy: CapacityPolicy
) -> dict[int, int]:
    """Each table's slots for ``needs``: ``fixed`` when given (``ValueError`` when a table
    needs more), else grown by ``policy.grow`` past ``current`` when needed, never shrunk.

    Example: current {0: 16}, needs {0: 12, 1: 100}, grow by an eighth -> {0: 16, 1: 112}.
    """
    return {i: _sized(need, current.get(i, 0), fixed, policy) for i, need in needs.items()}


def _sized(need: int, current: int, fixed: int | None, policy: CapacityPolicy) -> int:
    if fixed is not None:
        if need > fixed:
            raise ValueError(
                f"capacity={fixed} is too small: this batch needs {need} "
                f"{policy.what}; pass a larger capacity or None (auto; --capacity 0 on the "
                "command line)"
            )
        return fixed
    if need > current or not current:
        return max(current, policy.grow(need))
    return current


def batch_placer(
    ctx: StepContext,
    policies: list[tuple[CapacityPolicy, tuple]],
    lookahead: int = 0,
    capacity: Callable[..., tuple[int, ...]] | None = None,
) -> Callable[..., PlacedBatch]:
    """``place(batch[, next_batch, *later]) -> PlacedBatch``: checked, placed, capacity
    sized by ``policies`` (``later``: up to ``lookahead - 1`` batches after the next);
    ``capacity``: a ``capacity_fn`` to share with another placer (``steps_placer``), so
    both grow the same capacities."""
    if capacity is None and policies:
        capacity = capacity_fn(ctx, policies)

    def place(batch: Batch, next_batch: Batch | None = None, *later: Batch) -> PlacedBatch:
        data = put_batch(ctx, batch)
        if not lookahead:
            return PlacedBatch(data, capacity(batch) if capacity else ())
        if next_batch is None:
            return PlacedBatch(data, capacity(batch) if capacity else ())
        later = tuple(put_batch(ctx, b) for b in later[: lookahead - 1])
        need = capacity(batch, next_batch) if capacity else ()
        return PlacedBatch(data, need, put_batch(ctx, next_batch), later)

    return place


def steps_placer(
    ctx: StepContext, capacity: Callable[..., tuple[int, ...]] | None
) -> Callable[[Sequence[Batch]], PlacedBatch]:
    """``place_steps(batches) -> PlacedBatch``: the batches of consecutive steps for one
    program call (``TrainStep.steps``), each checked and sized as ``batch_placer``
    would, then stacked along a new leading axis and placed once. Capacities never
    shrink, so the last batch's capacity holds every batch's ids.

    Args:
      ctx: the step's context.
      capacity: the ``capacity_fn`` the step's ``batch_placer`` uses (``None``: the
        step has no capacities).

    Returns:
      ``place_steps``; its ``PlacedBatch.data`` holds ``[S, *shape]`` arrays (``S``
      steps), split along the batch axis like a single step's.
    """

    def place_steps(batches: Sequence[Batch]) -> PlacedBatch:
        if not batches:
            raise ValueError("place_steps needs the batches of one step or more")
        check_alike(batches)  # first: the checks below run the loss on each batch
        for batch in batches:
            check_host_batch(ctx, batch)
        need = ()  # sized only once every batch passed: a refused call grows nothing
        for batch in batches:
            need = capacity(batch) if capacity else ()
        specs = batch_specs(batches[0], ctx.batch_axes, ctx.replicated_keys)
        data = {
            k: runtime.put_global(np.stack([b[k] for b in batches]), ctx.mesh, P(None, *spec))
            for k, spec in specs.items()
        }
        return PlacedBatch(data, need, steps=len(batches))

    return place_steps


def check_alike(batches: Sequence[Batch]) -> None:
    """``ValueError`` unless every batch has the first one's keys, shapes and dtypes
    (one program runs them all)."""
    for i, batch in enumerate(batches):
        if not isinstance(batch, dict):
            raise ValueError(f"batch {i} must be a dict of arrays, got {type(batch).__name__}")
    first = {k: (np.shape(v), np.asarray(v).dtype) for k, v in batches[0].items()}
    for i, batch in enumerate(batches[1:], 1):
        this = {k: (np.shape(v), np.asarray(v).dtype) for k, v in batch.items()}
        if this != first:
            raise ValueError(
                f"batches of one program call must be alike: batch {i} has {this}, "
                f"batch 0 {first} (keys -> (shape, dtype))"
            )


class CapacityWarning(RuntimeWarning):
    """A step read more distinct ids of a table than its batch's capacity had slots."""


def overflow_message(ts, batch: PlacedBatch) -> str:
    """What to tell when ``ts.step`` on ``batch`` returned a loss of +inf (``finish.
    mark_missed``): some table's ids needed more slots than ``batch.capacity`` gave.

    Example: ``"... (capacity per table: embed 1 slots of distinct rows of one table on
    one worker); ..."``
    """
    per_table = ", ".join(
        f"{name} {slots} slots of {what}"
        for (name, what), slots in zip(ts.capacity_slots, batch.capacity, strict=False)
    )
    return (
        "a worker read more ids of a table than the batch's capacity had slots, or an id "
        "the model computed outside its table, so the step returned a loss of +inf "
        f"(capacity per table: {per_table}); the rows that did not fit were NaN and the "
        "step was skipped (unless nonfinite='off'). Place batches with ts.place_batch, "
        "which sizes the capacity from each batch, or give a larger capacity; keep the "
        "ids the model computes in [0, V) of their table"
    )


# ------------------------------------------------------------------- the state


def param_specs(ctx: StepContext) -> PyTree:
    """``PartitionSpec`` per parameter: each table by its layout, the rest replicated."""
    leaves, treedef = jax.tree.flatten(ctx.params)
    specs = [P()] * len(leaves)
    for t in ctx.tables:
        specs[t.index] = t.layout.spec(ctx.axis_name)
    return treedef.unflatten(specs)


def opt_specs(optimizer: optax.GradientTransformation, opt_state, specs: PyTree) -> PyTree:
    """The optimizer state's specs: a leaf that lies like a parameter takes its spec
    (cut to the leaf's rank: a per-row count of a row-wise table lies like its rows),
    the rest is replicated (``optax.partition``'s masked places stay)."""
    return map_params(
        optimizer,
        lambda leaf, spec: cut_spec(spec, np.ndim(leaf)),
        opt_state,
        specs,
        transform_non_params=lambda x: jax.tree.map(lambda _: P(), x),
        is_leaf=lambda x: isinstance(x, P),
    )


def initial_agg_state(ctx: StepContext, host_params):
    """Zeros of the aggregator's state, one slice per worker: global ``[P, *shape]`` (the
    aggregator reduces the dense layers only when there are tables)."""
    if ctx.tables:
        host_params = jax.tree.map(lambda x, m: None if m else x, host_params, ctx.table_mask)
    shapes = jax.eval_shape(ctx.aggregator.init, host_params)
    return jax.tree.map(lambda s: np.zeros((ctx.num_workers, *s.shape), s.dtype), shapes)


def pad_tables(ctx: StepContext, params: PyTree) -> PyTree:
    """``params`` with each table padded with zero rows or columns to the shape it is
    stored in (``layout.padded_shape``: its split dimension a multiple of the G workers
    it is sharded over), or packed with others by its layout's ``storage``."""
    leaves = dict(enumerate(jax.tree.leaves(params)))
    return replace_leaves(params, store_leaves(ctx.tables, ctx.group_size, leaves))


def cut_tables(ctx: StepContext, params: PyTree) -> PyTree:
    """``params`` with each stored table cut back to its V x D (``pad_tables`` undone)."""
    return replace_leaves(params, cut_leaves(ctx.tables, dict(enumerate(jax.tree.leaves(params)))))


def host_params_of(ctx: StepContext) -> Callable[[TrainState], PyTree]:
    """``TrainStep.host_params`` of a step built from ``ctx``."""

    def host_params(state: TrainState) -> PyTree:
        """The parameters of ``state`` as numpy arrays on this host, shaped as the
        model made them: each sharded table gathered whole and cut back to V x D (a
        padded table's padding, a table-wise pack's neighbours left out).

        Args:
          state: a ``TrainState`` of this step (``ts.state`` or one ``ts.step``
            returned).

        Returns:
          The parameter pytree, like the ``params`` given to ``make_train_step``.
        """
        return cut_tables(ctx, jax.tree.map(runtime.to_host, state.params))

    return host_params


def stored_together(ctx: StepContext) -> tuple:
    """``TrainStep.stored_together``: per layout with a ``storage``, its name, its
    tables as ``(name, V, D)`` and P (what places them: table-wise owners follow the
    sizes)."""
    return tuple(
        (tables[0].layout.name, tuple((t.name, t.vocab, t.dim) for t in tables), ctx.group_size)
        for _, tables in packs(ctx.tables)
    )


def place_state(ctx: StepContext, unpadded: bool = False) -> tuple[TrainState, TrainState]:
    """The initial state on the devices, and its ``PartitionSpec`` tree (the carry of
    a pipelined step is per worker). A table whose split dimension does not divide by
    the G workers is stored padded (``pad_tables``).

    Args:
      ctx: the step's context.
      unpadded: refuse such a size instead for a table whose layout's carrier reads
        its stored rows whole (``Pipelined.unpadded``: the pipelined steps' column
        tables).
    """
    specs = param_specs(ctx)
    host = jax.tree.map(np.asarray, ctx.params)
    for t in ctx.tables:
        if unpadded and t.layout.pipelined is not None and t.layout.pipelined.unpadded:
            check_divisible(t, ctx.group_size)
    host = pad_tables(ctx, host)
    opt_state = jax.tree.map(np.asarray, ctx.optimizer.init(host))
    agg_state = initial_agg_state(ctx, host)
    state = TrainState(host, opt_state, agg_state)
    agg_specs = jax.tree.map(lambda _: P(ctx.batch_axes), agg_state)
    state_specs = TrainState(specs, opt_specs(ctx.optimizer, opt_state, specs), agg_specs)
    placed = jax.tree.map(
        lambda x, s: runtime.put_global(x, ctx.mesh, s),
        state,
        state_specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    return placed, state_specs._replace(carry=P(ctx.axis_name))


# ------------------------------------------------------------- host utilities


def first_replica(x) -> np.ndarray:
    """One replica of a ``pmap``-stacked array (numpy or device), as numpy."""
    if isinstance(x, np.ndarray):
        return x[0]
    return np.asarray(x.addressable_data(0)).reshape(x.shape[1:])


def loss_value(loss: jax.Array) -> float:
    """The step's loss as a float (``pmap`` returns one copy per local device)."""
    return float(np.asarray(loss.addressable_data(0)).reshape(-1)[0])


def loss_values(losses: jax.Array) -> list[float]:
    """The losses of a call of ``TrainStep.steps`` (one per step), or of ``step`` (one),
    as floats."""
    return [float(x) for x in np.asarray(losses.addressable_data(0)).reshape(-1)]


def replica_params(state: TrainState) -> PyTree:
    """``TrainStep.host_params`` of a ``jax.pmap`` step: the parameters of ``state`` as
    numpy arrays on this host, from the first device's replica (the replicas are equal
    after every step's ``pmean``).

    Args:
      state: a ``TrainState`` of the step, its leaves stacked per local device.

    Returns:
      The parameter pytree, like the ``params`` given to ``make_train_step``.
    """
    return jax.tree.map(first_replica, state.params)


def stack_per_device(tree: PyTree, num_local: int) -> PyTree:
    """Every leaf repeated along a new leading axis of ``num_local`` (``pmap`` state)."""
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (num_local, *np.shape(x))), tree)


def pmap_placer(ctx: StepContext) -> Callable[[Batch], PlacedBatch]:
    """``place(batch)`` for a ``pmap`` step: this process's devices' slices, stacked."""
    devices = list(ctx.mesh.devices.flat)
    local = [d for d in devices if d.process_index == jax.process_index()]
    num, first = len(devices), devices.index(local[0])

    def place(batch: Batch) -> PlacedBatch:
        check_host_batch(ctx, batch)
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            if k in ctx.replicated_keys:
                out[k] = np.broadcast_to(v, (len(local), *v.shape))
            else:
                out[k] = v.reshape(num, len(v) // num, *v.shape[1:])[first : first + len(local)]
        return PlacedBatch(out)

    return place
