"""The hot layout (``embedding.hot``): the H most read rows of a table on every worker,
the rest sharded by rows. Its row map and storage against numpy; whole steps against one
device with SGD, Adam, Adagrad and lazy Adam; the optimizers it refuses; the wire;
checkpoints onto another count and layout; the command line and its refusals.
"""

import json
import math
import shutil

import jax
import numpy as np
import optax
import pytest
from helpers import THREE as SIZES
from helpers import assert_trees_close, run_placed, workload_step
from helpers import run_three_tables as run
from helpers import three_tables_batch as batch_of
from helpers import three_tables_loss as loss
from helpers import three_tables_params as fresh_params

import sparsecomm_jax as sc
from experiments.train import histogram, main
from models import get_workload
from sparsecomm_jax import checkpoint, planner, runtime
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.comm.costmodel import Link
from sparsecomm_jax.embedding import hot
from sparsecomm_jax.embedding.row_optimizers import lazy_adam
from sparsecomm_jax.embedding.tables import find_tables, table_mask, table_name


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
        (
            {"a": hot.layout({"a": [1, 99]})},
            r"table_layouts \(table a\): hot ids must lie in \[0, 37\); got \[99\]",
        ),
        ({"a": hot.layout({"a": [1, 1]})}, r"must be distinct; \[1\] appear twice"),
    ],
)
def test_hot_ids_that_cannot_be_are_refused(layouts, message):
    with pytest.raises(ValueError, match=message):
        step_of(fresh_params(0), 4, optax.sgd(0.1), layouts)


HOT = hot.layout({"a": [0, 1, 2, 5, 30], "b": [3], "c": list(range(9))})  # c: all hot
# Adam's default eps turns a near-zero gradient's rounding into a step of the whole
# learning rate (m / sqrt(v) near +-1 whatever its size): after four steps on 8 devices
# a dense weight was 7.7e-5 off the one-device run, and `embrace` on the same plan is
# off by as much. eps=1e-3 keeps a rounding a rounding, as the equivalence tests do.
OPTIMIZERS = {
    "sgd": (optax.sgd(0.1), "dense"),
    "adam": (optax.adam(0.02, eps=1e-3), "dense"),
    "adagrad": (optax.adagrad(0.1), "rows"),
    "lazy_adam": (lazy_adam(0.02, eps=1e-3), "rows"),
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


@pytest.mark.matrix
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


PIPELINED = [  # optimizer, the three DLRM tables' layouts, replica groups
    ("sgd", ("hot", "column", "replicated"), 1),
    ("adam", ("hot", "table", "column"), 2),
    ("lazy_adam", ("row", "hot", "column"), 2),
    # row-wise tables carried without a column one; Adam's dense update moves every row
    # batch t+1 reads early
    ("adam", ("row", "row", "hot"), 1),
    # clipping couples rows: the next rows are fetched after the update (no hot table:
    # clipping would count each copy of a hot row)
    ("clipped", ("row", "column", "table"), 1),
]
PIPELINE_OPTIMIZERS = {
    **OPTIMIZERS,
    "clipped": (optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1)), "dense"),
}


def dlrm_beside(seed: int, kinds: tuple[str, ...]):
    """``(workload, params, layouts)``: the three-table DLRM with ``kinds`` its tables'
    layouts, the hot one's hot ids 0, 1, 2, 5 and 7."""
    w = get_workload("dlrm", tables="40,24,9", dim=8, batch=16, multi_hot=2, seed=seed)
    names = [table_name(p) for p in w.embedding_paths]
    layouts = dict(zip(names, kinds, strict=True))
    for name, kind in layouts.items():
        if kind == "hot":
            layouts[name] = hot.layout({name: [0, 1, 2, 5, 7]})
    return w, w.init(jax.random.key(seed)), layouts


