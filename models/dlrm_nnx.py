"""DLRM as a flax NNX module: ``models.dlrm``'s model, data and loss, written in NNX.

The same arithmetic as the Linen ``dlrm.DLRM`` (bottom MLP, one pooled table per sparse
feature, pairwise dot interaction, top MLP), its tables ``nnx_tables.EmbedBag`` (sum)
found by the library, nothing swapped by hand. ``--model dlrm_nnx`` trains it with every
flag of ``--model dlrm``; given the Linen model's initial parameters it takes the same
steps (``tests/test_nnx.py``).

Example:
    >>> import jax
    >>> from models import dlrm, dlrm_nnx
    >>> w = dlrm_nnx.workload(dlrm.DLRMConfig(tables="50,40,30", dim=4, batch=8))
    >>> w.embedding_paths[0]
    ('sparse_0', 'embedding')
    >>> float(w.loss(w.init(jax.random.key(0)), w.batch_at(0))) > 0
    True

References:
    Naumov et al., "Deep Learning Recommendation Model for Personalization and
    Recommendation Systems", 2019.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.dlrm import DENSE_FEATURES, DLRMConfig, checked_shape, click_metrics, data, log_loss
from models.workload import Workload
from sparsecomm_jax import nnx_tables


class MLP(nnx.Module):
    """Dense layers of ``widths`` after ``in_features``, ReLU between (and after the
    last when ``last_relu``)."""

    def __init__(self, in_features: int, widths, last_relu: bool, rngs: nnx.Rngs):
        sizes = (in_features, *widths)
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:], strict=False)]
        )
        self.last_relu = last_relu

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers) or self.last_relu:
                x = nnx.relu(x)
        return x


class DLRM(nnx.Module):
    """``dlrm.DLRM`` in NNX: ``__call__(batch)`` -> click logits ``[B]``; one table per
    sparse feature, as attribute ``sparse_f`` (the batch key it reads)."""

    def __init__(self, sizes, dim: int, bottom, top, rngs: nnx.Rngs):
        self.bottom = MLP(DENSE_FEATURES, (*bottom, dim), True, rngs)
        self.features = len(sizes)
        for f, v in enumerate(sizes):
            setattr(self, f"sparse_{f}", nnx_tables.EmbedBag(v, dim, mode="sum", rngs=rngs))
        pairs = (self.features + 1) * self.features // 2
        self.top = MLP(dim + pairs, (*top, 1), False, rngs)

    def __call__(self, batch):
        x = self.bottom(batch["dense"])  # [B, D]
        pooled = [getattr(self, f"sparse_{f}")(batch[f"sparse_{f}"]) for f in range(self.features)]
        z = jnp.stack([x, *pooled], axis=1)  # [B, F+1, D]
        dots = jnp.einsum("bfd,bgd->bfg", z, z)
        upper = jnp.triu_indices(z.shape[1], k=1)
        features = jnp.concatenate([x, dots[:, upper[0], upper[1]]], axis=1)
        return self.top(features)[:, 0]


def loss(model: DLRM, batch) -> jax.Array:
    """Log loss of the clicks, as flax's NNX guides write a loss."""
    return log_loss(model(batch), batch["label"])


def workload(cfg: DLRMConfig) -> Workload:
    """The NNX DLRM as a ``Workload`` (its parameters the module's ``nnx.Param`` values,
    ``nnx_tables.split_model``)."""
    sizes, bottom, top = checked_shape(cfg)

    def make(key: jax.Array) -> DLRM:
        return DLRM(sizes, cfg.dim, bottom, top, rngs=nnx.Rngs(key))

    split = nnx_tables.split_model(nnx.eval_shape(make, jax.random.key(0)), loss)
    batch_at, heldout = data(cfg)

    def metrics(params, batch):
        return click_metrics(split.module(params)(batch), batch["label"])

    return Workload(
        name="dlrm_nnx",
        init=lambda key: nnx_tables.split_model(make(key), loss).params,
        loss=split.loss_fn,
        batch_at=batch_at,
        replicated_keys=(),
        items_per_step=cfg.batch,
        items_name="samples",
        embedding_paths=split.table_paths,
        config=dataclasses.asdict(cfg),
        heldout=heldout,
        metrics=metrics,
    )
