"""The user's optax optimizer, whole, under every strategy: transforms that reduce over the
whole tree (global-norm clipping, weight decay, trust ratios) and schedules give the
parameters of single-device training; ``table_update="auto"`` takes the row-sparse update
exactly where it equals the dense one, per table label in the style of
``optax.partition``."""

import jax
import optax
import pytest
from helpers import assert_trees_close, reference_run, strategy_run

from models import get_workload
from sparsecomm_jax.embedding import row_optimizers
from sparsecomm_jax.embedding.tables import table_mask

# embrace_2d as its pipelined program (conftest), not as embrace on this CPU mesh
pytestmark = pytest.mark.usefixtures("pipelined_2d")

STEPS = 3
SMALL = dict(vocab=128, dim=8, hidden=8, seq_len=6, batch=16, sampled_softmax=8)
CLIP = 0.02


def clipped_sgd():
    """The transformers' default recipe: clip by global norm, then a decaying rate."""
    return optax.chain(
        optax.clip_by_global_norm(CLIP), optax.sgd(optax.linear_schedule(0.5, 0.1, 3))
    )


def per_label(params):
    """The tables by clipped SGD, the rest by Adam: ``optax.partition`` of two labels."""
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "table" if path[0].key in ("embed", "softmax") else "dense", params
    )
    return optax.partition({"table": clipped_sgd(), "dense": optax.adam(1e-2, eps=1e-3)}, labels)


OPTIMIZERS = {  # params -> optimizer
    "clip+schedule": lambda _: clipped_sgd(),
    "adamw": lambda _: optax.adamw(1e-2, eps=1e-3, weight_decay=0.1),  # decays every row
    "lamb": lambda _: optax.lamb(1e-2, eps=1e-3),  # a trust ratio per parameter
    "per label": per_label,
}
# (optimizer, strategy, extra options, the table update "auto" must pick)
CASES = [
    *[
        ("clip+schedule", s, {}, "rows")
        for s in ("embrace", "embrace_rowwise", "embrace_2d", "sparse_allgather")
    ],
    ("clip+schedule", "dense", {}, "dense"),
    ("clip+schedule", "topk_a2a", {"density": 1.0}, "dense"),
    ("clip+schedule", "embrace_2d", {"table_update": "dense"}, "dense"),
    ("adamw", "embrace", {}, "dense"),
    ("lamb", "embrace_rowwise", {}, "dense"),
    ("per label", "embrace", {}, "rows"),
]


@pytest.fixture(scope="module")
def workload():
    w = get_workload("lstm_lm", seed=2, **SMALL)
    return w, w.init(jax.random.key(2))


@pytest.fixture(scope="module")
def references(workload):
    w, params = workload
    return {
        name: reference_run(w, make(params), params, STEPS) for name, make in OPTIMIZERS.items()
    }


def test_clipping_clips(workload):
    """The threshold is below the gradient's global norm, so the clip acts."""
    w, params = workload
    grads = jax.grad(w.loss)(params, w.batch_at(0))
    assert float(optax.tree.norm(grads)) > 5 * CLIP


@pytest.mark.matrix
@pytest.mark.parametrize("opt, strategy, options, chosen", CASES)
def test_the_users_optimizer_equals_single_device(
    workload, references, opt, strategy, options, chosen
):
    w, params = workload
    ref_losses, ref_params = references[opt]
    losses, got, ts = strategy_run(w, OPTIMIZERS[opt](params), params, STEPS, strategy, **options)
    assert ts.table_update == chosen
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-5)


def test_auto_takes_rows_only_where_they_equal_the_dense_update(workload):
    """The probe behind ``table_update="auto"``: a zero-gradient table row must keep its
    value and state. Adam's moments, weight decay and trust ratios move it; lazy Adam
    asks for rows by its definition (on a dense gradient it would be Adam)."""
    w, params = workload
    tables = table_mask(params, w.embedding_paths)
    stay = {
        n: row_optimizers.untouched_rows_stay(m(params), params, tables)
        for n, m in OPTIMIZERS.items()
    }
    assert stay == {"clip+schedule": True, "adamw": False, "lamb": False, "per label": True}
    assert row_optimizers.untouched_rows_stay(optax.adagrad(0.1), params, tables)
    assert not row_optimizers.untouched_rows_stay(optax.adam(1e-2), params, tables)
    lazy = optax.chain(optax.clip_by_global_norm(1.0), row_optimizers.lazy_adam(1e-2))
    assert row_optimizers.is_lazy(lazy, params)
    assert not row_optimizers.is_lazy(optax.adam(1e-2), params)
