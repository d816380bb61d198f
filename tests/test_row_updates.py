"""Row-sparse table updates in training (``table_update="rows"``): every lossless table
strategy (``embrace_2d`` too) with SGD and Adagrad on the touched rows equals
single-device dense training (tied and untied tables, sampled and full softmax); lazy
Adam equals a numpy reference; non-finite rows skip the step; the bfloat16 wire halves
the bytes; embrace sends each distinct row once; bad input fails before compiling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, place, reference_run, strategy_run

import sparsecomm_jax as sc
from experiments.train import main, train_and_evaluate, validate
from experiments.train.config import RunConfig
from models import get_workload
from sparsecomm_jax import row_optimizers, runtime
from sparsecomm_jax.comm import costmodel, hlo, wire
from sparsecomm_jax.embedding.layout import CapacityPolicy, grow_by_eighth, grow_with_margin
from sparsecomm_jax.errors import ArgumentError
from sparsecomm_jax.step import capacities

# embrace_2d as its pipelined program (conftest), not as embrace on this CPU mesh
pytestmark = pytest.mark.usefixtures("pipelined_2d")

STEPS = 3
SMALL = dict(vocab=256, dim=16, hidden=16, seq_len=8, batch=16)
OPTIMIZERS = {  # the optax optimizer: dense in the reference, on the rows in the strategy
    "sgd": lambda: optax.sgd(0.5),
    "adagrad": lambda: optax.adagrad(0.3),
}
ALL = ("embrace", "embrace_rowwise", "sparse_allgather", "embrace_2d")  # 2d: no emb.attend
CASES = [  # model, its variant, optimizer, strategies (every strategy on several models)
    ("lstm_lm", dict(sampled_softmax=16), "sgd", ALL),  # untied, sampled softmax
    ("lstm_lm", dict(sampled_softmax=16, tie_embeddings=True), "adagrad", ALL),  # tied
    ("gpt2", dict(), "adagrad", ("embrace", "embrace_rowwise")),  # tied full softmax
    ("bert", dict(sampled_softmax=16, tie_embeddings=False), "sgd", ("embrace_rowwise",)),
    ("transformer", dict(), "sgd", ("sparse_allgather", "embrace")),
]


@pytest.mark.matrix
@pytest.mark.parametrize("model, variant, opt, strategies", CASES)
def test_row_updates_match_single_device(model, variant, opt, strategies):
    """Adam with the dense update is checked for every strategy in test_equivalence."""
    w = get_workload(model, seed=2, **SMALL, **variant)
    params = w.init(jax.random.key(2))
    optimizer = OPTIMIZERS[opt]
    ref_losses, ref_params = reference_run(w, optimizer(), params, STEPS)
    for strategy in strategies:
        losses, got, ts = strategy_run(w, optimizer(), params, STEPS, strategy, table_update="rows")
        assert ts.table_update == "rows", strategy
        assert losses == pytest.approx(ref_losses, rel=1e-5), strategy
        assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-5)


def _lazy_adam_reference(w, params, steps, lr, eps=1e-3, b1=0.9, b2=0.999, per="row"):
    """One device, numpy: Adam on the dense autodiff gradient, where a table's row moves
    (and its moments advance) only on steps that read it (lstm_lm, untied: ``embed`` the
    inputs, ``softmax`` the targets and negatives); every other parameter is read every
    step. The bias correction counts the steps that read a row (``per="row"``) or, as
    PyTorch's ``SparseAdam``, every step of the parameter (``per="table"``);
    ``lr(steps before this one)`` when ``lr`` is a schedule, the same for every row of
    every parameter (a row first read late takes the schedule's value of that step)."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    mu, nu = jax.tree.map(np.zeros_like, params), jax.tree.map(np.zeros_like, params)
    count = jax.tree.map(lambda x: np.zeros(x.shape[:1], np.int64), params)
    table_count = 0
    losses = []
    for step in range(steps):
        batch = w.batch_at(step)
        tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        loss, grads = jax.value_and_grad(w.loss)(tree, batch)
        tokens = batch["tokens"]
        read = {"embed": [tokens[:, :-1]], "softmax": [tokens[:, 1:], batch["negatives"]]}
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            name = path[0].key
            rows = (
                np.unique(np.concatenate([np.ravel(x) for x in read[name]]))
                if name in read
                else slice(None)
            )
            p, m, v, c = (_at(t, path) for t in (params, mu, nu, count))
            g = np.asarray(g, np.float64)[rows]
            m[rows] = b1 * m[rows] + (1 - b1) * g
            v[rows] = b2 * v[rows] + (1 - b2) * g * g
            before = c[rows].copy() if per == "row" else np.full_like(c[rows], table_count)
            c[rows] += 1
            t = (before + 1).reshape(-1, *([1] * (g.ndim - 1))) if g.ndim else before + 1
            rate = float(lr(step)) if callable(lr) else lr
            m_hat, v_hat = m[rows] / (1 - b1**t), v[rows] / (1 - b2**t)
            p[rows] -= rate * m_hat / (np.sqrt(v_hat) + eps)
        table_count += 1
        losses.append(float(loss))
    return losses, params


def _at(tree, path):
    """The leaf of ``tree`` at ``path`` (a numpy array, changed in place)."""
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy, per, schedule",
    [
        ("embrace", "row", False),
        ("embrace_2d", "row", False),
        ("embrace", "table", True),
        ("embrace", "row", True),
    ],
)
def test_lazy_adam_matches_single_device_reference(strategy, per, schedule):
    """Both bias-correction counts against numpy, both with a learning-rate schedule
    (embrace_2d: the step counts, indexed by ids every worker holds, stay replicated)."""
    w = get_workload("lstm_lm", seed=3, **SMALL, sampled_softmax=16)
    params = w.init(jax.random.key(3))
    lr = optax.linear_schedule(1e-2, 2e-3, STEPS) if schedule else 1e-2
    ref_losses, ref_params = _lazy_adam_reference(w, params, STEPS, lr, per=per)
    # eps keeps Adam from amplifying float noise in near-zero gradients
    opt = row_optimizers.lazy_adam(lr, eps=1e-3, count=per)  # Adam on the dense leaves
    losses, got, _ = strategy_run(w, opt, params, STEPS, strategy, table_update="rows")
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-5)
    untouched = np.setdiff1d(np.arange(SMALL["vocab"]), w.batch_at(0)["tokens"])
    untouched = np.setdiff1d(
        untouched, np.concatenate([w.batch_at(s)["tokens"].ravel() for s in range(STEPS)])
    )
    untouched = np.setdiff1d(
        untouched, np.concatenate([w.batch_at(s)["negatives"] for s in range(STEPS)])
    )
    assert untouched.size
    before = np.asarray(params["embed"]["embedding"])
    np.testing.assert_array_equal(got["embed"]["embedding"][untouched], before[untouched])


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy, comm_dtype",
    [
        ("embrace", "float32"),
        ("embrace_2d", "float32"),
        ("embrace", "float8_e4m3fn"),
        ("embrace_rowwise", "forward=float8_e5m2,backward=float8_e4m3fn"),
    ],
)
def test_nonfinite_rows_skip_the_step(strategy, comm_dtype):
    """Only the table's gradient rows hold NaN at step 1: the check looks at the rows
    (in FP8 a row's NaN makes its scale NaN: the whole row arrives NaN)."""
    w = get_workload("lstm_lm", seed=4, **SMALL, sampled_softmax=16)

    def batch_at(step):
        return {
            **w.batch_at(step),
            "poison": np.full((SMALL["batch"],), np.nan if step else 0.0, np.float32),
        }

    def loss(params, batch, emb):  # NaN reaches only the table's gradient rows
        rows = emb.lookup(params["embed"]["embedding"], batch["tokens"][:, :1])
        return w.loss(params, batch, emb) + jnp.mean(batch["poison"]) * jnp.sum(rows)

    bad = w._replace(batch_at=batch_at, loss=loss)
    ts = sc.make_train_step(
        bad.loss,
        optax.sgd(0.1),
        runtime.data_mesh(8),
        w.init(jax.random.key(4)),
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        table_update="rows",
        comm_dtype=comm_dtype,
    )
    state, _ = ts.step(ts.state, place(ts, bad, 0, 2))
    before = jax.tree.map(np.asarray, ts.host_params(state))
    state, loss_value = ts.step(state, place(ts, bad, 1, 2))
    assert np.isnan(sc.loss_value(loss_value))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(ts.host_params(state)), strict=True):
        np.testing.assert_array_equal(a, b)