@pytest.mark.matrix
@pytest.mark.parametrize("name, kinds, count", PIPELINED)
def test_hot_tables_run_beside_embrace_2d_priorities(name, kinds, count):
    """``embrace_2d``'s pipelined program (as built where collectives overlap compute)
    with a hot table beside column-wise and replicated or table-wise ones, a row-wise
    one beside hot and column-wise ones, two row-wise ones beside a hot one, on 8
    devices and on 2 x 4 groups, and with an optimizer that couples rows (the next rows
    fetched after the update) beside row-wise and table-wise ones: the one-device
    losses and tables. The column-wise and row-wise tables' rows are carried to the
    next step; the others are read within each step."""
    seed = int(np.random.default_rng().integers(1 << 30))
    w, params, layouts = dlrm_beside(seed, kinds)
    optimizer, update = PIPELINE_OPTIMIZERS[name]
    print(f"seed {seed}")  # shown with a failure

    one = workload_step(w, params, 1, optimizer, "embrace", table_update=update)
    want_state, want = run_placed(one, w.batch_at, 4)
    ts = workload_step(
        w,
        params,
        8,
        optimizer,
        "embrace_2d",
        table_layouts=layouts,
        replicas=count,
        collectives_overlap=True,
        table_update=update,
    )
    assert ts.runs_as == "embrace_2d"
    state, got, carried = ts.state, [], []
    for t in range(4):
        state, loss = ts.step(state, sc.place_for_step(ts, w.batch_at, t, 4))
        got.append(sc.loss_value(loss))
        carried.append(len(state.carry.rows) if state.carry else 0)
    assert got == pytest.approx(want, rel=1e-5), seed
    assert_trees_close(ts.host_params(state), one.host_params(want_state))
    pipelined = sum(kind in ("column", "row", "hot") for kind in kinds)  # one lookup each
    assert carried == [pipelined] * 3 + [0]  # none after the last step


@pytest.mark.matrix
@pytest.mark.parametrize("kind, count", [("row", 1), ("hot", 2)])
def test_a_pipelined_table_read_by_shared_negatives_equals_embrace(kind, count):
    """A language model's tied table read by a lookup and by shared negatives (a
    sampled softmax: every worker holds the same ids), row-wise on 8 devices and hot on
    2 x 4 groups, carried by ``embrace_2d``'s pipelined program: ``embrace``'s losses
    and tables. (The shared negatives' rows are summed over the workers; the carry and
    the guard's refetch are typed alike.)"""
    w = get_workload(
        "gpt2", vocab=40, dim=8, layers=1, heads=2, seq_len=8, batch=8, sampled_softmax=4
    )
    params = w.init(jax.random.key(0))
    [name] = [table_name(p) for p in w.embedding_paths]
    layouts = {name: hot.layout({name: [0, 3]}) if kind == "hot" else kind}
    kw = dict(table_layouts=layouts, replicas=count, id_keys=w.id_keys)
    ref = workload_step(w, params, 8, optax.sgd(0.5), "embrace", **kw)
    ts = workload_step(w, params, 8, optax.sgd(0.5), "embrace_2d", collectives_overlap=True, **kw)
    assert ts.runs_as == "embrace_2d"
    want_state, want = run_placed(ref, w.batch_at, 3)
    state, got = run_placed(ts, w.batch_at, 3)
    assert got == pytest.approx(want, rel=1e-5)
    assert_trees_close(ts.host_params(state), ref.host_params(want_state))


