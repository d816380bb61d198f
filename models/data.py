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


def build_vocab(
    words: list[str], vocab_size: int, specials: tuple[str, ...] = ("<unk>",)
) -> dict[str, int]:
    """``specials`` first (ids 0, 1, ...), then the most frequent other words, up to
    ``vocab_size`` entries; ``"<unk>"`` must be among the specials."""
    if vocab_size < len(specials) + 1:
        raise ValueError(f"vocab_size must be >= {len(specials) + 1}, got {vocab_size}")
    counts = collections.Counter(w for w in words if w not in specials)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    vocab = {w: i for i, w in enumerate(specials)}
    for word, _ in ranked[: vocab_size - len(specials)]:
        vocab[word] = len(vocab)
    return vocab


def read_words(path: str | Path) -> list[str]:
    """Whitespace-separated words of a UTF-8 file, ``<eos>`` after every line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read text file {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = Path(path).read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(
            f"text file {str(path)!r} is not UTF-8 (byte {e.start}, line {line}: {e.reason}); "
            "convert it, e.g. iconv -t utf-8"
        ) from None
    return [w for line in text.splitlines() for w in [*_WORD.findall(line), "<eos>"]]


def encode(words: list[str], vocab: dict[str, int]) -> np.ndarray:
    """int32 ids of ``words``; words outside ``vocab`` become ``<unk>``."""
    unk = vocab["<unk>"]
    return np.array([vocab.get(w, unk) for w in words], dtype=np.int32)


class WindowStream:
    """Random windows of a token-id array, seeded by step.

    Args:
      ids: int32[N] the corpus as token ids.
      seed: seed of the window positions.
    """

    def __init__(self, ids: np.ndarray, seed: int = 0):
        self.ids, self.seed = np.asarray(ids, np.int32), seed

    def tokens(self, step: int, batch: int, length: int, salt: int = 0) -> np.ndarray:
        """int32[batch, length] windows of the corpus for ``step``."""
        if len(self.ids) <= length:
            raise ValueError(f"corpus has {len(self.ids)} tokens, fewer than length={length}")
        starts = _step_rng(self.seed, step, salt).integers(0, len(self.ids) - length, batch)
        return np.stack([self.ids[s : s + length] for s in starts])


class TextStream(WindowStream):
    """Word-level token stream from a local text file (whitespace tokenised, ``<eos>``
    at line ends), cut into random windows per step.

    Args:
      path: a UTF-8 text file.
      vocab_size: vocabulary size V, ``<unk>`` included.
      seed: seed of the window positions.
      specials: words given the first ids (``<unk>`` among them).
    """

    def __init__(
        self,
        path: str | Path,
        vocab_size: int,
        seed: int = 0,
        specials: tuple[str, ...] = ("<unk>",),
    ):
        words = read_words(path)
        self.vocab = build_vocab(words, vocab_size, specials)
        super().__init__(encode(words, self.vocab), seed)
