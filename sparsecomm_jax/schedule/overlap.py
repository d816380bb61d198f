"""EmbRace's horizontal scheduling across steps: step t's low-priority exchange and its
table update run while step t+1's forward and backward run.

XLA:CPU runs the collectives and the independent compute of one program one after the
other, and two programs that both communicate at once break the collective library's
message order. So each step is four programs, one of them collective-free:

===========  ============================================================  ===========
program      what                                                          collectives
===========  ============================================================  ===========
``fetch``    rows of batch 0 (and again after a spill of the guard)        yes
``compute``  forward + backward of batch t+1 on rows fetched early         none
``high``     dense mean and update, first chunks, early update, next rows  yes
``low``      late chunks of step t and the update of the tables            yes
===========  ============================================================  ===========

``low`` of step t runs on a host thread beside ``compute`` of step t+1; ``high`` of
t+1 waits for both. ``run(..., fused=True)`` instead dispatches one program per step
(``fused``: step t-1's ``low`` and step t's ``compute`` with no data edge between them,
then step t's ``high``), the form for accelerators whose latency-hiding scheduler
overlaps a program's collectives with its independent compute.

The optimizer runs in two halves that merge exactly for optimizers that treat every
parameter element on its own (SGD, momentum, Adam, Adagrad, ...): ``high`` updates the
dense layers and the state that belongs to no parameter (a step count); ``low`` updates
the tables and their state from the count before step t (``split_roles``). Either
``TableUpdate`` works (dense, or the rows alone). A skipped non-finite step keeps both
halves and fetches batch t+1's rows from the unchanged tables.

Built by ``sparsecomm_jax.make_overlapped`` (``build`` here); its module,
``sparsecomm_jax.strategies.overlapped``, has a runnable example.

References:
    Li et al., "EmbRace", ICPP 2022, section 4 (2D communication scheduling).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.embedding import access, update
from sparsecomm_jax.embedding.row_optimizers import (
    DROP,
    NOT_A_PARAM,
    RowGrad,
    rows_step,
    treats_rows_alone,
)
from sparsecomm_jax.embedding.tables import split_tables
from sparsecomm_jax.errors import few
from sparsecomm_jax.schedule import pipeline, scopes
from sparsecomm_jax.step import apply, batches, capacities, placed_state
from sparsecomm_jax.step.apply import aggregate
from sparsecomm_jax.step.state import StepContext, TrainState


class Overlapped(NamedTuple):
    """A built overlapped trainer.

    Attributes:
      run: ``run(state, batch_at, steps, timeline=None, fused=False) -> (state,
        losses)``; with a list ``timeline``, appends ``(phase, step, start, end)`` host
        times (seconds).
      state: the initial ``TrainState`` on the devices.
      host_params: ``state -> params`` as numpy (tables gathered to V x D).
      ctx: the step context.
      programs: the jitted fetch, compute, high, low, fused (to lower them).
      place: ``place(batch, next, *later) -> PlacedBatch``.
    """

    run: Callable
    state: TrainState
    host_params: Callable
    ctx: StepContext
    programs: Any = None
    place: Callable | None = None


class Pending(NamedTuple):
    """Step t's late exchange, handed from ``high`` to ``low`` (per table index)."""

    firsts: dict  # (ids, rows) pairs at the owner: the first chunk, concatenated
    handed: dict  # what the table's carrier needs for its late chunks (Carrier.hand_over)
    ok: Any  # bool: no worker had a NaN/Inf gradient or loss
    other: list  # the optimizer state's leaves of no parameter, before step t


# ------------------------------------------------------- the optimizer's halves


def split_roles(ctx: StepContext, opt_state) -> list[str]:
    """``"table"``, ``"dense"`` or ``"other"`` (a step count) per optimizer-state leaf."""
    roles = jax.tree.leaves(apply.row_view(ctx, opt_state).roles)
    tables = {t.index for t in ctx.tables}
    return ["other" if r == NOT_A_PARAM else "table" if r in tables else "dense" for r in roles]


