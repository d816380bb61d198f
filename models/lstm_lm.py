"""LSTM language model (the EmbRace paper's LM workload), on Zipf tokens or local text.

Parameters: ``embed`` (the input table, ``nn.Embed``'s ``{"embedding": V x D}``),
``lstm`` (the recurrent core, H units per layer), ``proj`` (H -> D, when H != D) and
``softmax`` (the output table, the same form, absent when tied to ``embed``). Full
softmax, or sampled softmax with N shared negatives per step.

Paper-scale config (EmbRace, 1B-word LM): ``vocab=793471, dim=512, hidden=2048,
layers=2, seq_len=20, batch=128 per GPU, sampled_softmax=8192``.

Example:
    >>> import jax
    >>> from models import lstm_lm
    >>> w = lstm_lm.workload(lstm_lm.LSTMConfig(vocab=100, dim=8, hidden=8))
    >>> params = w.init(jax.random.key(0))
    >>> float(w.loss(params, w.batch_at(0), None)) > 0
    True
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.workload import (
    Workload,
    embed,
    embed_params,
    lm_data,
    lm_loss,
    lm_metrics,
    lm_workload,
    output_params,
)
from sparsecomm_jax.embedding.access import PLAIN


@dataclasses.dataclass(frozen=True)
class LSTMConfig:
    vocab: int = 1000  # vocabulary size V
    dim: int = 32  # embedding width D
    hidden: int = 64  # LSTM units H per layer
    layers: int = 1  # stacked LSTM layers
    seq_len: int = 16  # tokens per example T (targets are the next tokens)
    batch: int = 16  # global batch (examples per step, all workers together)
    sampled_softmax: int = 0  # shared negatives per step; 0 = full softmax
    tie_embeddings: bool = False  # output table = input table
    zipf_exponent: float = 1.1  # Zipf exponent of the synthetic token stream
    text_file: str = ""  # a local text file instead of Zipf tokens (word-level)
    data_dir: str = ""  # WikiText / PTB folder: train, valid and test token files
    seed: int = 0  # data and init seed


class LSTMCore(nn.Module):
    """Stacked LSTM over [B, T, D] -> [B, T, H]."""

    hidden: int
    layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            cell = nn.OptimizedLSTMCell(self.hidden)
            zeros = cell.initialize_carry(jax.random.key(0), x[:, 0].shape)
            # typed like x (varying over a shard_map axis), so shard_map's check_vma holds
            first = x[:, 0, :1]
            carry = jax.tree.map(lambda c, f=first: c + 0 * f, zeros)
            x = nn.RNN(cell)(x, initial_carry=carry)
        return x


def _parts(cfg: LSTMConfig):
    core = LSTMCore(cfg.hidden, cfg.layers)
    proj = nn.Dense(cfg.dim) if cfg.hidden != cfg.dim else None
    return core, proj


def init_params(cfg: LSTMConfig, key: jax.Array) -> dict:
    """Parameters of the LM; tables are N(0, 1/D)."""
    k_emb, k_core, k_proj, k_out = jax.random.split(key, 4)
    core, proj = _parts(cfg)
    params = {
        "embed": embed_params(k_emb, cfg.vocab, cfg.dim),
        "lstm": core.init(k_core, jnp.zeros((1, 1, cfg.dim)))["params"],
        **output_params(cfg, k_out),
    }
    if proj is not None:
        params["proj"] = proj.init(k_proj, jnp.zeros((1, cfg.hidden)))["params"]
    return params


def loss_fn(cfg: LSTMConfig, params, batch, emb=None) -> jax.Array:
    """Mean next-token cross-entropy of ``batch["tokens"]``: int32[B, T+1]."""
    emb = emb or PLAIN
    core, proj = _parts(cfg)
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    h = core.apply({"params": params["lstm"]}, embed(cfg, params, inputs, emb))
    if proj is not None:
        h = proj.apply({"params": params["proj"]}, h)
    return lm_loss(cfg, params, h, targets, batch, emb)


def workload(cfg: LSTMConfig) -> Workload:
    """The LSTM LM as a ``Workload``."""
    batch_at, heldout = lm_data(cfg, lambda t, step: {"tokens": t}, cfg.seq_len + 1, 1)

    return lm_workload(
        "lstm_lm",
        cfg,
        init=lambda key: init_params(cfg, key),
        loss=lambda params, batch, emb=None: loss_fn(cfg, params, batch, emb),
        batch_at=batch_at,
        items_per_step=cfg.batch * cfg.seq_len,
        heldout=heldout,
        metrics=lm_metrics(cfg, loss_fn),
    )
