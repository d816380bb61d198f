"""DLRM: a recommendation model of many embedding tables, on Criteo-like data.

Dense features go through the bottom MLP to a D-vector; each sparse feature is a bag of
ids (one or several, ``multi_hot``) pooled from its own table (``nn.EmbedBag``, sum);
the feature interaction is the dot product of every pair of those vectors; the top MLP
turns them (with the bottom vector) into a click logit, trained by log loss.

Data: synthetic by default (13 dense features, one Zipf-distributed sparse feature per
table, a click drawn from a hidden logistic model of both, so the model can learn it),
or the Criteo TSV format from a local file (``--data-dir D`` with ``D/train.txt``:
label, 13 integer and 26 hexadecimal categorical columns, tab-separated, empty fields
allowed), categorical values hashed into the tables. Held-out log loss, accuracy and
AUC on the last tenth of the file (synthetic data: a held-out stream).

Each sparse feature is its own batch key (``sparse_0``, ``sparse_1``, ...), so its ids
are checked against its own table.

Paper-scale config (Criteo Kaggle, DLRM's reference): 26 tables, D = 16-128, bottom MLP
``512,256,64``, top ``512,256``; TorchRec's example uses D = 64.

Example:
    >>> import jax
    >>> from models import dlrm
    >>> w = dlrm.workload(dlrm.DLRMConfig(tables="50,40,30", dim=4, batch=8))
    >>> float(w.loss(w.init(jax.random.key(0)), w.batch_at(0))) > 0
    True

References:
    Naumov et al., "Deep Learning Recommendation Model for Personalization and
    Recommendation Systems", 2019.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np

from models.data import _step_rng, zipf_probabilities
from models.workload import Workload
from sparsecomm_jax import nn

DENSE_FEATURES = 13  # Criteo's integer columns
CATEGORICAL = 26  # Criteo's categorical columns


@dataclasses.dataclass(frozen=True)
class DLRMConfig:
    tables: str = "1000,1000,500,500,200,200,100,100"  # rows of each sparse feature's table
    dim: int = 16  # D: every table's row width and the bottom MLP's output
    bottom: str = "64"  # hidden widths of the bottom MLP (then D)
    top: str = "64,32"  # hidden widths of the top MLP (then the logit)
    multi_hot: int = 1  # ids per sparse feature (a bag, pooled by sum)
    zipf_exponent: float = 1.1  # Zipf exponent of the synthetic ids
    batch: int = 128  # global batch (samples per step)
    data_dir: str = ""  # a folder with a Criteo TSV train.txt instead of synthetic data
    seed: int = 0  # data and init seed
    raw_ids: bool = False  # ids of any 64-bit value, no modulo (for managed tables)

    SYNTHETIC_HELDOUT: ClassVar[bool] = True  # its synthetic data has held-out splits


def table_sizes(cfg: DLRMConfig) -> list[int]:
    """Rows of each table, from ``cfg.tables`` (``ValueError`` naming what is wrong)."""
    try:
        sizes = [int(x) for x in cfg.tables.split(",")]
    except ValueError:
        raise ValueError(
            f"--tables must be comma-separated row counts, got {cfg.tables!r}"
        ) from None
    if not sizes or min(sizes) < 2:
        raise ValueError(
            f"--tables needs one or more tables, each of >= 2 rows, got {cfg.tables!r}"
        )
    return sizes


def _widths(text: str, flag: str) -> list[int]:
    try:
        widths = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated widths, got {text!r}") from None
    if any(w < 1 for w in widths):
        raise ValueError(f"{flag} widths must be >= 1, got {text!r}")
    return widths


class MLP(linen.Module):
    widths: tuple[int, ...]
    last_relu: bool = True

    @linen.compact
    def __call__(self, x):
        for i, w in enumerate(self.widths):
            x = linen.Dense(w)(x)
            if i + 1 < len(self.widths) or self.last_relu:
                x = linen.relu(x)
        return x


class DLRM(linen.Module):
    """Bottom MLP, one pooled table per sparse feature, pairwise dot interaction, top MLP.

    ``__call__(batch)`` -> click logits ``[B]``; ``batch["dense"]`` float[B, 13],
    ``batch["sparse_f"]`` int[B, multi_hot] per feature ``f``.
    """

    sizes: tuple[int, ...]
    dim: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]

    @linen.compact
    def __call__(self, batch):
        x = MLP((*self.bottom, self.dim))(batch["dense"])  # [B, D]
        pooled = [
            nn.EmbedBag(v, self.dim, mode="sum", name=f"sparse_{f}")(batch[f"sparse_{f}"])
            for f, v in enumerate(self.sizes)
        ]
        z = jnp.stack([x, *pooled], axis=1)  # [B, F+1, D]
        dots = jnp.einsum("bfd,bgd->bfg", z, z)
        upper = jnp.triu_indices(z.shape[1], k=1)
        features = jnp.concatenate([x, dots[:, upper[0], upper[1]]], axis=1)
        return MLP((*self.top, 1), last_relu=False)(features)[:, 0]


def log_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean binary cross-entropy of click ``labels`` (0/1) given ``logits``."""
    logits = logits.astype(jnp.float32)
    return jnp.mean(jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits))))


