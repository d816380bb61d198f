"""Flax layers whose embedding tables every strategy can shard: ``Embed`` and the pooled
multi-hot ``EmbedBag``.

``Embed`` is a drop-in for ``flax.linen.Embed`` (same attributes, ``__call__(ids)`` and
``attend(query)``, the same parameter ``"embedding"``). Inside a strategy's step its
lookups go through that strategy's ``EmbeddingOps``: the step passes ``emb`` to the
loss, and the loss enters ``use_ops(emb)`` (or is wrapped by ``loss_with_embeddings``).
The table it then reads may be this worker's shard: V x D/P (``embrace``, column-wise)
or V/P x D (``embrace_rowwise``), which flax's own parameter shape check would reject.
``embedding_paths(params)`` lists the tables for ``make_train_step(embedding_paths=)``.

Inside ``use_ops`` an unmodified ``flax.linen.Embed`` is served the same way, through
``flax.linen.intercept_methods`` (its ``setup``, ``__call__`` and ``attend``), so
existing models need no change. ``flax.linen.map_variables`` cannot do this: it maps
the stored values, but the module's ``setup`` still checks them against the full
(V, D) shape, and a shard cannot be turned into the full table without gathering it.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from sparsecomm_jax import nn
    >>> layer = nn.Embed(10, 4)
    >>> params = layer.init(jax.random.key(0), jnp.zeros(3, jnp.int32))
    >>> nn.embedding_paths(params)
    (('params', 'embedding'),)
    >>> layer.apply(params, jnp.array([1, 2])).shape
    (2, 4)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as linen
import jax
import jax.numpy as jnp
from flax.core import meta

from sparsecomm_jax.embedding.access import PLAIN, EmbeddingOps

PyTree = Any
TABLE_NAME = "embedding"  # the parameter name of flax.linen.Embed and of Embed

_OPS: contextvars.ContextVar[EmbeddingOps | None] = contextvars.ContextVar(
    "sparsecomm_embedding_ops", default=None
)


def current_ops() -> EmbeddingOps | None:
    """The ``EmbeddingOps`` set by the innermost ``use_ops`` (``None`` outside)."""
    return _OPS.get()


@contextlib.contextmanager
def use_ops(emb: EmbeddingOps | None) -> Iterator[None]:
    """Routes every ``Embed`` (and ``flax.linen.Embed``) lookup through ``emb``.

    Args:
      emb: the ``EmbeddingOps`` a strategy passes to the loss (``None``: plain lookups).

    Example:
        >>> def loss_fn(params, batch, emb):
        ...     with use_ops(emb):
        ...         logits = model.apply(params, batch["tokens"])
        ...     return cross_entropy(logits, batch["labels"])
    """
    token = _OPS.set(emb if emb is not None else PLAIN)
    try:
        with linen.intercept_methods(_serve_flax_embed):
            yield
    finally:
        _OPS.reset(token)


def loss_with_embeddings(fn: Callable[[PyTree, Any], jax.Array]) -> Callable[..., jax.Array]:
    """``fn(params, batch) -> loss`` as the ``loss_fn(params, batch, emb)`` that
    ``train.make_train_step`` wants: ``fn`` runs inside ``use_ops(emb)``.

    Example:
        >>> loss_fn = loss_with_embeddings(lambda p, b: jnp.mean(model.apply(p, b["x"])))
    """

    def loss_fn(params: PyTree, batch: Any, emb: EmbeddingOps | None = None) -> jax.Array:
        with use_ops(emb):
            return fn(params, batch)

    return loss_fn


def embedding_paths(params: PyTree) -> tuple[tuple[str, ...], ...]:
    """Paths of every ``Embed`` / ``flax.linen.Embed`` table in ``params``: the 2-D
    leaves named ``"embedding"``, e.g. ``("params", "embed", "embedding")``.

    Args:
      params: a parameter pytree (``model.init(...)`` or its ``["params"]``).

    Returns:
      The paths, usable as ``make_train_step(embedding_paths=...)``.
    """
    found = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        if keys and keys[-1] == TABLE_NAME and len(jnp.shape(leaf)) == 2:
            found.append(keys)
    return tuple(found)


# ---------------------------------------------------------------------- the table


def _is_part_of(part: int, whole: int) -> bool:
    """``part`` is ``whole`` split k ways, rounded up (a table padded to a multiple of k):
    ``ceil(whole / k) == part`` for some k (the least k with ``ceil(whole / k) <= part``)."""
    k = -(-whole // part)
    return -(-whole // k) == part


def _is_shard_of(shape: tuple[int, ...], vocab: int, features: int) -> bool:
    """A column shard (V, D/k) or a row shard (V/k, D) of a V x D table (k workers; the
    split dimension rounded up where the table is stored padded)."""
    if len(shape) != 2 or 0 in shape:
        return False
    rows, cols = shape
    return (rows == vocab and _is_part_of(cols, features)) or (
        cols == features and _is_part_of(rows, vocab)
    )


def _is_table_wise(shape: tuple[int, ...], features: int) -> bool:
    """A worker's block of a table-wise pack (R rows of D, ``embedding.tablewise``) or
    the row of zeros a table packed with another's is stored as: any rows, D columns."""
    return len(shape) == 2 and shape[1] == features


