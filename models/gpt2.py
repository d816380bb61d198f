"""GPT-2-style decoder-only language model on Zipf tokens or local text.

Paper-scale config (GPT-2 small, as in TopKA2A's evaluation): ``vocab=50257, dim=768,
heads=12, layers=12, seq_len=1024``, tied input/output embeddings.

Example:
    >>> import jax
    >>> from models import gpt2
    >>> w = gpt2.workload(gpt2.GPT2Config(vocab=100))
    >>> float(w.loss(w.init(jax.random.key(0)), w.batch_at(0))) > 0
    True
"""

from __future__ import annotations

import dataclasses

import jax

from models.blocks import Stack, transformer_params
from models.workload import embed, lm_data, lm_loss, lm_metrics, lm_workload
from sparsecomm_jax.embedding.access import PLAIN


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab: int = 1000  # vocabulary size V
    dim: int = 32  # model width D (= embedding width)
    heads: int = 2  # attention heads
    layers: int = 1  # transformer blocks
    seq_len: int = 16  # tokens per example T
    batch: int = 16  # global batch (examples per step)
    sampled_softmax: int = 0  # shared negatives per step; 0 = full softmax
    tie_embeddings: bool = True  # output table = input table (as GPT-2)
    zipf_exponent: float = 1.1  # Zipf exponent of the synthetic tokens
    text_file: str = ""  # a local text file instead of Zipf tokens (word-level)
    data_dir: str = ""  # WikiText / PTB folder: train, valid and test token files
    seed: int = 0  # data and init seed


def _stack(cfg: GPT2Config) -> Stack:
    return Stack(cfg.dim, cfg.heads, cfg.layers, causal=True)


def init_params(cfg: GPT2Config, key: jax.Array) -> dict:
    return transformer_params(cfg, key, {"decoder": (_stack(cfg), 0)})


def loss_fn(cfg: GPT2Config, params, batch, emb=None) -> jax.Array:
    """Next-token cross-entropy of ``batch["tokens"]``: int32[B, T+1]."""
    emb = emb or PLAIN
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    x = embed(cfg, params, inputs, emb) + params["pos"]
    h = _stack(cfg).apply({"params": params["decoder"]}, x)
    return lm_loss(cfg, params, h, targets, batch, emb)


def workload(cfg: GPT2Config):
    batch_at, heldout = lm_data(cfg, lambda t, step: {"tokens": t}, cfg.seq_len + 1, 1)

    return lm_workload(
        "gpt2",
        cfg,
        init=lambda key: init_params(cfg, key),
        loss=lambda params, batch, emb=None: loss_fn(cfg, params, batch, emb),
        batch_at=batch_at,
        items_per_step=cfg.batch * cfg.seq_len,
        heldout=heldout,
        metrics=lm_metrics(cfg, loss_fn),
    )