def _row_bytes(strategy, comm_dtype, dim=16, batch=32):
    w = get_workload(
        "lstm_lm", seed=5, vocab=512, dim=dim, hidden=16, seq_len=8, batch=batch, sampled_softmax=16
    )
    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        runtime.data_mesh(8),
        w.init(jax.random.key(5)),
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        table_update="rows",
        comm_dtype=comm_dtype,
    )
    colls = hlo.collectives(ts.step, ts.state, ts.place_batch(w.batch_at(0)))
    ids = sum(c.bytes_sent for c in colls if c.shapes[0][0] in ("s32", "pred"))
    return hlo.total_bytes(colls) - ids, colls


def test_bfloat16_wire_halves_the_bytes():
    """Rows, gradient rows, negatives and the dense all-reduce (other layouts:
    test_table_gradients)."""
    f32, _ = _row_bytes("embrace", "float32")
    bf16, colls = _row_bytes("embrace", "bfloat16")
    assert bf16 == pytest.approx(f32 / 2, rel=0.02)
    assert not [c for c in colls if c.shapes[0][0] == "f32" and c.kind != "all-reduce"]


def test_each_exchange_travels_in_its_own_codec_to_the_byte():
    """forward FP8 (a float32 scale per row of D/P), backward bfloat16, dense mean FP8
    (a scale per block): each collective's compiled bytes from float32's by the codec's
    formulas (``wire.row_bytes``; ``costmodel.flat_mean_cost``, whose two halves are
    the all-to-all and the all-gather); ids untouched."""
    spec = "forward=float8_e4m3fn,backward=bfloat16,dense=float8_e5m2"
    _, f32 = _row_bytes("embrace", "float32", dim=64)
    _, narrow = _row_bytes("embrace", spec, dim=64)
    width, num = 64 // 8, 8
    a2a = [c.bytes_sent for c in f32 if c.kind == "all-to-all"]
    rows = [b for b in a2a if a2a.count(b) == 2]  # forward and back: the same rows
    (dense_a2a,) = [b for b in a2a if a2a.count(b) == 1]
    (dense_ag,) = [c for c in f32 if c.kind == "all-gather" and c.shapes[0][0] == "f32"]
    assert len(rows) == 2
    row_count = rows[0] // (4 * width)  # (P-1) x slots
    size = dense_a2a * num // (4 * (num - 1))  # d (a multiple of P here)
    extra = dense_ag.bytes_sent // (4 * (num - 1)) - size // num  # the step's scalars
    share = wire.flat_bytes(wire.padded(size, num, wire.E5M2) // num, wire.E5M2)
    want = [  # rows out, the dense mean's all-to-all, gradients back, its all-gather
        ("all-to-all", "u8", row_count * wire.row_bytes(width, wire.E4M3)),
        ("all-to-all", "u8", (num - 1) * share),
        ("all-to-all", "u16", row_count * wire.row_bytes(width, wire.BFLOAT16)),
        ("all-gather", "u8", (num - 1) * (share + 4 * extra)),
    ]
    assert want[1][2] + want[3][2] == costmodel.flat_mean_cost(size, num, wire.E5M2, extra)[1]
    ids = [c.bytes_sent for c in narrow if c.shapes[0][0] == "s32"]
    assert ids == [c.bytes_sent for c in f32 if c.shapes[0][0] == "s32"]
    got = [(c.kind, c.shapes[0][0], c.bytes_sent) for c in narrow if c.shapes[0][0] != "s32"]
    assert sorted(got) == sorted(want)  # which direction is which: the test below


def test_forward_rounds_the_rows_the_loss_sees_and_backward_the_update():
    """A narrow ``forward`` changes the first step's loss (the rows it is computed
    from); a narrow ``backward`` leaves it equal to float32's bit for bit and changes
    only what the update applies (the second step's loss)."""
    w = get_workload("lstm_lm", seed=3, **SMALL, sampled_softmax=16)
    params = w.init(jax.random.key(3))

    def losses(spec):
        kw = dict(table_update="rows", comm_dtype=spec)
        return strategy_run(w, optax.sgd(0.5), params, 2, "embrace_rowwise", **kw)[0]

    f32 = losses("float32")
    forward, backward = losses("forward=float8_e4m3fn"), losses("backward=float8_e4m3fn")
    assert forward[0] != f32[0] and forward[0] == pytest.approx(f32[0], rel=0.02)
    assert backward[0] == f32[0] and backward[1] != f32[1]


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy, spec",
    [
        ("embrace", "float8_e4m3fn"),
        ("embrace_rowwise", "forward=float8_e4m3fn,backward=float8_e5m2,dense=bfloat16"),
        ("sparse_allgather", "float8_e5m2"),
        ("embrace+topk_a2a", "forward=float8_e4m3fn,backward=float8_e4m3fn"),
    ],
)
def test_fp8_training_follows_float32(strategy, spec):
    """Steps with FP8 rows stay close to the same strategy's float32 steps (one device's
    reference for the lossless ones): FP8 rounds each value to 3 or 2 mantissa bits of
    its row's scale, and every sum is float32. A top-k strategy narrows its rows only."""
    w = get_workload("lstm_lm", seed=7, **SMALL, sampled_softmax=16)
    params = w.init(jax.random.key(7))
    kw = dict(table_update="rows", density=0.5)
    ref, ref_params, _ = strategy_run(w, optax.sgd(0.5), params, 4, strategy, **kw)
    got, got_params, ts = strategy_run(
        w, optax.sgd(0.5), params, 4, strategy, comm_dtype=spec, **kw
    )
    assert got == pytest.approx(ref, rel=0.02) and got != ref  # rounded, not float32
    assert_trees_close(got_params, ref_params, rtol=0.1, atol=0.02)


