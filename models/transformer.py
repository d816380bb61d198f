"""Encoder-decoder Transformer for translation (shared source/target vocabulary).

Synthetic task: the target is a fixed random permutation of the vocabulary applied to
the source word by word, behind a begin-of-sentence id 0, so there is something to learn.
The source is Zipf tokens, or windows of local text (``text_file``, ``data_dir``).

Paper-scale config (Transformer-base on WMT, EmbRace): ``vocab=32000 (shared BPE),
dim=512, heads=8, layers=6, seq_len=64``, tied embeddings.

Example:
    >>> import jax
    >>> from models import transformer
    >>> w = transformer.workload(transformer.TransformerConfig(vocab=100))
    >>> float(w.loss(w.init(jax.random.key(0)), w.batch_at(0))) > 0
    True
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from models.blocks import Stack, transformer_params
from models.workload import embed, lm_data, lm_loss, lm_metrics, lm_workload
from sparsecomm_jax.embedding.access import PLAIN

BOS_ID = 0


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab: int = 1000  # shared source/target vocabulary V (id 0 is BOS)
    dim: int = 32  # model width D
    heads: int = 2  # attention heads
    layers: int = 1  # encoder layers and decoder layers (each)
    seq_len: int = 16  # source and target length T
    batch: int = 16  # global batch (sentence pairs per step)
    sampled_softmax: int = 0  # shared negatives per step; 0 = full softmax
    tie_embeddings: bool = True  # output table = the shared input table
    zipf_exponent: float = 1.1  # Zipf exponent of the synthetic tokens
    text_file: str = ""  # a local text file as the source sentences (word-level)
    data_dir: str = ""  # WikiText / PTB folder: train, valid and test token files
    seed: int = 0  # data and init seed


def _stacks(cfg: TransformerConfig) -> tuple[Stack, Stack]:
    return (
        Stack(cfg.dim, cfg.heads, cfg.layers),
        Stack(cfg.dim, cfg.heads, cfg.layers, causal=True, cross=True),
    )


def init_params(cfg: TransformerConfig, key: jax.Array) -> dict:
    enc, dec = _stacks(cfg)
    return transformer_params(cfg, key, {"encoder": (enc, 0), "decoder": (dec, cfg.seq_len)})


def loss_fn(cfg: TransformerConfig, params, batch, emb=None) -> jax.Array:
    """Teacher-forced cross-entropy: ``src`` int32[B, T], ``tgt`` int32[B, T+1]."""
    emb = emb or PLAIN
    enc, dec = _stacks(cfg)
    memory = enc.apply(
        {"params": params["encoder"]}, embed(cfg, params, batch["src"], emb) + params["pos"]
    )
    x = embed(cfg, params, batch["tgt"][:, :-1], emb) + params["pos"]
    h = dec.apply({"params": params["decoder"]}, x, memory)
    return lm_loss(cfg, params, h, batch["tgt"][:, 1:], batch, emb)


def workload(cfg: TransformerConfig):
    perm = np.random.default_rng(cfg.seed + 1).permutation(cfg.vocab).astype(np.int32)

    def make_batch(src: np.ndarray, step: int) -> dict:
        bos = np.full((len(src), 1), BOS_ID, np.int32)
        return {"src": src, "tgt": np.concatenate([bos, perm[src]], 1)}

    batch_at, heldout = lm_data(cfg, make_batch, cfg.seq_len, 0)

    return lm_workload(
        "transformer",
        cfg,
        init=lambda key: init_params(cfg, key),
        loss=lambda params, batch, emb=None: loss_fn(cfg, params, batch, emb),
        batch_at=batch_at,
        items_per_step=cfg.batch * cfg.seq_len * 2,
        heldout=heldout,
        metrics=lm_metrics(cfg, loss_fn),
    )
