"""Synthetic and text token streams, seeded and addressable by step.

Every batch is a pure function of ``(seed, step)``, so every process builds the same
global batch, a resumed run sees the same data, and strategies can be compared on
identical inputs.

Example:
    >>> from models.data import ZipfStream
    >>> stream = ZipfStream(vocab=1000, exponent=1.1, seed=0)
    >>> stream.tokens(step=3, batch=4, length=9).shape
    (4, 9)
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np


def zipf_probabilities(vocab: int, exponent: float) -> np.ndarray:
    """p(k) proportional to 1 / (k + 1) ** exponent for k in [0, vocab)."""
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    if exponent <= 0:
        raise ValueError(f"exponent must be > 0, got {exponent}")
    w = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
    return w / w.sum()


def _step_rng(seed: int, step: int, salt: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, step, salt])


class ZipfStream:
    """Zipf-distributed token ids, the shape of natural-language word frequencies.

    Args:
      vocab: vocabulary size V; ids are in [0, V).
      exponent: Zipf exponent s (about 1.0-1.2 for English words).
      seed: the stream's seed.
    """

    def __init__(self, vocab: int, exponent: float = 1.1, seed: int = 0):
        self.vocab, self.exponent, self.seed = vocab, exponent, seed
        self._cdf = np.cumsum(zipf_probabilities(vocab, exponent))

    def tokens(self, step: int, batch: int, length: int, salt: int = 0) -> np.ndarray:
        """int32[batch, length] ids for ``step`` (same arguments, same ids)."""
        u = _step_rng(self.seed, step, salt).random((batch, length))
        ids = np.searchsorted(self._cdf, u, side="right")
        return np.minimum(ids, self.vocab - 1).astype(np.int32)


def log_uniform_negatives(vocab: int, num: int, seed: int, step: int) -> np.ndarray:
    """``num`` shared negative samples for sampled softmax, log-uniform over [0, V)."""
    u = _step_rng(seed, step, salt=7).random(num)
    ids = np.floor(np.exp(u * np.log(vocab + 1.0))) - 1
    return np.clip(ids, 0, vocab - 1).astype(np.int32)


_WORD = re.compile(r"\S+")


def build_vocab(words: list[str], vocab_size: int) -> dict[str, int]:
    """The ``vocab_size - 1`` most frequent words plus ``<unk>`` (id 0)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    counts = collections.Counter(words)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 1]
    vocab = {"<unk>": 0}
    for word, _ in ranked:
        vocab[word] = len(vocab)
    return vocab


class TextStream:
    """Word-level token stream from a local text file (whitespace tokenised, ``<eos>``
    at line ends), cut into random windows per step.

    Args:
      path: a UTF-8 text file.
      vocab_size: vocabulary size V, ``<unk>`` included.
      seed: seed of the window positions.
    """

    def __init__(self, path: str | Path, vocab_size: int, seed: int = 0):
        text = Path(path).read_text(encoding="utf-8")
        words = [w for line in text.splitlines() for w in [*_WORD.findall(line), "<eos>"]]
        self.vocab = build_vocab(words, vocab_size)
        self.ids = np.array([self.vocab.get(w, 0) for w in words], dtype=np.int32)
        self.seed = seed

    def tokens(self, step: int, batch: int, length: int, salt: int = 0) -> np.ndarray:
        """int32[batch, length] windows of the corpus for ``step``."""
        if len(self.ids) <= length:
            raise ValueError(f"corpus has {len(self.ids)} tokens, fewer than length={length}")
        starts = _step_rng(self.seed, step, salt).integers(0, len(self.ids) - length, batch)
        return np.stack([self.ids[s : s + length] for s in starts])
