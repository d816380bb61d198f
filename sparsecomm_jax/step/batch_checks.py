"""A host batch checked before it is placed: its keys split over the workers, and
every id in its table (the keys that feed tables found from the loss itself).

Example:
    >>> import numpy as np
    >>> from sparsecomm_jax.step import batch_checks
    >>> ranges = {"tokens": [("embed", 10)]}
    >>> batch_checks.check_ids({"tokens": np.array([[1, 12]])}, ranges)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: batch['tokens'] has ids in [1, 12], outside [0, 10) of table embed; a table ...
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from sparsecomm_jax.embedding import access
from sparsecomm_jax.errors import few
from sparsecomm_jax.step.state import Batch, StepContext


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
                f"of table {name}{hint}; a table of ids of any value takes the managed "
                "layout (table_layouts, or --plan at the command line)"
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


def check_tables_read_through_emb(ctx: StepContext, batch: Batch) -> None:
    """``ValueError`` naming the first table the strategy shards (or serves by rows)
    that the loss reads other than through ``emb`` (``access.read_outside``): such a
    read would see one worker's shard and train on wrong numbers without a word."""
    if not ctx.tables:
        return
    leaves, treedef = jax.tree.flatten(ctx.params)
    indices = {t.index for t in ctx.tables}
    mask = treedef.unflatten([i in indices for i in range(len(leaves))])
    if outside := access.read_outside(ctx.loss_fn, ctx.params, batch, mask):
        table = next(t for t in ctx.tables if t.index == min(outside))
        raise ValueError(
            f"the loss reads table {table.name} other than through emb (indexed directly, "
            "or a plain flax Embed): the step serves its rows from a sharded table, so "
            "that read would see one worker's part of it; read it with emb.lookup / "
            "emb.attend (the library's Embed does), or keep it out of embedding_paths"
        )


def check_host_batch(ctx: StepContext, batch: Batch) -> None:
    """Every check a batch passes before it is placed."""
    check_batch(batch, ctx.num_workers, ctx.replicated_keys)
    if ctx.id_tables:
        check_ids(batch, *id_ranges(ctx, batch), named=ctx.id_keys is not None)
    check_tables_read_through_emb(ctx, batch)  # once the ids are known to be ids


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
