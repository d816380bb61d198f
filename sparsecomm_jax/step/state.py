"""What every train step shares: its state, its context and the built step.

A *model* is a pure loss ``loss_fn(params, batch, emb) -> scalar``: the mean loss over
the examples of ``batch``, where ``emb`` (an ``embedding.access.EmbeddingOps``) does
every embedding-table access, so a strategy can serve rows from a sharded table without
model code. A *batch* is a flat dict of arrays whose leading axis is the global batch,
except the keys in ``replicated_keys`` that every worker sees whole.

A step has two halves: a *body*, run once per worker inside ``jax.shard_map``, computes
the gradients and exchanges them (``step.apply.Gradients``); the *update* then runs
the optimizer on global arrays (``step.apply.apply_gradients``). ``StepContext`` is
everything both are built from; ``TrainState`` what a step reads and writes;
``TrainStep`` the built result.

Example:
    >>> from sparsecomm_jax.step.state import TrainState
    >>> TrainState(params={}, opt_state=(), agg_state=()).carry
    ()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh

from sparsecomm_jax import runtime
from sparsecomm_jax.aggregators import Aggregator
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.embedding import access
from sparsecomm_jax.embedding.access import EmbeddingOps
from sparsecomm_jax.embedding.tables import Table
from sparsecomm_jax.embedding.update import TableUpdate

PyTree = Any
Batch = dict[str, Any]
LossFn = Callable[[PyTree, Batch, EmbeddingOps], jax.Array]


class TrainState(NamedTuple):
    """Everything a step reads and writes (a plain pytree: jit, shard, checkpoint).

    Attributes:
      params: model parameters (a sharded table is a global array: each worker holds
        its shard).
      opt_state: the optax optimizer state (sharded like the parameters it follows).
      agg_state: the gradient aggregator's state (error-feedback residuals, one slice
        per worker), or ``()``.
      carry: what a pipelined step hands to the next (``embrace_2d``: the embedding rows
        of the next batch), ``()`` otherwise and before the first step.
    """

    params: PyTree
    opt_state: PyTree
    agg_state: PyTree
    carry: PyTree = ()


class TrainStep(NamedTuple):
    """A built strategy.

    Attributes:
      step: ``step(state, placed_batch) -> (state, loss)``, a ``jax.jit`` function whose
        calls are checked first (``DonatingStep``) or a ``jax.pmap`` one (``PmapStep``);
        ``step.lower(...)`` gives its program; ``loss`` is the mean loss over the global
        batch, a scalar (``loss_value`` reads it). It donates ``state``: pass the state
        it returned to the next call. A batch ``place_batch`` did not place is a
        ``ValueError``, and so is an old state whose buffers were given away (the jit
        step; ``pmap`` on CPU keeps them, and computes from the old state).
      state: the initial ``TrainState``, placed on the devices (a table whose split
        dimension does not divide by P stored padded: read it through ``host_params``).
      place_batch: host batch (global, identical on every process) -> device batch;
        validates it first.
      host_params: ``state -> params`` as ordinary numpy arrays (sharded tables
        gathered back to V x D).
      strategy: the strategy's name, e.g. ``"embrace+topk_a2a"``.
      lookahead: k > 0 when ``place_batch(batch, next_batch, *later)`` wants the next
        k steps' batches too (``embrace_2d``), else 0.
      per_device_state: True when every state leaf has a leading local-device axis
        (``jax.pmap``), False for global arrays (``jax.jit``).
      table_update: the name of the tables' ``TableUpdate`` (``"dense"``, ``"rows"``).
      capacity_slots: per entry of a placed batch's ``capacity``, the table's name and
        what one slot holds (``capacities.overflow_message``).
      runs_as: the strategy whose step was built, as a full name: ``strategy`` itself,
        but ``"embrace"`` for ``"embrace_2d"`` (``"embrace+topk_a2a"`` for
        ``"embrace_2d+topk_a2a"``) where collectives cannot overlap compute (XLA:CPU)
        or no table is column-wise, row-wise or hot (nothing to pipeline).
      stored_together: the tables a layout stores together (``Layout.storage``, e.g.
        table-wise packs): per group ``(layout name, ((table name, V, D), ...), P)``. A
        checkpoint records it beside ``form``; one written before forms were recorded
        restores only into a step that stores its tables the same way.
      steps: ``steps(state, placed_steps) -> (state, losses)``: several steps in one
        program call, a ``lax.scan`` of ``step`` over the batches ``place_steps``
        stacked, or for a pipelined strategy (its steps carry rows and look ahead) the
        steps unrolled (``engines.unrolled_steps``; ``losses``: one per step, in
        order); the same arithmetic as calling ``step`` on each batch (to float
        rounding: XLA compiles the program whole), with one dispatch and one program
        run instead of one per step. A ``jax.pmap`` step runs one step a call: calling
        it is a ``ValueError`` that says so.
      place_steps: ``place_steps([batch, ...], *ahead) -> PlacedBatch`` of ``steps``:
        each batch checked and sized as ``place_batch`` would, then placed stacked
        along a new leading axis with the capacity of the largest (``ahead``: the
        batches a pipelined step reads past the call's; refusing as ``steps`` does).
      scannable: whether ``steps`` and ``place_steps`` run (several steps a call).
      form: how the state is stored (``step.stored_form.StateForm``: the tables' layouts on
        the G workers a table is sharded over), which a checkpoint records so that it
        restores onto another count or layout; ``None``: stored as the model made it
        (``jax.pmap``'s replicas).
      module: for a flax NNX model (``nnx_tables``), ``module(state) -> nnx.Module``:
        the user's module with the state's parameters (a model to call, save or keep
        training); ``None`` for a Linen parameter tree.
      vocabulary: the id-to-slot mappings of the managed tables
        (``embedding.managed.Vocabularies``), advanced by ``place_batch``: save its
        ``states()`` with a checkpoint; ``None`` without managed tables.
    """

    step: Callable[[TrainState, Any], tuple[TrainState, jax.Array]]
    state: TrainState
    place_batch: Callable[..., Any]
    host_params: Callable[[TrainState], PyTree]
    strategy: str
    lookahead: int = 0
    per_device_state: bool = False
    table_update: str = "dense"
    capacity_slots: tuple = ()
    runs_as: str = ""
    stored_together: tuple = ()
    steps: Callable[[TrainState, Any], tuple[TrainState, jax.Array]] | None = None
    place_steps: Callable[..., Any] | None = None
    scannable: bool = False
    form: Any = None
    module: Callable[[TrainState], Any] | None = None
    vocabulary: Any = None

    def sent_bytes(self, batch: Any) -> float:
        """Bytes each worker sends in one call of ``step`` on the placed ``batch`` (its
        capacity sizes the buffers): the collectives of the compiled program, summed
        (``comm.hlo.total_bytes``; a pipelined step's refetch branch, which runs only
        when a guess missed, left out). Compiles, never runs: the state is not donated.

        Args:
          batch: a batch from ``place_batch`` (or ``place_steps`` for ``steps``' bytes
            per call: use ``hlo.collectives(ts.steps, ...)`` then).

        Returns:
          Bytes per worker per call, in the codecs the wire chose.

        Example:
            >>> import jax.numpy as jnp, optax
            >>> from sparsecomm_jax import make_train_step, runtime
            >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"]) ** 2)
            >>> ts = make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(),
            ...                      {"w": jnp.zeros((1000, 1))})
            >>> n = len(jax.devices())
            >>> ts.sent_bytes(ts.place_batch({"x": jnp.ones((n, 1000))})) >= 0
            True
        """
        return hlo.total_bytes(hlo.collectives(self.step, self.state, batch))


class StepContext(NamedTuple):
    """What a step is built from (validated by ``make_train_step``).

    Attributes:
      loss_fn: the model's loss.
      optimizer: the optax optimizer of every parameter.
      mesh: the mesh with ``axis_name``.
      params: the initial parameters, unsharded (shapes of the full tables).
      axis_name: the mesh axis the tables are sharded over (the data-parallel axis
        of a 1-D mesh; with replica groups the batch is split over ``batch_axes``).
      replicated_keys: batch keys every worker sees whole.
      tables: the embedding tables the strategy places, each with its layout (empty
        for data-parallel strategies, which treat tables as dense parameters).
      table_mask: bool per parameter leaf: is it a table the strategy places?
      id_tables: every embedding table named (data parallel too, layout ``None``): the
        ranges ids are checked against.
      id_keys: which batch keys hold ids: ``None`` (every integer key that feeds a table,
        found from the loss), a tuple of keys (each checked against the tables it feeds),
        or key -> the leaf indices of the tables it reads.
      capacity: fixed slots per static buffer (``None``: sized per batch).
      aggregator: reduces the data-parallel gradients (the dense layers).
      nonfinite: ``"skip"`` (keep the state, NaN loss), ``"error"`` (the same; callers
        stop), ``"off"`` (no check).
      table_update: ``embedding.update.DENSE`` or ``ROWS``.
      wire: the codecs of the step's exchanges (``comm.wire.Wire``): rows forward,
        row gradients back, the dense layers' mean (with a table strategy).
      overlap: whether a program's collectives can run beside its compute on ``mesh``
        (``runtime.collectives_overlap``: not on XLA:CPU); without it ``embrace_2d``
        runs as ``embrace`` (``registry.Strategy.serial``).
      replica_axis: the mesh axis of the replica groups (2-D sparse parallelism: each
        table sharded over ``axis_name`` inside a group, replicated across groups), or
        ``None`` (a 1-D mesh: every table sharded over every device).
      replica_sync: how the row gradients are summed across the replica groups
        (``embedding.replica_groups``: ``"rows"``, ``"shard"``, or ``"auto"``: per table the
        one of fewer bytes).
    """

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    mesh: Mesh
    params: PyTree
    axis_name: str
    replicated_keys: tuple[str, ...]
    tables: tuple[Table, ...]
    table_mask: PyTree
    id_tables: tuple[Table, ...]
    id_keys: tuple[str, ...] | dict[str, tuple[int, ...]] | None
    capacity: int | None
    aggregator: Aggregator
    nonfinite: str
    table_update: TableUpdate
    wire: Any
    overlap: bool
    replica_axis: str | None = None
    replica_sync: str = "auto"

    @property
    def batch_axes(self) -> str | tuple[str, str]:
        """The mesh axes the batch is split over: ``axis_name``, or with replica groups
        ``(replica_axis, axis_name)`` (every device a worker of the data-parallel part)."""
        return (self.replica_axis, self.axis_name) if self.replica_axis else self.axis_name

    @property
    def num_workers(self) -> int:
        """P = R x G: the workers the batch is split over."""
        return self.num_replicas * self.group_size

    @property
    def group_size(self) -> int:
        """G: the workers a table is sharded over (``axis_name``); P without replicas."""
        return runtime.mesh_axis_size(self.mesh, self.axis_name)

    @property
    def num_replicas(self) -> int:
        """R: the groups each table is replicated over (1: a 1-D mesh)."""
        return runtime.mesh_axis_size(self.mesh, self.replica_axis) if self.replica_axis else 1

    @property
    def widths(self) -> dict[int, int]:
        """Table leaf index -> full row width D."""
        return {t.index: t.dim for t in self.tables}

    @property
    def table_rows(self) -> dict[int, int]:
        """Table leaf index -> its rows V."""
        return {t.index: t.vocab for t in self.tables}

    def reads(self, params, data, attend_error: str = "") -> list:
        """The table reads ``loss_fn`` makes on ``data`` (``access.traced_reads``)."""
        return access.traced_reads(
            self.loss_fn, params, data, self.table_mask, self.widths, self.table_rows, attend_error
        )
