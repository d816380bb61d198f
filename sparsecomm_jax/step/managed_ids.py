"""A step's managed tables (``embedding.managed``): their ids mapped to slots as a
batch is placed, and the fresh slots started at the start of the step's program.

``jit_step`` calls ``managed_step`` when a table's layout maps ids
(``Layout.maps_ids``); it gives back the step and its placers wrapped, and the
``Vocabularies`` the ``TrainStep`` holds (``TrainStep.vocabulary``).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> from sparsecomm_jax import make_train_step, runtime
    >>> def loss(p, b, emb):
    ...     return jnp.mean(emb.lookup(p["items"], b["item"]).sum(-1) ** 2)
    >>> params = {"items": jnp.zeros((64, 2))}
    >>> ts = make_train_step(loss, optax.sgd(0.1), runtime.data_mesh(), params,
    ...                      "embrace_rowwise", embedding_paths=["items"],
    ...                      table_layouts={"items": "managed"})
    >>> n = len(jax.devices())
    >>> state, _ = ts.step(ts.state, ts.place_batch({"item": np.arange(n) * 2**40}))
    >>> ts.vocabulary.evictions()
    {'items': 0}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime
from sparsecomm_jax.embedding import access, managed
from sparsecomm_jax.embedding.layout import grow_with_margin
from sparsecomm_jax.errors import NO_VALUE, ArgumentError
from sparsecomm_jax.step.batches import PlacedBatch
from sparsecomm_jax.step.state import StepContext, TrainState


def managed_tables(ctx: StepContext) -> tuple:
    """The tables of ``ctx`` whose layout maps ids (``Layout.maps_ids``)."""
    return tuple(t for t in ctx.tables if t.layout.maps_ids)


def vocabularies(ctx: StepContext) -> managed.Vocabularies:
    """The ``Vocabularies`` of ``ctx``'s managed tables, on the workers of a group."""
    tables = managed_tables(ctx)
    for t in tables:  # refused naming the argument: --plan at the command line
        if problem := managed.Blocks(t.vocab, ctx.group_size).problem():
            raise ArgumentError(
                "table_layouts",
                NO_VALUE,
                f"gives table {t.name} the managed layout with {t.vocab} slots (its rows): "
                + problem,
            )
    leaves, treedef = jax.tree.flatten(ctx.params)
    mask = treedef.unflatten([i in {t.index for t in ctx.id_tables} for i in range(len(leaves))])

    def reads(batch, direct: bool) -> dict:
        return access.key_tables(ctx.loss_fn, ctx.params, batch, mask, direct)

    return managed.Vocabularies(tables, ctx.group_size, reads)


def renewing(ctx: StepContext, step: Callable) -> Callable:
    """``step`` that first starts the placed batch's fresh slots afresh
    (``managed.renew``), then runs on the batch without them."""

    def run(state: TrainState, placed: PlacedBatch):
        params, opt_state = managed.renew(
            ctx.optimizer, state.params, state.opt_state, placed.fresh
        )
        state = state._replace(params=params, opt_state=opt_state)
        return step(state, dataclasses.replace(placed, fresh=None))

    return run


def mapping_placer(ctx: StepContext, vocab: managed.Vocabularies, place: Callable) -> Callable:
    """``place(batch) -> PlacedBatch``: the batch's managed ids mapped to slots
    (advancing the vocabularies: place batches in the order they are stepped), then
    placed by ``place``, its fresh slots with it (padded to a capacity per table:
    ``fresh_capacity``, one program per capacity)."""
    capacity: dict[int, int] = {}

    def placed(batch, *ahead) -> PlacedBatch:
        if ahead:
            raise ValueError("a step with managed tables reads no batch ahead")
        if not isinstance(batch, dict):
            raise ValueError(f"a batch must be a dict of arrays, got {type(batch).__name__}")
        mapped, fresh = vocab.map_batch(batch)
        out = place(mapped)
        arrays = {}
        for index, f in fresh.items():
            threshold = vocab.vocabularies[index].policy.threshold
            capacity[index] = fresh_capacity(f, capacity.get(index, 0), threshold)
            slots, rows = managed.padded_fresh(f, capacity[index])
            arrays[index] = (
                runtime.put_global(slots, ctx.mesh, P()),
                runtime.put_global(rows, ctx.mesh, P()),
            )
        return dataclasses.replace(out, fresh=arrays)

    return placed


