"""What a training script needs to know about a model: the ``Workload`` record."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.data import WindowStream, ZipfStream, log_uniform_negatives
from models.datasets import heldout_windows, lm_corpus
from sparsecomm_jax.comm.vma import same_varying
from sparsecomm_jax.nn import TABLE_NAME, Embed, use_ops


class Workload(NamedTuple):
    """A model with its data, as the train-step builders consume it.

    Attributes:
      name: the ``--model`` name.
      init: ``init(key) -> params``.
      loss: ``loss(params, batch, emb) -> scalar``, mean over the batch's examples
        (see ``sparsecomm_jax.train``).
      batch_at: ``batch_at(step) -> dict`` of numpy arrays: the global batch of ``step``.
      replicated_keys: batch keys every worker sees whole.
      items_per_step: tokens (LMs) or samples (vision) of one global batch.
      items_name: ``"tokens"`` or ``"samples"``: names the throughput field.
      embedding_paths: parameter paths (tuples of keys) of the embedding tables.
      config: the model's configuration, as a plain dict.
      id_keys: batch keys holding token ids (``None``: every integer entry).
      heldout: ``heldout(split, max_batches=0) -> list of batches`` of a held-out split
        (``"valid"``, ``"test"``); empty when the data has none (synthetic data).
      metrics: ``metrics(params, batch) -> dict`` of per-batch means (``loss``, and
        ``accuracy`` for classifiers) on dense parameters (see ``models.heldout``).
    """

    name: str
    init: Callable[[jax.Array], Any]
    loss: Callable[..., jax.Array]
    batch_at: Callable[[int], dict[str, np.ndarray]]
    replicated_keys: tuple[str, ...]
    items_per_step: int
    items_name: str
    embedding_paths: tuple[tuple[str, ...], ...]
    config: dict[str, Any]
    id_keys: tuple[str, ...] | None = None
    heldout: Callable[..., list[dict[str, np.ndarray]]] = lambda split, max_batches=0: []
    metrics: Callable[..., dict[str, jax.Array]] | None = None


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of integer ``labels``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def rows_logits(rows: jax.Array, h: jax.Array) -> jax.Array:
    """``rows @ h.T``: float[N, P] logits of ``N`` table rows at ``P`` hidden states.

    Its gradient materializes the logits' gradient transposed once, so that both
    gradient matmuls read their operands in row-major order. Left to itself XLA:CPU
    folds the transpose into the hidden states' gradient matmul, and a matmul that
    contracts its left operand's rows runs on a slower path there (the measurement is
    in BENCHMARKS.md, "The sampled softmax's gradient"). The tuning is for CPUs: on an
    accelerator the transpose costs one extra ``[P, N]`` copy. Reverse mode only
    (``jax.grad``, ``jax.vjp``), as for any ``jax.custom_vjp``.

    Example:
        >>> import jax.numpy as jnp
        >>> rows_logits(jnp.ones((3, 2)), jnp.ones((4, 2))).shape
        (3, 4)
    """
    return _rows_logits(*same_varying(rows, h))  # one replicated, one per worker: alike


@jax.custom_vjp
def _rows_logits(rows, h):
    return rows @ h.T


def _rows_logits_fwd(rows, h):
    return rows @ h.T, (rows, h)


def _rows_logits_bwd(res, g):
    rows, h = res
    g_t = jax.lax.optimization_barrier(g.T)  # [P, N], kept apart from the matmul
    return (g @ h).astype(rows.dtype), (g_t @ rows).astype(h.dtype)


_rows_logits.defvjp(_rows_logits_fwd, _rows_logits_bwd)


def sampled_softmax_loss(h, out: Embed, targets, negatives) -> jax.Array:
    """Softmax over each position's target and ``N`` negatives shared by the batch.

    Args:
      h: float[..., D] hidden states.
      out: the output table, a bound ``Embed`` (read inside ``use_ops``).
      targets: int[...] target ids, of shape ``h.shape[:-1]``.
      negatives: int[N] shared negative ids; a negative equal to the target is masked.

    Returns:
      The mean loss (scalar).

    References:
      Jean et al., "On Using Very Large Target Vocabulary for NMT", ACL 2015.
    """
    # -log softmax at the target is logsumexp(pos, neg...) - pos: the target's logit
    # is kept apart, with no [..., N+1] concatenation to read index 0 back from (the
    # concatenation's and the gather's gradients copy every logit), and the negatives'
    # logits are negatives-major, [N, P], from ``rows_logits``; both measured faster on
    # XLA:CPU (BENCHMARKS.md, "The sampled softmax's gradient").
    h2 = h.reshape(-1, h.shape[-1])  # [P, D], P positions
    pos = jnp.sum(h * out(targets), axis=-1).reshape(-1).astype(jnp.float32)  # [P]
    neg = rows_logits(out.lookup_shared(negatives), h2).astype(jnp.float32)  # [N, P]
    neg = jnp.where(negatives[:, None] == targets.reshape(1, -1), -1e9, neg)
    return jnp.mean(jnp.logaddexp(pos, jax.nn.logsumexp(neg, axis=0)) - pos)


def init_table(key: jax.Array, vocab: int, dim: int) -> jax.Array:
    """A V x D embedding table, N(0, 1/D)."""
    return jax.random.normal(key, (vocab, dim)) * dim**-0.5


def embed_params(key: jax.Array, vocab: int, dim: int) -> dict:
    """The parameters of an ``Embed`` table: ``{"embedding": V x D}``, N(0, 1/D)."""
    return {TABLE_NAME: init_table(key, vocab, dim)}


def table(cfg, table_params: dict) -> Embed:
    """The ``Embed`` (V x D of ``cfg``) bound to ``table_params``; call it, its
    ``attend`` or ``lookup_shared`` inside ``use_ops(emb)``."""
    return Embed(cfg.vocab, cfg.dim).bind({"params": table_params})


def embed(cfg, params, ids, emb) -> jax.Array:
    """Rows of the input table ``embed`` for ``ids``, read through ``emb``."""
    with use_ops(emb):
        return table(cfg, params["embed"])(ids)


def output_params(cfg, key: jax.Array) -> dict:
    """The output table ``softmax`` (V x D), or nothing when tied to ``embed``."""
    return {} if cfg.tie_embeddings else {"softmax": embed_params(key, cfg.vocab, cfg.dim)}


def table_paths(cfg) -> tuple[tuple[str, ...], ...]:
    """Parameter paths of a language model's embedding tables."""
    names = ("embed",) if cfg.tie_embeddings else ("embed", "softmax")
    return tuple((name, TABLE_NAME) for name in names)


