"""Flax NNX models under every strategy, unchanged: their ``nnx.Embed`` tables found and
served by the strategy's lookups.

``make_train_step(loss_fn, optimizer, mesh, model, strategy)`` takes an ``nnx.Module``
where it takes a Linen parameter tree, with ``loss_fn(model, batch)`` as flax's NNX
guides write losses. ``split_model`` does the work: it splits the module into its graph
and its ``nnx.Param`` values (a plain dict, the tree every strategy already places),
finds the tables (every plain ``flax.nnx.Embed`` and this module's ``EmbedBag``: their
``"embedding"`` parameters) and wraps the loss as the ``loss_fn(params, batch, emb)``
the strategies call. Inside that loss the module is rebuilt from the worker's
parameters, whose tables may be shards (V x D/P column-wise, V/P x D row-wise), and
each table's lookups and ``attend`` go through the strategy's ``EmbeddingOps``; the
user's module is never modified (the rebuilt copy's ``nnx.Embed`` objects are served
in place of theirs for the trace). ``TrainStep.module(state)`` rebuilds the user's
module with the trained parameters.

A subclass of ``nnx.Embed`` that overrides ``__call__`` or ``attend`` reads its table its
own way, so it is not taken as a table: its parameters stay dense, and naming it in
``embedding_paths`` is refused. Other subclasses are tables, served as ``nnx.Embed``.
The served reads compute as the Linen layer does (``nn.Embed``): rows cast to the
layer's ``dtype``, ``attend`` on the query cast to it (a custom ``promote_dtype`` and
``out_sharding`` are not consulted).

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> class Bag(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.embed = nnx.Embed(10, 4, rngs=rngs)
    ...         self.out = nnx.Linear(4, 2, rngs=rngs)
    ...     def __call__(self, ids):
    ...         return self.out(self.embed(ids).mean(axis=1))
    >>> split = split_model(Bag(nnx.Rngs(0)), lambda model, batch: model(batch).sum())
    >>> split.table_paths
    (('embed', 'embedding'),)
    >>> float(split.loss_fn(split.params, jnp.zeros((2, 3), jnp.int32))) != 0.0
    True
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparsecomm_jax import nn
from sparsecomm_jax.embedding.access import PLAIN, EmbeddingOps
from sparsecomm_jax.embedding.tables import table_name

PyTree = Any
TABLE_NAME = nn.TABLE_NAME  # nnx.Embed's parameter, as flax.linen.Embed's


def is_module(x: Any) -> bool:
    """Whether ``x`` is a flax NNX module (what ``make_train_step`` splits)."""
    return isinstance(x, nnx.Module)


# ---------------------------------------------------------------------- the lookups


def _rows(module: nnx.Embed, inputs: jax.Array, shared: bool = False) -> jax.Array:
    """``module``'s rows of ``inputs`` through the current ``EmbeddingOps``."""
    if not jnp.issubdtype(jnp.asarray(inputs).dtype, jnp.integer):
        raise ValueError("Input type must be an integer or unsigned integer.")
    table = module.embedding[...]  # float[V, D], or this worker's shard of it
    ops = nn.current_ops() or PLAIN
    rows = (ops.lookup_shared if shared else ops.lookup)(table, inputs)  # [*ids, D]
    return rows.astype(module.dtype or table.dtype)