def fresh_capacity(fresh: managed.Fresh, current: int, threshold: int) -> int:
    """The slots a table's fresh rows are padded to, ``current`` unless too small.

    The first batch of an empty table admits every distinct id it reads (threshold 1):
    later batches admit at most as many, give or take their spread, so
    ``grow_with_margin`` of the first need holds. With a threshold, admissions grow as
    ids come back: the capacity starts at ``Fresh.bound`` (the batch's reads and the
    zero rows), which no batch of that shape exceeds. A capacity that is exceeded all the
    same doubles (within the bound): one program per capacity.

    Example:
        >>> import numpy as np
        >>> fresh = managed.Fresh(np.arange(40), np.zeros((40, 2)), bound=100)
        >>> fresh_capacity(fresh, 0, 1), fresh_capacity(fresh, 0, 2), fresh_capacity(fresh, 32, 1)
        (59, 100, 64)
    """
    need, bound = fresh.slots.size, max(fresh.slots.size, fresh.bound)
    if need <= current:
        return current
    if not current:
        return min(bound, grow_with_margin(need)) if threshold == 1 else bound
    return min(bound, max(grow_with_margin(need), 2 * current))


def refuse_steps(*args, **kwargs):
    """``ts.steps`` / ``ts.place_steps`` of a step with managed tables."""
    raise ValueError(
        "a step with managed tables runs one step a program call (each batch's ids are "
        "mapped as it is placed): call ts.step(state, ts.place_batch(batch)) once a step"
    )


def check_strategy(ctx: StepContext, lookahead: int, strategy: str) -> None:
    """``ValueError`` where managed tables cannot go: a step that fetches the next
    batch's rows before its ids are mapped (``embrace_2d``)."""
    tables = managed_tables(ctx)
    if tables and lookahead:
        raise ArgumentError(
            "table_layouts",
            NO_VALUE,
            f"gives table {tables[0].name} the managed layout, which $strategy cannot "
            "carry across steps (it fetches the next batch's rows before that batch's ids "
            "are mapped to slots); use embrace or embrace_rowwise",
            strategy=strategy,
        )


class CountedStep(NamedTuple):
    """A step that counts the batches it runs into its vocabularies
    (``Vocabularies.stepped``): a save and an evaluation of the state it returns read
    the mappings as they stood after those batches, whatever is placed ahead."""

    step: Callable
    vocab: managed.Vocabularies

    def __call__(self, state: TrainState, batch: PlacedBatch):
        out = self.step(state, batch)
        self.vocab.stepped += 1
        return out

    def lower(self, *args, **kwargs):
        return self.step.lower(*args, **kwargs)


def for_evaluation(vocab: managed.Vocabularies, params, batches: list[dict]):
    """``(params, batches)`` to evaluate a model with managed tables on held-out data:
    each managed table's zero rows set to zeros (as a step starts them), each batch's
    ids looked up as the mappings stood after the batches stepped (nothing admitted,
    nothing counted; an id without a slot reads its owner's zero row).

    Args:
      vocab: ``TrainStep.vocabulary``.
      params: host parameters (``TrainStep.host_params``).
      batches: host batches of raw ids.

    Returns:
      The parameters and the batches, ready for the model's plain forward pass.
    """
    leaves, treedef = jax.tree.flatten(params)
    leaves = list(leaves)
    for index, vocabulary in vocab.vocabularies.items():
        table = np.array(leaves[index])
        table[vocabulary.blocks.first()] = 0
        leaves[index] = table
    return treedef.unflatten(leaves), vocab.lookup_batches(batches)