def auc(scores: jax.Array, labels: jax.Array) -> jax.Array:
    """Area under the ROC curve: the chance that a random click scores above a random
    non-click (ties count half); 0.5 when a batch has only one class."""
    order = jnp.argsort(scores)
    ranks = jnp.empty_like(scores).at[order].set(jnp.arange(1, scores.size + 1, dtype=scores.dtype))
    same = scores[:, None] == scores[None, :]  # average ranks of ties
    ranks = jnp.sum(jnp.where(same, ranks[None, :], 0), 1) / jnp.sum(same, 1)
    pos = jnp.sum(labels)
    neg = labels.size - pos
    value = (jnp.sum(ranks * labels) - pos * (pos + 1) / 2) / jnp.maximum(pos * neg, 1)
    return jnp.where((pos > 0) & (neg > 0), value, 0.5)


# ------------------------------------------------------------------------- data


def _batch(dense, sparse: list[np.ndarray], labels, raw: bool = False) -> dict[str, np.ndarray]:
    out = {"dense": dense.astype(np.float32), "label": labels.astype(np.float32)}
    kind = np.int64 if raw else np.int32  # raw ids: any 64-bit value
    out.update({f"sparse_{f}": ids.astype(kind) for f, ids in enumerate(sparse)})
    return out


def raw_ids(feature: int, ids: np.ndarray) -> np.ndarray:
    """The synthetic ids of ``feature`` as raw 64-bit values: a bijection of (feature,
    id) spread over all 64 bits, as a production id (a hash of a user or an item) is.

    Example:
        >>> raw_ids(0, np.array([0, 1])).dtype, len(set(raw_ids(0, np.arange(1000)).tolist()))
        (dtype('int64'), 1000)
    """
    with np.errstate(over="ignore"):
        value = (np.asarray(ids).astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        return (value ^ np.uint64((feature + 1) * 0xD1B54A32D192ED03 % 2**64)).view(np.int64)


def synthetic_data(cfg: DLRMConfig) -> tuple[Callable, Callable]:
    """``(batch_at, heldout)`` of Criteo-like synthetic data: log-normal counts as dense
    features, Zipf ids per table scattered over its rows by a fixed permutation (as
    Criteo's hashed ids are: the frequent ids are not the first rows), clicks from a
    hidden logistic model of both."""
    sizes = table_sizes(cfg)
    cdfs = [np.cumsum(zipf_probabilities(v, cfg.zipf_exponent)) for v in sizes]
    hidden = np.random.default_rng([cfg.seed, 7])
    hashed = [hidden.permutation(v) for v in sizes]
    w_dense = 2 * hidden.normal(size=DENSE_FEATURES) / np.sqrt(DENSE_FEATURES)
    scores = [3 * hidden.normal(size=v) / np.sqrt(len(sizes)) for v in sizes]

    def make(step: int, salt: int) -> dict[str, np.ndarray]:
        rng = _step_rng(cfg.seed, step, salt)
        dense = np.log1p(rng.lognormal(1.0, 1.0, (cfg.batch, DENSE_FEATURES)))
        ids = [
            h[np.minimum(np.searchsorted(c, rng.random((cfg.batch, cfg.multi_hot))), len(c) - 1)]
            for c, h in zip(cdfs, hashed, strict=True)
        ]
        logit = (dense - 1.0) @ w_dense + sum(
            s[i].mean(1) for s, i in zip(scores, ids, strict=True)
        )
        clicks = rng.random(cfg.batch) < 1 / (1 + np.exp(-logit))
        if cfg.raw_ids:
            ids = [raw_ids(f, i) for f, i in enumerate(ids)]
        return _batch(dense, ids, clicks, cfg.raw_ids)

    def heldout(split: str, max_batches: int = 0) -> list[dict[str, np.ndarray]]:
        n = max_batches or 8
        salt = {"valid": 1, "test": 2}.get(split)
        return [make(k, salt) for k in range(n)] if salt else []

    return (lambda step: make(step, 0)), heldout


def read_criteo(
    path: str | Path, sizes: list[int], max_rows: int = 0, raw: bool = False
) -> dict[str, np.ndarray]:
    """A Criteo TSV file as arrays: ``label`` float[N] (each line's label 0 or 1),
    ``dense`` float[N, 13] (``log(1 + max(x, 0))``, empty fields 0), ``sparse_f``
    int[N, 1] (the hexadecimal value of categorical column ``f``, below 2**64, hashed
    into ``sizes[f]`` rows, empty fields 0; with ``raw``, its 64 bits as an int64 id,
    no modulo: for a managed table).

    Raises:
      ValueError: the file is missing, has a line of another shape, a label other than
        0 or 1, or a field that is not a number in range (a count beyond 64 bits, a
        category of 2**64 or more), naming the file and line.
    """
    if len(sizes) > CATEGORICAL:
        raise ValueError(
            f"Criteo data has {CATEGORICAL} categorical columns; --tables gives {len(sizes)}"
        )
    if not os.path.isfile(path):
        raise ValueError(
            f"no Criteo file {str(path)!r} (label, 13 integer, 26 categorical columns)"
        )
    labels, dense, cats = [], [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != 1 + DENSE_FEATURES + CATEGORICAL:
                raise ValueError(
                    f"{path}, line {n}: {len(fields)} fields, a Criteo line has "
                    f"{1 + DENSE_FEATURES + CATEGORICAL} (tab-separated)"
                )
            try:
                labels.append(_label(fields[0]))
                dense.append([_count(x) for x in fields[1 : 1 + DENSE_FEATURES]])
                cats.append([_category(x) for x in fields[1 + DENSE_FEATURES :]])
            except ValueError as e:
                raise ValueError(f"{path}, line {n}: {e}") from None
            if max_rows and n >= max_rows:
                break
    if not labels:
        raise ValueError(f"{path} holds no lines")
    cats = np.asarray(cats, np.uint64)
    if raw:  # the value's 64 bits, every distinct value its own id
        sparse = [cats[:, f].view(np.int64)[:, None] for f in range(len(sizes))]
    else:
        sparse = [
            (cats[:, f] % np.uint64(v)).astype(np.int64)[:, None] for f, v in enumerate(sizes)
        ]
    dense = np.log1p(np.maximum(np.asarray(dense, np.float64), 0))
    return _batch(dense, sparse, np.asarray(labels) > 0, raw)


def _label(text: str) -> int:
    """A Criteo label: ``0`` or ``1`` (a click or not), nothing else."""
    if text not in ("0", "1"):
        raise ValueError(f"the label is {text[:20]!r}; a Criteo label is 0 or 1")
    return int(text)


def _count(text: str) -> int:
    """An integer column of Criteo (empty: 0), within 64 bits."""
    if not text:
        return 0
    if len(text.lstrip("+-")) > 19:  # int() of a huge string is slow and overflows numpy
        raise ValueError(f"integer field {text[:20]}... has {len(text)} digits, beyond 64 bits")
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"integer field {text} is beyond 64 bits")
    return value


def _category(text: str) -> int:
    """A categorical column of Criteo: a hexadecimal hash below 2**64 (empty: 0)."""
    if not text:
        return 0
    if len(text) > 16:
        raise ValueError(f"category {text[:20]}... has {len(text)} hex digits, beyond 64 bits")
    value = int(text, 16)
    if value < 0:
        raise ValueError(f"category {text} is negative; Criteo's are hexadecimal hashes")
    return value


def criteo_data(cfg: DLRMConfig) -> tuple[Callable, Callable]:
    """``(batch_at, heldout)`` of ``cfg.data_dir/train.txt``: the first nine tenths in
    seeded random batches, the last tenth held out."""
    rows = read_criteo(Path(cfg.data_dir) / "train.txt", table_sizes(cfg), raw=cfg.raw_ids)
    n = len(rows["label"])
    cut = max(1, n - n // 10)
    if cut < cfg.batch:
        raise ValueError(f"{cfg.data_dir}/train.txt has {n} lines, fewer than --batch {cfg.batch}")

    def batch_at(step: int) -> dict[str, np.ndarray]:
        idx = _step_rng(cfg.seed, step).integers(0, cut, cfg.batch)
        return {k: v[idx] for k, v in rows.items()}

    def heldout(split: str, max_batches: int = 0) -> list[dict[str, np.ndarray]]:
        if split != "valid":
            return []
        if n - cut < cfg.batch:
            raise ValueError(
                f"{cfg.data_dir}/train.txt has {n} lines: its last tenth, held out, has "
                f"{n - cut}, fewer than one --batch of {cfg.batch}; give a file of at "
                f"least {10 * cfg.batch} lines or a smaller --batch"
            )
        starts = range(cut, n - cfg.batch + 1, cfg.batch)
        batches = [{k: v[s : s + cfg.batch] for k, v in rows.items()} for s in starts]
        return batches[:max_batches] if max_batches else batches

    return batch_at, heldout


def checked_shape(cfg: DLRMConfig) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The rows of each table and the bottom and top MLPs' widths of ``cfg``
    (``ValueError`` naming the flag that is wrong)."""
    sizes = table_sizes(cfg)
    if cfg.multi_hot < 1:
        raise ValueError(f"--multi-hot must be >= 1, got {cfg.multi_hot}")
    if cfg.data_dir and cfg.multi_hot != 1:
        raise ValueError(
            f"--multi-hot {cfg.multi_hot} is for the synthetic data: a Criteo file "
            "(--data-dir) has one id per sparse feature; leave --multi-hot at 1"
        )
    return tuple(sizes), tuple(_widths(cfg.bottom, "--bottom")), tuple(_widths(cfg.top, "--top"))


def data(cfg: DLRMConfig) -> tuple[Callable, Callable]:
    """``(batch_at, heldout)``: a Criteo file's (``--data-dir``) or synthetic data."""
    return (criteo_data if cfg.data_dir else synthetic_data)(cfg)


def click_metrics(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
    """Log loss, accuracy and AUC of click ``logits`` against ``labels`` (0/1)."""
    correct = (logits > 0) == (labels > 0.5)
    return {
        "loss": log_loss(logits, labels),
        "accuracy": jnp.mean(correct),
        "auc": auc(logits, labels),
    }


def workload(cfg: DLRMConfig) -> Workload:
    """DLRM as a ``Workload``: one ``EmbedBag`` table per sparse feature."""
    sizes, bottom, top = checked_shape(cfg)
    model = DLRM(sizes, cfg.dim, bottom, top)
    batch_at, heldout = data(cfg)

    def init(key):  # parameters only: the forward pass on the batch is not computed
        return model.lazy_init(key, batch_at(0))

    def loss(params, batch, emb=None):
        with nn.use_ops(emb):
            return log_loss(model.apply(params, batch), batch["label"])

    def metrics(params, batch):
        return click_metrics(model.apply(params, batch), batch["label"])

    return Workload(
        name="dlrm",
        init=init,  # op by op: a jitted init of many tables compiles for minutes
        loss=loss,
        batch_at=batch_at,
        replicated_keys=(),
        items_per_step=cfg.batch,
        items_name="samples",
        embedding_paths=tuple(("params", f"sparse_{f}", "embedding") for f in range(len(sizes))),
        config=dataclasses.asdict(cfg),
        heldout=heldout,
        metrics=metrics,
    )
