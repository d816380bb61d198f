"""The strategy registry: names derive from it, and the README's worked example of a new
strategy (run from the README's own text) trains like the strategy it builds on."""

import re
from pathlib import Path

import jax
import optax
import pytest
from helpers import assert_trees_close, strategy_run

from models import get_workload
from sparsecomm_jax import train

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(heading: str) -> str:
    """The first ```python block after ``heading`` in the README."""
    text = README.read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_names_derive_from_the_registry():
    names = train.strategy_names()
    for s in train.STRATEGIES.values():
        assert s.name in names
        if s.needs_tables and s.combines:
            assert f"{s.name}+topk_a2a" in names
        if not s.combines:
            with pytest.raises(ValueError, match="cannot be combined"):
                train.parse_strategy(f"{s.name}+topk_a2a")
    assert train.parse_strategy("topk_a2a") == ("dense", "topk_a2a")
    with pytest.raises(ValueError, match="unknown strategy"):
        train.parse_strategy("embrace+nope")


def test_readme_example_strategy_trains_like_embrace(monkeypatch):
    monkeypatch.setattr(train, "STRATEGIES", dict(train.STRATEGIES))
    exec(readme_block("## Adding a strategy"), {})
    assert "clipped_embrace+topk_a2a" in train.strategy_names()
    w = get_workload("lstm_lm", seed=2, vocab=64, dim=16, hidden=16, seq_len=4, batch=8)
    params = w.init(jax.random.key(2))
    # small gradients: the clip at 1 never bites, so the run must equal embrace's
    ref, ref_params, _ = strategy_run(w, optax.sgd(0.1), params, 2, "embrace")
    got, got_params, _ = strategy_run(w, optax.sgd(0.1), params, 2, "clipped_embrace")
    assert got == pytest.approx(ref, rel=1e-6)
    assert_trees_close(got_params, ref_params, rtol=1e-6, atol=1e-7)
