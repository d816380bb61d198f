"""The hot layout (``embedding.hot``): the H most read rows of a table on every worker,
the rest sharded by rows. Its row map and storage against numpy; whole steps against one
device with SGD, Adam, Adagrad and lazy Adam; the optimizers it refuses; the wire;
checkpoints onto another count and layout; the command line and its refusals.
"""

import json
import shutil

import jax
import numpy as np
import optax
import pytest
from helpers import THREE as SIZES
from helpers import assert_trees_close
from helpers import run_three_tables as run
from helpers import three_tables_batch as batch_of
from helpers import three_tables_loss as loss
from helpers import three_tables_params as fresh_params

import sparsecomm_jax as sc
from experiments.train import main
from sparsecomm_jax import checkpoint, runtime
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.embedding import hot
from sparsecomm_jax.embedding.row_optimizers import lazy_adam


@pytest.mark.parametrize("workers", [1, 3, 4, 8])
def test_each_id_has_one_row_and_storage_round_trips(workers):
    """Random V, H: every id's stored row (numpy and jax agree) is a hot row in [0, H)
    or a cold row past its owner's hot rows, no two ids share one; pack then unpack
    gives the table back (rows and columns, and rows alone)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)  # a failure names it: rerun with this seed
    vocab = int(rng.integers(5, 60))
    ids = rng.choice(vocab, size=int(rng.integers(0, vocab + 1)), replace=False)
    rows = hot.HotRows.of(ids, vocab, workers)
    every = np.arange(vocab)
    at = rows.stored_row(every)
    np.testing.assert_array_equal(np.asarray(rows.stored_row(jax.numpy.asarray(every))), at)
    assert len(set(at.tolist())) == vocab, seed
    is_hot = rows.is_hot(every)
    np.testing.assert_array_equal(np.flatnonzero(is_hot), np.sort(ids))
    assert np.all(at[is_hot] < ids.size)
    assert np.all(at[~is_hot] % rows.block >= ids.size)
    storage = hot._storage({0: rows}, workers)
    for table in (rng.normal(size=(vocab, 3)), rng.integers(0, 9, size=vocab)):
        stored = storage.pack({0: table}, workers)[0]
        assert stored.shape[0] == workers * rows.block
        np.testing.assert_array_equal(stored[at], table)  # each id's row where it says
        for w in range(workers):  # every worker's block holds the hot rows
            np.testing.assert_array_equal(
                stored[w * rows.block : w * rows.block + ids.size], table[np.sort(ids)]
            )
        np.testing.assert_array_equal(storage.unpack({0: stored}, {0: vocab})[0], table)


def test_the_hot_ids_are_the_most_counted():
    counts = np.array([3, 9, 0, 9, 1, 7])
    assert hot.from_counts(counts, 3).tolist() == [1, 3, 5]
    assert hot.from_counts(counts, 0).tolist() == []
    with pytest.raises(ValueError, match="hot_rows must be in"):
        hot.from_counts(counts, 7)
    assert hot.from_counts(counts.astype(np.uint32), 2).tolist() == [1, 3]  # no wrap-around


@pytest.mark.parametrize(
    "layouts, message",
    [
        ({"a": hot.layout({"a": [1]}), "b": hot.layout({"b": [2]})}, "share one hot layout"),
        ({"a": hot.layout({"a": [1], "z": [2]})}, r"hot ids given for \['z'\]"),
        ({"a": hot.layout({"a": [1, 99]})}, r"table a: hot ids must lie in \[0, 37\); got \[99\]"),
        ({"a": hot.layout({"a": [1, 1]})}, r"must be distinct; \[1\] appear twice"),
    ],
)
def test_hot_ids_that_cannot_be_are_refused(layouts, message):
    with pytest.raises(ValueError, match=message):
        step_of(fresh_params(0), 4, optax.sgd(0.1), layouts)


HOT = hot.layout({"a": [0, 1, 2, 5, 30], "b": [3], "c": list(range(9))})  # c: all hot
OPTIMIZERS = {
    "sgd": (optax.sgd(0.1), "dense"),
    "adam": (optax.adam(0.02), "dense"),
    "adagrad": (optax.adagrad(0.1), "rows"),
    "lazy_adam": (lazy_adam(0.02), "rows"),
}


def step_of(params, devices, optimizer, layouts, **kw):
    return sc.make_train_step(
        loss,
        optimizer,
        runtime.data_mesh(devices),
        params,
        "embrace",
        embedding_paths=list(SIZES),
        table_layouts=layouts,
        **kw,
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_hot_tables_train_as_on_one_device(name):
    """Three hot tables (one all hot), on 8 workers and on 2 x 4 replica groups: the
    one-device losses and tables. Lazy Adam leaves a hot row no one read."""
    seed = int(np.random.default_rng().integers(1 << 30))
    params = fresh_params(seed)
    optimizer, update = OPTIMIZERS[name]
    one = step_of(params, 1, optimizer, None, table_update=update)
    state, want = run(one, seed)
    layouts = dict.fromkeys(SIZES, HOT)
    for count in (1, 2):
        ts = step_of(params, 8, optimizer, layouts, table_update=update, replicas=count)
        got_state, got = run(ts, seed)
        assert got == pytest.approx(want, rel=1e-5), (count, seed)
        assert_trees_close(ts.host_params(got_state), one.host_params(state))


def test_an_optimizer_that_would_count_each_copy_is_refused():
    """Clipping by global norm sums every copy of a hot row: refused when built."""
    clipped = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.1))
    with pytest.raises(ValueError, match="hot rows held by every worker"):
        step_of(fresh_params(0), 8, clipped, {"a": hot.layout({"a": [1, 2]})}, table_update="dense")


def test_a_narrow_forward_wire_leaves_hot_rows_exact():
    """Every row of every table hot: no row travels before the forward pass, so with
    bfloat16 rows forward the first loss is float32's to the bit; the row layout's is
    not (its rows travel rounded)."""
    params = fresh_params(3)
    every = hot.layout({k: range(v) for k, v in SIZES.items()})

    def first_loss(layouts, wire):
        ts = step_of(params, 8, optax.sgd(0.1), layouts, comm_dtype=wire, table_update="rows")
        return float(ts.step(ts.state, ts.place_batch(batch_of(3, 0)))[1])

    all_hot, all_rows = dict.fromkeys(SIZES, every), dict.fromkeys(SIZES, "row")
    assert first_loss(all_hot, "forward=bfloat16") == first_loss(all_hot, "float32")
    assert first_loss(all_rows, "forward=bfloat16") != first_loss(all_rows, "float32")


def test_the_forward_exchange_carries_only_cold_rows():
    """Every id of table a read in a batch made hot: the compiled step's all-to-alls
    carry fewer bytes than the row-wise layout's, and the hot rows are summed by an
    all-reduce."""
    params, batch = fresh_params(0), batch_of(0, 0)
    layouts = {"a": hot.layout({"a": np.unique(batch["a"])}), "b": "row", "c": "row"}
    mine = step_of(params, 8, optax.sgd(0.1), layouts)
    rowwise = step_of(params, 8, optax.sgd(0.1), {"a": "row", "b": "row", "c": "row"})

    def a2a_bytes(ts):
        found = hlo.collectives(ts.step, ts.state, ts.place_batch(batch))
        return sum(c.bytes_sent for c in found if c.kind == "all-to-all"), found

    hot_bytes, found = a2a_bytes(mine)
    row_bytes, _ = a2a_bytes(rowwise)
    assert hot_bytes < row_bytes
    assert any(c.kind == "all-reduce" and c.shapes[0][1][-1:] == (6,) for c in found)


def test_a_hot_checkpoint_moves_to_another_count_and_layout(tmp_path):
    """Hot on 4 workers, saved after two steps; restored hot on 8 (the hot ids read
    from the record) and row-wise on 2: each continues as the uninterrupted run."""
    seed = 7
    params, optimizer = fresh_params(seed), optax.adam(0.02)
    layouts = dict.fromkeys(SIZES, HOT)
    first = step_of(params, 4, optimizer, layouts)
    state, _ = run(first, seed, 2)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(2, first, state, force=True)
        assert ckpt.identity(2)["form"]["configs"]["hot"]["a"] == [0, 1, 2, 5, 30]
    _, want = run(first, seed, 2, state, start=2)
    for devices, then in ((8, layouts), (2, dict.fromkeys(SIZES, "row"))):
        ts = step_of(params, devices, optimizer, then)
        with checkpoint.Checkpointer(tmp_path) as ckpt:
            restored, _ = ckpt.restore_state(ts)
        _, got = run(ts, seed, 2, restored, start=2)
        assert got == pytest.approx(want, rel=1e-5), devices


# ------------------------------------------------------------------ the command line

PATHS = [f"params/sparse_{f}/embedding" for f in range(3)]
DLRM = ["--model", "dlrm", "--tables", "64,48,24", "--dim", "8", "--batch", "32"]
DLRM += ["--strategy", "embrace", "--optimizer", "lazy_adam", "--devices", "4"]


def plan(*layouts: str) -> str:
    return json.dumps(dict(zip(PATHS, layouts, strict=True)))


def test_the_command_line_trains_hot_tables_as_row_wise_ones(tmp_path):
    """``--plan`` hot for two tables with ``--hot-rows 8``, counted over the first
    batches and from a ``--histogram`` file: the row-wise plan's losses."""
    runs = {}
    counts = {p: np.arange(v)[::-1].copy() for p, v in zip(PATHS, (64, 48, 24), strict=True)}
    np.savez(tmp_path / "counts.npz", **counts)
    cases = {
        "row": [f"--plan={plan('row', 'row', 'column')}"],
        "measured": [f"--plan={plan('hot', 'hot', 'column')}", "--hot-rows=8"],
        "file": [
            f"--plan={plan('hot', 'hot', 'column')}",
            "--hot-rows=8",
            f"--histogram={tmp_path / 'counts.npz'}",
        ],
    }
    for name, flags in cases.items():
        out = tmp_path / f"{name}.json"
        assert main([*DLRM, "--steps", "3", *flags, "--out", str(out)]) == 0
        runs[name] = json.loads(out.read_text())["losses"]
        if name != "row":  # the two hot tables' 8 rows of 8, summed in one all-reduce
            shapes = [c["shapes"] for c in json.loads(out.read_text())["collectives"]]
            assert ["f32[16,8]"] in shapes, shapes
    assert runs["measured"] == pytest.approx(runs["row"], rel=1e-5)
    assert runs["file"] == pytest.approx(runs["row"], rel=1e-5)


def test_a_hot_run_resumes_on_another_device_count(tmp_path):
    flags = [*DLRM, f"--plan={plan('hot', 'hot', 'row')}", "--hot-rows=8"]
    assert main([*flags, "--steps", "4", f"--out={tmp_path / 'full.json'}"]) == 0
    full = json.loads((tmp_path / "full.json").read_text())
    saved = tmp_path / "saved"
    assert main([*flags, "--steps", "2", f"--checkpoint-dir={saved}"]) == 0
    folder = tmp_path / "eight"
    shutil.copytree(saved, folder)
    out = tmp_path / "r.json"
    again = [*flags, "--steps", "4", "--devices", "8", "--resume", f"--checkpoint-dir={folder}"]
    assert main([*again, f"--out={out}"]) == 0
    assert json.loads(out.read_text())["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)