def _check_table(module: linen.Embed, shape: tuple[int, ...]) -> None:
    full = (module.num_embeddings, module.features)
    if shape == full:
        return
    sharded = current_ops() not in (None, PLAIN)
    if sharded and (_is_shard_of(shape, *full) or _is_table_wise(shape, module.features)):
        return
    where = "/".join(module.scope.path) if module.scope is not None else "?"
    hint = (
        "a shard of the table must be read inside the strategy's step: call the model "
        "within sparsecomm_jax.nn.use_ops(emb) (or wrap the loss in loss_with_embeddings)"
        if _is_shard_of(shape, *full)
        else "the stored table does not match num_embeddings and features"
    )
    raise ValueError(f"embedding table {where} has shape {shape}, expected {full}: {hint}")


def _table(module: linen.Embed) -> jax.Array:
    """The stored table (or shard) without flax's full-shape check; created at init."""
    if module.has_variable("params", TABLE_NAME):
        table = meta.unbox(module.get_variable("params", TABLE_NAME))
        _check_table(module, tuple(jnp.shape(table)))
        return table
    shape = (module.num_embeddings, module.features)
    return module.param(TABLE_NAME, module.embedding_init, shape, module.param_dtype)


def _lookup(module: linen.Embed, table: jax.Array, inputs: jax.Array, shared=False) -> jax.Array:
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
        raise ValueError("Input type must be an integer or unsigned integer.")
    ops = current_ops() or PLAIN
    rows = (ops.lookup_shared if shared else ops.lookup)(table, inputs)  # [*ids, D]
    return rows.astype(module.dtype or table.dtype)


def _attend(module: linen.Embed, table: jax.Array, query: jax.Array) -> jax.Array:
    dtype = module.dtype or jnp.result_type(query, table)
    logits = (current_ops() or PLAIN).attend(table, query.astype(dtype))
    return logits.astype(dtype)  # [..., V]


