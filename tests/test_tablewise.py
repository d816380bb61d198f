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
from jax.sharding import PartitionSpec as P

import sparsecomm_jax as sc
from experiments.config import RunConfig
from experiments.train import train_and_evaluate
from sparsecomm_jax import runtime
from sparsecomm_jax.embedding import tablewise
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
        (i0, (ids0, rows0)), (i1, (ids1, rows1)) = got.back([g_a[0], g_b[0]])
        assert i0 == i1 == 0  # both pairs go to the pack
        dense = jnp.zeros(pack.shape).at[ids0].add(rows0, mode="drop")
        dense = dense.at[ids1].add(rows1, mode="drop")
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
    assert need == {0: count}


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
    with pytest.raises(ValueError, match="table-wise table cannot serve a full softmax"):
        ts.step(ts.state, ts.place_batch({"h": np.ones((N, 4), np.float32)}))


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
