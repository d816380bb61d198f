"""Flax models of the papers' workloads, each exposed as a ``Workload``.

Example:
    >>> from models import get_workload
    >>> w = get_workload("lstm_lm", vocab=100, dim=8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from models import bert, dlrm, dlrm_nnx, gpt2, lstm_lm, lstm_lm_nnx, transformer, vision
from models.workload import Workload

# name -> (config class, builder)
MODELS: dict[str, tuple[type, Callable[[Any], Workload]]] = {
    "lstm_lm": (lstm_lm.LSTMConfig, lstm_lm.workload),
    "lstm_lm_nnx": (lstm_lm.LSTMConfig, lstm_lm_nnx.workload),  # the same model in flax NNX
    "transformer": (transformer.TransformerConfig, transformer.workload),
    "bert": (bert.BERTConfig, bert.workload),
    "gpt2": (gpt2.GPT2Config, gpt2.workload),
    "resnet": (vision.VisionConfig, lambda cfg: vision.workload("resnet", cfg)),
    "vgg": (vision.VisionConfig, lambda cfg: vision.workload("vgg", cfg)),
    "dlrm": (dlrm.DLRMConfig, dlrm.workload),
    "dlrm_nnx": (dlrm.DLRMConfig, dlrm_nnx.workload),  # the same model written in flax NNX
}


def config_fields(name: str) -> set[str]:
    """The configuration fields model ``name`` accepts."""
    return {f.name for f in dataclasses.fields(MODELS[name][0])}


def has_synthetic_heldout(name: str) -> bool:
    """Whether model ``name``'s synthetic data has held-out splits (no ``--data-dir``
    needed to evaluate it)."""
    return getattr(MODELS[name][0], "SYNTHETIC_HELDOUT", False)


DATA_FIELDS = ("text_file", "data_dir")  # refused, not ignored, by a model without them


def check_data_fields(name: str, overrides: dict[str, Any]) -> None:
    """``ValueError`` when a data source is given to a model that cannot read it."""
    for field in DATA_FIELDS:
        if overrides.get(field) and field not in config_fields(name):
            readers = [m for m in MODELS if field in config_fields(m)]
            flag = "--" + field.replace("_", "-")
            raise ValueError(f"{flag} does not apply to --model {name}; it is read by {readers}")


def get_workload(name: str, **overrides: Any) -> Workload:
    """Builds model ``name`` with its default config updated by ``overrides``.

    Unknown names raise ``ValueError``; overrides the model does not have are ignored,
    so one set of CLI flags serves every model, except a data source (``text_file``,
    ``data_dir``) the model cannot read: that raises ``ValueError``.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    check_data_fields(name, overrides)
    cls, build = MODELS[name]
    known = config_fields(name)
    cfg = cls(**{k: v for k, v in overrides.items() if k in known and v is not None})
    return build(cfg)
