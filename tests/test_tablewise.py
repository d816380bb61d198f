"""The table-wise layout: owners and packs against a list-of-blocks reference, its
exchange against numpy on random ids, its capacity plan against a count, a full softmax
refused, and a run that resumes from its checkpoints (exact against single-device
training: ``test_many_tables``, ``test_dlrm``)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, reference_run, strategy_run
from jax.sharding import PartitionSpec as P

import sparsecomm_jax as sc
from experiments.train import train_and_evaluate
from experiments.train.config import RunConfig
from models import get_workload
from sparsecomm_jax import checkpoint, runtime
from sparsecomm_jax.embedding import access, tablewise
from sparsecomm_jax.embedding.access import LOOKUP, Read
from sparsecomm_jax.embedding.tables import Table

N = 8


def random_tables(rng, count: int) -> tuple:
    dims = rng.choice([4, 8], count)
    return tuple(
        Table(i, f"t{i}", int(rng.integers(1, 40)), int(d), tablewise.TABLE)
        for i, d in enumerate(dims)
    )


@pytest.mark.parametrize("seed", range(3))
def test_each_table_lies_whole_in_its_owners_block(seed):
    """Packed, each table is rows [owner R + offset, + V) of its pack, the blocks of one
    owner do not overlap, nothing else is stored, and unpacking gives the tables back."""
    rng = np.random.default_rng(seed)
    tables = tablewise.bind(random_tables(rng, 7), N)
    layout = tables[0].layout
    leaves = {t.index: rng.normal(size=(t.vocab, t.dim)).astype(np.float32) for t in tables}
    stored = layout.storage.pack(leaves, N)
    packing = tablewise.assign(tables, N)
    for t in tables:
        slot = packing.slots[t.index]
        rows = packing.rows[slot.pack]
        assert layout.storage.shape(t, N) == np.shape(stored[t.index])
        block = stored[slot.pack].reshape(N, rows, t.dim)[slot.owner]  # the owner's block
        np.testing.assert_array_equal(block[slot.offset : slot.offset + t.vocab], leaves[t.index])
    for pack, rows in packing.rows.items():  # the blocks: owned rows once, the rest zero
        used = np.zeros(N * rows, int)
        for i in packing.members(pack):
            start = packing.packed_ids(i, 0)
            used[start : start + leaves[i].shape[0]] += 1
        assert used.max() == 1 and not np.any(stored[pack][used == 0])
        held = used.reshape(N, rows).sum(1)
        sizes = sorted((leaves[i].shape[0] for i in packing.members(pack)), reverse=True)
        assert held.max() <= sum(sizes) / N + sizes[0]  # the greedy's bound
        owners = {packing.slots[i].owner for i in packing.members(pack)}
        assert len(owners) == min(len(sizes), N)  # no worker takes two while one has none
    back = layout.storage.unpack(stored, {t.index: t.vocab for t in tables})
    for t in tables:
        np.testing.assert_array_equal(back[t.index], leaves[t.index])


def test_the_exchange_brings_each_read_its_rows_and_each_owner_its_gradients():
    """Per worker its own ids of two tables; rows equal numpy's ``table[ids]``, and
    the owner's pairs scatter-add to the sum over workers of each read's gradient."""
    rng = np.random.default_rng(7)
    tables = tablewise.bind(
        (Table(0, "a", 30, 4, tablewise.TABLE), Table(1, "b", 11, 4, tablewise.TABLE)), N
    )
    layout = tables[0].layout
    leaves = {t.index: rng.normal(size=(t.vocab, t.dim)).astype(np.float32) for t in tables}
    stored = layout.storage.pack(leaves, N)
    ids = {t.index: rng.integers(0, t.vocab, (N, 5)).astype(np.int32) for t in tables}
    grads = {t.index: rng.normal(size=(N, 5, t.dim)).astype(np.float32) for t in tables}
    mesh = runtime.data_mesh(N)

    def body(pack, empty, ids_a, ids_b, g_a, g_b):
        # pack: float[R, 4] (this worker's block); ids_*: int[1, 5]; g_*: float[1, 5, 4]
        reads = [Read(LOOKUP, 0, ids_a[0]), Read(LOOKUP, 1, ids_b[0])]
        need = {0: 8, 1: 8}
        got = layout.fetch({0: pack, 1: empty}, reads, need, "data")
        ((i, (ids, rows)),) = got.back([g_a[0], g_b[0]])  # one pair: the pack's
        assert i == 0
        dense = jnp.zeros(pack.shape).at[ids].add(rows, mode="drop")
        return got.rows[0][None], got.rows[1][None], dense

    spec = P("data")
    run = jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec, spec, spec), check_vma=False
    )
    rows_a, rows_b, dense = run(stored[0], stored[1], ids[0], ids[1], grads[0], grads[1])
    np.testing.assert_allclose(rows_a, leaves[0][ids[0]], rtol=1e-6)
    np.testing.assert_allclose(rows_b, leaves[1][ids[1]], rtol=1e-6)
    want = {t.index: np.zeros((t.vocab, t.dim), np.float32) for t in tables}
    for i in want:
        np.add.at(want[i], ids[i].reshape(-1), grads[i].reshape(-1, 4))
    got = layout.storage.unpack({0: np.asarray(dense), 1: None}, {0: 30, 1: 11})
    for i in want:
        np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-6)


def test_the_capacity_plan_counts_distinct_ids_per_owner():
    """One bucket plan per pack: the most distinct ids one worker asks of one owner, the
    lookups of both tables together."""
    rng = np.random.default_rng(3)
    tables = tablewise.bind(
        (Table(0, "a", 50, 4, tablewise.TABLE), Table(1, "b", 20, 4, tablewise.TABLE)), N
    )
    packing = tablewise.assign(tables, N)
    look = {t.index: rng.integers(0, t.vocab, (N, 9)) for t in tables}
    reads = {i: (x, np.zeros(0, int)) for i, x in look.items()}
    need = tables[0].layout.capacity.need([reads], tables, N)
    count = 0  # the most distinct ids one worker asks of one owner, both tables together
    for w in range(N):
        owners = {}
        for t in tables:
            slot = packing.slots[t.index]
            owners.setdefault(slot.owner, set()).update((t.index, v) for v in look[t.index][w])
        count = max(count, *(len(s) for s in owners.values()))
    assert need == {0: count, 1: count}  # the pack's slots, for each of its tables
    only_a = {0: reads[0]}  # a step that reads one table: the other's slots grow too
    assert tables[0].layout.capacity.need([only_a], tables, N).keys() == {0, 1}


def test_a_full_softmax_of_a_table_wise_table_is_refused():
    params = {"t": jnp.ones((16, 4))}

    def loss(p, batch, emb):
        return jnp.mean(emb.attend(p["t"], batch["h"]))

    ts = sc.make_train_step(
        loss,
        optax.sgd(0.1),
        runtime.data_mesh(N),
        params,
        "embrace",
        embedding_paths=[("t",)],
        table_layouts={"t": "table"},
    )
    with pytest.raises(ValueError, match="^table t: a table-wise table cannot serve a full"):
        ts.step(ts.state, ts.place_batch({"h": np.ones((N, 4), np.float32)}))


@pytest.mark.cli
def test_a_table_wise_run_resumes_from_its_checkpoints(tmp_path):
    """DLRM, every table table-wise, Adagrad: 2 steps saved, resumed to 3, equal to 3."""
    paths = ["/".join(("params", f"sparse_{f}", "embedding")) for f in range(4)]
    base = dict(
        model="dlrm",
        tables="64,48,24,16",
        dim=8,
        batch=32,
        strategy="embrace",
        optimizer="adagrad",
        devices=4,
        plan=json.dumps(dict.fromkeys(paths, "table")),
    )
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    train_and_evaluate(RunConfig(steps=2, **base, **ck), progress=False)
    full = train_and_evaluate(RunConfig(steps=3, **base), progress=False)
    resumed = train_and_evaluate(RunConfig(steps=3, resume=True, **base, **ck), progress=False)
    assert resumed["start_step"] == 2
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)


@pytest.mark.cli
def test_a_resume_may_move_tables_into_and_out_of_a_pack(tmp_path):
    """The third table has V = P rows: as a pack's member it is stored [P, D] zeros, as
    a table of its own [V, D] = [P, D], so only the recorded form of the state tells
    the two apart. A resume that moves it out of the pack (and the packed tables to
    the strategy's layout) continues exactly."""
    paths = ["/".join(("params", f"sparse_{f}", "embedding")) for f in range(3)]
    base = dict(model="dlrm", tables="64,48,4", dim=8, batch=32, strategy="embrace", devices=4)

    def plan(*layouts):
        return json.dumps(dict(zip(paths, layouts, strict=True)))

    packed = plan("table", "table", "table")
    full = train_and_evaluate(RunConfig(steps=3, plan=packed, **base), progress=False)
    for other in (plan("table", "table", "row"), ""):
        ck = dict(checkpoint_dir=str(tmp_path / str(len(other))), checkpoint_every=1)
        train_and_evaluate(RunConfig(steps=2, plan=packed, **base, **ck), progress=False)
        resumed = train_and_evaluate(
            RunConfig(steps=3, resume=True, plan=other, **base, **ck), progress=False
        )
        assert resumed["start_step"] == 2
        assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)


