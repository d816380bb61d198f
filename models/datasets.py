"""Real data from local files: WikiText / PTB token files and CIFAR-10 pickle batches.

Nothing is downloaded: ``--data-dir`` names a folder that already holds the files.

=========  ==========================================================================
Layout     Files
=========  ==========================================================================
WikiText   ``wiki.train.tokens``, ``wiki.valid.tokens``, ``wiki.test.tokens``
PTB        ``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt``
CIFAR-10   ``cifar-10-batches-py/`` (or the folder itself) with ``data_batch_1`` ..
           ``data_batch_5``, ``test_batch``, ``batches.meta``
=========  ==========================================================================

Text is word-level (whitespace tokenised, ``<eos>`` after every line, as in the
WikiText and PTB releases); the vocabulary comes from the training split only.

Example:
    >>> import pathlib, tempfile
    >>> from models import datasets
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for split in ("train", "valid", "test"):
    ...     _ = (d / f"ptb.{split}.txt").write_text("the cat sat\\nthe dog <unk>\\n")
    >>> corpus = datasets.load_corpus(d, vocab_size=10)
    >>> corpus.splits["valid"].tolist()
    [2, 3, 5, 1, 2, 4, 0, 1]
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from models.data import _step_rng, build_vocab, encode, read_words

SPLITS = ("train", "valid", "test")
TEXT_LAYOUTS = {
    "WikiText": {s: f"wiki.{s}.tokens" for s in SPLITS},
    "PTB": {s: f"ptb.{s}.txt" for s in SPLITS},
}
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_FILES = (*CIFAR_TRAIN, "test_batch", "batches.meta")


class Corpus(NamedTuple):
    """A tokenised corpus.

    Attributes:
      vocab: word -> id (specials first).
      splits: split name -> int32[N] ids (``train`` always; ``valid``/``test`` when held
        out data exists).
      words: distinct words of the training split (before the ``vocab_size`` cap).
    """

    vocab: dict[str, int]
    splits: dict[str, np.ndarray]
    words: int


def _expected_text_files() -> str:
    return " or ".join(f"{k} ({', '.join(v.values())})" for k, v in TEXT_LAYOUTS.items())


def text_files(data_dir: str | Path) -> dict[str, Path]:
    """The split -> file map of a WikiText or PTB folder; ``ValueError`` naming the
    files expected when neither layout is complete."""
    d = Path(data_dir)
    for files in TEXT_LAYOUTS.values():
        if all((d / f).is_file() for f in files.values()):
            return {s: d / f for s, f in files.items()}
    raise ValueError(
        f"--data-dir {str(d)!r} lacks the token files: expected {_expected_text_files()}"
    )


def _corpus(split_words: dict[str, list[str]], vocab_size: int, specials) -> Corpus:
    vocab = build_vocab(split_words["train"], vocab_size, specials)
    splits = {s: encode(w, vocab) for s, w in split_words.items()}
    return Corpus(vocab, splits, len(set(split_words["train"])))


def load_corpus(
    data_dir: str | Path, vocab_size: int, specials: tuple[str, ...] = ("<unk>",)
) -> Corpus:
    """Train / valid / test ids of a WikiText or PTB folder.

    Args:
      data_dir: the folder.
      vocab_size: vocabulary size V: ``specials`` plus the most frequent training words
        (the rest become ``<unk>``).
      specials: words given the first ids; must include ``<unk>``.

    Returns:
      The ``Corpus``.
    """
    files = text_files(data_dir)
    return _corpus({s: read_words(f) for s, f in files.items()}, vocab_size, specials)


def file_corpus(path: str | Path, vocab_size: int, specials=("<unk>",)) -> Corpus:
    """A single text file as the training split (no held-out data)."""
    return _corpus({"train": read_words(path)}, vocab_size, specials)


def lm_corpus(cfg, specials: tuple[str, ...] = ("<unk>",)) -> Corpus | None:
    """The corpus a language-model config names (``data_dir`` or ``text_file``), or
    ``None`` for synthetic tokens."""
    if cfg.data_dir and cfg.text_file:
        raise ValueError("give --data-dir or --text-file, not both")
    if cfg.data_dir:
        return load_corpus(cfg.data_dir, cfg.vocab, specials)
    if cfg.text_file:
        return file_corpus(cfg.text_file, cfg.vocab, specials)
    return None


def heldout_windows(
    ids: np.ndarray, length: int, batch: int, max_batches: int = 0, overlap: int = 0
) -> list[np.ndarray]:
    """Consecutive windows of ``ids`` in equal-size chunks, in corpus order.

    Windows start every ``length - overlap`` tokens (next-token models take T+1 windows
    with overlap 1, so every token is a target once). Chunks hold ``batch`` windows (all
    of them when fewer); the last partial chunk is left out so every chunk has one shape.

    Args:
      ids: int32[N] a held-out split.
      length: tokens per window.
      batch: windows per chunk.
      max_batches: keep at most this many chunks (0 = all).
      overlap: tokens shared by consecutive windows, in [0, length).

    Returns:
      A list of int32[b, length] arrays.
    """
    stride = length - overlap
    n = (len(ids) - length) // stride + 1 if len(ids) >= length else 0
    if n == 0:
        raise ValueError(f"held-out split has {len(ids)} tokens, fewer than length={length}")
    windows = np.stack([ids[i * stride : i * stride + length] for i in range(n)])
    b = min(batch, n)
    chunks = [windows[i : i + b] for i in range(0, n - b + 1, b)]
    return chunks[:max_batches] if max_batches else chunks


# ------------------------------------------------------------------ CIFAR-10


class Images(NamedTuple):
    """Images as uint8[N, 32, 32, 3] and int32[N] labels."""

    images: np.ndarray
    labels: np.ndarray


def cifar_folder(data_dir: str | Path) -> Path:
    """The folder holding the CIFAR-10 batches (``data_dir`` or its
    ``cifar-10-batches-py``); ``ValueError`` naming the files expected."""
    for d in (Path(data_dir) / CIFAR_FOLDER, Path(data_dir)):
        if all((d / f).is_file() for f in CIFAR_FILES):
            return d
    raise ValueError(
        f"--data-dir {str(data_dir)!r} lacks the CIFAR-10 python batches: expected "
        f"{CIFAR_FOLDER}/{{{', '.join(CIFAR_FILES)}}}"
    )


class DataUnpickler(pickle.Unpickler):
    """An unpickler for data files: it builds only what the CIFAR-10 python batches
    hold (dicts, lists, bytes, numbers and numpy arrays); any other class or function a
    file names (``os.system`` in a ``__reduce__``, say) is refused, never called."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(
                f"refuses {module}.{name}: a data file may hold arrays, lists, bytes and "
                "numbers only"
            )
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    """The dict a CIFAR-10 file holds, read without running code; ``ValueError`` naming
    the file for anything else (a damaged, truncated or foreign file)."""
    try:
        with open(path, "rb") as f:
            d = DataUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is no CIFAR-10 python batch: {e}") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror or e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} is no CIFAR-10 python batch: holds a {type(d).__name__}")
    return d


