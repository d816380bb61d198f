"""The table layout protocol: how a table is placed over the workers and read.

A ``Layout`` is a value, one per file (``column.COLUMN``, ``row.ROW``,
``replicated.REPLICATED``, ``tablewise.TABLE``), that implements a fixed trio for the
tables placed with it:

1. **plan the ids** (host, before the step): ``capacity`` sizes the static buffers a
   batch needs, per table, from the ids each worker reads (``access.host_reads``);
2. **fetch rows** (device, inside ``shard_map``): ``fetch(shards, reads, capacity, axis,
   wire)`` brings every read of a step its rows, ``float[*ids.shape, D]``;
3. **send row gradients back**: the ``back`` that ``fetch`` returns takes the gradient of
   each read's rows and returns, per table, ``(ids, rows)`` pairs at the rows' owners:
   indices into this worker's shard, and the gradient rows summed over the workers that
   read them (padding ids lie outside the shard).

Besides the trio a layout says where its tables live (``spec``), which dimension it
splits (``split_dim``; a table is stored padded to a multiple of P there, see
``padded_shape``, unless its ``storage`` packs tables together), how a full softmax reads a table
(``attend``, differentiated by autodiff, and ``sum_dense`` that sums that dense gradient
over the workers), and how a row gradient lies as global arrays (``row_specs``, for the
row-sparse update). ``embedding.gradients`` drives the trio; ``embedding.update`` turns
the pairs into the optimizer's gradient.

A layout also owns what the planner knows of it (``pricing``: what one table costs a
worker per step, the messages of the exchange its tables share, which tables it can
serve) and how ``embrace_2d`` carries its tables across steps (``pipelined``: a
``Pipelined``, the plan of the carried ids and the ``Carrier`` exchange that sends a
step's gradient in two priorities and fetches the next batch's rows), so the planner,
the pipeline, the command line and the checkpoints ask the layouts instead of naming
them. Adding a layout is one file, one value and one line in
``embedding.layout_registry`` (or ``layout_registry.register`` from your own file).

Example:
    >>> from sparsecomm_jax.embedding import column
    >>> tuple(column.COLUMN.spec("data"))  # rows whole, columns split over "data"
    (None, 'data')

References:
    Li et al., "EmbRace", ICPP 2022 (column-wise); Mudigere et al., "High-performance,
    Distributed Training of Large-scale DLRMs", 2021 (row-wise, table-wise);
    torchrec's sharding types (input distribution, lookup, output distribution).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm import wire as comm_wire
from sparsecomm_jax.embedding.access import HostReads, Read
from sparsecomm_jax.embedding.tables import replace_leaves

Pairs = tuple[jax.Array, jax.Array]  # (ids int[m], rows float[m, width]) at the owner
FLOAT = 4  # bytes of a float32 entry on the wire and in memory


def both_ways(width: int, wire: comm_wire.Wire) -> int:
    """Bytes on the wire of one row of ``width`` values out (``wire.forward``) and its
    gradient back (``wire.backward``), scales included."""
    return comm_wire.row_bytes(width, wire.forward) + comm_wire.row_bytes(width, wire.backward)


class TableStats(NamedTuple):
    """What a table sees per step, per worker (``planner.table_stats`` measures it).

    Attributes:
      name: the table's path joined by ``/``.
      vocab: V. dim: D.
      reads: ids read per worker per step (every read, duplicates included).
      distinct: the most distinct ids one worker reads in a step (column's slots).
      bucket: the most distinct ids one worker asks of one owner (row's slots).
      lookups: how many reads of the table the loss makes (replicated pays per read).
      attended: the loss reads the whole table by a full softmax (``emb.attend``),
        which the table-wise layout does not serve.
      measured: layout name -> what that layout's price needs beyond these fields,
        measured by its ``Pricing.measure`` (the hot layout: the cold rows' buckets at
        each number of hot rows); ``None``: nothing more measured.
      raw: its ids are raw values, not rows (some id of the sample batches lies outside
        ``[0, V)``): only a layout that maps ids to rows (``Layout.maps_ids``, the
        managed one) serves it, and every other field is measured on the rows a fresh
        mapping of V slots gives the sample's ids.
    """

    name: str
    vocab: int
    dim: int
    reads: int
    distinct: int
    bucket: int
    lookups: int = 1
    attended: bool = False
    measured: Mapping[str, Any] | None = None
    raw: bool = False

    def of(self, layout: str) -> Any:
        """What ``layout``'s ``Pricing.measure`` measured of this table (``None``:
        nothing)."""
        return (self.measured or {}).get(layout)


class Price(NamedTuple):
    """What one table under one layout costs one worker per step.

    Attributes:
      bytes: sent per step (the alpha-beta model's bytes).
      seconds: the modelled time of those bytes and of its local work, messages
        left out (they are the layout's, shared by its tables: ``Pricing.messages``).
      memory: bytes of the table and its optimizer state held by the worker.
      config: the table's entry in the layout's ``Layout.config`` that this price
        assumes (the hot layout: the hot ids of the number of hot rows it priced
        lowest); ``None``: the layout is its name alone.
      setting: that configuration in a few words, for a plan's table (``"H=64"``).
    """

    bytes: float
    seconds: float
    memory: float
    config: Any = None
    setting: str = ""


class Pricing(NamedTuple):
    """What the planner knows of a layout.

    Attributes:
      table: ``table(stats, P, link, optimizer_slots, wire=comm.wire.DEFAULT) ->
        Price``: one table alone (``link`` a ``comm.costmodel.Link``;
        ``optimizer_slots`` optimizer state per parameter entry; ``wire`` the codecs
        its rows and their gradients travel in).
      messages: ``messages(P) -> int``: the messages per step of the exchange the
        layout's tables share (paid once, whatever number of tables it holds).
      together: ``together(stats, P, link, optimizer_slots, wire) -> [Price, ...]``: the
        tables priced as they are placed together (table-wise packs: each owner's load
        sets the exchange's buckets), one ``Price`` each; ``None``: each on its own.
      serves: ``serves(stats) -> bool``: whether the layout can serve the table's reads
        (the table-wise layout serves no full softmax).
      measure: ``measure(table, reads, counts, P) -> Any``: what the price needs beyond
        ``TableStats``' common fields, measured on the sample batches' ``reads`` (a
        list of ``access.HostReads``) and ``counts``, the histogram of the table's
        ids (``int[V]``, or ``None`` when the planner was given none); kept as
        ``stats.of(name)``. ``None``: the common fields are all it needs.
    """

    table: Callable[..., Price]
    messages: Callable[[int], int] = lambda workers: 0
    together: Callable[..., list[Price]] | None = None
    serves: Callable[[TableStats], bool] = lambda stats: True
    measure: Callable[..., Any] | None = None


class Fetched(NamedTuple):
    """The rows of a step's reads and the way back for their gradients.

    Attributes:
      rows: per read, ``float[*ids.shape, D]`` (full rows, in the order of the reads).
      back: ``back(grads) -> [(table index, (ids, rows)), ...]``: ``grads`` the gradient
        of each read's rows; the result this worker's share as the rows' owner.
      missed: table index -> bool[]: some id this worker reads of the table found no
        slot in the layout's static buffers (the batch's capacity was too small; its
        rows are NaN). Layouts without capacities leave it empty.
    """

    rows: list
    back: Callable[[list], list[tuple[int, Pairs]]]
    missed: dict = {}


class CapacityPolicy(NamedTuple):
    """How many static slots a batch needs, per table (the plan of the ids).

    Attributes:
      need: ``need(reads, tables, workers) -> {table index: slots}``; ``reads`` is a
        list of ``access.HostReads``: the step's batch, then the batches it looks ahead
        to (pipelined steps); ``tables`` the ``Table`` records to plan.
      what: what a slot holds, for the error when a fixed capacity is too small.
      grow: ``grow(need) -> capacity`` when the current capacity is exceeded.
      bound: ``bound(reads, table, workers) -> slots``: the most any batch of these
        read shapes can need, whatever its ids: the capacity of a table whose ids are
        computed from the parameters (the host cannot see them). ``None``: the layout
        finds out on the devices (a spill it recovers from).
    """

    need: Callable[[list[HostReads], tuple, int], dict[int, int]]
    what: str
    grow: Callable[[int], int]
    bound: Callable[[HostReads, Any, int], int] | None = None


class Storage(NamedTuple):
    """How a layout stores its tables when not each as its own leaf padded along
    ``split_dim`` (the table-wise layout packs several tables into one leaf).

    Attributes:
      shape: ``shape(table, P) -> (rows, columns)`` of the leaf that stores ``table``.
      pack: ``pack(leaves, P) -> leaves`` (host): table leaf index -> V x D array, to
        table leaf index -> stored array, for the tables of this layout.
      unpack: ``unpack(stored, vocabs) -> leaves``: the inverse, ``vocabs`` table leaf
        index -> V.
      check: ``check(optimizer, params, P)``: ``ValueError`` where the optimizer would
        not move tables stored together as it moves them apart (per-parameter labels or
        norms); called when a step is built.
    """

    shape: Callable[[Any, int], tuple[int, int]]
    pack: Callable[[dict, int], dict]
    unpack: Callable[[dict, dict], dict]
    check: Callable[[Any, Any, int], None] | None = None


class Carrying(NamedTuple):
    """Where a carried exchange runs, inside ``shard_map`` (``Carrier``).

    Attributes:
      axis: the mesh axis the tables are sharded over (a replica group's).
      batch_axes: the mesh axes the batch is split over (every group's: a row any group
        reads next goes first everywhere).
      workers: G, the workers of ``axis``.
    """

    axis: str
    batch_axes: Any
    workers: int


class Carrier(NamedTuple):
    """An exchange that carries tables' rows across steps (``embrace_2d``): the tables of
    every layout whose ``Pipelined.carrier`` is this value travel by it together. Every
    function runs inside ``shard_map``; ``where`` is a ``Carrying``; reads are
    ``access.Read`` s of the carrier's tables, their ids as the carrier exchanges them
    (``Pipelined.carried``).

    A plan (one per table) has ``next_ids``: int[m], the rows of this worker's shard that
    batch t+1 reads (the early update's rows), ``None`` at the last step.

    Attributes:
      plan: ``plan(where, shards, reads, g_rows, future, slots) -> (plans, spill)``:
        table index -> its plan of batch t's gradient exchange, which positions go in
        the first chunk (those batch t+1 reads) and which later; ``shards`` table index
        -> this worker's shard, ``g_rows`` each read's gradient rows, ``future`` the
        reads of batches t+1, t+2, ... (empty at the last step), ``slots`` table index
        -> its carried capacity; ``spill`` bool[], a position batch t+1 reads did not
        fit the first chunk (the step fetches the next rows again).
      first: ``first(where, plans) -> (pairs, plans, spill)``: the first chunk at the
        owners, table index -> ``[(ids, rows), ...]`` (ids of the owner's shard, the
        rows summed over the workers); the plans with what the chunk carried; ``spill``
        as ``plan``'s.
      later: ``later(where, plans, after) -> (pairs, missed)``: every other position at
        the owners, sent once ``after`` (every carrier's first chunk) has arrived
        (``comm.order.waits_for``); ``missed`` table index -> bool[], a position found
        no slot.
      fetch: ``fetch(where, shards, reads, slots, patches) -> rows``: each read's rows,
        ``float[*ids.shape, D]``; with ``patches`` (table index -> ``RowGrad`` of
        update rows, ``None``: none) read with that update added (``patched_take``).
      hand_over: ``hand_over(plan) -> arrays``: what a later program needs of a plan
        to send its late chunks (``make_overlapped`` runs them in a program of their
        own); ``None``: the carrier cannot be split so.
      hand_specs: ``hand_specs(axis) -> specs`` of ``hand_over``'s arrays.
      take_over: ``take_over(where, arrays, capacity, last) -> plan``: the plan again,
        in the later program (``capacity`` the table's slots; ``last``: no later batch).
      empty_reads: it takes a read of no ids (a bag of width 0); the pipelined step
        refuses one otherwise.
    """

    plan: Callable[..., tuple[dict, Any]]
    first: Callable[..., tuple[dict, dict, Any]]
    later: Callable[..., tuple[dict, dict]]
    fetch: Callable[..., list]
    hand_over: Callable[[Any], Any] | None = None
    hand_specs: Callable[[str], Any] | None = None
    take_over: Callable[..., Any] | None = None
    empty_reads: bool = True


class Pipelined(NamedTuple):
    """What ``embrace_2d`` needs of a layout to carry its tables' rows across steps
    (``schedule.pipeline``): step t sends first the gradient rows batch t+1 reads, the
    owners update those rows early, and batch t+1's rows are fetched then, carried to
    step t+1, whose forward pass sends nothing for them.

    Attributes:
      capacity: ``capacity(policy) -> CapacityPolicy``: the carried plan of the ids,
        made from the layout's own ``policy`` (a column table's first-chunk positions,
        a row table's buckets over batches t and t+1).
      carrier: the exchange its tables travel by (``column.CARRIER``, ``row.CARRIER``),
        shared with every layout that names the same one.
      unpadded: the carrier reads the stored rows whole: the dimension the layout
        splits must divide by the group's workers (no padding).
      carried: ``carried(table, G, ids) -> ids``: the ids the carrier exchanges for a
        read (the hot layout: a cold id's stored row, -1 for a hot id, which asks for
        no row); ``None``: the ids as read.
      near: ``near(table, G, ids, rows, shard) -> rows``: the carried rows with those
        read where they lie added (the hot layout's hot rows, from this worker's
        block); ``None``: the carried rows alone.
      late: ``late(tables, G, reads, g_rows, shards, axis, codec) -> [(table index,
        (ids, rows)), ...]``: more gradient pairs sent with the late chunks (the hot
        rows' all-reduce), for ``tables`` (table index -> ``Table``) of this layout;
        ``None``: none.
    """

    capacity: Callable[[CapacityPolicy | None], CapacityPolicy]
    carrier: Carrier
    unpadded: bool = False
    carried: Callable[[Any, int, jax.Array], jax.Array] | None = None
    near: Callable[..., jax.Array] | None = None
    late: Callable[..., list] | None = None


class Layout(NamedTuple):
    """One way to place tables over the workers (see the module doc).

    Attributes:
      name: e.g. ``"column"``.
      spec: ``spec(axis) -> PartitionSpec`` of a V x D table.
      split_dim: the dimension divided among the workers (``None``: replicated).
      capacity: the plan of the ids, or ``None`` when no static buffer depends on them.
      fetch: ``fetch(shards, reads, capacity, axis, wire) -> Fetched`` inside
        ``shard_map``: ``shards`` table index -> this worker's shard, ``reads`` the
        ``access.Read`` records of these tables (no ``ATTEND``), ``capacity`` table
        index -> slots (from ``capacity``), ``wire`` a ``comm.wire.Wire``: rows travel
        in ``wire.forward``, their gradients in ``wire.backward``.
      attend: ``attend(shard, h, axis) -> h @ table.T`` (a full softmax).
      sum_dense: ``sum_dense(g, axis)``: the dense ``attend`` gradient of a shard, summed
        over the workers.
      row_specs: ``row_specs(axis) -> (ids spec, rows spec)`` of a table's row gradient
        as global arrays.
      storage: how its tables are stored when not one padded leaf each (``None``: one
        leaf each, ``padded_shape``).
      bind: ``bind(tables, P) -> tables`` for a layout that places its tables by looking
        at all of them (table-wise owners): called once when a step is built, it returns
        the records with a layout bound to that placement (``None``: nothing to bind).
      pricing: what the planner knows of it (``None``: the planner leaves it out of
        its plans; it can still be given by hand).
      data_parallel: the table is no table to the step: an ordinary parameter, its
        gradient in the dense layers' all-reduce (``embedding.dense.DENSE``); the
        trio is never called.
      config: what this value of the layout was made with, as JSON: table name -> that
        table's configuration (the hot ids of ``embedding.hot``). A checkpoint and a
        ``TablePlan``'s JSON record it, and ``configure`` rebuilds the value from it.
        ``None``: the layout is its name alone.
      configure: ``configure(config) -> Layout``: the layout value of ``config``.
      pipelined: how ``embrace_2d`` carries its tables across steps (``None``: they are
        read within each step, through ``fetch``).
      maps_ids: a batch's ids are no rows: the host maps them to the table's rows as
        the batch is placed, and the step starts the rows it gives new ids afresh
        (``embedding.managed``: ids of any value, admission and eviction).
    """

    name: str
    spec: Callable[[str], P]
    split_dim: int | None
    capacity: CapacityPolicy | None
    fetch: Callable[..., Fetched]
    attend: Callable[[jax.Array, jax.Array, str], jax.Array]
    sum_dense: Callable[[jax.Array, str], jax.Array]
    row_specs: Callable[[str], tuple[P, P]]
    storage: Storage | None = None
    bind: Callable[[tuple, int], tuple] | None = None
    pricing: Pricing | None = None
    data_parallel: bool = False
    config: Any = None
    configure: Callable[[Any], Layout] | None = None
    pipelined: Pipelined | None = None
    maps_ids: bool = False

    @property
    def sharded(self) -> bool:
        """Each worker holds part of the layout's tables (it splits them, or places
        whole tables on owners), reached through an exchange the tables share."""
        return self.split_dim is not None or self.bind is not None

    @property
    def packs(self) -> bool:
        """It stores several tables in one leaf, as it places them (table-wise): a
        checkpoint restores them only into the same placement."""
        return self.bind is not None or self.storage is not None


def patched_take(shard: jax.Array, patch, ids: jax.Array) -> jax.Array:
    """``shard[ids]`` with ``patch.rows`` added to the rows at ``patch.ids``: rows read
    with an update added, without writing a table (a carrier's ``fetch`` with
    ``patches``: the early update of ``embrace_2d``).

    Args:
      shard: float[V, D/P] (a column-wise shard), or float[V/P, D] (a row-wise one).
      patch: a ``RowGrad``: ascending ids int[m] (padding, the shard's rows, last) and
        their update rows.
      ids: int[...] rows to read, in [0, rows); an id outside reads NaN (``jnp.take``),
        as the layout's own fetch does.

    Returns:
      ``float[*ids.shape, D/P]`` (``[*ids.shape, D]`` row-wise).

    Example:
        >>> import jax.numpy as jnp
        >>> from sparsecomm_jax.embedding.row_optimizers import RowGrad
        >>> patch = RowGrad(jnp.array([1, 3]), jnp.array([[10.0], [30.0]]))
        >>> patched_take(jnp.arange(4.0)[:, None], patch, jnp.array([3, 0, 1])).ravel().tolist()
        [33.0, 0.0, 11.0]
    """
    rows = jnp.take(shard, ids, axis=0)
    pos = jnp.clip(jnp.searchsorted(patch.ids, ids), 0, patch.ids.shape[0] - 1)
    hit = jnp.take(patch.ids, pos) == ids
    delta = jnp.take(patch.rows, pos, axis=0).astype(shard.dtype)
    return rows + jnp.where(hit[..., None], delta, 0)


def padded_shape(table: Any, num_workers: int) -> tuple[int, int]:
    """The shape a table is stored in: the dimension its layout splits rounded up to a
    multiple of P (``(V, D)`` when it divides, or for a replicated table).

    The padding is zeros that nothing reads: ids stay below V, and a step gives the
    model the first D columns of a row and the first V logits of a full softmax. Its
    gradient is zero, so under an optimizer that treats entries alone or reduces by
    sums and norms (SGD, Adam and AdamW with clipping by global norm are tested;
    Adagrad and LAMB are of the same kind) it stays zero and changes nothing. An
    optimizer that takes a mean over a whole table (``optax.centralize``,
    ``optax.adafactor``'s block RMS) would see the zeros: there the padded table is not
    exact; give such a table a size that divides by P.

    Example:
        >>> from sparsecomm_jax.embedding import column, row, tables
        >>> padded_shape(tables.Table(0, "t", 10, 6, row.ROW), 4)
        (12, 6)
        >>> padded_shape(tables.Table(0, "t", 10, 6, column.COLUMN), 4)
        (10, 8)
    """
    if table.layout.storage is not None:
        return table.layout.storage.shape(table, num_workers)
    shape = [table.vocab, table.dim]
    split = table.layout.split_dim
    if split is not None:
        shape[split] = -(-shape[split] // num_workers) * num_workers
    return shape[0], shape[1]


def split_size(layout: Layout, vocab: int, dim: int) -> int | None:
    """The size of a V x D table along the dimension ``layout`` splits (``None``: it
    splits none)."""
    return None if layout.split_dim is None else (vocab, dim)[layout.split_dim]


def check_divisible(table: Any, num_workers: int) -> None:
    """``ValueError`` unless the dimension a table's layout splits divides by P (the
    pipelined steps, which do not pad)."""
    size = split_size(table.layout, table.vocab, table.dim)
    if size is None:
        return
    what = "D (columns)" if table.layout.split_dim == 1 else "V (rows)"
    if size % num_workers:
        raise ValueError(
            f"embedding table {table.name} has {what} = {size}, not divisible by the "
            f"{num_workers} workers of the {table.layout.name}-wise layout; the pipelined "
            f"steps do not pad it (embrace, embrace_rowwise and sparse_allgather do; "
            f"embrace_2d pads a table given another layout by table_layouts or --plan, "
            f"where a table left out is column-wise)"
        )


def cut_spec(spec: P, ndim: int) -> P:
    """``spec`` cut to an array of ``ndim`` dimensions (a row state such as a per-row
    count, int[V], lies like its table's rows)."""
    return P(*tuple(spec)[:ndim])


PROBE_STEPS = 4  # optimizer steps of check_storage's probe


def check_storage(
    optimizer, params, small: dict[int, int], storage: Storage, num_workers: int, error: str
) -> None:
    """``ValueError(error)`` unless ``optimizer`` moves tables stored by ``storage`` as it
    moves them as the model made them: ``PROBE_STEPS`` steps of it on stand-ins of every
    parameter (table ``i`` with ``small[i]`` rows of its D, the other leaves cut to 130 in
    every dimension), stored and apart, on random gradients; the moves compared, each
    relative to the largest of its leaf (a small learning rate hides no difference).

    What the probe cannot see: a difference that shows only after ``PROBE_STEPS`` steps
    (``optax.MultiSteps`` of more, per-label schedules that part later) or only at
    larger sizes; noise (``add_noise``) is refused although harmless.
    """
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(params)

    def stand_in(i, x):
        shape = (
            (small[i], np.shape(x)[1]) if i in small else tuple(min(n, 130) for n in np.shape(x))
        )
        return rng.normal(size=shape).astype(np.float32)

    apart = [  # the parameters, then a gradient per step
        treedef.unflatten([stand_in(i, x) for i, x in enumerate(leaves)])
        for _ in range(1 + PROBE_STEPS)
    ]

    def tables_of(tree) -> dict:
        flat = jax.tree.leaves(tree)
        return {i: flat[i] for i in small}

    def stored(tree):
        return replace_leaves(tree, storage.pack(tables_of(tree), num_workers))

    def unstored(tree):
        return replace_leaves(tree, storage.unpack(tables_of(tree), small))

    def run(trees: list):  # steps from trees[0], gradients trees[1:]
        tree = trees[0]
        state = optimizer.init(tree)
        for grads in trees[1:]:
            updates, state = optimizer.update(grads, state, tree)
            tree = optax.apply_updates(tree, updates)
        return tree

    start = jax.tree.leaves(apart[0])
    want = jax.tree.leaves(run(apart))
    got = jax.tree.leaves(unstored(run([stored(t) for t in apart])))
    for x, a, b in zip(start, want, got, strict=True):  # the moves, however small
        moved = np.asarray(a) - x
        scale = float(np.abs(moved).max(initial=0.0))
        if not np.allclose(np.asarray(b) - x, moved, rtol=1e-3, atol=1e-4 * scale + 1e-12):
            raise ValueError(error)


# ------------------------------------------------------------------ growth rules


def padded_slots(grow, need: int) -> int:
    """The slots a layout's buffers hold where the largest need of a batch is ``need``
    (``grow``, its ``CapacityPolicy.grow``; 0 for a table no batch reads): what its
    exchange sends, padding included, and what the planner prices.

    Example:
        >>> padded_slots(next_power_of_two, 90), padded_slots(grow_by_eighth, 90)
        (128, 104)
    """
    return grow(need) if need > 0 else 0


def next_power_of_two(need: int) -> int:
    """At least 8, doubling: a run compiles a handful of programs at most."""
    return 1 << max(3, (need - 1).bit_length())


def grow_by_quarter(need: int) -> int:
    """25% headroom, in multiples of 8: a buffer stays close to what it carries."""
    return max(8, -(-int(need * 1.25) // 8) * 8)


#: Standard deviations of a batch's distinct ids that ``grow_with_margin`` leaves free.
MARGIN_SIGMAS = 3.0


def grow_with_margin(need: int, sigmas: float = MARGIN_SIGMAS) -> int:
    """``need`` plus ``sigmas`` x sqrt(need), at least 8: sized once from the first
    batch, the slots hold the batches after it, so a run compiles no program after its
    first steps.

    The ids of a table that a worker reads differ from batch to batch, and so does how
    many are distinct. That count is a sum of "id v appears" indicators, negatively
    associated for independent draws, so its variance is at most its mean: one standard
    deviation is at most sqrt(need). A slot count is a maximum over workers (and over
    owners, for buckets), which spreads wider. ``experiments.studies.steady_slots``
    replays the rules on the needs of 200-batch Zipf streams (a DLRM column- and
    row-wise, an LM): at 3 no stream of 36 grew after its first batch; at 2.5, 2 did.

    Args:
      need: the slots the first batch needs.
      sigmas: standard deviations of margin.

    Returns:
      The slots.

    Example:
        >>> grow_with_margin(100), grow_with_margin(10_000), grow_with_margin(1)
        (130, 10300, 8)
    """
    return max(8, need + math.ceil(sigmas * math.sqrt(need)))


def grow_by_eighth(need: int) -> int:
    """12.5% headroom, in multiples of 8: rows are padded little, recompiles are rare."""
    return max(8, -(-int(need * 1.125) // 8) * 8)


def distinct_per_worker(reads: HostReads, i: int, shared: bool = True) -> np.ndarray:
    """int[P]: the distinct ids each worker reads of table ``i`` (its lookups and, with
    ``shared``, the ids every worker holds)."""
    look, common = reads[i]
    extra = common.ravel() if shared else np.zeros(0, look.dtype)
    return np.array([np.unique(np.concatenate([w.ravel(), extra])).size for w in look])


def reads_of(reads: list[Read], tables: set[int]) -> list[Read]:
    """The reads of ``tables`` (in order), lookups only."""
    return [r for r in reads if r.table in tables and r.ids is not None]
