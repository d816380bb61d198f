"""The LSTM language model as a flax NNX module: ``models.lstm_lm``'s model, data and
loss, written in NNX.

The same arithmetic as ``lstm_lm`` (input table ``embed``, stacked LSTM of H units,
``proj`` H -> D when H != D, output table ``softmax`` or the tied ``embed``; full or
sampled softmax with shared negatives): its tables are plain ``nnx.Embed`` found by the
library, its sampled softmax reads the negatives through ``lookup_shared`` as the Linen
model does. ``--model lstm_lm_nnx`` trains it with every flag of ``--model lstm_lm``;
given the Linen model's initial parameters it takes the same steps
(``tests/test_nnx.py``).

Example:
    >>> import jax
    >>> from models import lstm_lm, lstm_lm_nnx
    >>> w = lstm_lm_nnx.workload(lstm_lm.LSTMConfig(vocab=100, dim=8, hidden=8))
    >>> w.embedding_paths
    (('embed', 'embedding'), ('softmax', 'embedding'))
    >>> float(w.loss(w.init(jax.random.key(0)), w.batch_at(0))) > 0
    True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.lstm_lm import LSTMConfig
from models.workload import Workload, cross_entropy, lm_data, sampled_softmax_loss
from sparsecomm_jax import nnx_tables


class LstmLm(nnx.Module):
    """``lstm_lm``'s model in NNX: ``__call__(inputs int[B, T])`` -> hidden states
    ``float[B, T, D]``; ``output`` is the table the softmax reads."""

    def __init__(self, cfg: LSTMConfig, rngs: nnx.Rngs):
        table = nnx.initializers.normal(cfg.dim**-0.5)  # N(0, 1/D), as lstm_lm's
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, embedding_init=table, rngs=rngs)
        widths = (cfg.dim,) + (cfg.hidden,) * cfg.layers
        self.lstm = nnx.List(
            [
                nnx.RNN(nnx.OptimizedLSTMCell(a, b, rngs=rngs), rngs=False)  # no keys kept
                for a, b in zip(widths, widths[1:], strict=False)
            ]
        )
        self.proj = nnx.Linear(cfg.hidden, cfg.dim, rngs=rngs) if cfg.hidden != cfg.dim else None
        self.softmax = (
            None
            if cfg.tie_embeddings
            else nnx.Embed(cfg.vocab, cfg.dim, embedding_init=table, rngs=rngs)
        )

    @property
    def output(self) -> nnx.Embed:
        return self.embed if self.softmax is None else self.softmax

    def __call__(self, inputs: jax.Array) -> jax.Array:
        x = self.embed(inputs)  # float[B, T, D]
        for rnn in self.lstm:
            # the carry (c, h) starts at zeros typed like x (varying over a shard_map
            # axis), so shard_map's check_vma holds
            zeros = 0 * x[:, 0, :1] + jnp.zeros((x.shape[0], rnn.cell.hidden_features), x.dtype)
            carry = (zeros, zeros)
            x = rnn(x, initial_carry=carry)  # float[B, T, H]
        return x if self.proj is None else self.proj(x)


def loss(cfg: LSTMConfig):
    """``loss(model, batch)``: mean next-token cross-entropy of ``batch["tokens"]``
    (int32[B, T+1]), full or sampled softmax as ``cfg`` says."""

    def next_token_loss(model: LstmLm, batch) -> jax.Array:
        inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        h = model(inputs)
        if cfg.sampled_softmax:
            return sampled_softmax_loss(h, model.output, targets, batch["negatives"])
        return cross_entropy(model.output.attend(h), targets)

    return next_token_loss


def workload(cfg: LSTMConfig) -> Workload:
    """The NNX LSTM LM as a ``Workload`` (its parameters the module's ``nnx.Param``
    values, ``nnx_tables.split_model``)."""
    batch_at, heldout = lm_data(cfg, lambda t, step: {"tokens": t}, cfg.seq_len + 1, 1)
    abstract = nnx.eval_shape(lambda: LstmLm(cfg, nnx.Rngs(0)))
    split = nnx_tables.split_model(abstract, loss(cfg))
    full = nnx_tables.split_model(abstract, loss(dataclasses.replace(cfg, sampled_softmax=0)))

    def init(key: jax.Array):
        return nnx_tables.split_model(LstmLm(cfg, nnx.Rngs(key)), loss(cfg)).params

    return Workload(
        name="lstm_lm_nnx",
        init=init,
        loss=split.loss_fn,
        batch_at=batch_at,
        replicated_keys=("negatives",) if cfg.sampled_softmax else (),
        items_per_step=cfg.batch * cfg.seq_len,
        items_name="tokens",
        embedding_paths=split.table_paths,
        config=dataclasses.asdict(cfg),
        heldout=heldout,
        metrics=lambda params, batch: {"loss": full.loss_fn(params, batch)},
    )
