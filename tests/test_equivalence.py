"""Every lossless table strategy equals single-device training, on every model, with Adam:
same losses, same final parameters (sharded tables gathered back). SGD, whose table
update is row-sparse under the table strategies, is covered by test_row_updates,
test_many_tables and test_optax."""

import jax
import optax
import pytest
from helpers import assert_trees_close, reference_run, strategy_run

from models import get_workload

# The data-parallel baselines ("dense", "dense_pmap") against single device:
# test_train_dense.
LOSSLESS = ("sparse_allgather", "embrace", "embrace_rowwise")
STEPS = 3
SMALL = dict(vocab=256, dim=16, hidden=16, seq_len=8, batch=16)
# Sampled softmax with untied tables on two models, tied full softmax on the others.
VARIANTS = {  # the first is the fast tier's case (conftest): a tied full softmax
    "gpt2": dict(),
    "lstm_lm": dict(sampled_softmax=16),
    "bert": dict(sampled_softmax=16, tie_embeddings=False),
    "transformer": dict(),
}
OPTIMIZERS = {
    # eps keeps Adam from amplifying float noise in exactly-zero gradients
    # (attention key biases) into visible parameter differences.
    "adam": lambda: optax.adam(1e-2, eps=1e-3),
}


# Adam (it magnifies any difference in a gradient) on every model.
CASES = [(m, "adam") for m in VARIANTS]


@pytest.mark.matrix
@pytest.mark.parametrize("model, opt", CASES)
def test_lossless_strategies_match_single_device(model, opt):
    w = get_workload(model, seed=1, **SMALL, **VARIANTS[model])
    params = w.init(jax.random.key(1))
    optimizer = OPTIMIZERS[opt]()
    ref_losses, ref_params = reference_run(w, optimizer, params, STEPS)
    assert ref_losses[-1] != ref_losses[0]
    for strategy in LOSSLESS:
        losses, got, _ = strategy_run(w, optimizer, params, STEPS, strategy)
        assert losses == pytest.approx(ref_losses, rel=1e-5), strategy
        assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-5)