def test_embrace_sends_each_distinct_row_once():
    """One id all-gather and one all-to-all each way for all lookups; each worker's slots
    per table = the most distinct ids any worker reads of it (numpy) with its margin,
    at most every id a worker reads."""
    _, colls = _row_bytes("embrace", "float32", batch=128)  # 16 sequences a worker
    w = get_workload(
        "lstm_lm", seed=5, vocab=512, dim=16, hidden=16, seq_len=8, batch=128, sampled_softmax=16
    )
    batch, num = w.batch_at(0), 8
    parts = np.split(batch["tokens"], num)
    neg = batch["negatives"]
    need = [
        max(np.unique(p[:, :-1]).size for p in parts),
        max(np.unique(np.r_[p[:, 1:].ravel(), neg]).size for p in parts),
    ]
    every = [parts[0][:, :-1].size, parts[0][:, 1:].size + neg.size]  # ids a worker reads
    caps = [min(grow_with_margin(n), most) for n, most in zip(need, every, strict=True)]
    rows = (num - 1) * sum(caps) * 16 // num * 4  # bytes of one exchange of rows
    kinds = [(c.kind, c.bytes_sent == rows) for c in colls]
    assert kinds.count(("all-to-all", True)) == 2  # rows forward, gradients back
    ids = [c for c in colls if c.kind == "all-gather" and c.shapes[0][0] == "s32"]
    # + the dense layers' mean (all-to-all, all-gather), whose all-gather also carries
    # the scalars (the loss, the finite flag, the capacity flags): no all-reduce
    assert len(ids) == 1 and len(colls) == 5
    assert sum(caps) < 2 * parts[0][:, 1:].size + neg.size  # fewer rows than ids read


