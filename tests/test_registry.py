"""The strategy registry: names derive from it, and the worked examples of a new
strategy and a new layout (run from the guide's own text, docs/guides/extending.md)
train like the strategy they build on."""

import re
from pathlib import Path

import jax
import optax
import pytest
from helpers import assert_trees_close, strategy_run

import sparsecomm_jax as sc
from models import get_workload
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.embedding import layout_registry
from sparsecomm_jax.schedule import scopes
from sparsecomm_jax.strategies import bodies

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "extending.md"


def guide_block(heading: str) -> str:
    """The first ```python block after ``heading`` in the extending guide."""
    text = GUIDE.read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_names_derive_from_the_registry():
    names = sc.strategy_names()
    for s in sc.STRATEGIES.values():
        assert s.name in names
        if s.needs_tables and s.combines:
            assert f"{s.name}+topk_a2a" in names
        if not s.combines:
            with pytest.raises(ValueError, match="cannot be combined"):
                sc.parse_strategy(f"{s.name}+topk_a2a")
    assert sc.parse_strategy("topk_a2a") == ("dense", "topk_a2a")
    with pytest.raises(ValueError, match="unknown strategy"):
        sc.parse_strategy("embrace+nope")


def test_guide_example_strategy_trains_like_embrace(monkeypatch):
    monkeypatch.setitem(sc.STRATEGIES, "clipped_embrace", None)  # removed after the test
    monkeypatch.setitem(layout_registry.LAYOUTS, "column_each_read", None)  # before the guide's
    scope = {}
    exec(guide_block("## A table layout"), scope)  # the imports (and its layout)
    exec(guide_block("## A strategy"), scope)
    assert "clipped_embrace+topk_a2a" in sc.strategy_names()
    w = get_workload("lstm_lm", seed=2, vocab=64, dim=16, hidden=16, seq_len=4, batch=8)
    params = w.init(jax.random.key(2))
    # small gradients: the clip at 1 never bites, so the run must equal embrace's
    ref, ref_params, _ = strategy_run(w, optax.sgd(0.1), params, 2, "embrace")
    got, got_params, _ = strategy_run(w, optax.sgd(0.1), params, 2, "clipped_embrace")
    assert got == pytest.approx(ref, rel=1e-6)
    assert_trees_close(got_params, ref_params, rtol=1e-6, atol=1e-7)


def test_guide_example_layout_trains_like_embrace_and_sends_more(monkeypatch):
    """The guide's layout (one exchange per read, no de-duplication), from its text:
    the same losses and parameters as embrace with both table updates, more bytes."""
    monkeypatch.setitem(sc.STRATEGIES, "embrace_each_read", None)  # removed after the test
    monkeypatch.setitem(layout_registry.LAYOUTS, "column_each_read", None)
    scope = {}
    exec(guide_block("## A table layout"), scope)
    sc.STRATEGIES["embrace_each_read"] = sc.Strategy(
        "embrace_each_read",
        bodies.shard_map_step(bodies.table_body),
        layout=scope["EACH_READ"],
        needs_tables=True,
        row_updates=True,
    )
    w = get_workload(
        "lstm_lm", seed=3, vocab=64, dim=16, hidden=16, seq_len=8, batch=64, sampled_softmax=8
    )
    params = w.init(jax.random.key(3))
    for update in ("dense", "rows"):
        ref, ref_params, ts_ref = strategy_run(
            w, optax.sgd(0.1), params, 2, "embrace", table_update=update
        )
        got, got_params, ts = strategy_run(
            w, optax.sgd(0.1), params, 2, "embrace_each_read", table_update=update
        )
        assert got == pytest.approx(ref, rel=1e-5)
        assert_trees_close(got_params, ref_params, rtol=1e-5, atol=1e-6)
    batch_ref, batch = ts_ref.place_batch(w.batch_at(0)), ts.place_batch(w.batch_at(0))
    sent_ref = hlo.total_bytes(hlo.collectives(ts_ref.step, ts_ref.state, batch_ref))
    sent = hlo.total_bytes(hlo.collectives(ts.step, ts.state, batch))
    assert sent > sent_ref  # ids repeat (Zipf tokens, shared negatives): each travels here


def test_guide_example_layout_is_pipelined_by_its_own_hook(monkeypatch):
    """The guide's pipelined layout (its ``Pipelined`` naming the column carrier), run
    from the guide's text: ``embrace_2d`` carries its table (a middle step fetches no
    row before its forward pass; the first step does) and trains as ``embrace``."""
    monkeypatch.setitem(layout_registry.LAYOUTS, "column_each_read", None)  # removed after the test
    monkeypatch.setitem(layout_registry.LAYOUTS, "column_each_read_2d", None)
    scope = {}
    exec(guide_block("## A table layout"), scope)
    exec(guide_block("## Pipelined by `embrace_2d`"), scope)  # asserts embrace's losses
    lm = scope["lm"]
    ts = sc.make_train_step(  # afresh: the guide's run donated its state
        lm.loss,
        optax.sgd(0.1),
        sc.runtime.data_mesh(4),
        scope["start"],
        "embrace_2d",
        embedding_paths=lm.embedding_paths,
        replicated_keys=lm.replicated_keys,
        table_layouts={"embed/embedding": scope["EACH_READ_2D"]},
        collectives_overlap=True,
    )
    assert ts.runs_as == "embrace_2d"
    first = sc.place_for_step(ts, lm.batch_at, 0, 3)
    before = hlo.scheduled_collectives(hlo.compiled_text(ts.step, ts.state, first))
    state, _ = ts.step(ts.state, first)
    middle = sc.place_for_step(ts, lm.batch_at, 1, 3)
    colls = hlo.scheduled_collectives(hlo.compiled_text(ts.step, state, middle))
    assert any(scopes.SCOPE_ROWS in c.op_name for c in before)
    assert not [c for c in colls if scopes.SCOPE_ROWS in c.op_name]
    assert [c for c in colls if scopes.SCOPE_HIGH in c.op_name and c.opcode == "all-to-all"]
