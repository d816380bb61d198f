"""placed_batches: each batch placed on a host thread while the step before runs; the
same batches, capacities and losses as placing each one on the step path."""

import threading

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparsecomm_jax as sc
from sparsecomm_jax import runtime

V, D, N = 40, 8, 8


def _loss(p, b, emb):
    rows = emb.lookup(p["embed"], b["ids"])  # float[B, T, D]
    return jnp.mean((rows.sum(1) @ p["w"] - b["y"]) ** 2)


def _train_step():
    rng = np.random.default_rng(1)
    params = {"embed": rng.normal(size=(V, D)).astype(np.float32), "w": np.ones((D, 1), np.float32)}
    return sc.make_train_step(
        _loss, optax.sgd(0.1), runtime.data_mesh(N), params, "embrace", embedding_paths=[("embed",)]
    )


def _batch_at(seed):
    def batch_at(step):
        rng = np.random.default_rng([seed, step])
        size = 2 + step % 3  # ids per example vary: the capacities change between steps
        return {
            "ids": rng.integers(0, V, (N * 2, size)).astype(np.int32),
            "y": rng.normal(size=(N * 2, 1)).astype(np.float32),
        }

    return batch_at


def test_same_batches_and_losses_as_placing_on_the_step_path():
    seed, steps = int(np.random.default_rng().integers(1 << 30)), 6
    ts = _train_step()
    state, plain = ts.state, []
    caps = []
    for s in range(steps):
        batch = sc.place_for_step(ts, _batch_at(seed), s, steps)
        caps.append(batch.capacity)
        state, loss = ts.step(state, batch)
        plain.append(sc.loss_value(loss))
    ts = _train_step()
    state, ahead = ts.state, []
    for s, batch in enumerate(sc.placed_batches(ts, _batch_at(seed), 0, steps)):
        assert batch.capacity == caps[s]
        state, loss = ts.step(state, batch)
        ahead.append(sc.loss_value(loss))
    assert ahead == plain
    assert [b.capacity for b in sc.placed_batches(ts, _batch_at(seed), 4, steps)] == caps[4:]


def test_the_next_batch_is_placed_while_the_step_runs():
    asked = {s: threading.Event() for s in range(4)}

    def batch_at(step):
        asked[step].set()
        return _batch_at(0)(step)

    batches = sc.placed_batches(_train_step(), batch_at, 0, 4)
    next(batches)  # batch 0 handed out: batch 1 is being made without being asked for
    assert asked[1].wait(timeout=30)
    assert not asked[2].is_set()
    batches.close()  # leaving early waits for the batch in flight and drops it


def test_an_error_placing_a_batch_is_raised_when_that_batch_is_asked_for():
    def batch_at(step):
        batch = _batch_at(0)(step)
        if step == 2:
            batch["ids"][0, 0] = V + 5
        return batch

    batches = sc.placed_batches(_train_step(), batch_at, 0, 4)
    next(batches), next(batches)
    with pytest.raises(ValueError, match="outside"):
        next(batches)
