"""The dense baselines equal single-device training on the same global batch; the
sampled softmax against numpy."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, reference_run, strategy_run
from jax.sharding import PartitionSpec as P

import sparsecomm_jax as sc
from models import get_workload
from models.workload import TABLE_NAME, rows_logits, sampled_softmax_loss, table
from sparsecomm_jax import runtime
from sparsecomm_jax.comm import hlo

STEPS = 4


@pytest.fixture(scope="module")
def lm():
    w = get_workload("lstm_lm", vocab=200, dim=16, hidden=16, seq_len=8, batch=16, seed=3)
    return w, w.init(jax.random.key(3))


@pytest.mark.matrix
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_dense_and_pmap_match_single_device(lm, opt):
    workload, params = lm
    optimizer = optax.sgd(0.5) if opt == "sgd" else optax.adam(1e-2)
    ref_losses, ref_params = reference_run(workload, optimizer, params, STEPS)
    assert ref_losses[-1] < ref_losses[0]  # training actually moves the parameters
    for strategy in ("dense", "dense_pmap"):
        losses, got, _ = strategy_run(workload, optimizer, params, STEPS, strategy)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        # Adam divides by sqrt(v): rows with tiny gradients amplify float rounding.
        assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-4 if opt == "adam" else 1e-6)


def test_dense_program_has_one_gradient_allreduce(lm):
    workload, params = lm
    _, _, ts = strategy_run(workload, optax.sgd(0.1), params, 1, "dense")
    batch = ts.place_batch(workload.batch_at(0))
    colls = hlo.collectives(ts.step, ts.state, batch)
    grad_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    reduced = sum(c.result_bytes for c in colls if c.kind == "all-reduce")
    assert reduced == pytest.approx(grad_bytes + 4, rel=1e-3)  # gradients + the loss
    assert hlo.total_bytes(colls) == pytest.approx(2 * 7 / 8 * reduced, rel=1e-6)


def test_sampled_softmax_and_tied_tables_train(lm):
    w = get_workload(
        "lstm_lm",
        vocab=300,
        dim=16,
        hidden=16,
        seq_len=8,
        batch=16,
        sampled_softmax=32,
        tie_embeddings=True,
    )
    params = w.init(jax.random.key(0))
    assert "softmax" not in params and w.replicated_keys == ("negatives",)
    ref_losses, ref_params = reference_run(w, optax.sgd(0.5), params, 3)
    losses, got, _ = strategy_run(w, optax.sgd(0.5), params, 3, "dense")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params)


def _sampled_loss(h, table_rows, targets, negatives):
    """``models.workload.sampled_softmax_loss`` on a plain ``V x D`` table."""
    cfg = types.SimpleNamespace(vocab=table_rows.shape[0], dim=table_rows.shape[1])
    return sampled_softmax_loss(h, table(cfg, {TABLE_NAME: table_rows}), targets, negatives)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "positions, dtype",
    [((3, 5), jnp.float32), ((15,), jnp.float32), ((3, 5), jnp.bfloat16)],
    ids=["batch-by-time", "flat", "bfloat16"],
)
def test_sampled_softmax_loss_matches_numpy_and_the_concatenated_form(positions, dtype):
    rng = np.random.default_rng(7)
    V, D, N = 50, 8, 12  # N differs from the 15 positions: a transposed gradient cannot fit
    h = rng.normal(size=(*positions, D)).astype(np.float32)
    rows = rng.normal(size=(V, D)).astype(np.float32)
    negatives = rng.choice(V, N, replace=False).astype(np.int32)
    targets = rng.integers(0, V, positions).astype(np.int32)
    targets.reshape(-1)[:3] = negatives[:3]  # some targets are among the negatives: masked
    h, rows = jnp.asarray(h, dtype), jnp.asarray(rows, dtype)  # rounded to dtype
    h64, rows64 = np.asarray(h, np.float64), np.asarray(rows, np.float64)
    want = []  # -log softmax at the target, over the target and the other negatives
    for hp, t in zip(h64.reshape(-1, D), targets.reshape(-1), strict=True):
        others = [n for n in negatives if n != t]
        logits = np.concatenate([[hp @ rows64[t]], rows64[others] @ hp])
        want.append(np.log(np.sum(np.exp(logits - logits.max()))) + logits.max() - logits[0])
    got = jax.jit(_sampled_loss)(h, rows, targets, negatives)
    assert got.dtype == jnp.float32  # summed in float32 whatever the inputs' dtype
    assert float(got) == pytest.approx(np.mean(want), rel=1e-5 if dtype == jnp.float32 else 1e-2)

    def concatenated(h, rows):  # the textbook form: one softmax over [target, negatives]
        pos = jnp.sum(h * rows[targets], axis=-1, keepdims=True)
        neg = jnp.where(negatives == targets[..., None], -1e9, h @ rows[negatives].T)
        logits = jnp.concatenate([pos, neg], axis=-1).astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits, axis=-1)[..., 0])

    grads = jax.grad(_sampled_loss, argnums=(0, 1))(h, rows, targets, negatives)
    want_grads = jax.grad(concatenated, argnums=(0, 1))(h, rows)
    assert [g.dtype for g in grads] == [dtype, dtype]
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert_trees_close(grads, want_grads, rtol=tol, atol=tol)


@pytest.mark.parametrize("varying", ["rows", "h"])
def test_rows_logits_in_shard_map_with_one_input_replicated(varying):
    """Inside a check_vma shard_map one input replicated and the other per worker: the
    gradients equal those of the plain matmul (the replicated one's summed)."""
    mesh = runtime.data_mesh()
    n = mesh.size
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.normal(size=(2 * n if varying == "rows" else 5, 4)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(3 * n if varying == "h" else 6, 4)), jnp.float32)
    specs = (P("data") if varying == "rows" else P(), P("data") if varying == "h" else P())

    def grads_of(logits):
        def body(rows, h):
            return jax.grad(lambda r, x: jnp.sum(jnp.tanh(logits(r, x))), argnums=(0, 1))(rows, h)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))(rows, h)

    assert_trees_close(grads_of(rows_logits), grads_of(lambda r, x: r @ x.T), rtol=1e-5)


