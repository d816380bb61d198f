"""A batch whose capacity is too small for its ids: the step is skipped and a
CapacityWarning names the table and its capacity (flag raised on the devices, carried
by the step's existing all-reduce)."""

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparsecomm_jax as sc
from sparsecomm_jax import runtime
from sparsecomm_jax.step.finish import CapacityWarning

V, D, N = 64, 8, 8


def _loss(p, b, emb):
    rows = emb.lookup(p["embed"], b["ids"])  # float[B, T, D]
    return jnp.mean((rows.sum(1) @ p["w"] - b["y"]) ** 2)


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
    with warnings.catch_warnings():
        warnings.simplefilter("error", CapacityWarning)  # a batch that fits: no warning
        state, loss = ts.step(ts.state, placed)
        assert np.isfinite(sc.loss_value(loss))
    before = ts.host_params(state)
    small = dataclasses.replace(placed, capacity=(1,))  # every worker reads 6 distinct ids
    with pytest.warns(CapacityWarning, match=r"table embed: .*capacity of 1 slots"):
        state, loss = ts.step(state, small)
        assert np.isnan(sc.loss_value(loss))
    after = ts.host_params(state)
    for k in before:  # the step was skipped
        np.testing.assert_array_equal(after[k], before[k])
