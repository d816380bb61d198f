"""Held-out evaluation of a ``Workload``: mean loss, perplexity and accuracy.

Metrics are computed on one device from dense parameters (``TrainStep.host_params``),
so every strategy is evaluated by the same program.

Example:
    >>> import jax
    >>> from models import get_workload, heldout
    >>> w = get_workload("resnet", width=4, batch=4)
    >>> heldout.heldout_splits(w)  # synthetic images: no held-out split
    ()
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from models.workload import Workload

SPLITS = ("valid", "test")


def evaluate(workload: Workload, params: Any, batches: list[dict]) -> dict[str, float]:
    """Metrics averaged over equal-size held-out ``batches`` (``{}`` when there are none).

    Args:
      workload: the model and its data.
      params: dense parameters (numpy or device arrays).
      batches: from ``workload.heldout(split)``.

    Returns:
      ``loss``, ``batches``, and ``perplexity`` (language models) or ``accuracy``
      (classifiers).
    """
    if not batches or workload.metrics is None:
        return {}
    fn = jax.jit(workload.metrics)
    rows = [jax.tree.map(float, fn(params, b)) for b in batches]
    out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    if workload.items_name == "tokens":
        out["perplexity"] = math.exp(min(out["loss"], 700.0))
    return {**out, "batches": len(batches)}


def heldout_splits(workload: Workload) -> tuple[str, ...]:
    """The held-out splits the workload has, ``valid`` before ``test``."""
    return tuple(s for s in SPLITS if workload.heldout(s, 1))