def test_errors_before_compiling(lm):
    workload, params = lm
    mesh = runtime.data_mesh(8)
    with pytest.raises(ValueError, match="unknown strategy"):
        sc.make_train_step(workload.loss, optax.sgd(0.1), mesh, params, "nope")
    with pytest.raises(ValueError, match="axis_name 'model' is not in the mesh"):
        sc.make_train_step(workload.loss, optax.sgd(0.1), mesh, params, axis_name="model")
    ts = sc.make_train_step(workload.loss, optax.sgd(0.1), mesh, params)
    with pytest.raises(ValueError, match="divisible by the number of devices"):
        ts.place_batch({"tokens": np.zeros((12, 9), np.int32)})
    with pytest.raises(ValueError, match="only 8 cpu devices"):
        runtime.data_mesh(16)


def test_arguments_of_the_wrong_kind(lm):
    workload, params = lm
    mesh = runtime.data_mesh(8)
    sgd = optax.sgd(0.1)
    cases = [
        ((None, sgd, mesh, params), "loss_fn must be callable"),
        ((workload.loss, "sgd", mesh, params), "optax GradientTransformation"),
        ((workload.loss, sgd, "mesh", params), "jax.sharding.Mesh"),
        ((workload.loss, sgd, mesh, {}), "params has no arrays"),
        ((workload.loss, sgd, mesh, {"w": np.zeros(3, np.int32)}), r"\['w'\] must be a float"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            sc.make_train_step(*args)
    with pytest.raises(ValueError, match="nonfinite='ignore' must be one of"):
        sc.make_train_step(workload.loss, sgd, mesh, params, nonfinite="ignore")
