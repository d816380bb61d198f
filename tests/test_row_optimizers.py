"""The row view of optax optimizers (``embedding.row_optimizers``) against the dense optax
update on fresh random inputs: exact for SGD and Adagrad, lazy Adam equal to Adam on the
rows it touches every step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparsecomm_jax.embedding import row_optimizers as ro

V, D = 40, 6


def _sparse_grads(rng, steps, touched=12):
    """Per step: ids with duplicates and rows, and the dense V x D gradient they make."""
    out = []
    for _ in range(steps):
        ids = rng.choice(V, size=touched, replace=True).astype(np.int32)
        rows = rng.normal(size=(touched, D)).astype(np.float32)
        dense = np.zeros((V, D), np.float32)
        np.add.at(dense, ids, rows)
        out.append((ids, rows, dense))
    return out


def test_segment_rows_matches_numpy():
    rng = np.random.default_rng(0)
    ids = rng.integers(-2, V + 2, size=30).astype(np.int32)  # some out of range
    rows = rng.normal(size=(30, D)).astype(np.float32)
    got = jax.jit(ro.segment_rows, static_argnums=2)(ids, rows, V)
    valid = (ids >= 0) & (ids < V)
    uniq = np.unique(ids[valid])
    assert got.ids.shape == (30,)
    np.testing.assert_array_equal(np.asarray(got.ids[: uniq.size]), uniq)
    assert (np.asarray(got.ids[uniq.size :]) == V).all()
    dense = np.zeros((V, D), np.float32)
    np.add.at(dense, ids[valid], rows[valid])
    np.testing.assert_allclose(np.asarray(got.rows[: uniq.size]), dense[uniq], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got.rows[uniq.size :]), 0.0)


@pytest.mark.parametrize(
    "name, dense",
    [("sgd", lambda: optax.sgd(0.3)), ("adagrad", lambda: optax.adagrad(0.3))],
)
def test_exact_transforms_equal_dense_optax(name, dense):
    rng = np.random.default_rng(1)
    table = rng.normal(size=(V, D)).astype(np.float32)
    opt, ref_opt = dense(), dense()
    state, ref_state = opt.init(jnp.asarray(table)), ref_opt.init(table)
    got, ref = jnp.asarray(table), jnp.asarray(table)
    step = jax.jit(lambda g, s, t: ro.apply_rows(opt, g, s, t))
    for ids, rows, dense_grad in _sparse_grads(rng, steps=4):
        got, state = step(ro.segment_rows(jnp.asarray(ids), jnp.asarray(rows), V), state, got)
        updates, ref_state = ref_opt.update(jnp.asarray(dense_grad), ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-7)


def test_lazy_adam_is_adam_when_every_row_is_touched():
    rng = np.random.default_rng(2)
    table = jnp.asarray(rng.normal(size=(V, D)).astype(np.float32))
    opt, ref_opt = ro.lazy_adam(0.01), optax.adam(0.01)
    state, ref_state, got, ref = opt.init(table), ref_opt.init(table), table, table
    for _ in range(3):
        g = jnp.asarray(rng.normal(size=(V, D)).astype(np.float32))
        got, state = ro.apply_rows(opt, ro.RowGrad(jnp.arange(V), g), state, got)
        updates, ref_state = ref_opt.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_lazy_adam_leaves_untouched_rows_alone():
    """Rows not looked up keep table row, moments and count; touched rows follow Adam on
    their own gradient sequence (a row touched at steps 0 and 2 takes two Adam steps)."""
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.normal(size=(V, D)).astype(np.float32))
    opt = ro.lazy_adam(0.01)
    state, got = opt.init(table), table
    steps = [np.array([1, 5, 5]), np.array([7]), np.array([1, 9])]
    grads = [rng.normal(size=(len(s), D)).astype(np.float32) for s in steps]
    for ids, rows in zip(steps, grads, strict=True):
        g = ro.segment_rows(jnp.asarray(ids), jnp.asarray(rows), V)
        got, state = ro.apply_rows(opt, g, state, got)
    untouched = np.setdiff1d(np.arange(V), [1, 5, 7, 9])
    np.testing.assert_array_equal(np.asarray(got)[untouched], np.asarray(table)[untouched])
    np.testing.assert_array_equal(np.asarray(state[0].mu)[untouched], 0.0)
    counts = np.zeros(V, np.int32)
    counts[[1, 5, 7, 9]] = [2, 1, 1, 1]  # steps that touched the row (duplicates once)
    np.testing.assert_array_equal(np.asarray(state[0].count), counts)
    # row 1: two Adam steps on its own gradients
    ref_opt = optax.adam(0.01)
    row, ref_state = table[1], ref_opt.init(table[1])
    for g in (grads[0][0], grads[2][0]):
        updates, ref_state = ref_opt.update(jnp.asarray(g), ref_state, row)
        row = optax.apply_updates(row, updates)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(row), rtol=1e-6)


@pytest.mark.parametrize("count", ["row", "table"])
def test_lazy_adam_schedule_follows_the_step_count(count):
    """A learning-rate schedule takes the optimizer's step count, not a row's own: a row
    first read at step 5 moves by the schedule's rate at step 5, with either bias
    correction (numpy below)."""
    rng = np.random.default_rng(4)
    schedule = optax.linear_schedule(0.1, 0.01, 10)
    opt = ro.lazy_adam(schedule, count=count)
    table = jnp.asarray(rng.normal(size=(V, D)).astype(np.float32))
    state, got = opt.init(table), table
    for _ in range(5):
        g = ro.RowGrad(jnp.array([0]), jnp.asarray(rng.normal(size=(1, D)), jnp.float32))
        got, state = ro.apply_rows(opt, g, state, got)
    g1 = rng.normal(size=(1, D)).astype(np.float32)
    g = ro.RowGrad(jnp.array([1]), jnp.asarray(g1))
    before = np.asarray(got[1])
    got, state = ro.apply_rows(opt, g, state, got)
    moved = np.asarray(got[1]) - before
    t = 1 if count == "row" else 6  # the bias correction's count for row 1 at this step
    m_hat = (1 - 0.9) * g1[0] / (1 - 0.9**t)
    v_hat = (1 - 0.999) * g1[0] ** 2 / (1 - 0.999**t)
    expected = -float(schedule(5)) * m_hat / (np.sqrt(v_hat) + 1e-8)
    np.testing.assert_allclose(moved, expected, rtol=1e-4)


PARAMS = {"t": jnp.zeros((10, 4)), "w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
BEHAVIOUR = [  # optimizer, treats rows alone, untouched rows stay (the row view is exact)
    ("sgd", lambda: optax.sgd(0.1), True, True),
    ("momentum", lambda: optax.sgd(0.1, momentum=0.9), True, False),
    ("adam", lambda: optax.adam(1e-2), True, False),
    ("adagrad", lambda: optax.adagrad(0.1), True, True),
    ("schedule", lambda: optax.sgd(optax.linear_schedule(0.1, 0.0, 10)), True, True),
    ("clip", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), False, True),
    ("clip far", lambda: optax.chain(optax.clip_by_global_norm(1e6), optax.sgd(0.1)), False, True),
    ("adamw", lambda: optax.adamw(1e-2, weight_decay=0.1), True, False),
    ("lamb", lambda: optax.lamb(1e-2), False, False),
    ("lazy_adam", lambda: ro.lazy_adam(1e-2), True, False),
]


@pytest.mark.parametrize("name, make, alone, stay", BEHAVIOUR, ids=[b[0] for b in BEHAVIOUR])
def test_what_an_optimizer_does_to_rows(name, make, alone, stay):
    """The probes the pipelined step (rows alone) and the choice of the row view (rows
    stay) rely on, against what each optimizer is known to do."""
    assert ro.treats_rows_alone(make(), PARAMS) is alone
    assert ro.untouched_rows_stay(make(), PARAMS) is stay