def test_a_checkpoint_restores_into_a_step_that_packs_its_tables_otherwise(tmp_path):
    """Table b has V = P rows: packed with a it is stored [P, 4] zeros, laid out by
    rows [V, 4] = [P, 4]; the shapes agree, the recorded form does not, and the
    restore converts. A checkpoint that records only what is stored together (written
    before forms were recorded) is still refused."""
    rng = np.random.default_rng()
    params = {k: rng.normal(size=(v, 4)).astype(np.float32) for k, v in (("a", 20), ("b", N))}

    def loss(p, batch, emb):
        return jnp.sum(emb.lookup(p["a"], batch["a"]) * emb.lookup(p["b"], batch["b"]))

    def step_of(layouts):
        paths = [("a",), ("b",)]
        mesh = runtime.data_mesh(N)
        return sc.make_train_step(
            loss,
            optax.sgd(0.1),
            mesh,
            params,
            "embrace",
            embedding_paths=paths,
            table_layouts=layouts,
        )

    packed = step_of({"a": "table", "b": "table"})
    assert packed.stored_together == (("table", (("a", 20, 4), ("b", N, 4)), N),)
    apart = step_of({"a": "table", "b": "row"})
    assert apart.state.params["b"].shape == packed.state.params["b"].shape
    with checkpoint.Checkpointer(tmp_path / "new") as ckpt:
        ckpt.save_state(1, packed, packed.state, force=True)
        state, _ = ckpt.restore_state(apart)
    assert_trees_close(apart.host_params(state), params)
    identity = {"stored_together": json.loads(json.dumps(packed.stored_together))}
    with checkpoint.Checkpointer(tmp_path / "old") as ckpt:
        ckpt.save(1, checkpoint.portable(packed, packed.state), True, identity)
        state, _ = ckpt.restore_state(step_of({"a": "table", "b": "table"}))
        assert_trees_close(packed.host_params(state), params)
        packed_words = r"table \[a \(20 x 4\), b \(8 x 4\)\] on 8 workers"
        with pytest.raises(checkpoint.MismatchError, match=packed_words):
            ckpt.restore_state(apart)