def _served_call(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """``nnx.Embed.__call__`` through the strategy (the Linen layer's arithmetic)."""
    return _rows(self, inputs)


def _served_attend(self, query: jax.Array, out_sharding: Any = None) -> jax.Array:
    """``nnx.Embed.attend`` through the strategy: the query cast to the layer's dtype,
    the logits ``[..., V]`` too (as the Linen layer computes it)."""
    table = self.embedding[...]  # float[V, D], or this worker's shard of it
    dtype = self.dtype or jnp.result_type(query, table)
    logits = (nn.current_ops() or PLAIN).attend(table, query.astype(dtype))
    return logits.astype(dtype)


def _served_lookup_shared(self, inputs: jax.Array) -> jax.Array:
    """As ``__call__``, for ids every worker holds identically (shared negatives)."""
    return _rows(self, inputs, shared=True)


POOLINGS = nn.POOLINGS


class EmbedBag(nnx.Embed):
    """Pooled lookups of bags of ids for NNX models, as ``sparsecomm_jax.nn.EmbedBag``
    is for Linen (PyTorch's ``nn.EmbeddingBag``, TorchRec's pooled tables): one row per
    bag, the sum or the mean of its ids' rows; padded places hold ``padding_id`` or lie
    past the bag's ``lengths``. Its lookups always go through the current strategy's
    ``EmbeddingOps`` (a plain ``take`` outside a step).

    Args (besides ``nnx.Embed``'s):
      mode: ``"sum"`` or ``"mean"`` (an empty bag is zeros).
      padding_id: the id of padded places, or ``None``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> bag = EmbedBag(10, 2, mode="mean", padding_id=0, rngs=nnx.Rngs(0))
        >>> pooled = bag(jnp.array([[3, 5, 0], [7, 0, 0]]))  # bags of 2 and 1 ids
        >>> table = bag.embedding[...]
        >>> bool(jnp.allclose(pooled[0], (table[3] + table[5]) / 2))
        True
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        mode: str = "sum",
        padding_id: int | None = None,
        **kwargs: Any,
    ):
        if mode not in POOLINGS:
            raise ValueError(f"EmbedBag mode must be one of {POOLINGS}, got {mode!r}")
        super().__init__(num_embeddings, features, **kwargs)
        self.mode = mode
        self.padding_id = padding_id

    def __call__(self, inputs: jax.Array, lengths: jax.Array | None = None) -> jax.Array:
        """Pooled rows ``[*inputs.shape[:-1], features]`` of bags ``inputs[..., L]``."""
        if jnp.ndim(inputs) < 1:
            raise ValueError("EmbedBag inputs must be bags [..., L] of ids, got a scalar")
        rows = _rows(self, inputs)  # [..., L, D]
        counted = jnp.ones(jnp.shape(inputs), bool)
        if self.padding_id is not None:
            counted &= inputs != self.padding_id
        if lengths is not None:
            counted &= jnp.arange(jnp.shape(inputs)[-1]) < jnp.asarray(lengths)[..., None]
        weights = counted.astype(rows.dtype)[..., None]
        pooled = jnp.sum(rows * weights, axis=-2)
        if self.mode == "mean":
            pooled = pooled / jnp.maximum(jnp.sum(weights, axis=-2), 1)
        return pooled


def _serves(cls: type) -> bool:
    """Whether instances of ``cls`` read their table only through ``nnx.Embed``'s
    ``__call__`` and ``attend`` (or ``EmbedBag``'s own lookups), so the step can serve
    them: ``nnx.Embed``, ``EmbedBag`` and their subclasses that override neither."""
    if not issubclass(cls, nnx.Embed):
        return False
    own_call = EmbedBag.__call__ if issubclass(cls, EmbedBag) else nnx.Embed.__call__
    served = getattr(cls, "_sparsecomm_served", False)
    return served or (cls.__call__ is own_call and cls.attend is nnx.Embed.attend)


def _is_table(module: Any) -> bool:
    return _serves(type(module))


@functools.cache
def _served_class(cls: type) -> type:
    """``cls`` with its table's reads routed through the current ``EmbeddingOps``."""
    methods = {"attend": _served_attend, "lookup_shared": _served_lookup_shared}
    if not issubclass(cls, EmbedBag):  # EmbedBag reads through _rows already
        methods["__call__"] = _served_call
    return type(f"Served{cls.__name__}", (cls,), {**methods, "_sparsecomm_served": True})


def serve(model: nnx.Module) -> nnx.Module:
    """Routes the table reads of every table of ``model`` (``nnx.Embed``, ``EmbedBag``
    and their subclasses that read the table as they do) through the current
    ``EmbeddingOps`` (``nn.use_ops``): each object's class becomes a subclass of its own
    with served ``__call__``, ``attend`` and ``lookup_shared`` (the same attributes and
    parameters). Used on the copy a step's loss rebuilds, never on the user's module.
    Returns ``model``."""
    for _, module in nnx.iter_modules(model):
        cls = type(module)
        if _serves(cls) and not getattr(cls, "_sparsecomm_served", False):
            object.__setattr__(module, "__class__", _served_class(cls))
    return model


# ---------------------------------------------------------------------- the split


def _key(k: Any) -> str:
    return str(k)


def _str_keys(tree: Any) -> Any:
    """A pure dict with every key a string (``nnx.List`` entries are ints)."""
    if isinstance(tree, dict):
        return {_key(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _like(template: Any, tree: Any) -> Any:
    """``tree`` (string keys) with ``template``'s keys again."""
    if isinstance(template, dict):
        return {k: _like(v, tree[_key(k)]) for k, v in template.items()}
    return tree


class SplitModel(NamedTuple):
    """An NNX module as a strategy's step takes it (``split_model``).

    Attributes:
      params: the ``nnx.Param`` values, a nested dict with string keys.
      loss_fn: ``loss_fn(params, batch, emb) -> scalar``: the module rebuilt from
        ``params`` (its tables served by ``emb``) and the user's ``loss(model, batch)``.
      table_paths: each table's path in ``params``, e.g. ``("embed", "embedding")``.
      module: ``module(params) -> nnx.Module``: the user's module with ``params``.
    """

    params: PyTree
    loss_fn: Callable[..., jax.Array]
    table_paths: tuple[tuple[str, ...], ...]
    module: Callable[[PyTree], nnx.Module]


def table_paths(model: nnx.Module) -> tuple[tuple[str, ...], ...]:
    """The path of every table of ``model`` in its parameters (``SplitModel.params``):
    the ``"embedding"`` of each ``nnx.Embed`` and ``EmbedBag`` (and each subclass that
    reads its table through their methods).

    Example:
        >>> from flax import nnx
        >>> table_paths(nnx.Embed(10, 4, rngs=nnx.Rngs(0)))
        (('embedding',),)
    """
    return tuple(
        (*map(_key, path), TABLE_NAME) for path, m in nnx.iter_modules(model) if _is_table(m)
    )


#: The metadata keys flax has used for a variable's logical axis names, newest first.
SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def metadata_layouts(model: nnx.Module) -> dict[str, str]:
    """Each table's layout as its NNX sharding metadata names it (MaxText's logical axes,
    ``nnx.with_partitioning`` or ``embedding_metadata``): the vocabulary axis (the first)
    named and the feature axis not means ``"row"``; the feature axis named and the
    vocabulary axis not means ``"column"``; neither or both: no preference (the
    strategy's layout). Keys are table names (``"embed/embedding"``).

    Example:
        >>> from flax import nnx
        >>> named = dict(out_sharding=("vocab", None), eager_sharding=False)
        >>> metadata_layouts(nnx.Embed(10, 4, embedding_metadata=named, rngs=nnx.Rngs(0)))
        {'embedding': 'row'}
    """
    out = {}
    for path, module in nnx.iter_modules(model):
        if not _is_table(module):
            continue
        meta = module.embedding.get_metadata()
        names = next((meta[k] for k in SHARDING_KEYS if meta.get(k) is not None), None)
        if isinstance(names, jax.sharding.NamedSharding):
            names = names.spec
        if isinstance(names, jax.sharding.PartitionSpec):
            names = tuple(names)
        if not isinstance(names, tuple | list) or len(names) != 2:
            continue
        vocab, features = (n is not None for n in names)
        if vocab != features:
            out["/".join((*map(_key, path), TABLE_NAME))] = "row" if vocab else "column"
    return out


def _check_loss(loss: Callable) -> None:
    try:
        params = inspect.signature(loss).parameters.values()
    except (TypeError, ValueError):  # a builtin or a C callable: trust it
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 2:
        raise TypeError(
            f"loss_fn({', '.join(p.name for p in required)}) has the Linen form "
            "loss_fn(params, batch, emb); with an nnx.Module pass loss_fn(model, batch)"
        )


def check_tree_loss(loss: Callable) -> None:
    """A one-line ``TypeError`` when a loss given with a Linen parameter tree cannot take
    ``(params, batch, emb)``: the NNX form ``loss(model, batch)`` (or any two-argument
    loss) given a tree. A wrapper is judged by its own signature."""
    try:
        params = inspect.signature(loss, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # a builtin or a C callable: trust it
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3:
        names = ", ".join(p.name for p in positional)
        raise TypeError(
            f"loss_fn({names}) cannot take (params, batch, emb): with a parameter tree pass "
            "nn.loss_with_embeddings(loss) for a loss(params, batch); an NNX model goes to "
            "make_train_step as the module itself, with loss_fn(model, batch)"
        )


def _check_state(rest: nnx.State) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(
        rest, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    if leaves:
        held = ", ".join(
            f"{'/'.join(_key(getattr(k, 'key', k)) for k in path)} ({type(v).__name__})"
            for path, v in leaves[:4]
        )
        more = f" and {len(leaves) - 4} more" if len(leaves) > 4 else ""
        raise ValueError(
            f"model holds state other than nnx.Param that the step cannot carry: {held}"
            f"{more}; keep random keys and statistics out of the module (pass keys in "
            "the batch)"
        )


def split_model(model: nnx.Module, loss: Callable[[nnx.Module, Any], jax.Array]) -> SplitModel:
    """``model`` and its ``loss(model, batch)`` as a strategy's step takes them.

    Args:
      model: an ``nnx.Module`` holding ``nnx.Param`` state only.
      loss: ``loss(model, batch) -> scalar``, the mean over the batch's examples.

    Returns:
      A ``SplitModel``.

    Raises:
      TypeError: ``loss`` has the Linen form ``loss(params, batch, emb)``.
      ValueError: ``model`` holds state other than parameters (which, named).
    """
    _check_loss(loss)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    _check_state(rest)
    pure = nnx.to_pure_dict(state)
    # shapes only: the step does not keep a copy of the initial parameters alive
    template = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    keys = jax.tree_util.tree_map(lambda _: None, pure)

    def module(params: PyTree) -> nnx.Module:
        values = jax.tree_util.tree_map(lambda x: x, template)  # a fresh State to fill
        nnx.replace_by_pure_dict(values, _like(keys, params))
        return nnx.merge(graphdef, values, rest)

    def loss_fn(params: PyTree, batch: Any, emb: EmbeddingOps | None = None) -> jax.Array:
        rebuilt = serve(module(params))
        with nn.use_ops(emb):
            return loss(rebuilt, batch)

    return SplitModel(_str_keys(pure), loss_fn, table_paths(model), module)


def module_of(
    split: SplitModel, host_params: Callable[[Any], PyTree]
) -> Callable[[Any], nnx.Module]:
    """``TrainStep.module``: ``state -> `` the user's module with the state's parameters
    (``host_params(state)``, the tables gathered back to V x D)."""
    rebuild = split.module  # not ``split``, which holds the initial parameters

    def module(state: Any) -> nnx.Module:
        params = jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), host_params(state))
        return rebuild(params)

    return module


def refuse_nnx_optimizer(optimizer: Any) -> None:
    """A one-line ``TypeError`` for an ``nnx.Optimizer`` (the step runs optax itself)."""
    if isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            "optimizer is an nnx.Optimizer; pass its optax transformation instead, e.g. "
            "make_train_step(loss_fn, optax.adam(1e-3), mesh, model, ...): the step keeps "
            "the optimizer state itself"
        )


def with_metadata_layouts(
    model: nnx.Module, table_layouts: Mapping[Any, Any] | None, tables: set[str]
) -> Mapping[Any, Any] | None:
    """``table_layouts`` with the ``metadata_layouts`` of each of ``tables`` (names)
    that it does not name."""
    named = {table_name(p) for p in (table_layouts or {})}
    found = {k: v for k, v in metadata_layouts(model).items() if k in tables and k not in named}
    if not found:
        return table_layouts
    return {**found, **(table_layouts or {})}


def step_tables(
    model: nnx.Module,
    split: SplitModel,
    name: Any,
    embedding_paths: Any,
    table_layouts: Mapping[Any, Any] | None,
) -> tuple[Any, Mapping[Any, Any] | None]:
    """``make_train_step``'s ``embedding_paths`` and ``table_layouts`` for an NNX model:
    the tables found (unless ``embedding_paths`` names them) and, for a strategy that
    takes a layout per table (``name``: a ``StrategyName``), each table's sharding
    metadata unless ``table_layouts`` names it.

    Raises:
      ValueError: the strategy shards tables and the model has none, or
        ``embedding_paths`` names a table whose reads the step cannot serve (an
        ``nnx.Embed`` subclass overriding ``__call__`` or ``attend``).
    """
    if not embedding_paths and name.strategy.needs_tables and not split.table_paths:
        raise ValueError(
            f"strategy {name.tables!r} needs embedding tables: the model has no "
            "flax.nnx.Embed (or nnx_tables.EmbedBag, or a subclass of either that reads "
            "its table through their __call__ and attend)"
        )
    paths = embedding_paths or split.table_paths
    if not callable(paths):
        served = {table_name(p) for p in split.table_paths}
        named = {table_name(p) for p in paths}
        if unserved := sorted((_embed_tables(model) - served) & named):
            raise ValueError(
                f"embedding_paths names {unserved}, tables of nnx.Embed subclasses that "
                "override __call__ or attend: the step cannot route their reads; read the "
                "table through nnx.Embed's methods, or leave it out (a dense parameter)"
            )
    if name.strategy.any_layout and not callable(paths):
        table_layouts = with_metadata_layouts(model, table_layouts, named)
    return paths, table_layouts


def _embed_tables(model: nnx.Module) -> set[str]:
    """The names of every ``nnx.Embed`` (of any subclass)'s table in ``model``."""
    return {
        "/".join((*map(_key, path), TABLE_NAME))
        for path, m in nnx.iter_modules(model)
        if isinstance(m, nnx.Embed)
    }