def lm_loss(cfg, params, h, targets, batch, emb) -> jax.Array:
    """Full or sampled softmax over the (tied or separate) output table."""
    out = table(cfg, params["embed"] if cfg.tie_embeddings else params["softmax"])
    with use_ops(emb):
        if cfg.sampled_softmax:
            return sampled_softmax_loss(h, out, targets, batch["negatives"])
        return cross_entropy(out.attend(h), targets)


def with_negatives(cfg, batch: dict, step: int) -> dict:
    """Adds the step's shared negatives when the model uses sampled softmax."""
    if cfg.sampled_softmax:
        batch["negatives"] = log_uniform_negatives(cfg.vocab, cfg.sampled_softmax, cfg.seed, step)
    return batch


HELDOUT_STEP = 1 << 40  # held-out batch i is built as step HELDOUT_STEP + i (BERT masks)


def lm_data(
    cfg, make_batch: Callable, length: int, overlap: int, specials: tuple[str, ...] = ("<unk>",)
) -> tuple[Callable, Callable]:
    """``(batch_at, heldout)`` of a language model from its token source.

    Args:
      cfg: the model config (``data_dir``, ``text_file``, ``vocab``, ``batch``, ``seed``,
        ``zipf_exponent``, ``sampled_softmax``).
      make_batch: ``make_batch(tokens int32[B, length], step) -> batch dict``.
      length: tokens per example window.
      overlap: tokens consecutive held-out windows share (1 for next-token prediction
        on T+1 windows, so every token is a target once; else 0).
      specials: words with the first ids (``<unk>`` among them).

    Returns:
      ``batch_at(step)`` and ``heldout(split, max_batches=0)`` (see ``Workload``).
    """
    corpus = lm_corpus(cfg, specials)
    if corpus is None:
        stream = ZipfStream(cfg.vocab, cfg.zipf_exponent, cfg.seed)
    else:
        train = corpus.splits["train"]
        if len(train) <= length:  # a window is `length` tokens, one must fit with room
            source = f"--text-file {cfg.text_file}" if cfg.text_file else "--data-dir's train file"
            raise ValueError(
                f"{source} has {len(train)} tokens; an example takes {length} (from "
                f"--seq-len {cfg.seq_len}), so it needs more than that: lower --seq-len"
            )
        stream = WindowStream(train, cfg.seed)

    def batch_at(step: int) -> dict:
        return with_negatives(cfg, make_batch(stream.tokens(step, cfg.batch, length), step), step)

    def heldout(split: str, max_batches: int = 0) -> list[dict]:
        if corpus is None or split not in corpus.splits:
            return []
        ids = corpus.splits[split]
        if len(ids) < length:
            raise ValueError(
                f"the {split} file of --data-dir has {len(ids)} tokens, fewer than one "
                f"example ({length}); lower --seq-len"
            )
        chunks = heldout_windows(ids, length, cfg.batch, max_batches, overlap)
        return [make_batch(c, HELDOUT_STEP + i) for i, c in enumerate(chunks)]

    return batch_at, heldout


def lm_metrics(cfg, loss_fn: Callable) -> Callable:
    """Held-out metrics of a language model: the full-softmax loss (sampled softmax is
    a training device only)."""
    full = dataclasses.replace(cfg, sampled_softmax=0)
    return lambda params, batch: {"loss": loss_fn(full, params, batch, None)}


def lm_workload(name, cfg, init, loss, batch_at, items_per_step, **extra) -> Workload:
    """A language-model ``Workload`` (tables and negatives follow ``cfg``); ``extra``
    sets further fields (``heldout``, ``metrics``)."""
    return Workload(
        name=name,
        init=jax.jit(init),  # one program (eager flax init compiles every initializer)
        loss=loss,
        batch_at=batch_at,
        replicated_keys=("negatives",) if cfg.sampled_softmax else (),
        items_per_step=items_per_step,
        items_name="tokens",
        embedding_paths=table_paths(cfg),
        config=dataclasses.asdict(cfg),
        **extra,
    )