SIZES = {"a": 20, "b": 12}


def small_params() -> dict:
    rng = np.random.default_rng(5)
    params = {k: rng.normal(size=(v, 4)).astype(np.float32) for k, v in SIZES.items()}
    params["w"] = rng.normal(size=(4,)).astype(np.float32)
    return params


def small_loss(params, batch, emb):
    a = emb.lookup(params["a"], batch["a"] + batch["shift"])  # ids computed by the model
    b = emb.lookup(params["b"], batch["b"])
    return jnp.mean(jnp.sum(a * b * params["w"], -1) ** 2)


def table_wise_step(optimizer, **kw):
    return sc.make_train_step(
        small_loss,
        optimizer,
        runtime.data_mesh(N),
        small_params(),
        "embrace",
        embedding_paths=[("a",), ("b",)],
        id_keys=("a", "b"),
        table_layouts={"a": "table", "b": "table"},
        **kw,
    )


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.lamb(0.1),  # a trust ratio per parameter
        optax.partition(
            {"slow": optax.sgd(0.01), "fast": optax.sgd(0.5)},
            {"a": "slow", "b": "fast", "w": "fast"},
        ),
    ],
    ids=["lamb", "partition by table"],
)
def test_an_optimizer_that_treats_tables_apart_is_refused(optimizer):
    with pytest.raises(ValueError, match="does not move table-wise tables stored together"):
        table_wise_step(optimizer)