class Embed(linen.Embed):
    """``flax.linen.Embed`` whose table a strategy may shard (see the module docstring).

    Attributes (as ``flax.linen.Embed``):
      num_embeddings: V. features: D. dtype: of the output (default: the table's).
      param_dtype: of the table. embedding_init: its initializer.

    Lookups read the table through ``current_ops()`` (plain ``take`` outside
    ``use_ops``); ``attend(query)`` computes ``query @ table.T`` (a tied softmax);
    ``lookup_shared(ids)`` (not in flax) reads ids that every worker holds.
    """

    def setup(self) -> None:
        self.embedding = _table(self)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Rows ``[*inputs.shape, features]`` of the integer ``inputs``."""
        return _lookup(self, self.embedding, inputs)

    def attend(self, query: jax.Array) -> jax.Array:
        """``query @ table.T``: logits ``[..., num_embeddings]``."""
        return _attend(self, self.embedding, query)

    def lookup_shared(self, inputs: jax.Array) -> jax.Array:
        """As ``__call__``, for ids every worker holds identically (e.g. negatives
        shared by the batch): sharded strategies exchange them more cheaply."""
        return _lookup(self, self.embedding, inputs, shared=True)


POOLINGS = ("sum", "mean")


class EmbedBag(Embed):
    """Pooled lookups of bags of ids (multi-hot features), like PyTorch's
    ``nn.EmbeddingBag`` and TorchRec's pooled tables: one row per bag, the sum or the
    mean of its ids' rows. Bags of different lengths are padded to one width ``L``:
    the padded places hold ``padding_id`` (a valid row, never counted) or lie past the
    bag's ``lengths``. Under every layout the rows come through the strategy's lookup,
    so the row-sparse update stays exact (a padded place has a zero gradient).

    Attributes:
      num_embeddings, features, ...: as ``Embed``.
      mode: ``"sum"`` or ``"mean"`` (an empty bag is zeros).
      padding_id: the id of padded places, or ``None`` (use ``lengths``, or no padding).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> bag = EmbedBag(10, 2, mode="mean", padding_id=0)
        >>> ids = jnp.array([[3, 5, 0], [7, 0, 0]])  # bags of 2 and 1 ids
        >>> params = bag.init(jax.random.key(0), ids)
        >>> table = params["params"]["embedding"]
        >>> pooled = bag.apply(params, ids)
        >>> bool(jnp.allclose(pooled[0], (table[3] + table[5]) / 2))
        True
    """

    mode: str = "sum"
    padding_id: int | None = None

    def __call__(self, inputs: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
        """Pooled rows ``[*inputs.shape[:-1], features]`` of bags ``inputs[..., L]``
        (``lengths``: ids per bag, ``[*inputs.shape[:-1]]``)."""
        if self.mode not in POOLINGS:
            raise ValueError(f"EmbedBag mode must be one of {POOLINGS}, got {self.mode!r}")
        if jnp.ndim(inputs) < 1:
            raise ValueError("EmbedBag inputs must be bags [..., L] of ids, got a scalar")
        if lengths is not None and jnp.shape(lengths) != jnp.shape(inputs)[:-1]:
            raise ValueError(
                f"EmbedBag lengths must have the shape of the bags, inputs.shape[:-1] = "
                f"{tuple(jnp.shape(inputs)[:-1])}: one length per bag; got "
                f"{tuple(jnp.shape(lengths))}"
            )
        rows = _lookup(self, self.embedding, inputs)  # [..., L, D]
        counted = jnp.ones(inputs.shape, bool)
        if self.padding_id is not None:
            counted &= inputs != self.padding_id
        if lengths is not None:
            counted &= jnp.arange(inputs.shape[-1]) < jnp.asarray(lengths)[..., None]
        weights = counted.astype(rows.dtype)[..., None]
        pooled = jnp.sum(rows * weights, axis=-2)
        if self.mode == "mean":
            pooled = pooled / jnp.maximum(jnp.sum(weights, axis=-2), 1)
        return pooled


def _serve_flax_embed(next_fun, args, kwargs, context):
    """Method interceptor: an unmodified ``flax.linen.Embed`` behaves as ``Embed``."""
    module = context.module
    if not isinstance(module, linen.Embed) or isinstance(module, Embed):
        return next_fun(*args, **kwargs)
    if context.method_name == "setup":
        module.embedding = _table(module)
        return None
    if context.method_name == "__call__":
        return _lookup(module, module.embedding, *args, **kwargs)
    if context.method_name == "attend":
        return _attend(module, module.embedding, *args, **kwargs)
    return next_fun(*args, **kwargs)
