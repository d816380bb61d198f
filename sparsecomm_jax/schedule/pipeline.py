"""EmbRace's 2D scheduling as a train step: ``embrace_2d``.

One pipelined step (batch t, with batches t+1..t+``LOOKAHEAD`` known) for the tables
whose layout says how it is carried (``Layout.pipelined``: the column, row and hot
layouts, and any registered layout that has a ``Pipelined``):

1. **exchange** (one ``shard_map``): batch t's forward and backward read rows fetched
   during step t-1 (or now, at the first step); the dense layers go through the
   aggregator; each carried table's gradient travels by its layout's carrier
   (``Pipelined.carrier``), first the positions batch t+1 reads (every carrier's first
   chunk before any later one), then the rest once every first chunk has arrived;
2. **early update**: the optimizer on the row view of the first chunk alone gives the
   update of the rows batch t+1 reads (exact for optimizers that treat rows
   independently: all of those rows' gradient is in the first chunk);
3. **next rows** (one ``shard_map``): batch t+1's rows, read by the carriers from the
   tables with that update added (``layout.patched_take``), never a copy of a table;
4. **the update** of every parameter, as ``embrace`` makes it (dense or row-sparse);
5. **the guard**: a row batch t+1 reads that missed the first chunk, or a skipped step,
   marks the carried rows stale (``Carried``); step t+1 exchanges on the carried rows
   at once (nothing of it waits for step t's late chunks) and, where they were stale,
   does its exchange again on rows fetched from the final tables (a ``jax.lax.cond``:
   exact, slower, rare). Several steps unrolled in one program call
   (``TrainStep.steps``) so let step t+1's forward and backward pass run while step
   t's late chunks are in flight.

A carrier serves every table of every layout that names it (``column.CARRIER``: each
table's positions in priority chunks; ``row.CARRIER``: two chunks to the owners for
every row-wise and hot table in one exchange each). A layout may carry only part of a
table's ids (``Pipelined.carried``: a hot table's cold rows), read the rest where it
lies (``Pipelined.near``) and send their gradients with the late chunks
(``Pipelined.late``). Tables of layouts without a ``Pipelined`` (table-wise,
replicated) run beside the carried ones: their rows are fetched in step t's exchange,
before the forward pass, through their layout, and their gradients return after every
first chunk, as ``embrace`` reads them. This module names no layout.

With replica groups (``replicas=R``) each group exchanges its chunks within itself;
the priorities are those of every group's next batches (a row any group reads next
goes first everywhere), and each table's first chunks, then its later ones, are summed
across the groups (``replica_groups.sum_tables``), so the early update sees the whole
gradient of the rows it moves.

Equal to ``embrace`` with the same table update. The dense layers have no data
dependency on the table exchange, so an accelerator's scheduler may overlap them.

The schedule pays only by hiding communication behind compute. Where a program's
collectives cannot run beside its compute (``StepContext.overlap`` false: XLA:CPU runs
a program's thunks one after the other), the early chunk, the early update and the
second fetch can only add time, so ``make_train_step`` does not build this program
there: ``embrace``'s step runs, every row in one exchange after the backward pass,
under this strategy's rules (``registry.Strategy.serial``; ``collectives_overlap=True``
builds this program anyway).

References:
    Li et al., "EmbRace", ICPP 2022, section 4.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.comm.order import edge, waits_for
from sparsecomm_jax.comm.vma import vary
from sparsecomm_jax.embedding import access, replica_groups
from sparsecomm_jax.embedding.gradients import fetch_all, outside
from sparsecomm_jax.embedding.layout import CapacityPolicy, Carrier, Carrying, Layout
from sparsecomm_jax.embedding.row_optimizers import RowGrad, row_updates, treats_rows_alone
from sparsecomm_jax.embedding.tables import split_tables
from sparsecomm_jax.embedding.update import row_gradient
from sparsecomm_jax.schedule import scopes
from sparsecomm_jax.step import apply, batches
from sparsecomm_jax.step.apply import Gradients, aggregate, apply_gradients
from sparsecomm_jax.step.batches import PlacedBatch
from sparsecomm_jax.step.state import StepContext, TrainState

LOOKAHEAD = 3  # batches t+1..t+3 order the late rows (those t+1 reads go first)

NO_ATTEND_2D = (
    "embrace_2d needs tables that are read by lookups only; a full softmax over a table "
    "(emb.attend) needs the whole updated table before the next step: use a sampled "
    "softmax (models: --sampled-softmax N)"
)


def carried_capacity(layout: Layout) -> CapacityPolicy | None:
    """The plan of the ids of a table the pipeline carries (``Pipelined.capacity`` made
    from the layout's own), or ``None`` for a layout it does not carry (its own plan)."""
    if layout.pipelined is None:
        return None
    return layout.pipelined.capacity(layout.capacity)


def carried_tables(ctx: StepContext) -> set[int]:
    """The tables whose rows the pipeline carries across steps: those whose layout has
    a ``Pipelined``. The others (table-wise, replicated) are read through their layouts
    within the step (``step_rows``)."""
    return {t.index for t in ctx.tables if t.layout.pipelined is not None}


def carriers(ctx: StepContext) -> list[tuple[Carrier, list[int]]]:
    """Each carrier with the carried tables it exchanges, in the tables' order (the
    tables of every layout naming one carrier travel together)."""
    out: list[tuple[Carrier, list[int]]] = []
    for t in ctx.tables:
        if t.layout.pipelined is None:
            continue
        carrier = t.layout.pipelined.carrier
        for known, tables in out:
            if known is carrier:
                tables.append(t.index)
                break
        else:
            out.append((carrier, [t.index]))
    return out


def carrying(ctx: StepContext) -> Carrying:
    """Where the carriers run: the step's table axis, its batch axes, its workers."""
    return Carrying(ctx.axis_name, ctx.batch_axes, ctx.num_workers)


def _table(ctx: StepContext, i: int):
    return next(t for t in ctx.tables if t.index == i)


def as_carried(ctx: StepContext, read):
    """``read`` as its table's carrier exchanges it (``Pipelined.carried``: a hot table's
    ids as their stored rows where cold, -1 where hot); another read as it is."""
    table = _table(ctx, read.table)
    pipelined = table.layout.pipelined
    if pipelined is None or pipelined.carried is None:
        return read
    return read._replace(ids=pipelined.carried(table, ctx.group_size, read.ids))


def with_near_rows(ctx: StepContext, read, got, shard):
    """The carried rows of ``read`` with those its layout reads where they lie
    (``Pipelined.near``: a hot table's hot rows from this worker's block, as the step's
    tables hold them); otherwise ``got``."""
    table = _table(ctx, read.table)
    pipelined = table.layout.pipelined
    if pipelined is None or pipelined.near is None:
        return got
    return pipelined.near(table, ctx.group_size, read.ids, got, shard)


def pipelined_reads(ctx: StepContext, params, data, attend_error: str = "") -> list:
    """``ctx.reads``, refusing a read of no ids (a bag of width 0) of a carried table
    whose carrier cannot plan one (``Carrier.empty_reads``: the column carrier plans each
    table's positions from its reads and has none to plan; ``embrace`` takes it, as do
    the row-wise and hot tables, which send nothing for it, and the tables read within
    the step)."""
    reads = ctx.reads(params, data, attend_error)
    refused = {
        t.index: t.name
        for t in ctx.tables
        if t.layout.pipelined is not None and not t.layout.pipelined.carrier.empty_reads
    }
    if empty := sorted({refused[r.table] for r in reads if r.ids.size == 0 and r.table in refused}):
        raise ValueError(
            f"tables {empty} are read with no ids (a bag of width 0): the pipelined step "
            "(embrace_2d, make_overlapped) cannot plan such a read; use embrace"
        )
    return reads


def carried_reads(ctx: StepContext, reads: list) -> list:
    """The reads of ``reads`` whose rows the pipeline carries (``carried_tables``)."""
    carried = carried_tables(ctx)
    return [r for r in reads if r.table in carried]


def step_rows(ctx: StepContext, carry, reads: list, leaves: list, slots: dict[int, int]):
    """Every read's rows for the step's forward pass: a carried table's carried from
    step t-1 (or fetched now, at the first step; with the rows its layout reads where
    they lie, ``with_near_rows``), another layout's fetched now through that layout
    (``gradients.fetch_all``).

    Returns:
      ``(rows, back, missed)``: per read ``float[*ids.shape, D]``; ``back(g_rows)`` ->
      ``[(table index, (ids, rows)), ...]``, the other layouts' gradients at their
      owners (``g_rows`` every read's); table index -> ``missed`` flag (the other
      layouts' ``Fetched.missed``, and a carried table's id outside it).
    """
    carried = carried_tables(ctx)
    mine = [k for k, r in enumerate(reads) if r.table in carried]
    others = [k for k, r in enumerate(reads) if r.table not in carried]
    if carry != ():
        got = list(carry)
    else:
        tables = {i: leaves[i] for i in carried}
        got = prefetch(ctx, tables, [reads[k] for k in mine], slots)
    got = [
        with_near_rows(ctx, reads[k], g, leaves[reads[k].table])
        for k, g in zip(mine, got, strict=True)
    ]
    rows = dict(zip(mine, got, strict=True))
    back, missed = (lambda g_rows: []), {}
    if others:
        tables = tuple(t for t in ctx.tables if t.index not in carried)
        read = [reads[k] for k in others]
        got, back_of, missed = fetch_all(tables, leaves, read, slots, ctx.axis_name, ctx.wire)
        rows.update(zip(others, got, strict=True))

        def back(g_rows):
            return back_of([g_rows[k] for k in others])

    # an id the model computes outside a carried table (the host checks the batch's):
    # the step is marked, as the layouts' own fetch marks it
    missed = or_flags(missed, outside(ctx.tables, [reads[k] for k in mine]))
    return [rows[k] for k in range(len(reads))], back, missed


def or_flags(flags: dict, more: dict) -> dict:
    """Table index -> bool[]: ``flags`` or'ed with ``more``, table by table."""
    out = dict(flags)
    for i, flag in more.items():
        out[i] = out[i] | flag if i in out else flag
    return out


def prefetch(
    ctx: StepContext, tables: dict[int, Any], reads: list, slots: dict[int, int], patches=None
) -> list:
    """Rows for each logged read of a carried table, from ``tables``, by each table's
    carrier (``Carrier.fetch``, one call a carrier for all its tables' reads, as the
    carrier exchanges them: ``as_carried``; ``slots`` the tables' capacities). With
    ``patches`` (table index -> ``RowGrad``) each row is read with its early update
    added. Typed as varying over the batch axes, as the carry is."""
    out: list = [None] * len(reads)
    for carrier, mine in carriers(ctx):
        ks = [k for k, r in enumerate(reads) if r.table in mine]
        if not ks:
            continue
        shards = {i: tables[i] for i in mine}
        sent = [as_carried(ctx, reads[k]) for k in ks]
        patch = None if patches is None else {i: patches[i] for i in mine}
        got = carrier.fetch(carrying(ctx), shards, sent, slots, patch)
        for k, rows in zip(ks, got, strict=True):
            out[k] = rows
    return vary(out, ctx.batch_axes)  # a sum over the workers (shared ids) is typed the same


# ----------------------------------------------------------- 1. the exchange


def across_groups(ctx: StepContext, pairs: dict[int, list], tables: dict) -> dict[int, list]:
    """With replica groups, each table's pairs summed over the groups
    (``replica_groups.sum_tables``: the first chunks in one exchange, the later ones in
    another); without, ``pairs``. A group's first chunk holds every row any group reads
    next (``priority.future_ids``), so their sum is the whole gradient of those rows."""
    if not ctx.replica_axis:
        return pairs
    rows = {i: tables[i].shape[0] for i in pairs}
    return replica_groups.sum_tables(pairs, rows, ctx.replica_axis, ctx.replica_sync)


def late_extras(ctx: StepContext, reads, g_rows, tables, after, later: dict) -> dict[int, list]:
    """The late pairs (``later``) of the tables whose layout sends more with them
    (``Pipelined.late``: a hot table's hot rows' all-reduce), that more added; each
    layout's tables in one call, its gradients sent once ``after`` (every first chunk)
    has arrived."""
    by_layout: dict[int, tuple[Any, dict]] = {}
    for t in ctx.tables:
        pipelined = t.layout.pipelined
        if pipelined is not None and pipelined.late is not None:
            by_layout.setdefault(id(pipelined), (pipelined, {}))[1][t.index] = t
    out: dict[int, list] = {}
    for pipelined, mine in by_layout.values():
        ks = [k for k, r in enumerate(reads) if r.table in mine]
        if not ks:
            continue
        grads = [waits_for(g_rows[k], after) for k in ks]
        more = pipelined.late(
            mine,
            ctx.group_size,
            [reads[k] for k in ks],
            grads,
            tables,
            ctx.axis_name,
            ctx.wire.backward,
        )
        for i, pair in more:
            out[i] = [*out.get(i, later.get(i, [])), pair]
    return out


def in_step_pairs(back, g_rows: list, after) -> dict[int, list]:
    """The gradients of the tables read within the step (``step_rows``) at their
    owners, table index -> pairs, sent once ``after`` (every carried table's first
    chunk) has arrived."""
    pairs: dict[int, list] = {}
    for i, pair in back([waits_for(g, after) for g in g_rows]):
        pairs.setdefault(i, []).append(pair)
    return pairs


def carried_plans(ctx: StepContext, reads, g_rows, future, slots, tables) -> tuple[list, Any]:
    """Every carrier's plans of its tables (``Carrier.plan``, on the reads as it
    exchanges them): ``([(carrier, table index -> plan), ...], spill)``; ``spill``
    bool[], a position batch t+1 reads did not fit a first chunk."""
    planned, spill = [], jnp.array(False)
    for carrier, mine in carriers(ctx):
        ks = [k for k, r in enumerate(reads) if r.table in mine]
        sent = [as_carried(ctx, reads[k]) for k in ks]
        ahead = [[as_carried(ctx, r) for r in batch if r.table in mine] for batch in future]
        shards = {i: tables[i] for i in mine}
        plans, more = carrier.plan(
            carrying(ctx), shards, sent, [g_rows[k] for k in ks], ahead, slots
        )
        planned.append((carrier, plans))
        spill = spill | more
    return planned, spill


def chunks_of(ctx: StepContext, planned: list, spill, tables) -> tuple[dict, dict, dict, Any]:
    """Every carried table's chunks at the owners (summed across replica groups): every
    carrier's first chunks, then the late ones, which wait for every first chunk.

    Returns:
      ``(firsts, later, missed, spill)``: table index -> first-chunk pairs, -> late pairs
      (before the groups' sum: the caller adds the other tables'), -> bool[] a late
      position found no slot; ``spill`` with the first chunks' own misses added.
    """
    where, firsts, sent = carrying(ctx), {}, []
    with jax.named_scope(scopes.SCOPE_HIGH):
        for carrier, plans in planned:
            pairs, plans, more = carrier.first(where, plans)
            firsts |= pairs
            sent.append((carrier, plans))
            spill = spill | more
        firsts = across_groups(ctx, firsts, tables)
    later, missed = {}, {}
    with jax.named_scope(scopes.SCOPE_LOW):
        after = tuple(rows for pairs in firsts.values() for _, rows in pairs)
        for carrier, plans in sent:
            pairs, lost = carrier.later(where, plans, after)
            later |= pairs
            missed |= lost
    return firsts, later, missed, spill


class Exchanged(NamedTuple):
    """What the exchange program hands on (global arrays once out of ``shard_map``)."""

    grads: Gradients  # loss, finite flag, the step's mean gradient, agg_state, missed
    firsts: dict  # carried table index -> RowGrad: the first chunk's mean gradient
    spill: jax.Array  # on every worker: a row batch t+1 reads missed the first chunk


def exchange_body(ctx: StepContext):
    """Step 1 per worker: forward/backward on the carried rows (and the rows of the
    tables read within the step), the dense layers' aggregation, every carrier's first
    chunk, then the late chunks, what the layouts send with them (``late_extras``) and
    the other tables' gradients."""
    widths, mask = ctx.widths, ctx.table_mask
    loss_of_rows = access.answered_loss(ctx.loss_fn, mask, attend_error=NO_ATTEND_2D)

    def body(state: TrainState, batch: PlacedBatch) -> Exchanged:
        params, leaves = state.params, jax.tree.leaves(state.params)
        reads = pipelined_reads(ctx, params, batch.data, NO_ATTEND_2D)
        tables, slots = {i: leaves[i] for i in widths}, batch.slots(ctx.tables)
        with jax.named_scope(scopes.SCOPE_ROWS):  # nothing for carried rows after step 0
            rows, back, missed = step_rows(ctx, state.carry, reads, leaves, slots)
        varying = vary((params, rows), ctx.batch_axes)  # each worker's own gradient
        grad_fn = jax.value_and_grad(lambda p, r: loss_of_rows(p, batch.data, r), argnums=(0, 1))
        loss, (g_params, g_rows) = grad_fn(*varying)
        with jax.named_scope(scopes.SCOPE_DENSE):
            rest, agg_state = aggregate(ctx, split_tables(g_params, mask)[1], state.agg_state)
        ahead = [batch.next, *batch.later] if batch.next is not None else []
        future = [pipelined_reads(ctx, params, b) for b in ahead]
        planned, spill = carried_plans(ctx, reads, g_rows, future, slots, tables)
        firsts, later, lost, spill = chunks_of(ctx, planned, spill, tables)
        missed = or_flags(missed, lost)
        with jax.named_scope(scopes.SCOPE_LOW):
            after = tuple(rows for pairs in firsts.values() for _, rows in pairs)
            later |= late_extras(ctx, reads, g_rows, tables, after, later)
            later = across_groups(ctx, later | in_step_pairs(back, g_rows, after), tables)
        num = ctx.num_workers
        fulls = {
            i: ctx.table_update.gradient(firsts.get(i, []) + later.get(i, []), tables[i], num)
            for i in widths
        }
        grads = apply.with_tables(ctx, rest, fulls)
        grads, spill = apply.gradients_and_flags(ctx, loss, grads, agg_state, missed, spill)
        plans = {i: plan for _, group in planned for i, plan in group.items()}
        firsts = {i: early_rows(ctx, pairs, plans[i], tables[i]) for i, pairs in firsts.items()}
        return Exchanged(grads, firsts, spill)

    return body


# ------------------------------------------------- 2. early update, 3. next rows


def early_rows(ctx: StepContext, pairs: list, plan, shard) -> RowGrad:
    """The rows batch t+1 reads that the step moves (a carrier's plan: its ``next_ids``),
    with their first-chunk gradient (``TableUpdate.early_rows``); at the last step the
    first chunk alone."""
    if plan.next_ids is None:
        return row_gradient(pairs, shard, ctx.num_workers)
    return ctx.table_update.early_rows(pairs, plan.next_ids, shard, ctx.num_workers)


def early_patches(ctx: StepContext, state: TrainState, firsts: dict[int, RowGrad]) -> dict:
    """Table index -> ``RowGrad(ids, update rows)``: the optimizer's step on the row view
    of the first chunk alone (zero gradient for every other leaf, so nothing here waits
    for the dense all-reduce, and the tables read within the step are left to the
    update: their updates here are unused); its new state is dropped (the update
    recomputes it)."""
    view = apply.row_view(ctx, state.opt_state)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads = apply.with_tables(ctx, zeros, firsts)
    updates = row_updates(
        ctx.optimizer, state.params, state.opt_state, grads, view.roles, view.take
    )
    leaves = jax.tree.leaves(updates)
    return {i: RowGrad(g.ids, leaves[i]) for i, g in firsts.items()}


def next_rows_body(ctx: StepContext, slots: dict[int, int] | None = None):
    """Step 3 per worker: batch t+1's rows from the tables with the early update added;
    the carried tables' full gradient made to wait for those reads (the update then
    writes those tables in place). ``slots``: the carried tables' capacities."""
    widths = ctx.widths

    def body(params, patches, data, fulls):
        leaves = jax.tree.leaves(params)
        reads = carried_reads(ctx, pipelined_reads(ctx, params, data))
        tables = {i: leaves[i] for i in widths}
        with jax.named_scope(scopes.SCOPE_NEXT):
            rows = prefetch(ctx, tables, reads, slots or {}, patches)
        read = edge(rows, ctx.replica_axis)  # once for every leaf
        # the carried tables' gradients only: they are read here (a table read within
        # the step is not, and one typed replicated, such as a replicated table's,
        # must not take this worker's edge)
        carried = carried_tables(ctx)
        fulls = {
            i: jax.tree.map(lambda g: waits_for(g, read) if _is_float(g) else g, f)
            if i in carried
            else f
            for i, f in fulls.items()
        }
        return tuple(rows), fulls

    return body


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


# ----------------------------------------------------------------- 5. the guard


class Carried(NamedTuple):
    """What a pipelined step hands the next (``TrainState.carry``): batch t+1's rows of
    every carried read, per worker, and whether they may be stale (the same on every
    worker): a row batch t+1 reads missed the first chunk (its early update lacks part
    of its gradient), or the step was skipped (the early update may hold NaN; the
    tables were kept). The next step exchanges on the carried rows without waiting for
    this step's late chunks, and where they were stale redoes its exchange on rows
    fetched from the tables (``jax.lax.cond``: every worker takes the same branch)."""

    rows: tuple  # per carried read float[*ids.shape, D], each worker's own
    stale: jax.Array  # bool[]


def fetch_body(ctx: StepContext, slots: dict[int, int] | None = None):
    """Rows of every read of ``data`` the pipeline carries (per worker), from the
    tables (``slots``: the carried tables' capacities)."""

    def body(params, data):
        reads = carried_reads(ctx, pipelined_reads(ctx, params, data, NO_ATTEND_2D))
        leaves = jax.tree.leaves(params)
        return tuple(prefetch(ctx, {i: leaves[i] for i in ctx.widths}, reads, slots or {}))

    return body


# ------------------------------------------------------------------ the step


def pipelined_step(ctx: StepContext, specs: TrainState):
    """``step(state, batch) -> (state, loss)`` of ``embrace_2d`` (see the module doc):
    three ``shard_map`` programs and two optimizer steps on global arrays, one jitted
    program in all. An optimizer that couples rows (clipping by global norm, a trust
    ratio: ``row_optimizers.treats_rows_alone`` is false) cannot update the next batch's
    rows from the first chunk alone: its step fetches them after the update (exact, the
    schedule's gain lost)."""
    axis = ctx.axis_name
    early = treats_rows_alone(ctx.optimizer, ctx.params)
    per = P(ctx.batch_axes)  # each worker's own (rows carried, batches)
    grad_specs = apply.gradient_specs(ctx, specs.params, missed=True)
    carried = carried_tables(ctx)
    first_specs = {
        t.index: RowGrad(*t.layout.row_specs(axis)) for t in ctx.tables if t.index in carried
    }
    table_specs = apply.table_leaves(ctx, grad_specs.grads)

    def smap(body, ins, outs):
        return jax.shard_map(body, mesh=ctx.mesh, in_specs=ins, out_specs=outs)

    def step(state: TrainState, batch: PlacedBatch):
        batch_specs = batches.placed_specs(batch, ctx.batch_axes, ctx.replicated_keys)
        slots = batch.slots(ctx.tables)  # the carried tables' capacities (batch t and t+1)
        out = Exchanged(grad_specs, first_specs, P())

        def exchange(rows):  # rows: () at the first step (it fetches its own)
            state_in = specs._replace(carry=per if rows != () else ())
            run = smap(exchange_body(ctx), (state_in, batch_specs), out)
            return run(state._replace(carry=rows), batch)

        def fetch(params, data, data_specs):
            return smap(fetch_body(ctx, slots), (specs.params, data_specs), per)(params, data)

        if state.carry == ():
            ex = exchange(())
        else:  # speculative: on the carried rows, redone from the tables if they were stale
            rows, stale = state.carry
            ex_carried = exchange(rows)
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ex_carried)

            def again():
                with jax.named_scope(scopes.SCOPE_REFETCH):
                    rows = fetch(state.params, batch.data, batch_specs.data)
                return exchange(rows)

            def nothing():  # from shapes alone: this branch waits for none of the step
                return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

            ex_again = jax.lax.cond(stale, again, nothing)
            # selected leaf by leaf: what needs only the carried exchange never waits
            # for the conditional (whose refetch reads the tables step t-1 wrote)
            ex = jax.tree.map(lambda a, b: jnp.where(stale, a, b), ex_again, ex_carried)
        grads, carry = ex.grads, ()
        if batch.next is not None and early:
            patches = early_patches(ctx, state, ex.firsts)
            fulls = apply.table_leaves(ctx, grads.grads)
            carry, fulls = smap(
                next_rows_body(ctx, slots),
                (specs.params, first_specs, batch_specs.next, table_specs),
                (per, table_specs),
            )(state.params, patches, batch.next, fulls)
            grads = grads._replace(grads=apply.with_tables(ctx, grads.grads, fulls))
        new, loss = apply_gradients(ctx, state, grads._replace(carry=()))
        loss = apply.mark_missed(grads.missed, loss)
        if batch.next is None:
            return new, loss
        if not early:  # the next rows from the updated tables
            rows = fetch(new.params, batch.next, batch_specs.next)
            return new._replace(carry=Carried(rows, jnp.array(False))), loss
        stale = ex.spill | ~grads.ok if ctx.nonfinite != "off" else ex.spill
        return new._replace(carry=Carried(carry, stale)), loss

    return step
