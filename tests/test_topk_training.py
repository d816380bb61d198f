"""Top-k strategies in full training: exact at density 1, converge at 1% and 5%."""

import jax
import numpy as np
import optax
import pytest
from helpers import strategy_run

from experiments.train import train_and_evaluate
from experiments.train.config import RunConfig
from models import get_workload
from sparsecomm_jax.comm import hlo

SMALL = dict(vocab=256, dim=16, hidden=16, seq_len=8, batch=16)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy",
    [
        "topk_allgather",
        "topk_a2a",
        "gtopk",
        "topk_balanced",
        "oktopk",
        "embrace+topk_a2a",
        "embrace_rowwise+gtopk",
        "embrace+oktopk",
    ],
)
def test_density_one_is_dense(strategy):
    w = get_workload("lstm_lm", sampled_softmax=16, **SMALL)
    params = w.init(jax.random.key(0))
    ref, ref_params, _ = strategy_run(w, optax.sgd(0.5), params, 3, "dense")
    got, got_params, ts = strategy_run(w, optax.sgd(0.5), params, 3, strategy, density=1.0)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    residual = jax.tree.leaves(ts.state.agg_state)
    assert residual and all(r.shape[0] == 8 for r in residual)  # one slice per worker


def test_topk_balanced_trains_as_topk_allgather():
    """Both return the exact sum of what every worker selected: at 1% the same steps,
    through the user's path (make_train_step, place_for_step). A pair deferred past an
    owner's slots would change topk_balanced's mean, and so its steps."""
    w = get_workload("lstm_lm", sampled_softmax=16, **SMALL)
    params = w.init(jax.random.key(1))
    ref, ref_params, _ = strategy_run(w, optax.sgd(0.5), params, 4, "topk_allgather", density=0.01)
    got, got_params, _ = strategy_run(w, optax.sgd(0.5), params, 4, "topk_balanced", density=0.01)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_embrace_plus_topk_exchanges_tables_by_all_to_all():
    w = get_workload("lstm_lm", sampled_softmax=16, **SMALL)
    _, _, ts = strategy_run(
        w, optax.sgd(0.5), w.init(jax.random.key(0)), 1, "embrace+topk_a2a", density=0.05
    )
    colls = hlo.collectives(ts.step, ts.state, ts.place_batch(w.batch_at(1)))
    kinds = [c.kind for c in colls]
    assert kinds.count("all-to-all") >= 4  # table lookups and the top-k exchange
    assert not [c for c in colls if c.kind == "all-reduce" and c.result_bytes > 64]


CONVERGENCE = {
    "lstm_lm": dict(vocab=500, dim=32, hidden=64, seq_len=16, lr=1.0, steps=50),
    "resnet": dict(image_size=16, noise=2.0, lr=0.1, steps=50),
}


@pytest.mark.cli
@pytest.mark.parametrize("model", sorted(CONVERGENCE))
def test_topk_a2a_converges_like_dense(model):
    """After the same steps, the loss (mean of the last 10) is within 5% of dense."""

    def final(strategy, density=1.0):
        cfg = RunConfig(
            model=model,
            strategy=strategy,
            density=density,
            optimizer="sgd",
            devices=4,
            batch=32,
            **CONVERGENCE[model],
        )
        losses = train_and_evaluate(cfg, progress=False)["losses"]
        assert losses[-1] < losses[0]
        return float(np.mean(losses[-10:]))

    dense = final("dense")
    for density in (0.01, 0.05):
        assert final("topk_a2a", density) <= 1.05 * dense
