"""BERT-style masked language model on Zipf tokens or local text.

Each example has ``masked`` positions (a fixed count, so shapes are static) replaced by
the ``[MASK]`` id 0; the loss is the cross-entropy of the original ids there.

Paper-scale config (BERT-base, EmbRace and TopKA2A): ``vocab=30522, dim=768, heads=12,
layers=12, seq_len=128 (512), masked=20``, tied output embeddings.

Example:
    >>> import jax
    >>> from models import bert
    >>> w = bert.workload(bert.BERTConfig(vocab=100))
    >>> float(w.loss(w.init(jax.random.key(0)), w.batch_at(0))) > 0
    True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.blocks import Stack, transformer_params
from models.data import _step_rng
from models.workload import embed, lm_data, lm_loss, lm_metrics, lm_workload
from sparsecomm_jax.embedding.access import PLAIN

MASK_ID = 0
TEXT_SPECIALS = ("[MASK]", "<unk>")  # ids 0 and 1 of a text vocabulary


@dataclasses.dataclass(frozen=True)
class BERTConfig:
    vocab: int = 1000  # vocabulary size V (id 0 is [MASK])
    dim: int = 32  # model width D
    heads: int = 2  # attention heads
    layers: int = 1  # transformer blocks
    seq_len: int = 16  # tokens per example T
    masked: int = 3  # masked positions per example (about 15% of T)
    batch: int = 16  # global batch (examples per step)
    sampled_softmax: int = 0  # shared negatives per step; 0 = full softmax
    tie_embeddings: bool = True  # output table = input table (as BERT)
    zipf_exponent: float = 1.1  # Zipf exponent of the synthetic tokens
    text_file: str = ""  # a local text file instead of Zipf tokens (word-level)
    data_dir: str = ""  # WikiText / PTB folder: train, valid and test token files
    seed: int = 0  # data and init seed


def _stack(cfg: BERTConfig) -> Stack:
    return Stack(cfg.dim, cfg.heads, cfg.layers)


def init_params(cfg: BERTConfig, key: jax.Array) -> dict:
    return transformer_params(cfg, key, {"encoder": (_stack(cfg), 0)})


def loss_fn(cfg: BERTConfig, params, batch, emb=None) -> jax.Array:
    """Cross-entropy at the masked positions: ``tokens`` int32[B, T] (masked),
    ``positions`` and ``labels`` int32[B, M]."""
    emb = emb or PLAIN
    x = embed(cfg, params, batch["tokens"], emb) + params["pos"]
    h = _stack(cfg).apply({"params": params["encoder"]}, x)
    h = jnp.take_along_axis(h, batch["positions"][..., None], axis=1)  # [B, M, D]
    return lm_loss(cfg, params, h, batch["labels"], batch, emb)


def masked_batch(tokens: np.ndarray, masked: int, seed: int, step: int) -> dict:
    """Masks ``masked`` distinct positions per example (host-side, seeded)."""
    rng = _step_rng(seed, step, salt=3)
    b, t = tokens.shape
    positions = np.argsort(rng.random((b, t)), axis=1)[:, :masked].astype(np.int32)
    labels = np.take_along_axis(tokens, positions, axis=1)
    inputs = tokens.copy()
    np.put_along_axis(inputs, positions, MASK_ID, axis=1)
    return {"tokens": inputs, "positions": positions, "labels": labels}


def workload(cfg: BERTConfig):
    if not 0 < cfg.masked <= cfg.seq_len:
        raise ValueError(f"masked must be in [1, seq_len={cfg.seq_len}], got {cfg.masked}")
    batch_at, heldout = lm_data(
        cfg,
        lambda tokens, step: masked_batch(tokens, cfg.masked, cfg.seed, step),
        cfg.seq_len,
        0,
        specials=TEXT_SPECIALS,  # [MASK] keeps id 0 on text
    )

    w = lm_workload(
        "bert",
        cfg,
        init=lambda key: init_params(cfg, key),
        loss=lambda params, batch, emb=None: loss_fn(cfg, params, batch, emb),
        batch_at=batch_at,
        items_per_step=cfg.batch * cfg.seq_len,
        heldout=heldout,
        metrics=lm_metrics(cfg, loss_fn),
    )
    # positions are ints too, but not ids: name the keys that hold token ids
    negatives = ("negatives",) if cfg.sampled_softmax else ()
    return w._replace(id_keys=("tokens", "labels", *negatives))