def test_an_optimizer_that_labels_the_tables_alike_is_accepted():
    labels = {"a": "tables", "b": "tables", "w": "dense"}
    table_wise_step(
        optax.partition({"tables": optax.adagrad(0.1), "dense": optax.adam(0.1)}, labels)
    )


def test_an_id_the_model_computes_outside_its_table_reads_no_other_tables_row():
    """Table a (20 rows) and b share a pack; an id of a shifted past 20 would be a row of
    b there: it finds no row, the step's loss is +inf and the step is skipped."""
    ts = table_wise_step(optax.sgd(0.1))
    rng = np.random.default_rng(0)
    batch = {
        "a": rng.integers(0, 20, N * 2).astype(np.int32),
        "b": rng.integers(0, 12, N * 2).astype(np.int32),
        "shift": np.zeros(N * 2, np.int32),
    }
    state, loss = ts.step(ts.state, ts.place_batch(batch))
    assert np.isfinite(sc.loss_value(loss))
    before = ts.host_params(state)
    batch["shift"][3] = 20  # a's id 20 + x: beyond a, inside the pack
    state, loss = ts.step(state, ts.place_batch(batch))
    assert sc.loss_value(loss) == np.inf
    after = ts.host_params(state)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


@pytest.mark.matrix
@pytest.mark.parametrize("tied", [False, True], ids=["two tables", "tied"])
def test_an_lm_with_shared_negatives_equals_single_device(tied):
    """The LSTM LM's input and output tables table-wise (one pack of two tables, or one
    tied table read by inputs, targets and shared negatives: ``lookup_shared``)."""
    w = get_workload(
        "lstm_lm",
        vocab=96,
        dim=8,
        hidden=8,
        seq_len=4,
        batch=16,
        sampled_softmax=8,
        tie_embeddings=tied,
    )
    params = w.init(jax.random.key(2))
    opt = optax.adagrad(0.1)
    ref_losses, ref_params = reference_run(w, opt, params, 3)
    layouts = dict.fromkeys(w.embedding_paths, "table")
    losses, got, ts = strategy_run(w, opt, params, 3, "embrace", table_layouts=layouts)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-5, atol=1e-6)


def narrow_loss(params, batch, emb):
    """Table a read by shared ids alone (every worker the same negatives), b by int8 ids
    whose packed rows (b's block starts at row 100) do not fit in int8."""
    neg = emb.lookup_shared(params["a"], batch["neg"])  # [K, 4]
    b = emb.lookup(params["b"], batch["b"])  # [B/P, 4]
    return jnp.mean((b @ neg.T) ** 2) + jnp.mean(b * params["w"])


def test_shared_reads_alone_and_narrow_ids_equal_single_device():
    rng = np.random.default_rng(9)
    params = {
        "a": rng.normal(size=(100, 4)).astype(np.float32),
        "b": rng.normal(size=(90, 4)).astype(np.float32),
        "w": rng.normal(size=(4,)).astype(np.float32),
    }
    batches = [
        {
            "neg": rng.integers(0, 100, 6).astype(np.int32),
            "b": rng.integers(0, 90, N * 2).astype(np.int8),
        }
        for _ in range(3)
    ]
    opt = optax.sgd(0.3)
    ref, state = jax.tree.map(jnp.asarray, params), opt.init(params)
    for batch in batches:
        grads = jax.grad(narrow_loss)(ref, batch, access.PLAIN)
        updates, state = opt.update(grads, state, ref)
        ref = optax.apply_updates(ref, updates)
    ts = sc.make_train_step(
        narrow_loss,
        opt,
        runtime.data_mesh(N),
        params,
        "embrace",
        replicated_keys=("neg",),
        embedding_paths=[("a",), ("b",)],
        table_layouts={"a": "table", "b": "table"},
    )
    state = ts.state
    for batch in batches:
        state, loss = ts.step(state, ts.place_batch(batch))
        assert np.isfinite(sc.loss_value(loss))
    assert_trees_close(ts.host_params(state), ref, rtol=1e-5, atol=1e-6)
