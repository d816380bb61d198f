"""The hot layout from the command line: each table that ``--plan`` gives ``"hot"`` holds
its ``--hot-rows`` most read ids on every worker (``sparsecomm_jax.embedding.hot``).

The counts of each table's ids come from ``--histogram`` (a ``.npz`` of table name ->
``int[V]``, as ``numpy.savez`` writes it) or, without one, from the first
``HISTOGRAM_BATCHES`` batches of the run's own data (every read of the table the model
makes, as the step's capacity planning sees them). Either way the ids are the model's;
the layout keeps its own map and a checkpoint records the hot ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.train.config import RunConfig
from sparsecomm_jax.embedding import access, hot
from sparsecomm_jax.embedding.layouts import TablePlan
from sparsecomm_jax.embedding.tables import find_tables, table_mask

HISTOGRAM_BATCHES = 16  # the first batches counted when no --histogram is given


def hot_tables(config: RunConfig) -> list[str]:
    """The tables ``--plan`` gives the hot layout."""
    if not isinstance(config.plan, TablePlan):
        return []
    return [name for name, layout in config.plan.items() if layout.name == hot.HOT.name]


def check_flags(config: RunConfig) -> None:
    """``--hot-rows`` and ``--histogram`` against ``--plan``, before JAX starts."""
    tables = hot_tables(config)
    if tables and not config.hot_rows:
        raise ValueError(
            f"--plan gives {tables[0]} the hot layout: pass --hot-rows H (its H most read "
            "rows on every worker)"
        )
    if not tables and (config.hot_rows or config.histogram):
        flag = "--hot-rows" if config.hot_rows else "--histogram"
        raise ValueError(f'{flag} is for tables that --plan gives "hot"; --plan gives none')
    if config.histogram:
        path = Path(config.histogram)
        if not path.is_file():
            problem = "does not exist" if not path.exists() else "is not a regular file"
            raise ValueError(f"--histogram {config.histogram} {problem}; give a .npz of counts")


def read_counts(path: str, tables: list) -> dict[str, np.ndarray]:
    """Each table's counts from the ``.npz`` at ``path`` (``ValueError`` naming the flag,
    the file and the table for a missing table, another length, negative counts)."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            found = {k: np.asarray(saved[k]) for k in saved.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"--histogram {path}: not a .npz of counts ({e})") from None
    out = {}
    for t in tables:
        if t.name not in found:
            raise ValueError(
                f"--histogram {path} has no counts for table {t.name} (it has {sorted(found)[:4]})"
            )
        counts = found[t.name]
        if counts.shape != (t.vocab,) or not np.issubdtype(counts.dtype, np.number):
            raise ValueError(
                f"--histogram {path}: table {t.name} has counts of shape {counts.shape}; the "
                f"table has {t.vocab} rows: give one count per row"
            )
        if np.any(counts < 0):
            raise ValueError(f"--histogram {path}: table {t.name} has negative counts")
        out[t.name] = counts
    return out


def measured_counts(workload, params, tables: list, batches: int) -> dict[str, np.ndarray]:
    """Each table's reads per id over the first ``batches`` batches (host, numpy)."""
    mask = table_mask(params, workload.embedding_paths)
    reads_of = access.host_reads(workload.loss, params, mask, workload.replicated_keys, 1)
    counts = {t.name: np.zeros(t.vocab, np.int64) for t in tables}
    for step in range(batches):
        reads = reads_of(workload.batch_at(step))
        for t in tables:
            if t.index in reads:
                look, shared = reads[t.index]
                ids = np.concatenate([np.asarray(look).ravel(), np.asarray(shared).ravel()])
                ids = ids[(ids >= 0) & (ids < t.vocab)]  # a computed id outside: not a row
                counts[t.name] += np.bincount(ids, minlength=t.vocab)
    return counts


def hot_plan(config: RunConfig, workload, params) -> TablePlan | str:
    """``config.plan`` with its hot tables' layout holding their ``--hot-rows`` most read
    ids (``ValueError`` naming the flag and the table when H exceeds a table)."""
    names = hot_tables(config)
    if not names:
        return config.plan
    try:
        every = {t.name: t for t in find_tables(params, table_mask(params, names), None)}
    except ValueError as e:
        raise ValueError(f"--plan: {e}") from None
    tables = [every[n] for n in names]
    for t in tables:
        if config.hot_rows > t.vocab:
            raise ValueError(
                f"--hot-rows {config.hot_rows} is more than table {t.name} has rows ({t.vocab})"
            )
    if config.histogram:
        counts = read_counts(config.histogram, tables)
    else:
        counts = measured_counts(workload, params, tables, HISTOGRAM_BATCHES)
    chosen = {name: hot.from_counts(c, config.hot_rows) for name, c in counts.items()}
    layout = hot.layout(chosen)
    return TablePlan({**config.plan, **dict.fromkeys(names, layout)})
