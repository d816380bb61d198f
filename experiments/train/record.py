"""The record a run leaves: the JSON result and how it is written.

``result`` gathers a finished run's losses, step times, throughput, the bytes each
worker sends (read from the compiled program), its collectives, peak memory and the
full configuration; ``write_json`` writes it atomically.

Example:
    >>> from experiments.train.record import write_json
    >>> write_json({"losses": [1.0]}, "")  # no path: nothing written
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from experiments.train.config import RunConfig
from experiments.train.loop import RunLog, warm_steps
from experiments.train.startup import calibrated_link
from sparsecomm_jax import parse_strategy
from sparsecomm_jax.comm import hlo, wire
from sparsecomm_jax.embedding import access
from sparsecomm_jax.embedding.layout_registry import TablePlan
from sparsecomm_jax.embedding.tables import find_tables, table_mask


def peak_memory(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        return int(total - m.alias_size_in_bytes)
    except Exception:  # memory analysis is optional on some backends
        return None


def _median(values: list, warmup: int) -> float | None:
    """The median of ``values`` after the first ``warmup`` (all when that leaves none),
    ``None`` entries left out."""
    kept = [v for v in values[warmup:] if v is not None] or [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def result(config: RunConfig, workload, log: RunLog, start: int, rank: int) -> dict:
    """The JSON record of a finished run (see ``experiments.train.train_and_evaluate``):
    bytes and collectives of the steady-state program (the one run most; the
    overlapped step's ``high`` and ``low`` together)."""
    keys = log.per_step or [max(log.runs, key=log.runs.get)]  # the program run most
    steady = [log.programs[key] for key in keys]
    colls = [c for p in steady for c in hlo.parse_collectives(p.as_text())]
    warm = warm_steps(log, config.warmup)  # the first --warmup program calls
    step_time = statistics.median(log.times[warm:] or log.times)
    wall = _median(log.wall_times, warm)  # throughput: every second of a step
    record = {
        "model": config.model,
        "strategy": config.strategy,
        "devices": config.devices,
        "steps": config.steps,
        "losses": log.losses,
        "step_times_s": log.times,
        "step_time_s": step_time,
        "step_time_mean_s": statistics.fmean(log.times[warm:] or log.times),
        "place_times_s": log.place_times,
        "place_time_s": _median(log.place_times, warm),
        "wall_time_s": wall,
        f"{workload.items_name}_per_s": workload.items_per_step / (wall or step_time),
        "comm_bytes_per_step": hlo.total_bytes(colls),
        "collectives": [c.as_dict() for c in colls],
        "peak_memory_bytes": max((peak_memory(p) or 0) for p in steady) or None,
        "compile_s": log.compile_s,
        "programs": len(log.programs),
        "compiled_at_steps": list(log.compiled_at),  # the first step of each compiling call
        "float32_exchanges": float32_exchanges(config, workload),
        "start_step": start,
        "skipped_steps": log.skipped,
        "rank": rank,
        "config": {**config.to_json(), "model_config": workload.config},
    }
    if config.calibrate:
        record["link"] = calibrated_link(config.devices)
    return record


def managed_tables(vocab) -> dict[str, dict[str, int]]:
    """Each managed table's mapping after the steps run (``ts.vocabulary``): its slots,
    the ids holding one, the ids waiting for admission, the ids evicted so far (those a
    restore onto fewer slots a worker dropped included) and the batches mapped."""
    out = {}
    for name, state in vocab.states(vocab.stepped).items():
        out[name] = {
            "slots": int(state.ids.size),
            "held": int(state.used.sum()),
            "waiting": int(state.waiting),
            "evictions": int(state.evictions),
            "batches": int(state.steps),
        }
    return out


def float32_exchanges(config: RunConfig, workload) -> list[str]:
    """The exchanges that stay float32 under a narrow ``--comm-dtype``, each with why:
    a table the model reads whole (a tied or full softmax, ``emb.attend``,
    ``access.whole_table_reads``) exchanges it whole in float32 (sharded: its all-gather
    and its gradient's reduce-scatter; replicated: its gradient's all-reduce). A table
    kept data parallel (``dense``) travels with the dense layers, in the wire's codec."""
    if not wire.parse(config.comm_dtype).narrow:
        return []
    params = jax.eval_shape(workload.init, jax.random.key(0))
    mask = table_mask(params, workload.embedding_paths)
    tables = {t.index: t.name for t in find_tables(params, mask, None)}
    whole = access.whole_table_reads(workload.loss, params, workload.batch_at(0), mask)
    default = parse_strategy(config.strategy).strategy.layout
    planned = dict(config.plan) if isinstance(config.plan, TablePlan) else {}
    found = []
    for i in sorted(whole):
        layout = planned.get(tables[i], default)
        if layout.data_parallel:  # travels with the dense layers, in the wire's codec
            continue
        what = (
            "its whole-table all-gather and its gradient's reduce-scatter"
            if layout.sharded
            else "its gradient's all-reduce"
        )
        found.append(
            f"{tables[i]}: {what} (read whole by a full softmax, emb.attend, which is "
            "differentiated through the whole table)"
        )
    return found


def deferred_entries(state) -> int | None:
    """The selected entries the gradient aggregator had to keep for want of a static
    slot over the run, every worker's (``ErrorFeedbackState.deferred``: topk_balanced,
    oktopk, adaptive); ``None`` for the aggregators without slots. Every process calls
    it (an all-gather where the state spans processes)."""
    deferred = getattr(state.agg_state, "deferred", ())
    if not jax.tree.leaves(deferred):
        return None
    return int(np.sum(multihost_utils.process_allgather(deferred, tiled=True)))


def strict(value: Any) -> Any:
    """``value`` with every NaN or Inf float made ``None``: strict JSON (``null``), which
    every reader accepts (``jq``, browsers; a bare ``NaN`` is not JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def write_json(result: dict[str, Any], path: str) -> None:
    """Writes ``result`` to ``path`` (if given) atomically, a complete file or none, as
    strict JSON (NaN and Inf as ``null``)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(strict(result), indent=1, allow_nan=False))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
