"""The hot layout from the command line: each table that ``--plan`` gives ``"hot"`` holds
its ``--hot-rows`` most read ids on every worker (``sparsecomm_jax.embedding.hot``);
under ``--plan auto`` or ``model`` the planner prices the hot layout for every table and
picks its H from the same counts (``planner.table_stats(..., counts=...)``).

The counts of each table's ids come from ``--histogram`` (a ``.npz`` of table name ->
``int[V]``, as ``numpy.savez`` writes it) or, without one, from the first
``HISTOGRAM_BATCHES`` batches of the run's own data (every read of the table the model
makes, as the step's capacity planning sees them). Either way the ids are the model's;
the layout keeps its own map, and a checkpoint and the run's recorded plan keep the hot
ids (a plan's JSON may give them: ``{"table": {"layout": "hot", "config": [ids]}}``).
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from experiments.train.config import RunConfig
from sparsecomm_jax.embedding import access, hot
from sparsecomm_jax.embedding.layout_registry import TablePlan
from sparsecomm_jax.embedding.tables import find_tables, table_mask

HISTOGRAM_BATCHES = 16  # the first batches counted when no --histogram is given
# What reading a file that is no .npz of counts raises (a cut or corrupted member, a
# compression zipfile does not know, a header numpy refuses).
_UNREADABLE = (
    OSError,
    ValueError,
    EOFError,
    RuntimeError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)


def hot_tables(config: RunConfig) -> list[str]:
    """The tables ``--plan`` gives the hot layout without their hot ids."""
    if not isinstance(config.plan, TablePlan):
        return []
    return [
        name
        for name, layout in config.plan.items()
        if hot.is_hot_layout(layout) and name not in (layout.config or {})
    ]


def planned(config: RunConfig) -> bool:
    """The planner chooses the layouts (``--plan auto`` or ``model``)."""
    return config.plan in ("auto", "model")


def check_flags(config: RunConfig) -> None:
    """``--hot-rows`` and ``--histogram`` against ``--plan``, before JAX starts."""
    tables = hot_tables(config)
    if planned(config) and config.hot_rows:
        raise ValueError(
            f"--hot-rows: with --plan {config.plan} the planner picks each table's H from "
            'the histogram; to fix H, give the tables "hot" in a --plan object'
        )
    if tables and not config.hot_rows:
        raise ValueError(
            f"--plan gives {tables[0]} the hot layout: pass --hot-rows H (its H most read "
            "rows on every worker)"
        )
    if not tables and not planned(config) and (config.hot_rows or config.histogram):
        flag, also = (
            ("--hot-rows", "") if config.hot_rows else ("--histogram", ", or for --plan auto/model")
        )
        raise ValueError(
            f'{flag} is for tables that --plan gives "hot" without their ids{also}; --plan '
            "gives none"
        )
    if config.histogram:
        path = Path(config.histogram)
        if not path.is_file():
            problem = "does not exist" if not path.exists() else "is not a regular file"
            raise ValueError(f"--histogram {config.histogram} {problem}; give a .npz of counts")


def _not_npz(path: str, why: str = "") -> ValueError:
    return ValueError(
        f"--histogram {path}: not a .npz of counts (a zip of .npy arrays, as numpy.savez "
        f"writes){why}"
    )


def _headers(archive: zipfile.ZipFile, path: str) -> dict[str, tuple]:
    """Each array's ``(member, shape, dtype)`` from its ``.npy`` header alone: nothing
    is read before its shape is checked (a small file may declare billions of counts)."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0}
    readers[(2, 0)] = np.lib.format.read_array_header_2_0
    found = {}
    for info in archive.infolist():
        try:
            with archive.open(info) as f:
                read = readers.get(np.lib.format.read_magic(f))
                shape, _, dtype = read(f) if read else (None, None, None)
        except _UNREADABLE:
            read = None
        if read is None:
            raise _not_npz(path, f"; {info.filename[:40]!r} is not a .npy array")
        found[info.filename.removesuffix(".npy")] = (info, shape, dtype)
    return found


def _counts_of(archive: zipfile.ZipFile, path: str, table, header: tuple) -> np.ndarray:
    """Table ``table``'s counts, read once their header says one number per row."""
    info, shape, dtype = header
    if dtype.kind not in "iuf":  # no bools, complex numbers, strings, objects
        raise ValueError(
            f"--histogram {path}: table {table.name} has counts of type {dtype}; give "
            "integer or float counts"
        )
    if shape != (table.vocab,):
        raise ValueError(
            f"--histogram {path}: table {table.name} has counts of shape {shape}; the "
            f"table has {table.vocab} rows: give one count per row"
        )
    try:
        with archive.open(info) as f:
            counts = np.lib.format.read_array(f, allow_pickle=False)
    except _UNREADABLE:
        raise _not_npz(path, f"; the counts of {table.name} are cut short") from None
    if not np.all(np.isfinite(counts)):
        raise ValueError(f"--histogram {path}: table {table.name} has counts that are not finite")
    if np.any(counts < 0):
        raise ValueError(f"--histogram {path}: table {table.name} has negative counts")
    return counts


def read_counts(path: str, tables: list, every: bool = True) -> dict[str, np.ndarray]:
    """Each table's counts from the ``.npz`` at ``path`` (``ValueError`` naming the flag,
    the file and the table for a file that is no ``.npz``, a missing table, another
    length, negative counts). Each array's header is checked before its data is read,
    so a file is never read into more memory than one count per row of each table.

    Args:
      path: the file. tables: the ``Table`` records to read counts for.
      every: each table must have counts; otherwise (the planner's histogram) a table
        without any is left out, and counts naming no table are refused.
    """
    try:
        archive = zipfile.ZipFile(path)
    except _UNREADABLE:
        raise _not_npz(path) from None
    with archive:
        found = _headers(archive, path)
        if not every and (stray := sorted(set(found) - {t.name for t in tables})):
            raise ValueError(
                f"--histogram {path} has counts for {stray[0][:40]}, no table of the "
                f"model (its tables: {[t.name for t in tables][:4]})"
            )
        out = {}
        for t in tables:
            if t.name not in found and not every:
                continue
            if t.name not in found:
                raise ValueError(
                    f"--histogram {path} has no counts for table {t.name} (it has "
                    f"{[name[:40] for name in sorted(found)[:4]]})"
                )
            out[t.name] = _counts_of(archive, path, t, found[t.name])
    if not out:
        raise ValueError(f"--histogram {path} holds no counts; give a .npz of table -> counts")
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


def planner_counts(config: RunConfig, workload, params) -> dict[str, np.ndarray]:
    """Every table's counts for the planner (``--plan auto``/``model``): ``--histogram``'s
    (a table it lacks is not offered the hot layout) or the first ``HISTOGRAM_BATCHES``
    batches'."""
    tables = find_tables(params, table_mask(params, workload.embedding_paths), None)
    if config.histogram:
        return read_counts(config.histogram, tables, every=False)
    return measured_counts(workload, params, tables, HISTOGRAM_BATCHES)


def hot_plan(config: RunConfig, workload, params) -> TablePlan | str:
    """``config.plan`` with its hot tables' layout holding their ``--hot-rows`` most read
    ids (``ValueError`` naming the flag and the table when H exceeds a table); tables
    the plan gives their hot ids keep them."""
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
    given = [x.config for x in config.plan.values() if hot.is_hot_layout(x) and x.config]
    layout = hot.layout({**(given[0] if given else {}), **chosen})  # one value for all
    every = [n for n, x in config.plan.items() if hot.is_hot_layout(x)]
    return TablePlan({**config.plan, **dict.fromkeys(every, layout)})