def test_the_tables_beside_the_pipeline_wait_for_its_first_chunks():
    """In a middle step's compiled program the hot table's gradients (the hot rows'
    all-reduce, the cold rows' all-to-all) and the late chunks of the column-wise and
    row-wise tables are sent after every first chunk has arrived, and the next batch's
    lookups of the carried tables do not wait for them (the hot rows' read counts, from
    the ids alone, need not wait). A middle step fetches nothing before its forward
    pass (the first step fetches every table's rows). With no column-wise, row-wise or
    hot table there is nothing to pipeline: ``embrace``'s step runs."""
    from sparsecomm_jax.schedule import scopes

    w, params, layouts = dlrm_beside(0, ("hot", "column", "row"))

    def step(layouts):
        return workload_step(
            w,
            params,
            8,
            optax.sgd(0.1),
            "embrace_2d",
            table_layouts=layouts,
            collectives_overlap=True,
        )

    ts = step(layouts)
    first_step = sc.place_for_step(ts, w.batch_at, 0, 3)
    before = hlo.scheduled_collectives(hlo.compiled_text(ts.step, ts.state, first_step))
    state, _ = ts.step(ts.state, first_step)
    text = hlo.compiled_text(ts.step, state, sc.place_for_step(ts, w.batch_at, 1, 3))
    instrs, colls = hlo.entry_instructions(text), hlo.scheduled_collectives(text)
    # the first step fetches the three tables' rows before its forward pass; a middle
    # step reads them carried (the hot rows where they are): nothing before it
    assert any(scopes.SCOPE_ROWS in c.op_name for c in before)
    assert not [c for c in colls if scopes.SCOPE_ROWS in c.op_name]

    floats = {c.name for c in hlo.parse_collectives(text) if c.shapes[0][0] == "f32"}

    def named(scope, kind):  # the collectives of gradient rows (float) of one scope
        return [
            c
            for c in colls
            if scope in c.op_name and c.opcode.startswith(kind) and c.name in floats
        ]

    first = {c.name for c in named(scopes.SCOPE_HIGH, "all-to-all")}
    late = named(scopes.SCOPE_LOW, "all-reduce") + named(scopes.SCOPE_LOW, "all-to-all")
    assert first and named(scopes.SCOPE_LOW, "all-reduce"), [c.op_name for c in colls]
    for c in late:
        assert first <= hlo.ancestors(instrs, c.name), c.name
    for c in named(scopes.SCOPE_NEXT, "all-to-all"):
        assert not hlo.ancestors(instrs, c.name) & {c.name for c in late}
    assert len(first) == 2  # the column table's first chunk; the hot and row-wise ones
    assert step(dict.fromkeys(layouts, "table")).runs_as == "embrace"


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


@pytest.mark.cli
def test_the_command_line_trains_hot_tables_as_row_wise_ones(tmp_path):
    """``--plan`` hot for two tables with ``--hot-rows 8``, counted over the first
    batches and from a ``--histogram`` file, and beside ``embrace_2d``'s pipelined
    column table: the row-wise plan's losses."""
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
        "pipelined": [
            f"--plan={plan('hot', 'hot', 'column')}",
            "--hot-rows=8",
            "--strategy=embrace_2d",
            "--collectives-overlap=yes",
        ],
    }
    for name, flags in cases.items():
        out = tmp_path / f"{name}.json"
        assert main([*DLRM, "--steps", "3", *flags, "--out", str(out)]) == 0
        runs[name] = json.loads(out.read_text())["losses"]
        if name != "row":  # the two hot tables' 8 rows of 8, summed in one all-reduce
            shapes = [c["shapes"] for c in json.loads(out.read_text())["collectives"]]
            assert ["f32[16,8]"] in shapes, shapes
    for name in ("measured", "file", "pipelined"):
        assert runs[name] == pytest.approx(runs["row"], rel=1e-5), name
    assert json.loads((tmp_path / "pipelined.json").read_text())["runs_as"] == "embrace_2d"


@pytest.mark.cli
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


# ------------------------------------------------------------------ the planner

VOCAB, WIDTH = 4096, 8


def one_table_loss(p, batch, emb):
    return jax.numpy.mean((emb.lookup(p["t"], batch["ids"]) @ p["w"] - batch["y"]) ** 2)


def one_table(rng, workers: int, ids: np.ndarray):
    """Random parameters of one V x D table and a readout, and a batch of ``ids``."""
    params = {
        "t": rng.normal(size=(VOCAB, WIDTH)).astype(np.float32),
        "w": rng.normal(size=(WIDTH, 1)).astype(np.float32),
    }
    batch = {"ids": ids.astype(np.int32), "y": rng.normal(size=(ids.size, 1)).astype(np.float32)}
    return params, batch


