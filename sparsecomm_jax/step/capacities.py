"""How many static slots a step's buffers need, sized on the host from each batch.

Each layout's ``capacity`` policy (or a strategy's own, as ``embrace_2d``'s for the
tables it carries) measures what a batch needs per table; ``capacity_fn`` grows the
slots when a batch needs more (a new program) and never shrinks them, or holds a fixed
``capacity``. A step whose ids outgrew its slots returns a loss of +inf
(``overflow_message`` says what to do).

Example:
    >>> from sparsecomm_jax.embedding.column import CAPACITY
    >>> grow_capacities({0: 16}, {0: 12, 1: 100}, None, CAPACITY)  # 100 + 3 sqrt(100)
    {0: 16, 1: 130}
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from sparsecomm_jax.embedding import access
from sparsecomm_jax.embedding.layout import CapacityPolicy, Layout
from sparsecomm_jax.step.state import Batch, StepContext


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

    Example: current {0: 16}, needs {0: 12, 1: 100}, column-wise -> {0: 16, 1: 130}.
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


class CapacityWarning(RuntimeWarning):
    """A step read more distinct ids of a table than its batch's capacity had slots."""


def overflow_message(ts, batch) -> str:
    """What to tell when ``ts.step`` on ``batch`` (a ``batches.PlacedBatch``) returned a
    loss of +inf (``apply.mark_missed``): some table's ids needed more slots than
    ``batch.capacity`` gave.

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