def _field(d: dict, key: bytes, path: Path):
    if key not in d:
        raise ValueError(f"{path} is no CIFAR-10 python batch: no {key.decode()!r} entry")
    return d[key]


def read_cifar_batch(path: Path) -> Images:
    """One pickle batch: rows of 3072 bytes (R, G, B planes of 32 x 32) to NHWC.

    Raises:
      ValueError: naming the file, for anything but N > 0 rows of 3072 uint8 and N
        integer labels in [0, 10).
    """
    d = _unpickle(path)
    data, labels = _field(d, b"data", path), _field(d, b"labels", path)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        kind = data.dtype if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{path}: 'data' must be uint8 pixels (0-255), got {kind}")
    if data.ndim != 2 or data.shape[1] != 3072 or not data.shape[0]:
        raise ValueError(f"{path}: 'data' must be N > 0 rows of 3072 bytes, got {data.shape}")
    try:
        labels = np.asarray(labels)
    except (ValueError, TypeError):
        labels = np.asarray([], object)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{path}: 'labels' must be a list of integers")
    if len(labels) != len(data):
        raise ValueError(f"{path}: {len(data)} images but {len(labels)} labels")
    if labels.min() < 0 or labels.max() >= 10:
        raise ValueError(
            f"{path}: labels must lie in [0, 10), got [{labels.min()}, {labels.max()}]"
        )
    data = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return Images(np.ascontiguousarray(data), labels.astype(np.int32))


def load_cifar10(data_dir: str | Path) -> tuple[Images, Images, list[str]]:
    """(train, test, class names) of a CIFAR-10 python-pickle folder, every file read
    without running code and checked (``read_cifar_batch``)."""
    d = cifar_folder(data_dir)
    parts = [read_cifar_batch(d / f) for f in CIFAR_TRAIN]
    train = Images(*(np.concatenate(x) for x in zip(*parts, strict=True)))
    meta = d / "batches.meta"
    names = _field(_unpickle(meta), b"label_names", meta)
    if not (
        isinstance(names, list) and len(names) == 10 and all(isinstance(n, bytes) for n in names)
    ):
        raise ValueError(f"{meta}: 'label_names' must be 10 names")
    return train, read_cifar_batch(d / "test_batch"), [n.decode(errors="replace") for n in names]


def normalizer(train: Images) -> Callable[[np.ndarray], np.ndarray]:
    """``uint8 NHWC -> float32`` standardised with the training set's channel stats."""
    mean = train.images.mean(axis=(0, 1, 2), dtype=np.float64)
    std = train.images.std(axis=(0, 1, 2), dtype=np.float64) + 1e-6
    return lambda x: ((x - mean) / std).astype(np.float32)


def epoch_indices(n: int, batch: int, seed: int, step: int) -> np.ndarray:
    """Sample indices of ``step``: a fresh seeded permutation of [0, n) every epoch."""
    pos = step * batch + np.arange(batch)
    out = np.empty(batch, np.int64)
    for epoch in np.unique(pos // n):
        sel = pos // n == epoch
        out[sel] = _step_rng(seed, int(epoch), salt=9).permutation(n)[pos[sel] % n]
    return out