def with_other(kinds: list[str], opt_state, other: list):
    """``opt_state`` with its ``"other"`` leaves replaced by ``other`` (in order)."""
    leaves, treedef = jax.tree.flatten(opt_state)
    rest = iter(other)
    return treedef.unflatten(
        [next(rest) if k == "other" else x for k, x in zip(kinds, leaves, strict=True)]
    )


def pick(kinds: list[str], wanted: str, new, old):
    """The optimizer state with ``new``'s leaves of kind ``wanted``, else ``old``'s."""
    leaves_new, treedef = jax.tree.flatten(new)
    out = [
        n if k == wanted else o
        for k, n, o in zip(kinds, leaves_new, jax.tree.leaves(old), strict=True)
    ]
    return treedef.unflatten(out)


def dense_half(ctx: StepContext, state: TrainState, mean, ok, view) -> TrainState:
    """The optimizer on the dense layers (and the step count): the tables and their
    state untouched (the row view of no rows: no pass over a table). ``view`` reads and
    writes rows (``apply.row_view``)."""
    empty = {
        t.index: RowGrad(jnp.zeros((0,), jnp.int32), jnp.zeros((0, t.dim), jnp.float32))
        for t in ctx.tables
    }
    grads = apply.with_tables(ctx, mean, empty)
    params, opt_state = rows_step(
        ctx.optimizer, state.params, state.opt_state, grads, view.roles, ok, view.take, view.put
    )
    return TrainState(params, opt_state, state.agg_state)


# ---------------------------------------------------------------- the bodies


def compute_body(ctx: StepContext) -> Callable:
    """Forward and backward on rows fetched early: no collective. Returns the local
    loss float[1], local dense gradients (leading axis 1) and gradient rows."""
    loss_of_rows = access.answered_loss(ctx.loss_fn, ctx.table_mask)

    def body(params, rows, data):
        grad = jax.value_and_grad(lambda p, r: loss_of_rows(p, data, r), argnums=(0, 1))
        loss, (g, g_rows) = grad(params, list(rows))
        dense = split_tables(g, ctx.table_mask)[1]
        return loss[None], jax.tree.map(lambda x: x[None], dense), tuple(g_rows)

    return body


class HighOut(NamedTuple):
    """What the exchange half of ``high`` hands on (global arrays)."""

    mean: Any  # the dense layers' mean gradient (None at the tables)
    agg_state: Any
    firsts: dict  # table -> (ids, rows): its first pairs, concatenated
    first_grads: dict  # table -> RowGrad: the first chunk's mean gradient
    handed: dict  # table -> what its carrier hands to ``low`` (Carrier.hand_over)
    loss: Any
    ok: Any
    spill: Any


def high_exchange_body(ctx: StepContext) -> Callable:
    """The dense all-reduce, every table's plan and first chunk (by its carrier), and
    the step's scalars (loss, finite flag, spill) in one all-reduce."""
    widths, where = ctx.widths, pipeline.carrying(ctx)

    def body(state: TrainState, loss, g_dense, g_rows, batch) -> HighOut:
        leaves = jax.tree.leaves(state.params)
        reads = pipeline.pipelined_reads(ctx, state.params, batch.data)
        mean, agg_state = aggregate(ctx, jax.tree.map(lambda x: x[0], g_dense), state.agg_state)
        ahead = [batch.next, *batch.later] if batch.next is not None else []
        future = [pipeline.pipelined_reads(ctx, state.params, b) for b in ahead]
        tables, slots = {i: leaves[i] for i in widths}, batch.slots(ctx.tables)
        planned, spill = pipeline.carried_plans(ctx, reads, list(g_rows), future, slots, tables)
        pairs, plans = {}, {}
        with jax.named_scope(scopes.SCOPE_HIGH):
            for carrier, group in planned:
                got, group, more = carrier.first(where, group)
                pairs, plans, spill = pairs | got, plans | group, spill | more
        loss, ok, spill = apply.reduce_scalars(ctx, loss[0], (mean, agg_state, g_rows), spill)
        firsts = {
            i: (jnp.concatenate([a for a, _ in p]), jnp.concatenate([b for _, b in p]))
            for i, p in pairs.items()
        }
        first_grads = {
            i: pipeline.early_rows(ctx, p, plans[i], leaves[i]) for i, p in pairs.items()
        }
        carrier = {t.index: t.layout.pipelined.carrier for t in ctx.tables}
        handed = {i: carrier[i].hand_over(p) for i, p in plans.items()}
        return HighOut(mean, agg_state, firsts, first_grads, handed, loss, ok, spill)

    return body


