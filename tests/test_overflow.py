"""A batch whose capacity is too small for its ids: the step is skipped and returns a
loss of +inf (a flag raised on the devices, carried by the step's existing collectives,
no host callback), and ``overflow_message`` names the tables and their capacities."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparsecomm_jax as sc
from sparsecomm_jax import runtime

V, D, N = 64, 8, 8


def _loss(p, b, emb):
    rows = emb.lookup(p["embed"], b["ids"])  # float[B, T, D]
    return jnp.mean((rows.sum(1) @ p["w"] - b["y"]) ** 2)


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise"])
def test_too_small_a_capacity_is_named_and_the_step_skipped(strategy):
    rng = np.random.default_rng()
    params = {"embed": rng.normal(size=(V, D)).astype(np.float32), "w": np.ones((D, 1), np.float32)}
    ts = sc.make_train_step(
        _loss, optax.sgd(0.1), runtime.data_mesh(N), params, strategy, embedding_paths=[("embed",)]
    )
    batch = {
        "ids": rng.permutation(V)[: N * 6].reshape(N * 2, 3).astype(np.int32),  # all distinct
        "y": rng.normal(size=(N * 2, 1)).astype(np.float32),
    }
    placed = ts.place_batch(batch)
    state, loss = ts.step(ts.state, placed)  # a batch that fits
    assert np.isfinite(sc.loss_value(loss))
    before = ts.host_params(state)
    small = dataclasses.replace(placed, capacity=(1,))  # every worker reads 6 distinct ids
    state, loss = ts.step(state, small)
    assert sc.loss_value(loss) == np.inf
    after = ts.host_params(state)
    for k in before:  # the step was skipped
        np.testing.assert_array_equal(after[k], before[k])
    message = sc.overflow_message(ts, small)
    assert "embed 1 slots of distinct rows" in message and "+inf" in message
    state, loss = ts.step(state, placed)  # the next batch that fits trains again
    assert np.isfinite(sc.loss_value(loss))