def test_per_table_capacities_grow_one_by_one_and_never_shrink():
    policy = CapacityPolicy(None, "rows", grow_by_eighth)
    current, sizes = {}, []
    for need in ((10, 100), (12, 90), (9, 130)):
        current = capacities.grow_capacities(current, dict(enumerate(need)), None, policy)
        sizes.append(tuple(current.values()))
    assert sizes == [(16, 112), (16, 112), (16, 152)]
    with pytest.raises(ValueError, match="capacity=64 is too small: this batch needs 100"):
        capacities.grow_capacities({}, {0: 10, 1: 100}, 64, policy)


def test_bad_input_fails_before_compiling():
    w = get_workload("lstm_lm", **SMALL)
    args = (w.loss, optax.sgd(0.1), runtime.data_mesh(8), w.init(jax.random.key(0)))
    kw = dict(embedding_paths=w.embedding_paths)
    with pytest.raises(ValueError, match="comm_dtype='float8' is unknown"):
        sc.make_train_step(*args, "embrace", comm_dtype="float8", **kw)
    with pytest.raises(ValueError, match="table_update='rows' needs a strategy among"):
        sc.make_train_step(*args, "dense", table_update="rows", **kw)
    with pytest.raises(ValueError, match="comm_dtype='bfloat16' needs"):
        sc.make_train_step(*args, "embrace", comm_dtype="bfloat16", table_update="dense", **kw)
    with pytest.raises(ValueError, match="comm_dtype='bfloat16' is not available for embrace_2d"):
        sc.make_train_step(*args, "embrace_2d", comm_dtype="bfloat16", table_update="rows", **kw)
    spec = "forward=float8_e4m3fn,dense=bfloat16"
    with pytest.raises(ValueError, match="which embrace\\+topk_a2a sends by top-k in float32"):
        sc.make_train_step(*args, "embrace+topk_a2a", comm_dtype=spec, **kw)