def late_body(ctx: StepContext, capacity: tuple, last: bool) -> Callable:
    """Step t's late chunks, by each table's carrier from what ``high`` handed over
    (``Carrier.take_over``): each table's gradient as the ``TableUpdate`` wants it."""
    where = pipeline.carrying(ctx)

    def body(params, pending: Pending):
        leaves = jax.tree.leaves(params)
        slots = dict(
            zip((t.index for t in ctx.tables), capacity or (0,) * len(ctx.tables), strict=True)
        )
        fulls = {}
        with jax.named_scope(scopes.SCOPE_LOW):
            for carrier, mine in pipeline.carriers(ctx):
                plans = {
                    i: carrier.take_over(where, pending.handed[i], slots[i], last) for i in mine
                }
                later, _ = carrier.later(where, plans, ())
                for i in mine:
                    pairs = [pending.firsts[i], *later[i]]
                    fulls[i] = ctx.table_update.gradient(pairs, leaves[i], ctx.num_workers)
        return fulls

    return body


def table_half(ctx: StepContext, kinds, params, opt_state, fulls: dict, pending: Pending):
    """The optimizer on the tables (``ctx.table_update``) from the step count before
    step t: ``(table leaves, opt_state)`` with only the tables' state changed."""
    zeros = split_tables(jax.tree.map(jnp.zeros_like, params), ctx.table_mask)[1]
    grads = apply.with_tables(ctx, zeros, fulls)
    opt_in = with_other(kinds, opt_state, pending.other)
    view = apply.row_view(ctx, opt_in)
    new_p, new_s = ctx.table_update.apply(ctx.optimizer, params, opt_in, grads, pending.ok, view)
    leaves = jax.tree.leaves(new_p)
    return {t.index: leaves[t.index] for t in ctx.tables}, pick(kinds, "table", new_s, opt_state)


# ---------------------------------------------------------------- the programs


class Programs(NamedTuple):
    fetch: Callable
    compute: Callable
    high: Callable
    low: Callable
    fused: Callable  # low of step t-1 beside compute of step t, then high of step t


