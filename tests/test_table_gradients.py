"""Table gradients through each layout (``embedding.gradients``) against dense autodiff on
one device; the bfloat16 wire: close to float32 and half the bytes of the compiled
collectives; FP8 rows close to float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import aggregators, runtime
from sparsecomm_jax.comm import hlo, wire
from sparsecomm_jax.embedding import column, gradients, replicated, row, update
from sparsecomm_jax.embedding.access import PLAIN
from sparsecomm_jax.embedding.tables import Table

N, V, D = 8, 64, 16
LAYOUTS = {"column": column.COLUMN, "row": row.ROW, "replicated": replicated.REPLICATED}
SLOTS = {0: 16}  # per table: enough for every layout's buffers here


def _sampled_loss(params, batch, emb):
    x = emb.lookup(params["t"], batch["ids"])  # [b, 3, D]
    neg = emb.lookup_shared(params["t"], batch["neg"])  # [5, D]
    return jnp.mean(jnp.sin(x * params["w"]) @ neg.T)


def _loss(params, batch, emb):
    """Lookups, shared lookups and a tied full softmax (attend) on one table."""
    x = emb.lookup(params["t"], batch["ids"])  # [b, 3, D]
    logits = emb.attend(params["t"], x[:, 0] * params["w"])  # [b, V]
    return _sampled_loss(params, batch, emb) + jnp.mean(jax.nn.log_softmax(logits)[:, :4])


def _inputs(seed):
    rng = np.random.default_rng(seed)
    params = {
        "t": rng.normal(size=(V, D)).astype(np.float32),
        "w": rng.normal(size=(D,)).astype(np.float32),
    }
    ids = rng.integers(0, V, size=(N * 2, 3)).astype(np.int32)
    ids[:, 1] = ids[:, 0]  # duplicates within a worker
    return params, {"ids": ids, "neg": rng.integers(0, V, size=5).astype(np.int32)}


def _row_step(layout_name, comm_dtype, loss=_loss):
    """shard_map: the mean table gradient, scattered back into a dense shard."""
    mesh = runtime.data_mesh(N)
    layout, mask = LAYOUTS[layout_name], {"t": True, "w": False}
    spec, tables = layout.spec("data"), (Table(0, "t", V, D, layout),)

    def body(params, batch):
        _, grads, pairs, _ = gradients.table_gradients(
            loss, params, batch, tables, mask, SLOTS, "data", wire.parse(comm_dtype)
        )
        dense = update.dense_gradient(pairs[0], params["t"], N)  # the mean, as a shard
        return dense, grads["w"][None]  # per worker: no all-reduce in the program

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=({"t": spec, "w": P()}, {"ids": P("data"), "neg": P()}),
        out_specs=(spec, P("data")),
        check_vma=False,
    )
    return jax.jit(fn), mesh, spec


def _reference(params, batch):
    def worker_loss(p, ids):
        return _loss(p, {"ids": ids, "neg": batch["neg"]}, PLAIN)

    grads = [jax.grad(worker_loss)(params, ids) for ids in np.split(batch["ids"], N)]
    return jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *grads)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_row_grads_equal_dense_gradient(layout_name):
    params, batch = _inputs(seed=len(layout_name))
    fn, mesh, spec = _row_step(layout_name, "float32")
    placed = (
        {"t": runtime.put_global(params["t"], mesh, spec), "w": params["w"]},
        {"ids": runtime.put_global(batch["ids"], mesh, P("data")), "neg": batch["neg"]},
    )
    table, w = fn(*placed)
    ref = _reference(params, batch)
    np.testing.assert_allclose(runtime.to_host(table), ref["t"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w).mean(axis=0), ref["w"], rtol=1e-5, atol=1e-6)
    fn16 = _row_step(layout_name, "bfloat16")[0]
    table16, _ = fn16(*placed)
    np.testing.assert_allclose(runtime.to_host(table16), ref["t"], rtol=0.05, atol=2e-3)
    table8, _ = _row_step(layout_name, "forward=float8_e4m3fn,backward=float8_e5m2")[0](*placed)
    scale = np.abs(ref["t"]).max()  # FP8: within half an ulp of each row's scale, summed
    np.testing.assert_allclose(runtime.to_host(table8), ref["t"], rtol=0.15, atol=0.02 * scale)
    # without attend (its table gather stays float32) every row exchange halves
    f32 = _float_bytes(_row_step(layout_name, "float32", _sampled_loss)[0], placed)
    bf16 = _float_bytes(_row_step(layout_name, "bfloat16", _sampled_loss)[0], placed)
    assert bf16 == pytest.approx(f32 / 2, rel=0.05)


def _float_bytes(fn, args):
    """Bytes per worker of the collectives that carry rows (ids are int32)."""
    return sum(c.bytes_sent for c in hlo.collectives(fn, *args) if c.shapes[0][0] != "s32")


def test_flat_mean_is_pmean_with_half_the_bytes():
    rng = np.random.default_rng(5)
    tree = {"a": rng.normal(size=(N * 3, 5)).astype(np.float32), "b": rng.normal(size=(N,))}
    tree["b"] = tree["b"].astype(np.float32)
    mesh = runtime.data_mesh(N)

    def build(agg):
        return jax.jit(
            jax.shard_map(
                lambda t: agg.update(t, agg.init(t))[0],
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P(),
                check_vma=False,
            )
        )

    placed = jax.tree.map(lambda x: runtime.put_global(x, mesh, P("data")), tree)
    ref_fn, fn = (
        build(aggregators.dense_allreduce("data")),
        build(aggregators.flat_allreduce("data", "bfloat16")),
    )
    ref, got = ref_fn(placed), fn(placed)
    for k in tree:
        want = tree[k].reshape(N, -1, *tree[k].shape[1:]).mean(axis=0)
        np.testing.assert_allclose(np.asarray(ref[k]), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got[k]), want, rtol=2e-2, atol=2e-2)
    assert _float_bytes(fn, (placed,)) == pytest.approx(
        _float_bytes(ref_fn, (placed,)) / 2, rel=0.1
    )


def test_unknown_comm_dtype():
    with pytest.raises(ValueError, match="comm_dtype='float16' is unknown; choose one of"):
        wire.codec("float16")
