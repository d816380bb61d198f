"""Train-step builders: one ``make_train_step`` for every communication strategy.

A *model* here is a pure loss ``loss_fn(params, batch, emb) -> scalar``: the mean loss
over the examples of ``batch``, where ``emb`` (an ``EmbeddingOps``) does every
embedding-table access, so strategies can swap a replicated table for a sharded one
without model-specific code. A *batch* is a flat dict of arrays whose leading axis is
the global batch, except the keys in ``replicated_keys`` that every worker sees whole.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from sparsecomm_jax import runtime, train
    >>> mesh = runtime.data_mesh()
    >>> loss = lambda p, b, emb: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> ts = train.make_train_step(loss, optax.sgd(0.1), mesh, {"w": jnp.zeros((3, 1))})
    >>> n = len(jax.devices())
    >>> batch = ts.place_batch({"x": jnp.ones((n, 3)), "y": jnp.ones((n, 1))})
    >>> state, loss_value = ts.step(ts.state, batch)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import runtime

PyTree = Any
Batch = dict[str, Any]


class EmbeddingOps(NamedTuple):
    """How a model touches its embedding tables.

    Attributes:
      lookup: ``lookup(table, ids) -> rows``: rows ``[*ids.shape, D]`` of ``table``.
      attend: ``attend(table, h) -> logits``: ``h @ table.T`` (tied output softmax).
    """

    lookup: Callable[[jax.Array, jax.Array], jax.Array]
    attend: Callable[[jax.Array, jax.Array], jax.Array]


DENSE_EMBEDDING = EmbeddingOps(
    lookup=lambda table, ids: jnp.take(table, ids, axis=0),
    attend=lambda table, h: h @ table.T,
)

LossFn = Callable[[PyTree, Batch, EmbeddingOps], jax.Array]


class TrainState(NamedTuple):
    """Everything a step reads and writes (a plain pytree: jit, shard, checkpoint).

    Attributes:
      params: model parameters (sharded tables hold only this worker's shard).
      opt_state: the optax optimizer state.
      agg_state: the gradient aggregator's state (error-feedback residuals), or ``()``.
    """

    params: PyTree
    opt_state: PyTree
    agg_state: PyTree


class TrainStep(NamedTuple):
    """A built strategy.

    Attributes:
      step: ``step(state, placed_batch) -> (state, loss)``, a ``jax.jit`` or ``jax.pmap``
        function (so ``step.lower(...)`` gives its program); ``loss`` is the mean loss
        over the global batch (one copy per device under ``pmap``: see ``loss_value``).
      state: the initial ``TrainState``, placed on the devices.
      place_batch: host batch (global, identical on every process) -> device batch.
      host_params: ``state -> params`` as ordinary (unsharded) numpy arrays.
      strategy: the strategy's name.
    """

    step: Callable[[TrainState, Batch], tuple[TrainState, jax.Array]]
    state: TrainState
    place_batch: Callable[[Batch], Batch]
    host_params: Callable[[TrainState], PyTree]
    strategy: str


def check_batch(batch: Batch, num_workers: int, replicated_keys: Sequence[str]) -> None:
    """Raises ``ValueError`` unless every sharded leaf's leading axis divides by P."""
    if not isinstance(batch, dict):
        raise ValueError(f"batch must be a dict of arrays, got {type(batch).__name__}")
    for key, x in batch.items():
        if key in replicated_keys:
            continue
        n = np.shape(x)[0] if np.ndim(x) else None
        if n is None or n % num_workers:
            raise ValueError(
                f"batch[{key!r}] has leading size {n}, which must be divisible by the "
                f"number of devices ({num_workers})"
            )


def _batch_specs(batch: Batch, axis_name: str, replicated_keys: Sequence[str]) -> dict:
    return {k: P() if k in replicated_keys else P(axis_name) for k in batch}


def _local_grads(loss_fn: LossFn, params, batch, emb: EmbeddingOps):
    """Loss and gradient of this worker's loss (never ``psum`` the loss before grad)."""
    return jax.value_and_grad(loss_fn)(params, batch, emb)


def _apply(optimizer: optax.GradientTransformation, grads, opt_state, params):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _dense_body(loss_fn: LossFn, optimizer, axis_name: str) -> Callable:
    """One data-parallel step inside ``shard_map``/``pmap``: grads by ``pmean``."""

    def body(state: TrainState, batch: Batch):
        loss, grads = _local_grads(loss_fn, state.params, batch, DENSE_EMBEDDING)
        grads = jax.lax.pmean(grads, axis_name)
        params, opt_state = _apply(optimizer, grads, state.opt_state, state.params)
        return TrainState(params, opt_state, state.agg_state), jax.lax.pmean(loss, axis_name)

    return body


def _replicated_state(params, optimizer, mesh: Mesh) -> TrainState:
    state = TrainState(params, optimizer.init(params), ())
    host = jax.tree.map(np.asarray, state)
    return jax.tree.map(lambda x: runtime.put_global(x, mesh, P()), host)


def _make_dense(loss_fn, optimizer, mesh, params, axis_name, replicated_keys) -> TrainStep:
    """``dense``: ``jax.jit(jax.shard_map(...))`` with ``lax.pmean`` of all gradients."""
    body = _dense_body(loss_fn, optimizer, axis_name)
    num = runtime.mesh_axis_size(mesh, axis_name)

    def place(batch: Batch) -> Batch:
        check_batch(batch, num, replicated_keys)
        specs = _batch_specs(batch, axis_name, replicated_keys)
        return {k: runtime.put_global(np.asarray(v), mesh, specs[k]) for k, v in batch.items()}

    def step(state, batch):
        specs = _batch_specs(batch, axis_name, replicated_keys)
        fn = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), P()), check_vma=False
        )
        return fn(state, batch)

    return TrainStep(
        step=jax.jit(step, donate_argnums=0),
        state=_replicated_state(params, optimizer, mesh),
        place_batch=place,
        host_params=lambda s: jax.tree.map(runtime.to_host, s.params),
        strategy="dense",
    )


