"""Sharded embeddings: planning on hand-worked examples, collectives against a
list-of-blocks numpy reference, and the compiled program's collectives and bytes."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, reference_run, strategy_run
from jax.sharding import PartitionSpec as P

import sparsecomm_jax as sc
from models import get_workload
from sparsecomm_jax import runtime
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.embedding import column, replicated, row
from sparsecomm_jax.embedding.access import LOOKUP, PLAIN, SHARED, Read
from sparsecomm_jax.embedding.tables import table_mask

# embrace_2d as its pipelined program (conftest), not as embrace on this CPU mesh
pytestmark = pytest.mark.usefixtures("pipelined_2d")

LAYOUTS = {"column": column.COLUMN, "row": row.ROW}

N = 8


def test_bucket_plan_hand_example():
    send, pos = row.bucket_plan(jnp.array([5, 1, 5, 2]), vocab=8, num_workers=2, capacity=2)
    np.testing.assert_array_equal(send, [[1, 2], [5, -1]])
    np.testing.assert_array_equal(pos, [2, 0, 2, 1])


def test_rowwise_capacity_hand_example():
    need = row.bucket_slots([np.array([1, 1, 2, 5]), np.array([6, 7, 7])], 8, 2)
    assert need == 2


def test_pipelined_rowwise_capacity_covers_this_batch_and_the_next():
    """The pipelined step sends batch t's gradients and fetches batch t+1's rows through
    one capacity: the most distinct ids one worker asks of one owner in either."""
    from types import SimpleNamespace

    table, empty = SimpleNamespace(index=0, vocab=8), np.zeros(0, np.int32)
    now = {0: ([np.array([1, 1, 2, 5]), np.array([6, 7, 7])], empty)}  # 2 of one owner
    nxt = {0: ([np.array([0, 1, 2, 3]), np.array([4])], empty)}  # worker 0: 4 of owner 0
    policy = row.two_batches(row.CAPACITY)
    assert policy.need([now], [table], 2) == {0: 2}
    assert policy.need([now, nxt], [table], 2) == {0: 4}
    assert policy.need([now, now, nxt], [table], 2) == {0: 2}  # t+2 is not fetched
    assert policy.what == "distinct rows from one owner (batch t or t+1)"


def _run_lookup(fn, table_global, ids, spec):
    mesh = runtime.data_mesh(N)
    body = jax.shard_map(
        fn, mesh=mesh, in_specs=(spec, P("data")), out_specs=P("data"), check_vma=False
    )
    table = runtime.put_global(table_global, mesh, spec)
    return np.asarray(jax.jit(body)(table, runtime.put_global(ids, mesh, P("data"))))


@pytest.mark.parametrize("layout", ["column", "row"])
def test_lookup_matches_blocks_reference(layout):
    rng = np.random.default_rng(0)
    v, d = 64, 16
    table = rng.normal(size=(v, d)).astype(np.float32)
    ids = rng.integers(0, v, size=(N * 3, 5)).astype(np.int32)
    ids[:, 0] = ids[:, 1]  # duplicates within a worker
    if layout == "column":
        fn = lambda t, i: column.fetch_rows(t, i, "data")  # noqa: E731
    else:
        fn = lambda t, i: row.fetch_one(t, i, "data", capacity=15)[0]  # noqa: E731
    got = _run_lookup(fn, table, ids, LAYOUTS[layout].spec("data"))
    # reference: each worker's block of ids, looked up in the whole table
    blocks = [table[block] for block in np.split(ids, N)]
    np.testing.assert_array_equal(got, np.concatenate(blocks))


def _two_tables(seed: int, shapes: list, id_shapes: list):
    """Random tables of ``shapes`` (V, D), ids of ``id_shapes`` into each, and a gradient
    row per id: fresh inputs for a two-table exchange."""
    rng = np.random.default_rng(seed)
    tables = [rng.normal(size=s).astype(np.float32) for s in shapes]
    ids = [
        rng.integers(0, v, i).astype(np.int32) for (v, _), i in zip(shapes, id_shapes, strict=True)
    ]
    grads = [
        rng.normal(size=(*i, d)).astype(np.float32)
        for (_, d), i in zip(shapes, id_shapes, strict=True)
    ]
    return tables, ids, grads


def test_row_reads_of_two_tables_share_one_exchange_and_match_blocks():
    """Two row-wise tables of different widths read through one exchange
    (``row.fetch_many``): each worker gets its rows, each owner the gradient rows of its
    ids summed over the workers; the program has three all-to-alls, not six."""
    tables, ids, grads = _two_tables(5, [(16, 4), (24, 2)], [(N * 3,), (N * 2, 2)])
    mesh = runtime.data_mesh(N)

    def body(t0, t1, i0, i1, g0, g1):
        rows, back, _ = row.fetch_many([t0, t1], [i0, i1], [3, 4], "data")
        summed = []
        for (local, sums), t in zip(back([g0, g1]), (t0, t1), strict=True):  # at the owner
            summed.append(jnp.zeros(t.shape).at[local].add(sums, mode="drop"))
        return (*rows, *summed)

    row_spec, data = P("data", None), P("data")
    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(row_spec, row_spec) + (data,) * 4,
            out_specs=(data, data, row_spec, row_spec),
            check_vma=False,
        )
    )
    args = [runtime.put_global(t, mesh, row_spec) for t in tables]
    args += [runtime.put_global(x, mesh, data) for x in (*ids, *grads)]
    r0, r1, s0, s1 = (np.asarray(x) for x in fn(*args))
    np.testing.assert_array_equal(r0, tables[0][ids[0]])  # blocks: every worker's ids
    np.testing.assert_array_equal(r1, tables[1][ids[1]])
    for got, table, i, g in zip((s0, s1), tables, ids, grads, strict=True):
        want = np.zeros_like(table)
        np.add.at(want, i.reshape(-1), g.reshape(-1, table.shape[1]))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    kinds = [c.kind for c in hlo.collectives(fn, *args)]
    assert kinds == ["all-to-all"] * 3  # ids, rows, gradients: one each for both tables


def test_gradients_sent_alone_reach_their_owners_as_the_blocks_say():
    """``row.send_gradients`` (the pipelined step's chunks), one table: each owner gets, per id it
    owns, the sum of every worker's gradient rows at that id; a negative id sends
    nothing; with too few slots, the ids past a bucket's C are flagged missed and sent
    nowhere. Reference: per worker, its block of ids, bucketed in ascending order."""
    v, d, cap = 32, 3, 1
    rng = np.random.default_rng()
    ids = rng.integers(-1, v, (N * 6,)).astype(np.int32)  # -1: this position sends nothing
    grads = rng.normal(size=(N * 6, d)).astype(np.float32)
    mesh, data = runtime.data_mesh(N), P("data")

    def body(i, g):
        [((local, rows), missed)] = row.send_gradients([i], [g], [cap], "data", [v // N])
        return jnp.zeros((v // N, d)).at[local].add(rows, mode="drop"), missed

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(data, data), out_specs=(P("data", None), data))
    )
    got, missed = fn(runtime.put_global(ids, mesh, data), runtime.put_global(grads, mesh, data))
    want, want_missed = np.zeros((v, d), np.float32), np.zeros(ids.shape, bool)
    for w, (block, g) in enumerate(zip(np.split(ids, N), np.split(grads, N), strict=True)):
        for owner in range(N):  # the first C distinct ids it owns fit, in ascending order
            mine = np.unique(block[(block >= 0) & (block // (v // N) == owner)])
            for k, x in enumerate(mine):
                at = np.flatnonzero(block == x)
                if k < cap:
                    want[x] += g[at].sum(0)
                else:
                    want_missed[w * 6 + at] = True
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(missed), want_missed)
    assert want_missed.any() and not want_missed.all()  # both cases met


def test_replicated_reads_of_two_tables_share_one_all_gather_each_way():
    """Every worker's (id, gradient row) pairs of two replicated tables of different
    widths reach every worker, worker after worker, through one all-gather of ids and one
    of rows."""
    tables, ids, grads = _two_tables(6, [(10, 3), (7, 5)], [(N * 2,), (N, 3)])
    mesh = runtime.data_mesh(N)

    def body(t0, t1, i0, i1, g0, g1):
        reads = [Read(LOOKUP, 0, i0), Read(LOOKUP, 1, i1)]
        fetched = replicated.fetch({0: t0, 1: t1}, reads, {}, "data")
        (_, (a0, r0)), (_, (a1, r1)) = fetched.back([g0, g1])
        return (*fetched.rows, a0, r0, a1, r1)

    data = P("data")
    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P()) + (data,) * 4,
            out_specs=(data, data, P(), P(), P(), P()),
        )
    )
    args = [runtime.put_global(t, mesh, P()) for t in tables]
    args += [runtime.put_global(x, mesh, data) for x in (*ids, *grads)]
    rows0, rows1, a0, r0, a1, r1 = (np.asarray(x) for x in fn(*args))
    np.testing.assert_array_equal(rows0, tables[0][ids[0]])
    np.testing.assert_array_equal(rows1, tables[1][ids[1]])
    np.testing.assert_array_equal(a0, ids[0])  # every worker's ids, in worker order
    np.testing.assert_array_equal(a1, ids[1].reshape(-1))
    np.testing.assert_array_equal(r0, grads[0])
    np.testing.assert_array_equal(r1, grads[1].reshape(-1, 5))
    kinds = [c.kind for c in hlo.collectives(fn, *args)]
    assert kinds == ["all-gather"] * 2  # ids, rows: one each for both tables


@pytest.mark.parametrize("layout", ["column", "row"])
def test_shared_lookup_and_attend(layout):
    rng = np.random.default_rng(1)
    table = rng.normal(size=(32, 8)).astype(np.float32)
    shared = rng.integers(0, 32, size=(6,)).astype(np.int32)
    mesh = runtime.data_mesh(N)
    if layout == "column":
        lookup_shared = column.fetch_shared_rows
    else:
        lookup_shared = lambda t, ids, axis: row.fetch_shared_one(t, ids, axis)[0]  # noqa: E731
    h = rng.normal(size=(N * 2, 8)).astype(np.float32)

    def body(t, x):
        rows = lookup_shared(t, jnp.asarray(shared), "data")
        return rows[None], LAYOUTS[layout].attend(t, x, "data")

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(LAYOUTS[layout].spec("data"), P("data")),
        out_specs=(P("data"), P("data")),
        check_vma=False,
    )
    rows, logits = jax.jit(fn)(
        runtime.put_global(table, mesh, LAYOUTS[layout].spec("data")),
        runtime.put_global(h, mesh, P("data")),
    )
    for w in range(N):
        np.testing.assert_array_equal(np.asarray(rows)[w], table[shared])
    np.testing.assert_allclose(np.asarray(logits), h @ table.T, rtol=1e-5, atol=1e-5)


def test_shard_and_gather_table_roundtrip():
    table = np.random.default_rng(2).normal(size=(16, 8)).astype(np.float32)
    mesh = runtime.data_mesh(N)
    for layout, shard_shape in (("column", (16, 1)), ("row", (2, 8))):
        sharded = runtime.put_global(table, mesh, LAYOUTS[layout].spec("data"))
        assert sharded.addressable_shards[0].data.shape == shard_shape
        np.testing.assert_array_equal(runtime.to_host(sharded), table)


# ------------------------------------------------------------- compiled programs

V, D, T, NEG = 4096, 32, 8, 16


def _lm(batch, **kw):
    return get_workload(
        "lstm_lm", vocab=V, dim=D, hidden=32, seq_len=T, batch=batch, sampled_softmax=NEG, **kw
    )


def _make(strategy, w, devices=N, **kw):
    return sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        runtime.data_mesh(devices),
        w.init(jax.random.key(0)),
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        **kw,
    )


def _program(strategy, devices, batch):
    w = _lm(batch)
    ts = _make(strategy, w, devices)
    return ts, hlo.collectives(ts.step, ts.state, ts.place_batch(w.batch_at(0)))


def _dense_mean_bytes(ts, workers):
    """Bytes of the dense layers' mean: one flat buffer, an all-to-all and an all-gather
    of it (``aggregators.flat_allreduce``), padded to a multiple of P."""
    params = ts.host_params(ts.state)
    size = sum(
        x.size for k in params if k not in ("embed", "softmax") for x in jax.tree.leaves(params[k])
    )
    padded = -(-size // workers) * workers
    return 2 * (workers - 1) / workers * padded * 4


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy, all_reduces",
    [("topk_allgather", 0), ("embrace+topk_allgather", 0), ("topk_a2a", 1), ("gtopk", 1)],
)
def test_topk_steps_carry_their_scalars(strategy, all_reduces):
    """The loss and the finite flags ride ``topk_allgather``'s indices: no all-reduce of
    their own; ``topk_a2a`` (whose dense result would need a copy) and ``gtopk``
    (pairwise rounds) keep one small all-reduce of the scalars."""
    ts, colls = _program(strategy, N, batch=4 * N)
    assert len([c for c in colls if c.kind == "all-reduce"]) == all_reduces


def test_embrace_program_bytes():
    """One all-gather of each worker's distinct ids, one all-to-all of its distinct rows
    each way (every table, the shared negatives too), the dense layers' mean."""
    ts, colls = _program("embrace", N, batch=4 * N)
    w = _lm(4 * N)
    n = 4 * T  # tokens per worker and lookup
    assert not [c for c in colls if c.kind == "all-reduce" and c.result_bytes >= V * D * 4]
    caps = ts.place_batch(w.batch_at(0)).capacity  # distinct rows per table, with headroom
    slots = [min(caps[0], n), min(caps[1], n + NEG)]  # never more than the reads per worker
    ids = sum(c.bytes_sent for c in colls if c.kind == "all-gather" and c.shapes[0][0] == "s32")
    assert ids == (N - 1) * sum(slots) * 4  # each table's distinct ids, once
    rows = 2 * (N - 1) / N * N * sum(slots) * (D // N) * 4
    a2a_and_gather = hlo.total_bytes(colls, ["all-to-all", "all-gather"]) - ids
    # the loss, the finite flag and a capacity flag per table ride the mean's all-gather
    scalars = (N - 1) * (2 + 2) * 4
    assert a2a_and_gather == pytest.approx(rows + _dense_mean_bytes(ts, N) + scalars, rel=1e-3)
    assert not [c for c in colls if c.kind == "all-reduce"]  # no collective of their own
    per_position = 2 * (2 * (N - 1) / N * n * D * 4) + 2 * (N - 1) / N * NEG * D * 4
    assert rows <= per_position  # each distinct row once: never more than every position
    # the table never travels whole, and each worker holds V x D/P of it
    assert ts.state.params["embed"]["embedding"].addressable_shards[0].data.shape == (V, D // N)


def test_bytes_scale_with_workers():
    """Per-worker batch fixed: sparse_allgather grows with P, embrace stays bounded."""
    per_worker = 4

    def table_bytes(strategy, p):
        ts, colls = _program(strategy, p, batch=per_worker * p)
        sent = hlo.total_bytes(colls, ["all-to-all", "all-gather", "reduce-scatter"])
        return sent - _dense_mean_bytes(ts, p)

    sparse = [table_bytes("sparse_allgather", p) for p in (2, 8)]
    embrace = [table_bytes("embrace", p) for p in (2, 8)]
    assert sparse[1] > 5 * sparse[0]
    assert embrace[1] < 2.5 * embrace[0]
    n = per_worker * T
    bound = 2 * (2 * n * D * 4 + 7 * n * 4) + 2 * NEG * D * 4  # lookups + ids + negatives
    assert embrace[1] <= bound


def test_embrace_memory_is_a_shard():
    def arg_bytes(strategy):
        w = _lm(2 * N)
        ts = _make(strategy, w)
        lowered = ts.step.lower(ts.state, ts.place_batch(w.batch_at(0)))
        return lowered.compile().memory_analysis().argument_size_in_bytes

    saved = arg_bytes("dense") - arg_bytes("embrace")
    assert saved == pytest.approx(2 * V * D * 4 * (1 - 1 / N), rel=0.02)  # two tables


# ------------------------------------------------------------------- bad input


@pytest.mark.matrix
@pytest.mark.parametrize("strategy, vocab, dim", [("embrace", 64, 12), ("embrace_rowwise", 60, 16)])
def test_indivisible_tables_are_padded_and_equal_single_device(strategy, vocab, dim):
    """D = 12 column-wise and V = 60 row-wise over 8 workers: stored padded, trained
    exactly, given back V x D; the pipelined step refuses to pad."""
    w = get_workload("lstm_lm", vocab=vocab, dim=dim, hidden=8, seq_len=4, batch=8)
    params = w.init(jax.random.key(0))
    ref_losses, ref_params = reference_run(w, optax.sgd(0.5), params, 2)
    losses, got, _ = strategy_run(w, optax.sgd(0.5), params, 2, strategy)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-5)
    if strategy == "embrace":
        with pytest.raises(ValueError, match=r"D \(columns\) = 12, not divisible by the 8"):
            _make("embrace_2d", w)


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["dense", "dense_pmap", "embrace", "embrace_rowwise"])
def test_token_id_out_of_range(strategy):
    w = get_workload("lstm_lm", vocab=64, dim=16, hidden=8, seq_len=4, batch=8)
    ts = _make(strategy, w)
    batch = w.batch_at(0)
    batch["tokens"][3, 2] = 64
    with pytest.raises(ValueError, match=r"has ids in \[0, 64\], outside \[0, 64\) of table embed"):
        ts.place_batch(batch)
    batch["tokens"][3, 2] = -1
    with pytest.raises(ValueError, match=r"outside \[0, 64\) of table"):
        ts.place_batch(batch)


@pytest.mark.parametrize("id_keys", [None, {"tokens": ("embed", "embedding")}])
def test_float_ids_are_named(id_keys):
    """Token ids given as floats: a ValueError naming the key, whether the batch's keys
    are found by tracing the loss or named by ``id_keys``."""
    w = get_workload("lstm_lm", vocab=64, dim=16, hidden=8, seq_len=4, batch=8)
    ts = _make("embrace", w, id_keys=id_keys)
    batch = w.batch_at(0)
    batch["tokens"] = batch["tokens"].astype(np.float32)
    with pytest.raises(ValueError, match=r"\['tokens'\].*integer"):
        ts.place_batch(batch)


def test_ids_bucketized_from_a_float_feature_are_placed():
    """A float key the ids are computed from (``digitize``) feeds the table but is not
    itself ids: placed without complaint; named as ids by ``id_keys``, refused."""
    bins = jnp.linspace(0.0, 1.0, 15)  # 16 buckets: ids in [0, 16)

    def loss(params, batch, ops):
        rows = ops.lookup(params["t"], jnp.digitize(batch["age"], bins))  # [B/P, 4]
        return jnp.mean((rows.sum(-1) - batch["y"]) ** 2)

    params = {"t": jnp.ones((16, 4))}
    rng = np.random.default_rng(5)
    batch = {"age": rng.random(N).astype(np.float32), "y": rng.random(N).astype(np.float32)}
    for id_keys, ok in ((None, True), (["age"], False)):
        ts = sc.make_train_step(
            loss,
            optax.sgd(0.1),
            runtime.data_mesh(N),
            params,
            "embrace",
            embedding_paths=[("t",)],
            id_keys=id_keys,
        )
        if ok:
            _, value = ts.step(ts.state, ts.place_batch(batch))
            assert np.isfinite(sc.loss_value(value))
        else:
            with pytest.raises(ValueError, match=r"batch\['age'\] holds float32"):
                ts.place_batch(batch)


def test_capacity_too_small_and_auto_growth():
    w = get_workload("lstm_lm", vocab=512, dim=16, hidden=8, seq_len=8, batch=16)
    with pytest.raises(ValueError, match="capacity=1 is too small"):
        _make("embrace_rowwise", w, capacity=1).place_batch(w.batch_at(0))
    # auto, per table: the input table is read by tokens[:, :-1] (the output table only by
    # the full softmax, no slots); worker 0 asks owner 0 (rows 0-63) for the 16 distinct
    # ids 0-7 and 9-16 -> 16 + ceil(3 sqrt(16)) = 28 slots (row.CAPACITY's margin)
    calm = {"tokens": np.zeros((16, 9), np.int32)}
    wild = {"tokens": np.arange(16 * 9, dtype=np.int32).reshape(16, 9)}
    ts = _make("embrace_rowwise", w)
    assert ts.place_batch(calm).capacity == (8, 0)  # 1 id: at least 8
    assert ts.place_batch(wild).capacity == (28, 0)
    assert ts.place_batch(calm).capacity == (28, 0)  # never shrinks: no recompiles


def test_embedding_strategy_needs_tables():
    w = get_workload("lstm_lm", vocab=64, dim=16, hidden=8, seq_len=4, batch=8)
    with pytest.raises(ValueError, match="needs embedding tables"):
        sc.make_train_step(
            w.loss, optax.sgd(0.1), runtime.data_mesh(N), w.init(jax.random.key(0)), "embrace"
        )
    with pytest.raises(ValueError, match="not in the parameters"):
        _make("embrace", w._replace(embedding_paths=(("nope",),)))
    with pytest.raises(ValueError, match=r"embedding paths \[\('nope',\)\] are not in"):
        _make("embrace", w._replace(embedding_paths=["nope"]))  # a string: a one-key path


def test_a_string_names_a_table_path_as_its_name():
    params = {"embed": np.zeros((4, 2)), "inner": {"embed": np.zeros((4, 2))}}
    assert table_mask(params, ["embed"]) == {"embed": True, "inner": {"embed": False}}
    assert table_mask(params, "embed") == {"embed": True, "inner": {"embed": False}}
    assert table_mask(params, [("inner", "embed")]) == {"embed": False, "inner": {"embed": True}}
    assert table_mask(params, ["inner/embed"]) == {"embed": False, "inner": {"embed": True}}
    listed = {"layers": [np.zeros((4, 2)), np.zeros((4, 2))]}  # a list index in the path
    assert table_mask(listed, ["layers/1"]) == {"layers": [False, True]}
    assert table_mask(listed, [("layers", 1)]) == {"layers": [False, True]}


def test_rowwise_capacity_growth_stays_exact():
    """Batches of very different diversity through one auto-capacity step: exact."""
    w = get_workload("lstm_lm", vocab=512, dim=16, hidden=8, seq_len=8, batch=16)
    batches = [
        {"tokens": np.zeros((16, 9), np.int32)},
        {"tokens": np.arange(16 * 9, dtype=np.int32).reshape(16, 9)},
    ]
    w = w._replace(batch_at=lambda step: batches[step])
    params = w.init(jax.random.key(0))
    ref, _, _ = strategy_run(w, optax.sgd(0.5), params, 2, "dense")
    got, _, _ = strategy_run(w, optax.sgd(0.5), params, 2, "embrace_rowwise")
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def _gated_loss(params, batch, ops):
    """Ids chosen by a parameter: on the host's zeros the gate is shut and the ids
    coarse (two distinct values); at its real value the ids are the tokens."""
    tokens = batch["tokens"]
    ids = jnp.where(params["gate"][0] > 0, tokens, tokens // 32 * 32)
    rows = ops.lookup(params["embed"], ids)  # [B/P, T, D]
    return jnp.mean((rows @ params["w"] - batch["y"]) ** 2)


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise", "embrace_2d"])
def test_ids_computed_from_the_parameters_get_every_row_they_need(strategy):
    """The host plans row capacities with the model on zeros; ids computed from the
    parameters differ there. Such tables get the bound any batch can need (with a
    warning; embrace_2d's first chunk spills on the devices and is fetched again), and
    training equals single-device training."""
    rng = np.random.default_rng(3)
    params = {
        "embed": rng.normal(size=(64, 8)).astype(np.float32),
        "gate": np.ones(1, np.float32),
        "w": rng.normal(size=8).astype(np.float32),
    }
    batches = [
        {
            "tokens": rng.integers(0, 64, size=(16, 4)).astype(np.int32),
            "y": rng.normal(size=(16, 4)).astype(np.float32),
        }
        for _ in range(3)
    ]
    opt = optax.sgd(0.1)
    ref, opt_state = jax.tree.map(jnp.asarray, params), opt.init(params)
    for b in batches:
        grads = jax.grad(_gated_loss)(ref, b, PLAIN)
        updates, opt_state = opt.update(grads, opt_state, ref)
        ref = optax.apply_updates(ref, updates)
    ts = sc.make_train_step(
        _gated_loss,
        opt,
        runtime.data_mesh(8),
        params,
        strategy,
        embedding_paths=[("embed",)],
    )
    state = ts.state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(len(batches)):
            state, _ = ts.step(state, sc.place_for_step(ts, batches.__getitem__, s, len(batches)))
    said = any("computed from the parameters" in str(w.message) for w in caught)
    assert said == (strategy != "embrace_2d")
    assert_trees_close(ts.host_params(state), ref, rtol=1e-5, atol=1e-6)


def _column_fetch(shards, ids, shared, grads, capacity):
    """``column.fetch`` of table 0 (looked up: ``ids`` int[N, n], and the ``shared`` ids)
    and table 1 (read only through ``shared``), on N workers: every read's rows, the
    tables' gradients scattered into dense shards from the owners' pairs, and the
    ``missed`` flags."""
    m = ids.shape[1]

    def body(t0, t1, my_ids, g):
        # t*: float[V, D/P]; my_ids: int[1, n]; g: float[1, n + 2s, D]
        reads = [Read(LOOKUP, 0, my_ids[0]), Read(SHARED, 0, shared), Read(SHARED, 1, shared)]
        got = column.fetch({0: t0, 1: t1}, reads, capacity, "data")
        s = shared.size
        pairs = dict(got.back([g[0, :m], g[0, m : m + s], g[0, m + s :]]))
        dense = [
            jnp.zeros(t.shape).at[pairs[i][0]].add(pairs[i][1], mode="drop")
            for i, t in ((0, t0), (1, t1))
        ]
        flags = jnp.stack([got.missed[0], got.missed[1]])[None]
        return *(r[None] for r in got.rows), *dense, flags

    col, per = P(None, "data"), P("data")
    run = jax.shard_map(
        body,
        mesh=runtime.data_mesh(N),
        in_specs=(col, col, per, per),
        out_specs=(per, per, per, col, col, per),
        check_vma=False,
    )
    return run(*shards, ids, grads)


@pytest.mark.matrix
@pytest.mark.parametrize("capacity", ["enough", "short"])
def test_column_fetch_against_numpy_with_shared_only_tables_and_short_capacity(capacity):
    """Each worker's own distinct ids: rows equal ``table[ids]`` and the owners' pairs sum
    every worker's gradients (numpy), for a looked-up table and one read only through
    shared ids (whose ids never travel); a capacity below a worker's distinct ids gives
    that worker NaN rows for the ids past it, drops their gradients and raises its flag."""
    rng = np.random.default_rng()
    vocab, dim, n, s = 50, 16, 12, 5
    tables = [rng.normal(size=(vocab, dim)).astype(np.float32) for _ in range(2)]
    ids = rng.integers(0, vocab, (N, n)).astype(np.int32)
    shared = jnp.asarray(rng.choice(vocab, s, replace=False).astype(np.int32))
    grads = rng.normal(size=(N, n + 2 * s, dim)).astype(np.float32)
    distinct = [np.unique(np.concatenate([w, np.asarray(shared)])) for w in ids]
    cap0 = max(d.size for d in distinct) - (0 if capacity == "enough" else 2)
    rows0, rows_sh0, rows_sh1, dense0, dense1, flags = _column_fetch(
        tables, ids, shared, grads, {0: cap0, 1: s}
    )
    want0, want1 = np.zeros_like(tables[0]), np.zeros_like(tables[1])
    np.add.at(want1, np.tile(np.asarray(shared), N), grads[:, n + s :].reshape(-1, dim))
    for w in range(N):
        kept = distinct[w][:cap0]  # the sorted distinct ids the capacity has slots for
        reads = np.concatenate([ids[w], np.asarray(shared)])
        ok = np.isin(reads, kept)
        got = np.concatenate([np.asarray(rows0[w]), np.asarray(rows_sh0[w])])
        np.testing.assert_allclose(got[ok], tables[0][reads[ok]], rtol=1e-6)
        assert np.all(np.isnan(got[~ok]))
        assert bool(flags[w, 0]) == (not ok.all()) and not flags[w, 1]
        np.add.at(want0, reads[ok], grads[w, : n + s][ok])
        np.testing.assert_allclose(rows_sh1[w], tables[1][np.asarray(shared)], rtol=1e-6)
    assert (capacity == "short") == bool(np.asarray(flags)[:, 0].any())
    np.testing.assert_allclose(dense0, want0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dense1, want1, rtol=1e-5, atol=1e-5)
