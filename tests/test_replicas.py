"""2-D sparse parallelism (``replicas=R``): tables sharded within groups of G devices,
replicated across R groups, their row gradients summed across the groups each step.

The collective against a numpy list-of-blocks reference; whole steps against the
single device and the 1-D run on 8 devices as 2 x 4 and 4 x 2, with SGD, Adam and lazy
Adam; the replicas held equal; the compiled exchanges' groups; checkpoints between 1-D
and 2-D; the command line.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import THREE as SIZES
from helpers import THREE_BATCH as BATCH
from helpers import assert_trees_close, run_placed, workload_step
from helpers import run_three_tables as run
from helpers import three_tables_batch as batch_of
from helpers import three_tables_loss as loss
from helpers import three_tables_params as fresh_params
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import sparsecomm_jax as sc
from experiments.train import main
from models import get_workload
from sparsecomm_jax import checkpoint, runtime
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.embedding import replica_groups
from sparsecomm_jax.embedding.row_optimizers import lazy_adam

MIXED = {"a": "table", "b": "row", "c": "column"}


# ------------------------------------------------------------------ the collective


@pytest.mark.parametrize("how", [replica_groups.ROWS, replica_groups.SHARD])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_the_sum_across_groups_adds_every_groups_pairs(how, shape):
    """Per device (r, g) random pairs ``(ids, rows)`` of its shard, some ids padding
    (>= S), some repeated; after ``sum_tables`` every replica of position g holds, as a
    dense shard, the sum over r of the scatter-added pairs (numpy), and the same ids."""
    rng = np.random.default_rng()
    rows_, shard, m, w = shape[0], 11, 7, 3
    ids = rng.integers(0, shard + 3, size=(*shape, m)).astype(np.int32)  # some padding
    vals = rng.normal(size=(*shape, m, w)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("replica", "data"))

    def body(i, v):  # i: int[1, 1, m], v: float[1, 1, m, w] (this device's pairs)
        pairs = {0: [(i[0, 0], v[0, 0])]}
        [(got_ids, got_rows)] = replica_groups.sum_tables(pairs, {0: shard}, "replica", how)[0]
        dense = jnp.zeros((shard, w)).at[got_ids].add(got_rows, mode="drop")  # float[S, w]
        touched = jnp.zeros((shard,), bool).at[got_ids].set(True, mode="drop")
        return dense[None], touched[None]

    dense, touched = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("replica", "data"), P("replica", "data")),
            out_specs=(P("data"), P("data")),  # replicated over the groups: checked
        )
    )(ids, vals)
    for g in range(shape[1]):
        want = np.zeros((shard, w), np.float32)
        for r in range(rows_):
            keep = ids[r, g] < shard
            np.add.at(want, ids[r, g][keep], vals[r, g][keep])
        np.testing.assert_allclose(np.asarray(dense[g]), want, rtol=1e-5, atol=1e-6)
        seen = np.zeros(shard, bool)
        seen[ids[:, g][ids[:, g] < shard]] = True
        np.testing.assert_array_equal(np.asarray(touched[g]), seen)


@pytest.mark.parametrize("how", [replica_groups.ROWS, replica_groups.SHARD, replica_groups.AUTO])
def test_sum_tables_sums_each_table_apart_in_shared_collectives(how):
    """Two tables of other widths and shard sizes, summed in the same collectives: each
    comes back as its own sum over the groups (numpy), whichever exchange carries it."""
    rng = np.random.default_rng()
    shape, m = (2, 4), 6
    sizes, widths = {0: 9, 1: 40}, {0: 3, 1: 5}
    ids = {i: rng.integers(0, sizes[i] + 2, size=(*shape, m)).astype(np.int32) for i in sizes}
    vals = {i: rng.normal(size=(*shape, m, widths[i])).astype(np.float32) for i in sizes}
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("replica", "data"))

    def body(ids, vals):  # per table: int[1, 1, m], float[1, 1, m, w]
        pairs = {i: [(ids[i][0, 0], vals[i][0, 0])] for i in sizes}
        summed = replica_groups.sum_tables(pairs, sizes, "replica", how)
        out = {}
        for i, [(got_ids, got_rows)] in summed.items():
            dense = jnp.zeros((sizes[i], widths[i])).at[got_ids].add(got_rows, mode="drop")
            out[i] = dense[None]
        return out

    spec, outs = {i: P("replica", "data") for i in sizes}, {i: P("data") for i in sizes}
    dense = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=outs))(
        ids, vals
    )
    for i in sizes:
        for g in range(shape[1]):
            want = np.zeros((sizes[i], widths[i]), np.float32)
            for r in range(shape[0]):
                keep = ids[i][r, g] < sizes[i]
                np.add.at(want, ids[i][r, g][keep], vals[i][r, g][keep])
            np.testing.assert_allclose(np.asarray(dense[i][g]), want, rtol=1e-5, atol=1e-6)


def test_the_cheaper_exchange_is_chosen():
    assert replica_groups.choose(touched=10, shard_rows=1000, replicas=4) == replica_groups.ROWS
    assert replica_groups.choose(touched=600, shard_rows=1000, replicas=4) == replica_groups.SHARD
    assert replica_groups.choose(touched=10, shard_rows=8, replicas=2) == replica_groups.SHARD


# ------------------------------------------------------------------ whole steps


def step_of(params, devices, optimizer, replica_count=1, layouts=None, **kw):
    return sc.make_train_step(
        loss,
        optimizer,
        runtime.data_mesh(devices),
        params,
        kw.pop("strategy", "embrace"),
        embedding_paths=list(SIZES),
        table_layouts=layouts,
        replicas=replica_count,
        **kw,
    )


def replicas_equal(ts, state, paths=None) -> None:
    """Every device of a table's group position holds the same shard: the replicas
    have made the same updates (``paths``: each table's keys in ``state.params``,
    default the three tables')."""
    for path in paths or [(name,) for name in SIZES]:
        x = state.params
        for key in path:
            x = x[key]
        by_index: dict = {}
        for shard in x.addressable_shards:
            key = str(shard.index)
            got = np.asarray(shard.data)
            if key in by_index:
                np.testing.assert_array_equal(got, by_index[key], err_msg=str(path))
            by_index[key] = got


OPTIMIZERS = {  # eps=1e-3: the default lets a rounding move a weight by the learning rate
    "sgd": (optax.sgd(0.1), "dense"),
    "adam": (optax.adam(0.02, eps=1e-3), "dense"),
    "lazy_adam": (lazy_adam(0.02, eps=1e-3), "rows"),
}


@pytest.mark.matrix
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_d_equals_one_device_and_one_d(name):
    """2 x 4 (rows summed by all-gather) and 4 x 2 (by all-reduce of the shard), mixed
    layouts, against one device and the 1-D run on 8: the same losses and tables, and
    every replica equal."""
    seed = int(np.random.default_rng().integers(1 << 30))
    params = fresh_params(seed)
    optimizer, update = OPTIMIZERS[name]
    one = step_of(params, 1, optimizer, table_update=update)
    state, want = run(one, seed)
    flat = step_of(params, 8, optimizer, layouts=MIXED, table_update=update)
    _, flat_losses = run(flat, seed)
    assert flat_losses == pytest.approx(want, rel=1e-5)
    for count, sync in ((2, "rows"), (4, "shard")):
        ts = step_of(params, 8, optimizer, count, MIXED, table_update=update, replica_sync=sync)
        got_state, got = run(ts, seed)
        assert got == pytest.approx(want, rel=1e-5), (count, sync, seed)
        assert_trees_close(ts.host_params(got_state), one.host_params(state))
        replicas_equal(ts, got_state)


def test_lazy_adam_moves_a_row_touched_in_one_group_in_every_replica():
    """Row 3 of ``a`` is read only by the first group's workers: lazy Adam moves it in
    both replicas (as on one device), and leaves row 4, read by no one, where it was."""
    params = fresh_params(0)
    batch = batch_of(0, 0)
    batch["a"] = np.where(np.arange(BATCH) < BATCH // 2, 3, 5)  # group 0: 3, group 1: 5
    one = step_of(params, 1, lazy_adam(0.1), table_update="rows")
    ts = step_of(params, 8, lazy_adam(0.1), 2, table_update="rows", replica_sync="rows")
    want, _ = one.step(one.state, one.place_batch(batch))
    got, _ = ts.step(ts.state, ts.place_batch(batch))
    moved = ts.host_params(got)["a"]
    assert not np.allclose(moved[3], params["a"][3]) and np.array_equal(moved[4], params["a"][4])
    assert_trees_close(ts.host_params(got), one.host_params(want))
    replicas_equal(ts, got)


def test_the_lookups_exchange_spans_a_group_and_the_sum_spans_the_replicas():
    """In the compiled 2 x 4 step, every all-to-all (the lookups) spans 4 devices and
    the sums across the groups span 2, shared by the tables; the dense layers' mean
    spans all 8."""
    ts = step_of(fresh_params(0), 8, optax.sgd(0.1), 2, MIXED, replica_sync="rows")
    found = hlo.collectives(ts.step, ts.state, ts.place_batch(batch_of(0, 0)))
    sizes = {c.kind: set() for c in found}
    for c in found:
        sizes[c.kind].add(c.group_size)
    assert 4 in sizes["all-to-all"] and 2 in sizes["all-gather"]
    assert {c.group_size for c in found} <= {2, 4, 8}
    # the three tables' sums share collectives: ids and rows of the row-wise and packed
    # tables, ids and rows of the column-wise one (their ids typed alike in a group)
    assert sum(c.group_size == 2 for c in found) == 4


def test_several_steps_a_call_and_a_narrow_wire_compose():
    """``steps`` (one scan) equals step by step; bfloat16 rows give the 1-D run's
    losses (the same rows rounded alike; only the order of the sums differs)."""
    seed = 5
    params = fresh_params(seed)
    ts = step_of(params, 8, optax.sgd(0.1), 2, MIXED)
    _, want = run(ts, seed)
    fresh = step_of(params, 8, optax.sgd(0.1), 2, MIXED)
    placed = fresh.place_steps([batch_of(seed, s) for s in range(3)])
    _, losses = fresh.steps(fresh.state, placed)
    assert [float(x) for x in losses] == pytest.approx(want, rel=1e-5)
    narrow = dict(comm_dtype="bfloat16", table_update="rows")
    _, flat = run(step_of(params, 8, optax.sgd(0.1), 1, MIXED, **narrow), seed)
    _, two = run(step_of(params, 8, optax.sgd(0.1), 2, MIXED, **narrow), seed)
    assert two == pytest.approx(flat, rel=1e-5)


def test_a_checkpoint_moves_between_one_d_and_two_d(tmp_path):
    """Saved on 2 x 4 after two steps, restored on 8 (1-D) and on 4 x 2; and saved on 8,
    restored on 2 x 4: each continues as the uninterrupted run."""
    seed = 11
    params = fresh_params(seed)
    optimizer = optax.adam(0.02)
    for saved, then in (((8, 2), (8, 1)), ((8, 2), (8, 4)), ((8, 1), (8, 2))):
        first = step_of(params, saved[0], optimizer, saved[1], MIXED)
        state, _ = run(first, seed, 2)
        folder = tmp_path / f"{saved}{then}"
        with checkpoint.Checkpointer(folder) as ckpt:
            ckpt.save_state(2, first, state, force=True)
        _, want = run(first, seed, 2, state, start=2)
        ts = step_of(params, then[0], optimizer, then[1], MIXED)
        with checkpoint.Checkpointer(folder) as ckpt:
            restored, _ = ckpt.restore_state(ts)
        _, got = run(ts, seed, 2, restored, start=2)
        assert got == pytest.approx(want, rel=1e-5), (saved, then)


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["embrace+topk_a2a", "embrace+oktopk"])
def test_a_top_k_aggregator_spans_every_device_of_the_groups(strategy):
    """The dense layers' top-k (error feedback, one residual per worker) over all 8
    workers of 2 x 4 groups: the 1-D run's losses to the bit (the same selections,
    exchanged over the same workers)."""
    params = fresh_params(4)
    losses = {}
    for count in (1, 2):
        ts = step_of(params, 8, optax.sgd(0.1), count, MIXED, strategy=strategy, density=0.5)
        losses[count] = run(ts, 4)[1]
    assert losses[2] == losses[1]


def pipelined(w, params, devices: int, optimizer, strategy="embrace", steps=4, **kw):
    """Losses and host parameters of ``steps`` steps, batches placed as a user places
    them for a pipelined step (``place_for_step``: the step and those it looks ahead
    to)."""
    ts = workload_step(w, params, devices, optimizer, strategy, **kw)
    state, losses = run_placed(ts, w.batch_at, steps)
    return losses, ts.host_params(state), (ts, state)


@pytest.mark.matrix
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_embrace_2d_priorities_in_replica_groups_equal_one_device(name):
    """``embrace_2d``'s pipelined program (as built where collectives overlap compute)
    on 2 x 4 and 4 x 2: every group sends first the rows any group reads next, the early
    update of those rows uses their gradient summed over all groups, and the run is the
    one-device run (losses, tables; the replicas equal)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    w = get_workload("dlrm", tables="40,24,9", dim=8, batch=16, multi_hot=2, seed=seed)
    params = w.init(jax.random.key(seed))
    optimizer, update = OPTIMIZERS[name]
    want, want_params, _ = pipelined(w, params, 1, optimizer, table_update=update)
    for count, sync in ((2, "rows"), (4, "shard")):
        got, got_params, (ts, state) = pipelined(
            w,
            params,
            8,
            optimizer,
            "embrace_2d",
            replicas=count,
            replica_sync=sync,
            table_update=update,
            collectives_overlap=True,
        )
        assert ts.runs_as == "embrace_2d"
        assert got == pytest.approx(want, rel=1e-5), (count, seed)
        assert_trees_close(got_params, want_params)
        replicas_equal(ts, state, w.embedding_paths)
    batch = sc.place_for_step(ts, w.batch_at, 0, 4)  # 4 x 2: groups of 2, sums over 4
    found = hlo.collectives(ts.step, ts.state, batch)
    assert 2 in {c.group_size for c in found if c.kind == "all-to-all"}  # a group's chunks
    assert 4 in {c.group_size for c in found if c.kind == "all-reduce"}  # the shard sums
    assert {c.group_size for c in found} <= {2, 4, 8}  # 8: the dense layers' mean


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(replica_count=3), "replicas=3 must divide the 8 devices"),
        (dict(replica_count=0), "replicas=0 must be an integer >= 1"),
        (dict(replica_count=2, strategy="dense"), "needs a strategy among"),
        (dict(replica_count=2, replica_sync="sometimes"), "replica_sync='sometimes'"),
    ],
)
def test_replica_groups_that_cannot_be_are_refused(kw, message):
    with pytest.raises(sc.errors.ArgumentError, match=message):
        step_of(fresh_params(0), 8, optax.sgd(0.1), **kw)


@pytest.mark.cli
def test_the_command_line_runs_two_d_to_the_one_d_losses(tmp_path):
    """``--replicas 2`` on DLRM gives ``--replicas 1``'s losses, with ``embrace`` and
    ``embrace_2d``; the result records it."""
    args = ["--model", "dlrm", "--tables", "64,48,24", "--dim", "8", "--batch", "32"]
    args += ["--strategy", "embrace", "--optimizer", "lazy_adam", "--steps", "3"]
    out = {}
    for count in (1, 2):
        path = tmp_path / f"{count}.json"
        assert main([*args, "--replicas", str(count), "--out", str(path)]) == 0
        out[count] = json.loads(path.read_text())
    assert out[2]["losses"] == pytest.approx(out[1]["losses"], rel=1e-5)
    assert out[2]["config"]["replicas"] == 2
    path = tmp_path / "2d.json"  # the priorities' strategy, as this CPU runs it
    two_d = [*args, "--strategy", "embrace_2d", "--replicas", "2", "--out", str(path)]
    assert main(two_d) == 0
    assert json.loads(path.read_text())["losses"] == pytest.approx(out[1]["losses"], rel=1e-5)