def _make_dense_pmap(loss_fn, optimizer, mesh, params, axis_name, replicated_keys) -> TrainStep:
    """``dense_pmap``: the classic ``jax.pmap`` + ``lax.pmean`` baseline."""
    body = _dense_body(loss_fn, optimizer, axis_name)
    devices = list(mesh.devices.flat)
    local = [d for d in devices if d.process_index == jax.process_index()]
    num, first = len(devices), devices.index(local[0])

    def place(batch: Batch) -> Batch:
        check_batch(batch, num, replicated_keys)
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            if k in replicated_keys:
                out[k] = np.broadcast_to(v, (len(local), *v.shape))
            else:
                out[k] = v.reshape(num, -1, *v.shape[1:])[first : first + len(local)]
        return out

    state = TrainState(params, optimizer.init(params), ())
    state = jax.tree.map(
        lambda x: np.broadcast_to(np.asarray(x), (len(local), *np.shape(x))), state
    )
    return TrainStep(
        step=jax.pmap(body, axis_name=axis_name, devices=devices, donate_argnums=0),
        state=state,
        place_batch=place,
        host_params=lambda s: jax.tree.map(_first_replica, s.params),
        strategy="dense_pmap",
    )


def _first_replica(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x[0]
    return np.asarray(x.addressable_data(0)).reshape(x.shape[1:])


def loss_value(loss: jax.Array) -> float:
    """The step's loss as a float (``pmap`` returns one copy per local device)."""
    return float(np.asarray(loss.addressable_data(0)).reshape(-1)[0])


STRATEGIES: dict[str, Callable[..., TrainStep]] = {
    "dense_pmap": _make_dense_pmap,
    "dense": _make_dense,
}


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    params: PyTree,
    strategy: str = "dense",
    *,
    axis_name: str = "data",
    replicated_keys: Sequence[str] = (),
) -> TrainStep:
    """Builds the train step of ``strategy`` and its initial state.

    Args:
      loss_fn: ``loss_fn(params, batch, emb) -> scalar``, mean over the batch's examples.
      optimizer: any optax optimizer; every worker applies it to the mean gradient.
      mesh: a mesh with axis ``axis_name`` (see ``runtime.data_mesh``).
      params: initial parameters (host or device arrays, unsharded).
      strategy: one of ``STRATEGIES``.
      axis_name: the data-parallel mesh axis.
      replicated_keys: batch keys every worker sees whole (e.g. shared negative samples).

    Returns:
      A ``TrainStep``: ``state, loss = ts.step(state, ts.place_batch(batch))``.

    Raises:
      ValueError: unknown strategy or an axis name that is not in the mesh.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    runtime.mesh_axis_size(mesh, axis_name)
    return STRATEGIES[strategy](loss_fn, optimizer, mesh, params, axis_name, tuple(replicated_keys))