def _programs(ctx: StepContext, specs: TrainState, kinds: list[str]) -> Programs:
    """The jitted programs (specs follow the batch's structure)."""
    axis = ctx.axis_name
    rep, per = P(), P(axis)
    no_carry = specs._replace(carry=())
    grad_specs = apply.gradient_specs(ctx, specs.params)
    table_specs = apply.table_leaves(ctx, grad_specs.grads)
    row_specs = {t.index: t.layout.row_specs(axis) for t in ctx.tables}
    mean_specs = split_tables(specs.params, ctx.table_mask)[1]
    handed_specs = {t.index: t.layout.pipelined.carrier.hand_specs(axis) for t in ctx.tables}
    pending_specs = Pending(row_specs, handed_specs, rep, rep)
    high_specs = HighOut(
        mean_specs,
        per,
        row_specs,
        {i: RowGrad(*row_specs[i]) for i in ctx.widths},
        handed_specs,
        rep,
        rep,
        rep,
    )

    def smap(body, ins, outs, check_vma=True):
        return jax.shard_map(body, mesh=ctx.mesh, in_specs=ins, out_specs=outs, check_vma=check_vma)

    def data_specs(data):
        return batches.batch_specs(data, axis, ctx.replicated_keys)

    def fetch(params, data):
        return smap(pipeline.fetch_body(ctx), (specs.params, data_specs(data)), per)(params, data)

    def compute(params, rows, data):
        ins = (specs.params, per, data_specs(data))
        # no collective: each worker's own loss and gradients, untyped
        return smap(compute_body(ctx), ins, (per, per, per), check_vma=False)(params, rows, data)

    def high(state: TrainState, loss, g_dense, g_rows, batch):
        bspecs = batches.placed_specs(batch, axis, ctx.replicated_keys)
        ins = (no_carry, per, per, per, bspecs)
        h = smap(high_exchange_body(ctx), ins, high_specs)(state, loss, g_dense, g_rows, batch)
        new = dense_half(ctx, state, h.mean, h.ok, apply.row_view(ctx, state.opt_state))
        new = new._replace(agg_state=update.where(h.ok, h.agg_state, state.agg_state))
        carry = ()
        if batch.next is not None:
            patches = pipeline.early_patches(ctx, state, h.first_grads)
            patches = {i: p._replace(ids=jnp.where(h.ok, p.ids, DROP)) for i, p in patches.items()}
            first_specs = {i: RowGrad(*row_specs[i]) for i in ctx.widths}
            carry, _ = smap(
                pipeline.next_rows_body(ctx),
                (specs.params, first_specs, bspecs.next, {}),
                (per, {}),
            )(state.params, patches, batch.next, {})
        other = [
            x for k, x in zip(kinds, jax.tree.leaves(state.opt_state), strict=True) if k == "other"
        ]
        pend = Pending(h.firsts, h.handed, h.ok, other)
        return new, carry, pend, jnp.where(h.ok, h.loss, jnp.nan), h.spill

    def low(params, opt_state, pend: Pending, capacity, last):
        pend_specs = pending_specs._replace(other=jax.tree.map(lambda _: rep, pend.other))
        fulls = smap(late_body(ctx, capacity, last), (specs.params, pend_specs), table_specs)(
            params, pend
        )
        return table_half(ctx, kinds, params, opt_state, fulls, pend)

    def fused(state: TrainState, pend: Pending, rows, batch, capacity):
        with jax.named_scope(scopes.SCOPE_LOW):
            tables, opt_state = low(state.params, state.opt_state, pend, capacity, False)
        out = compute(state.params, rows, batch.data)
        params = replace_tables(state.params, tables)
        with jax.named_scope(scopes.SCOPE_HIGH):
            return high(state._replace(params=params, opt_state=opt_state), *out, batch)

    return Programs(
        jax.jit(fetch),
        jax.jit(compute),
        jax.jit(high),
        jax.jit(low, static_argnums=(3, 4)),
        jax.jit(fused, static_argnums=4),
    )


def replace_tables(params, tables: dict):
    """``params`` with the table leaves in ``tables`` (leaf index -> array)."""
    leaves, treedef = jax.tree.flatten(params)
    return treedef.unflatten([tables.get(i, x) for i, x in enumerate(leaves)])


