"""``make_overlapped``: ``embrace_2d`` across steps, as a trainer with its own loop.

Step t's late exchange and table update run beside step t+1's forward and backward
(``schedule.overlap``): on CPU as two programs on two host threads, on an accelerator as
one program per step (``run(..., fused=True)``). It takes ``make_train_step``'s
arguments and returns an ``Overlapped`` whose ``run(state, batch_at, steps)`` trains;
``python -m experiments.train --strategy embrace_2d --overlap`` runs it.

Example:
    A bag of words regressed to one number; its table exchanged as ``embrace_2d``
    exchanges it, the next step's rows first:

    >>> import jax, jax.numpy as jnp, numpy as np, optax
    >>> from sparsecomm_jax import make_overlapped, nn, runtime
    >>> V, D, B, T = 64, 8, 16, 4
    >>> params = {"embed": {"embedding": jax.random.normal(jax.random.key(0), (V, D))},
    ...           "w": jnp.zeros((D, 1))}
    >>> def loss(p, batch):
    ...     rows = nn.Embed(V, D).apply({"params": p["embed"]}, batch["tokens"])  # [B, T, D]
    ...     return jnp.mean((rows.mean(1) @ p["w"] - batch["y"]) ** 2)
    >>> def batch_at(step):
    ...     tokens = np.random.default_rng(step).integers(0, V, (B, T), np.int32)
    ...     return {"tokens": tokens, "y": np.ones((B, 1), np.float32)}
    >>> ov = make_overlapped(nn.loss_with_embeddings(loss), optax.sgd(0.1),
    ...                      runtime.data_mesh(), params,
    ...                      embedding_paths=[("embed", "embedding")], id_keys=("tokens",))
    >>> state, losses = ov.run(ov.state, batch_at, steps=3)
    >>> len(losses), losses[-1] < losses[0]
    (3, True)

References:
    Li et al., "EmbRace", ICPP 2022, section 4 (2D communication scheduling).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

from sparsecomm_jax.embedding.tables import TablePaths
from sparsecomm_jax.embedding.update import TableUpdate
from sparsecomm_jax.schedule import overlap
from sparsecomm_jax.schedule.overlap import Overlapped
from sparsecomm_jax.strategies.build import make_context
from sparsecomm_jax.strategies.registry import parse_strategy


def make_overlapped(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    mesh,
    params,
    *,
    axis_name: str = "data",
    replicated_keys: Sequence[str] = (),
    embedding_paths: TablePaths = (),
    id_keys: Sequence[str] | Mapping[str, Any] | None = None,
    nonfinite: str = "skip",
    table_update: str | TableUpdate = "auto",
    **options: Any,
) -> Overlapped:
    """``embrace_2d`` with step t's late exchange beside step t+1's compute.

    Args: as ``make_train_step`` (the strategy is ``embrace_2d``; the dense layers are
      reduced by one flat all-reduce).

    Returns:
      An ``Overlapped``: ``state, losses = ov.run(ov.state, batch_at, steps)``.

    Raises:
      ValueError: as ``make_train_step``.
    """
    ctx = make_context(
        loss_fn,
        optimizer,
        mesh,
        params,
        parse_strategy("embrace_2d"),
        axis_name=axis_name,
        replicated_keys=replicated_keys,
        embedding_paths=embedding_paths,
        id_keys=id_keys,
        nonfinite=nonfinite,
        table_update=table_update,
        **options,
    )
    return overlap.build(ctx)
