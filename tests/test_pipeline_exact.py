"""``embrace_2d`` through the public API (``make_train_step`` + ``place_for_step``) is
exactly ``embrace``: on tied tables read several times per batch key (every language
model with sampled softmax), after a skipped non-finite step, and when the host sizes
the first chunk too small (the device-side guard, with the dense and the row-sparse
table update)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, reference_run, run_placed

import sparsecomm_jax as sc
from models import get_workload
from sparsecomm_jax import runtime
from sparsecomm_jax.embedding import priority
from sparsecomm_jax.schedule import pipeline, scopes

# embrace_2d as its pipelined program (conftest), not as embrace on this CPU mesh
pytestmark = pytest.mark.usefixtures("pipelined_2d")
CPU_PROBE = runtime.collectives_overlap  # the platform's answer, before the fixture

TIED = {
    "lstm_lm": dict(tie_embeddings=True, hidden=8),
    "transformer": {},
    "gpt2": {},
    "bert": dict(masked=2),
}


def _workload(name, seed=0, vocab=8):
    return get_workload(
        name,
        vocab=vocab,
        dim=8,
        layers=1,
        heads=2,
        seq_len=8,
        batch=8,
        sampled_softmax=4,
        seed=seed,
        **TIED[name],
    )


def _poisoned(w, bad_step):
    """``w`` whose loss is multiplied by ``batch["scale"]``: Inf at ``bad_step``, so
    every gradient (tables included) is non-finite there and the step is skipped."""

    def loss(p, b, emb=None):
        return w.loss(p, b, emb) * b["scale"]

    def batch_at(step):
        return {**w.batch_at(step), "scale": np.float32(np.inf if step == bad_step else 1.0)}

    return w._replace(loss=loss, batch_at=batch_at, replicated_keys=(*w.replicated_keys, "scale"))


def _run(w, strategy, steps, params, devices=4, optimizer=None, **kw):
    """Losses of every step and the final host parameters, as a user drives them."""
    ts = sc.make_train_step(
        w.loss,
        optimizer or optax.sgd(0.5),
        runtime.data_mesh(devices),
        params,
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        id_keys=w.id_keys,
        **kw,
    )
    state, losses = run_placed(ts, w.batch_at, steps)
    return np.array(losses), ts.host_params(state)


def _assert_same_run(w, steps, optimizer=None, seed=0):
    params = w.init(jax.random.key(seed))
    ref_losses, ref = _run(w, "embrace", steps, params, optimizer=optimizer)
    losses, got = _run(w, "embrace_2d", steps, params, optimizer=optimizer)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)
    return losses


@pytest.mark.matrix
@pytest.mark.parametrize("name", sorted(TIED))
def test_tied_tables_equal_embrace(name):
    """A tied table is read by the inputs, the targets and the negatives: every read
    counts towards the first chunk, and no row batch t+1 reads is fetched stale."""
    _assert_same_run(_workload(name), steps=4)


@pytest.mark.matrix
@pytest.mark.parametrize("name", ["lstm_lm"])  # a full softmax: test_tied_tables_equal_embrace
def test_step_after_a_skipped_step(name):
    """Step 1 is skipped (Inf gradients); step 2 reads rows of the unchanged tables."""
    losses = _assert_same_run(
        _poisoned(_workload(name, seed=1), 1), steps=4, optimizer=optax.adam(1e-2, eps=1e-3)
    )
    assert np.isnan(losses[1]) and np.isfinite(losses[[0, 2, 3]]).all()


def _one_per_table(reads, tables, workers):
    """A first chunk of one position per table (``priority.first_chunk_need``)."""
    return {t.index: 1 for t in tables} if len(reads) > 1 else {}


def test_guard_when_the_first_chunk_is_too_small(monkeypatch):
    """The host under-sizes the first chunk (capacity 1): rows batch t+1 reads spill
    into the late chunk, the device sees it and fetches them after the full update."""
    monkeypatch.setattr(priority, "first_chunk_need", _one_per_table)
    _assert_same_run(_workload("gpt2", seed=2), steps=3)


def test_guard_with_row_updates(monkeypatch):
    """The same spill with the row-sparse update (the early rows of batch 1 miss part of
    their gradient, so they must be fetched again): equal to single-device Adagrad."""
    monkeypatch.setattr(priority, "first_chunk_need", _one_per_table)
    w = _workload("gpt2", seed=2)
    params = w.init(jax.random.key(2))
    ref_losses, ref = reference_run(w, optax.adagrad(0.3), params, 2)
    losses, got = _run(
        w,
        "embrace_2d",
        2,
        params,
        optimizer=optax.adagrad(0.3),
        table_update="rows",
    )
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)


def test_fixed_capacity_too_small_is_refused():
    w = _workload("gpt2")
    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        runtime.data_mesh(4),
        w.init(jax.random.key(0)),
        "embrace_2d",
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        capacity=1,
    )
    with pytest.raises(ValueError, match="capacity=1 is too small"):
        sc.place_for_step(ts, w.batch_at, 0, 2)


def test_loss_scale_poison_is_finite_elsewhere():
    """The poisoned workload is the plain one at every other step (checks the helper)."""
    w = _workload("gpt2")
    p = w.init(jax.random.key(0))
    poisoned = _poisoned(w, 1)
    assert jnp.isclose(poisoned.loss(p, poisoned.batch_at(0)), w.loss(p, w.batch_at(0)))
    assert not jnp.isfinite(poisoned.loss(p, poisoned.batch_at(1)))


def _alternating():
    """An LM whose batch t+1 reads the other half of the vocabulary, t+2 this one."""
    base = _workload("lstm_lm", seed=3, vocab=256)

    def batch_at(step):
        tokens = np.random.default_rng(step).integers(0, 128, (8, 9)) + 128 * (step % 2)
        return {**base.batch_at(step), "tokens": tokens.astype(np.int32)}

    return base._replace(batch_at=batch_at)


def _make_2d(w, strategy="embrace_2d", **kw):
    return sc.make_train_step(
        w.loss,
        optax.sgd(0.5),
        runtime.data_mesh(4),
        w.init(jax.random.key(0)),
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        **kw,
    )


def test_late_rows_in_next_use_order_over_several_chunks(monkeypatch):
    """Where collectives overlap compute (an accelerator), a latency-free link cuts the
    late rows into ``MAX_LATE_CHUNKS`` chunks (t+2's rows before t+3's, ...), each one
    all-to-all; exactly embrace."""
    from sparsecomm_jax.comm import costmodel, hlo

    monkeypatch.setattr(priority, "LINK", costmodel.Link(0.0, 1e-9))
    w = _alternating()
    _assert_same_run(w, steps=4)
    ts = _make_2d(w)
    batch = sc.place_for_step(ts, w.batch_at, 0, 5)
    text = hlo.compiled_text(ts.step, ts.state, batch)
    low = [
        c
        for c in hlo.scheduled_collectives(text)
        if scopes.SCOPE_LOW in c.op_name and c.opcode == "all-to-all"
    ]
    n = 2 * 2 * 8  # positions per worker: inputs and targets of 2 sequences of 8
    late = priority.late_capacities(n, batch.capacity[0], 8, 4)[1:]
    assert len(low) == len(late) == priority.MAX_LATE_CHUNKS


@pytest.mark.matrix
@pytest.mark.parametrize("asked", ["platform", "no"])
def test_without_overlap_embrace_2d_runs_embraces_step(monkeypatch, asked):
    """Where a program's collectives cannot overlap its compute (this CPU mesh, asked
    of the platform or said), ``embrace_2d``'s pipelined program is not built: the step
    is ``embrace``'s, the same compiled collectives and bitwise the same losses, with no
    lookahead; ``collectives_overlap=True`` builds the pipeline."""
    from sparsecomm_jax.comm import hlo

    monkeypatch.setattr(runtime, "collectives_overlap", CPU_PROBE)
    assert not CPU_PROBE(runtime.data_mesh(4))
    w = _alternating()
    kw = {} if asked == "platform" else {"collectives_overlap": False}
    serial, ref = _make_2d(w, **kw), _make_2d(w, "embrace")
    piped = _make_2d(w, collectives_overlap=True)
    assert (serial.strategy, serial.runs_as, serial.lookahead) == ("embrace_2d", "embrace", 0)
    assert (piped.runs_as, piped.lookahead) == ("embrace_2d", pipeline.LOOKAHEAD)
    combined = _make_2d(w, "embrace_2d+topk_a2a", density=0.5, **kw)
    assert combined.runs_as == "embrace+topk_a2a"

    def kinds(ts):
        batch = sc.place_for_step(ts, w.batch_at, 0, 4)
        text = hlo.compiled_text(ts.step, ts.state, batch)
        return [(c.kind, c.shapes) for c in hlo.parse_collectives(text)]

    assert kinds(serial) == kinds(ref)
    losses, got = _run(w, "embrace_2d", 4, w.init(jax.random.key(1)), **kw)
    ref_losses, want = _run(w, "embrace", 4, w.init(jax.random.key(1)))
    np.testing.assert_array_equal(losses, ref_losses)
    assert_trees_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_embrace_2d_refuses_the_same_models_either_way(monkeypatch, overlap):
    """The one-exchange form keeps ``embrace_2d``'s rules, so a model that trains on
    CPU trains on an accelerator: a full softmax over a table (``emb.attend``) and a
    table whose D does not divide by P are refused with or without overlap."""
    import jax.numpy as jnp

    monkeypatch.setattr(runtime, "collectives_overlap", CPU_PROBE)
    kw = dict(embedding_paths=[("t",)], collectives_overlap=overlap)
    mesh, opt = runtime.data_mesh(4), optax.sgd(0.1)
    batch = {"ids": np.arange(8, dtype=np.int32).reshape(4, 2)}

    def attend_loss(p, b, emb):
        h = emb.lookup(p["t"], b["ids"]).mean(axis=1)
        return jnp.mean(emb.attend(p["t"], h))

    ts = sc.make_train_step(attend_loss, opt, mesh, {"t": jnp.ones((16, 8))}, "embrace_2d", **kw)
    with pytest.raises(ValueError, match="embrace_2d needs tables that are read by lookups"):
        ts.step(ts.state, sc.place_for_step(ts, lambda i: batch, 0, 1))

    def loss(p, b, emb):
        return jnp.mean(emb.lookup(p["t"], b["ids"]))

    with pytest.raises(ValueError, match=r"D \(columns\) = 6, not divisible by the 4"):
        sc.make_train_step(loss, opt, mesh, {"t": jnp.ones((16, 6))}, "embrace_2d", **kw)