def _timed(timeline, phase: str, step: int, fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    if timeline is not None:
        timeline.append((phase, step, start, time.perf_counter()))
    return out


def _runner(ctx: StepContext, progs: Programs, place: Callable) -> Callable:
    def placed(batch_at, step, steps):
        if step + 1 == steps:
            return place(batch_at(step))
        ahead = [min(s, steps - 1) for s in range(step + 1, step + 1 + pipeline.LOOKAHEAD)]
        return place(batch_at(step), *(batch_at(s) for s in ahead))

    def late(timeline, t, state, pend, capacity, last=False):
        tables, opt_state = _timed(
            timeline, "low", t, progs.low, state.params, state.opt_state, pend, capacity, last
        )
        return state._replace(params=replace_tables(state.params, tables), opt_state=opt_state)

    def run(state: TrainState, batch_at, steps: int, timeline=None, fused: bool = False):
        if fused:
            return run_fused(state, batch_at, steps, timeline)
        state, losses = state._replace(carry=()), []
        batch = placed(batch_at, 0, steps)
        rows = _timed(timeline, "fetch", 0, progs.fetch, state.params, batch.data)
        out = _timed(timeline, "compute", 0, progs.compute, state.params, rows, batch.data)
        with ThreadPoolExecutor(1) as pool:
            for t in range(steps):
                state, rows, pend, loss, spill = _timed(
                    timeline, "high", t, progs.high, state, *out, batch
                )
                losses.append(loss)
                last = t + 1 == steps
                pending = pool.submit(late, timeline, t, state, pend, batch.capacity, last)
                if not last:
                    batch = placed(batch_at, t + 1, steps)
                    out = _timed(
                        timeline, "compute", t + 1, progs.compute, state.params, rows, batch.data
                    )
                state = pending.result()
                if not last and bool(spill):  # guard: fetch after the full update, recompute
                    rows = _timed(timeline, "fetch", t + 1, progs.fetch, state.params, batch.data)
                    out = _timed(
                        timeline, "compute", t + 1, progs.compute, state.params, rows, batch.data
                    )
        return state, [float(np.asarray(x)) for x in losses]

    def run_fused(state: TrainState, batch_at, steps: int, timeline=None):
        state, losses = state._replace(carry=()), []
        batch = placed(batch_at, 0, steps)
        rows = _timed(timeline, "fetch", 0, progs.fetch, state.params, batch.data)
        out = _timed(timeline, "compute", 0, progs.compute, state.params, rows, batch.data)
        state, rows, pend, loss, spill = _timed(timeline, "high", 0, progs.high, state, *out, batch)
        losses.append(loss)
        for t in range(1, steps):
            capacity, batch = batch.capacity, placed(batch_at, t, steps)
            if bool(spill):  # guard: step t-1's update now, rows again, a no-op pending
                state = late(timeline, t - 1, state, pend, capacity)
                pend = pend._replace(ok=jnp.array(False))
                rows = _timed(timeline, "fetch", t, progs.fetch, state.params, batch.data)
            state, rows, pend, loss, spill = _timed(
                timeline, "fused", t, progs.fused, state, pend, rows, batch, capacity
            )
            losses.append(loss)
        state = late(timeline, steps - 1, state, pend, batch.capacity, True)
        return state, [float(np.asarray(x)) for x in losses]

    return run


def hands_over(layout) -> bool:
    """Whether ``make_overlapped`` can carry a table of ``layout``: its carrier hands
    its late chunks to another program (``Carrier.hand_over``)."""
    return layout.pipelined is not None and layout.pipelined.carrier.hand_over is not None


def build(ctx: StepContext) -> Overlapped:
    """The overlapped trainer of a ``StepContext`` (``strategies.make_overlapped``
    builds one from the same arguments as ``make_train_step``).

    Raises:
      ValueError: an optimizer that couples rows (its two halves would not merge), or
        a table whose layout's carrier cannot hand its late chunks to another program.
    """
    if not treats_rows_alone(ctx.optimizer, ctx.params):
        raise ValueError(
            "make_overlapped splits the optimizer's step into the dense layers' and the "
            "tables' halves, which needs an optimizer that updates each parameter row on "
            "its own (SGD, momentum, Adam, Adagrad, ...); this one couples rows (e.g. "
            "optax.clip_by_global_norm, a trust ratio): use make_train_step(..., "
            "'embrace_2d') instead, which is exact with it"
        )
    if others := [t.name for t in ctx.tables if not hands_over(t.layout)]:
        raise ValueError(
            "make_overlapped sends the late chunks from a program of their own, which their "
            f"carrier allows for column-wise tables only; {few(others)} have other layouts "
            "(table_layouts): use make_train_step(..., 'embrace_2d'), which takes a layout "
            "per table"
        )
    state, specs = placed_state.place_state(ctx, unpadded=True)
    kinds = split_roles(ctx, state.opt_state)
    progs = _programs(ctx, specs, kinds)
    policies = capacities.layout_policies(ctx, pipeline.carried_capacity)
    place = batches.batch_placer(ctx, policies, pipeline.LOOKAHEAD)
    return Overlapped(
        run=_runner(ctx, progs, place),
        state=state,
        host_params=lambda s: jax.tree.map(runtime.to_host, s.params),
        ctx=ctx,
        programs=progs,
        place=place,
    )