def test_a_narrow_wire_never_makes_adam_lazy_without_a_word():
    """``comm_dtype="float8_e4m3fn"`` with ``optax.adam`` and ``table_update="auto"``
    picked the row update (lazy Adam: +8.6% loss at step 30): now refused as the command
    line refuses it; ``table_update="rows"`` says so on purpose, and ``lazy_adam`` and
    SGD take the row update as before."""
    w = get_workload("lstm_lm", **SMALL)
    params = w.init(jax.random.key(0))

    def build(optimizer, **kw):
        return sc.make_train_step(
            w.loss,
            optimizer,
            runtime.data_mesh(8),
            params,
            "embrace",
            embedding_paths=w.embedding_paths,
            **kw,
        )

    with pytest.raises(ArgumentError, match="not exact for this optimizer .* lazy Adam") as e:
        build(optax.adam(1e-2), comm_dtype="float8_e4m3fn")
    assert e.value.argument == "comm_dtype" and e.value.mentions == {"table_update": "rows"}
    assert build(optax.adam(1e-2)).table_update == "dense"  # float32: Adam stays Adam
    chosen = build(optax.adam(1e-2), comm_dtype="float8_e4m3fn", table_update="rows")
    assert chosen.table_update == "rows"
    assert build(sc.lazy_adam(1e-2), comm_dtype="float8_e4m3fn").table_update == "rows"
    assert build(optax.sgd(0.1), comm_dtype="bfloat16").table_update == "rows"


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(comm_dtype="float8"), "--comm-dtype 'float8' is unknown"),
        (dict(optimizer="momentum", table_update="rows"), "momentum has no row-sparse"),
        (dict(optimizer="lazy_adam", strategy="dense"), "lazy_adam is a row-sparse"),
        (dict(comm_dtype="bfloat16", optimizer="adam"), "needs the row-sparse table update"),
        (dict(comm_dtype="bfloat16", strategy="embrace+topk_a2a"), "sends by top-k in float32"),
        (dict(table_update="rows", strategy="dense"), "needs a strategy among"),
        (dict(comm_dtype="bfloat16", strategy="embrace_2d"), "not available for embrace_2d"),
    ],
)
def test_cli_rejects_before_jax_starts(flags, message):
    config = RunConfig(**{"strategy": "embrace", "optimizer": "sgd", **flags})
    with pytest.raises(ValueError, match=message):
        validate(config)


def test_cli_error_is_one_line(capsys):
    assert main(["--strategy", "embrace", "--comm-dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--comm-dtype 'fp8' is unknown" in err and "\n" not in err


@pytest.mark.cli
def test_row_states_resume_from_a_checkpoint(tmp_path):
    """Adagrad's row state, sharded like its table, saved on 8 devices, resumed on 4."""
    base = dict(
        vocab=256,
        dim=16,
        hidden=16,
        seq_len=8,
        batch=16,
        sampled_softmax=16,
        warmup=0,
        strategy="embrace_rowwise",
        optimizer="adagrad",
        lr=0.3,
    )
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    train_and_evaluate(RunConfig(steps=2, **base, **ck), progress=False)
    full = train_and_evaluate(RunConfig(steps=3, **base), progress=False)
    resumed = train_and_evaluate(
        RunConfig(steps=3, devices=4, resume=True, **base, **ck), progress=False
    )
    assert resumed["start_step"] == 2
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)