def head_and_tail(rng, workers: int, head: int = 48, tail: int = 32) -> np.ndarray:
    """Each worker reads the ``head`` ids 0.. (rows of the first owner) and ``tail``
    uniform ids past a quarter of the table: the row layout's bucket at the first
    owner holds the whole head."""
    rows = [
        np.concatenate([np.arange(head), rng.integers(VOCAB // 4, VOCAB, tail)])
        for _ in range(workers)
    ]
    return np.concatenate(rows)


def stats_of(params, batches, counts, workers):
    [found] = planner.table_stats(one_table_loss, params, ["t"], batches, workers, counts=counts)
    return found


def test_the_planner_picks_hot_rows_where_they_shrink_the_buckets():
    """A head every worker reads in the first owner's rows: the hot layout's cold
    buckets shrink as H grows, its pricing picks an H > 0 whose hot ids are the
    histogram's most read, the planner prefers it to the row layout (messages free),
    and the plan's layouts train as the row layout does."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng, workers = np.random.default_rng(seed), 4
    history = [head_and_tail(rng, workers) for _ in range(8)]
    counts = {"t": np.bincount(np.concatenate(history), minlength=VOCAB)}
    params, batch = one_table(rng, workers, head_and_tail(rng, workers))
    found = stats_of(params, [batch], counts, workers)
    options = found.of("hot").options
    assert options[0].rows == 0 and options[0].bucket == found.bucket >= 48, seed
    seen = np.count_nonzero(counts["t"])  # every H tried up to the ids counted
    assert [o.rows for o in options] == [0, *(h for h in hot.HOT_ROWS_TRIED if h <= seen)]
    assert options[2].bucket < options[0].bucket, seed  # the head is hot at H = 64
    free = Link(0.0, 1e-9)
    plan = planner.plan_tables([found], workers, free, layouts=["row", "hot"])
    [choice] = plan.choices
    hot_rows = int(choice.setting.removeprefix("H="))
    assert choice.layout == "hot" and hot_rows > 0, (seed, plan.table())
    assert choice.bytes < planner.layout_cost(found, "row", workers, free).bytes
    layout = plan.layouts()["t"]
    assert layout.config["t"] == hot.from_counts(counts["t"], hot_rows).tolist()
    losses, sent = {}, {}
    for name, layouts in (("row", {"t": "row"}), ("plan", plan.layouts())):
        ts = sc.make_train_step(
            one_table_loss,
            optax.adam(0.02),
            runtime.data_mesh(workers),
            params,
            "embrace",
            embedding_paths=["t"],
            table_layouts=layouts,
        )
        placed = ts.place_batch(batch)
        sent[name] = hlo.total_bytes(hlo.collectives(ts.step, ts.state, placed))
        state, losses[name] = ts.state, []
        for _ in range(3):
            state, loss_value = ts.step(state, placed)
            losses[name].append(float(loss_value))
    assert losses["plan"] == pytest.approx(losses["row"], rel=1e-5), seed
    # the compiled steps differ by what the model says the table's exchanges differ by
    row_bytes = planner.layout_cost(found, "row", workers, free).bytes
    assert sent["plan"] - sent["row"] == choice.bytes - row_bytes, seed


def test_uniform_ids_get_no_hot_rows():
    """Ids spread evenly: no H saves the cold buckets what its all-reduce costs, so the
    hot pricing's best is H = 0, priced as never worth choosing (the row layout with two
    more all-reduces), and the planner gives the table the row layout, nor offers hot
    rows to be timed; without counts the hot layout is not offered."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng, workers = np.random.default_rng(seed), 4
    uniform = lambda: rng.integers(0, VOCAB, 64 * workers)  # noqa: E731
    counts = {"t": np.bincount(np.concatenate([uniform() for _ in range(8)]), minlength=VOCAB)}
    params, batch = one_table(rng, workers, uniform())
    found = stats_of(params, [batch], counts, workers)
    slow = Link.from_bandwidth(1.0)
    priced = planner.layout_cost(found, "hot", workers, slow)
    assert priced.setting == "H=0" and priced.seconds == math.inf, seed  # never chosen
    plan = planner.plan_tables([found], workers, slow, layouts=["row", "hot"])
    assert plan.layouts().names() == {"t": "row"}, (seed, plan.table())
    candidates = planner.candidate_plans([found], workers, slow, layouts=["row", "hot"])
    assert all(p.layouts().names() == {"t": "row"} for p in candidates)  # nor timed
    unmeasured = stats_of(params, [batch], None, workers)
    assert unmeasured.of("hot") is None and not planner.serves(unmeasured, "hot")
    with pytest.raises(ValueError, match="no layout of \\['hot'\\] serves table t"):
        planner.plan_tables([unmeasured], workers, slow, layouts=["hot"])


def test_the_hot_rows_all_reduce_is_priced_as_compiled():
    """At one capacity for both, the compiled hot step sends the row step's bytes plus
    the all-reduce of H rows and their counts: the difference the pricing adds."""
    rng, workers, capacity = np.random.default_rng(), 4, 16
    params, batch = one_table(rng, workers, head_and_tail(rng, workers, 8, 8))
    stats = planner.TableStats("t", VOCAB, WIDTH, 16, 16, capacity)

    def sent(layout):
        ts = sc.make_train_step(
            one_table_loss,
            optax.sgd(0.1),
            runtime.data_mesh(workers),
            params,
            "embrace",
            embedding_paths=["t"],
            table_layouts={"t": layout},
            capacity=capacity,
        )
        return hlo.total_bytes(hlo.collectives(ts.step, ts.state, ts.place_batch(batch)))

    link = Link(0.0, 1.0)
    for rows in (16, 64):
        added = sent(hot.layout({"t": range(rows)})) - sent("row")
        priced = hot.option_price(stats, hot.Option(rows, capacity), workers, link, 0).bytes
        assert (
            added
            == priced - hot.option_price(stats, hot.Option(0, capacity), workers, link, 0).bytes
        )


PLANNED = ["--model", "dlrm", "--tables", "100000", "--dim", "2", "--bottom", "8", "--top", "8"]
PLANNED += ["--zipf-exponent", "1.5", "--batch", "2048", "--devices", "4", "--strategy", "embrace"]
PLANNED += ["--plan", "model", "--plan-memory-mb", "1", "--link-alpha-us", "0"]


@pytest.mark.cli
def test_plan_model_picks_hot_rows_and_a_resume_keeps_them(tmp_path):
    """A 100,000-row table read by Zipf ids on 4 workers, within 1 MB, messages free:
    the planner gives it hot rows, the most counted ids of the run's first batches, and
    the run sends fewer bytes a step than the row layout's, to the same losses; the
    run's record holds the hot ids, and a resume under ``--plan model`` takes that plan
    and continues as the uninterrupted run."""
    full, rows = tmp_path / "full.json", tmp_path / "rows.json"
    assert main([*PLANNED, "--steps", "4", f"--out={full}"]) == 0
    record = json.loads(full.read_text())
    row_plan = [*PLANNED[:-6], "--plan", json.dumps({"params/sparse_0/embedding": "row"})]
    assert main([*row_plan, "--steps", "4", f"--out={rows}"]) == 0
    row_run = json.loads(rows.read_text())
    assert record["comm_bytes_per_step"] < row_run["comm_bytes_per_step"]
    assert record["losses"] == pytest.approx(row_run["losses"], rel=1e-5)
    table = "params/sparse_0/embedding"
    [choice] = record["plan"]["tables"]
    assert choice["layout"] == "hot" and choice["setting"].startswith("H="), record["plan"]
    hot_rows = int(choice["setting"].removeprefix("H="))
    assert record["config"]["plan"] == {table: {"layout": "hot", "config": choice["config"]}}
    w = get_workload(
        "dlrm", tables="100000", dim=2, bottom="8", top="8", zipf_exponent=1.5, batch=2048
    )
    params = w.init(jax.random.key(0))
    tables = find_tables(params, table_mask(params, w.embedding_paths), None)
    counts = histogram.measured_counts(w, params, tables, histogram.HISTOGRAM_BATCHES)
    assert choice["config"] == hot.from_counts(counts[table], hot_rows).tolist()
    saved = tmp_path / "saved"
    assert main([*PLANNED, "--steps", "2", f"--checkpoint-dir={saved}"]) == 0
    out = tmp_path / "resumed.json"
    assert (
        main([*PLANNED, "--steps", "4", "--resume", f"--checkpoint-dir={saved}", f"--out={out}"])
        == 0
    )
    resumed = json.loads(out.read_text())
    assert "plan" not in resumed  # taken from the checkpoints' record, not planned anew
    assert resumed["config"]["plan"] == record["config"]["plan"]
    assert resumed["losses"] == pytest.approx(record["losses"][2:], rel=1e-5)
