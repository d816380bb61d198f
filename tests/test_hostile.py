"""Hostile input, kept: each case a user met, through the interface where they met it
(the training command line, the Python API in a user's own script), refused with an
error that names the argument, the file and line, or the key; never a traceback, a
silent wrong result or a half-written folder.

Each ``main(argv)`` here is the command line's own entry point in this process (the
same checks and messages as ``python -m experiments.train``; an exception it does not
turn into its one-line error fails the test); ``test_the_command_line_process_*`` runs
the real process for the exit code and the absence of any traceback.
"""

import io
import json
import os
import socket
import subprocess
import sys
import zipfile

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REPO
from helpers import stderr_lines
from jax.sharding import PartitionSpec as P
from test_dlrm import write_criteo

import sparsecomm_jax as sc
from experiments.train import main
from models import dlrm
from sparsecomm_jax import checkpoint, distributed, nn, runtime
from sparsecomm_jax.comm import hlo, wire
from sparsecomm_jax.errors import ArgumentError

N = 8
TINY = ["--vocab", "50", "--dim", "8", "--hidden", "8", "--seq-len", "4", "--batch", "8"]
TINY += ["--devices", "2", "--steps", "2"]


def one_line(capsys) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "it/s" not in x]
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------ checkpoints

HOLD = """
import sys, time
from sparsecomm_jax import checkpoint
ckpt = checkpoint.Checkpointer(sys.argv[1])
print("holding", flush=True)
sys.stdin.readline()
ckpt.close()
"""


@pytest.mark.processes
def test_a_second_writer_of_a_checkpoint_folder_is_refused_at_once(tmp_path):
    """Two processes, one folder: the second ``Checkpointer`` is refused when it is
    made, naming the holder's process id and host; nothing of it reaches the folder.
    The folder need not exist yet (the checkpointer makes it)."""
    folder = tmp_path / "new" / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        who = f"process {holder.pid} on {socket.gethostname()}"
        with pytest.raises(ValueError, match=f"is in use by another run \\({who} holds"):
            checkpoint.Checkpointer(folder)
        assert not checkpoint.saved_steps(folder)
    finally:
        holder.communicate("\n", timeout=60)
    with checkpoint.Checkpointer(folder) as ckpt:  # released at the holder's close
        assert ckpt.save(1, {"w": jnp.ones(2)}, force=True)


def test_a_second_checkpointer_in_one_process_and_a_lock_on_a_new_folder(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "a") as ckpt:
        with pytest.raises(ValueError, match="this process: close the Checkpointer"):
            checkpoint.Checkpointer(tmp_path / "a")
        ckpt.save(1, {"w": jnp.ones(2)}, force=True)
    lock = checkpoint.DirectoryLock(tmp_path / "b" / "c")  # made, not FileNotFoundError
    with checkpoint.Checkpointer(tmp_path / "b" / "c", lock=lock) as ckpt:  # writes under it
        assert ckpt.save(1, {"w": jnp.ones(2)}, force=True)
    lock.release()


@pytest.mark.cli
@pytest.mark.parametrize(
    "strategy, devices, message",
    [
        # the pipelined step stores column-wise tables unpadded: D = 8 needs a count
        # that divides it
        (
            "embrace_2d",
            "3",
            "table params/sparse_0/embedding has D (columns) = 8, not divisible by the 3 workers",
        ),
        # error feedback keeps one residual per worker
        ("embrace+topk_a2a", "4", "residuals of error feedback for 2 workers; this step has 4"),
    ],
)
def test_a_resume_that_cannot_be_on_the_new_count_is_one_line(
    tmp_path, capsys, strategy, devices, message
):
    """A resume onto a count where the run's tables or state cannot be placed: one line
    that names the count (and the table), exit 2, the checkpoints kept."""
    args = ["--model", "dlrm", "--tables", "64,48", "--dim", "8", "--batch", "24"]
    args += ["--strategy", strategy, "--checkpoint-dir", str(tmp_path)]
    assert main([*args, "--devices", "2", "--steps", "2"]) == 0
    saved = checkpoint.saved_steps(str(tmp_path))
    capsys.readouterr()
    assert main([*args, "--devices", devices, "--steps", "3", "--resume"]) == 2
    assert message in one_line(capsys)
    assert checkpoint.saved_steps(str(tmp_path)) == saved and 2 in saved


@pytest.mark.cli
def test_a_resume_says_the_plan_it_cannot_place_came_from_the_checkpoint(tmp_path, capsys):
    """``--plan model`` on ``--resume`` keeps the plan the checkpoints were made with (a
    search anew could store the tables another way). Where that plan cannot be placed
    on the new count, the one line names the table and the count, and says the plan came
    from the checkpoint folder and how to give another."""
    args = ["--model", "dlrm", "--tables", "64,48", "--dim", "8", "--batch", "24"]
    args += ["--strategy", "embrace_2d", "--checkpoint-dir", str(tmp_path)]
    plan = {"params/sparse_0/embedding": "column", "params/sparse_1/embedding": "row"}
    assert main([*args, "--plan", json.dumps(plan), "--devices", "2", "--steps", "2"]) == 0
    capsys.readouterr()
    resume = ["--plan", "model", "--devices", "3", "--steps", "3", "--resume"]
    assert main([*args, *resume]) == 2
    line = one_line(capsys)
    assert "sparse_0/embedding has D (columns) = 8, not divisible by the 3 workers" in line
    assert f"the checkpoints in --checkpoint-dir {tmp_path} were made with" in line
    assert "kept for --plan model on --resume; give --plan with a plan for 3 devices" in line
    assert 2 in checkpoint.saved_steps(str(tmp_path))


def test_a_planner_memory_limit_nothing_fits_names_the_flag(capsys):
    """``--plan model`` within a ``--plan-memory-mb`` no layout fits: one line naming the
    flag, its value as typed and the device count, exit 2."""
    args = ["--model", "dlrm", "--tables", "64,48", "--dim", "8", "--batch", "24"]
    flags = [
        "--strategy",
        "embrace",
        "--devices",
        "2",
        "--plan",
        "model",
        "--plan-memory-mb",
        "0.001",
    ]
    assert main([*args, *flags]) == 2
    line = one_line(capsys)
    assert "--plan-memory-mb 0.001 on 2 devices: no layout of the tables fits" in line


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--replicas", "3"], "--replicas 3 must divide the 8 devices"),
        (["--replicas", "0"], "--replicas"),
        (["--replicas", "2", "--strategy", "dense"], "--replicas 2 needs a strategy among"),
        (["--replicas", "2", "--plan", "auto"], "--plan auto is built for one group"),
        (
            ["--replicas", "2", "--overlap", "--strategy", "embrace_2d"],
            "--overlap is built for one group of every device; leave out --overlap",
        ),
    ],
)
def test_replica_groups_that_cannot_be_are_one_line(capsys, flags, message):
    args = ["--model", "dlrm", "--tables", "64,48", "--dim", "8", "--batch", "24"]
    assert main([*args, "--devices", "8", "--strategy", "embrace", *flags]) == 2
    assert message in one_line(capsys)


HOT_PATHS = [f"params/sparse_{f}/embedding" for f in range(3)]
HOT_DLRM = ["--model", "dlrm", "--tables", "64,48,24", "--dim", "8", "--batch", "32"]
HOT_DLRM += ["--strategy", "embrace", "--optimizer", "lazy_adam", "--devices", "4"]


def hot_plan(*layouts: str) -> str:
    return json.dumps(dict(zip(HOT_PATHS, layouts, strict=True)))


def write(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def declared(path, name: str, count: int, data: bytes = b"") -> str:
    """A .npz whose array ``name`` declares ``count`` float64 counts in its header but
    holds ``data``."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (count,)}
    )
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{name}.npy", header.getvalue() + data)
    return str(path)


def untrusted_histograms(tmp_path) -> dict[str, str]:
    """Files given as ``--histogram`` that are not what it takes."""
    (tmp_path / "blank.npz").write_bytes(b"")
    (tmp_path / "text.npz").write_text("user,count\n1,2\n")
    np.save(tmp_path / "counts.npy", np.ones(64))
    return {
        "EMPTY_FILE": str(tmp_path / "blank.npz"),
        "TEXT": str(tmp_path / "text.npz"),
        "NPY": str(tmp_path / "counts.npy"),
        "HEADER": declared(tmp_path / "header.npz", HOT_PATHS[0], 10**13),
        "DECLARED": declared(tmp_path / "big.npz", HOT_PATHS[0], 300_000_000, bytes(2**21)),
    }


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--hot-rows", "-1"], "--hot-rows"),
        (["--hot-rows", "25"], "--hot-rows 25 is more than table params/sparse_2/embedding"),
        ([], "pass --hot-rows H"),
        (["--hot-rows", "4", "--histogram", "/nonexistent.npz"], "does not exist"),
        (["--hot-rows", "4", "--histogram", "SHORT"], "has counts of shape (10,)"),
        (["--hot-rows", "4", "--histogram", "NEGATIVE"], "has negative counts"),
        (["--hot-rows", "4", "--histogram", "MISSING"], "has no counts for table"),
        (["--hot-rows", "4", "--histogram", "EMPTY_FILE"], "not a .npz of counts"),
        (["--hot-rows", "4", "--histogram", "NPY"], "not a .npz of counts"),
        (["--hot-rows", "4", "--histogram", "TEXT"], "not a .npz of counts"),
        (["--hot-rows", "4", "--histogram", "HEADER"], "has counts of shape (10000000000000,)"),
        (["--hot-rows", "4", "--histogram", "DECLARED"], "has counts of shape (300000000,)"),
    ],
)
def test_hot_flags_that_cannot_be_are_one_line(tmp_path, capsys, flags, message):
    """Among them histograms that are no .npz (empty, a .npy, text) and ones whose
    header declares more counts than the file holds (10^13, or 300M in a small file):
    refused from the header, before any count is read."""
    files = {
        **untrusted_histograms(tmp_path),
        "SHORT": write(tmp_path / "s.npz", **{p: np.ones(10) for p in HOT_PATHS}),
        "NEGATIVE": write(
            tmp_path / "n.npz",
            **{p: -np.ones(v) for p, v in zip(HOT_PATHS, (64, 48, 24), strict=True)},
        ),
        "MISSING": write(tmp_path / "m.npz", other=np.ones(3)),
    }
    flags = [files.get(f, f) for f in flags]
    argv = [*HOT_DLRM, "--steps", "1", f"--plan={hot_plan('hot', 'row', 'hot')}", *flags]
    assert main(argv) == 2
    assert message in one_line(capsys)


def test_hot_rows_without_a_hot_table_is_one_line(capsys):
    assert main([*HOT_DLRM, "--steps", "1", "--hot-rows", "4"]) == 2
    line = one_line(capsys)  # not "or for --plan auto/model": there the planner picks H
    assert 'for tables that --plan gives "hot"' in line and "auto/model" not in line


INTS = "must be a list of integers"
HUGE = '{"params/sparse_0/embedding": {"layout": "hot", "config": [18446744073709551616]}}'


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--plan", "model", "--hot-rows", "4"], "the planner picks each table's H"),
        (["--plan", "auto", "--histogram", "STRAY"], "has counts for params/other, no table"),
        (["--plan", '{"params/sparse_0/embedding": {"layout": "row", "config": [1]}}'], "takes no"),
        (["--plan", '{"params/sparse_0/embedding": {"layout": "hot"}}'], '{"layout": name, "con'),
        (["--plan", '{"params/sparse_0/embedding": {"layout": "hot", "config": "x"}}'], INTS),
        (["--plan", '{"params/sparse_0/embedding": {"layout": "hot", "config": [1.5]}}'], INTS),
        (["--plan", '{"params/sparse_0/embedding": {"layout": "hot", "config": [1e30]}}'], INTS),
        (["--plan", '{"params/sparse_0/embedding": {"layout": "hot", "config": [true]}}'], INTS),
        (["--plan", HUGE], "hot ids must lie in [0, 64)"),
        (
            ["--plan", '{"params/sparse_0/embedding": {"layout": "hot", "config": [-1]}}'],
            "--plan (table params/sparse_0/embedding): hot ids must lie in [0, 64); got [-1]",
        ),
        (["--plan", "model", "--histogram", "NAN"], "has counts that are not finite"),
        (["--plan", "model", "--histogram", "BOOL"], "has counts of type bool"),
        (["--plan", "model", "--histogram", "EMPTY"], "holds no counts"),
        (["--plan", "model", "--histogram", "EMPTY_FILE"], "not a .npz of counts"),
        (["--plan", "model", "--histogram", "NPY"], "not a .npz of counts"),
        (["--plan", "model", "--histogram", "HEADER"], "has counts of shape (10000000000000,)"),
    ],
)
def test_planned_and_configured_hot_rows_that_cannot_be_are_one_line(
    tmp_path, capsys, flags, message
):
    """The planner's H with a fixed ``--hot-rows``; a histogram naming a table the model
    lacks, holding none, or counts that are not finite or not numbers; a plan's
    configured entry that is malformed, not a list of integers, beyond any table, or
    given to a layout that takes none."""
    files = {
        **untrusted_histograms(tmp_path),
        "STRAY": write(tmp_path / "stray.npz", **{"params/other": np.ones(3)}),
        "NAN": write(tmp_path / "nan.npz", **{HOT_PATHS[0]: np.full(64, np.nan)}),
        "BOOL": write(tmp_path / "bool.npz", **{HOT_PATHS[0]: np.ones(64, bool)}),
        "EMPTY": write(tmp_path / "empty.npz"),
    }
    flags = [files.get(f, f) for f in flags]
    assert main([*HOT_DLRM, "--steps", "1", *flags]) == 2
    assert message in one_line(capsys)


def test_a_restored_fresh_state_runs_in_the_users_own_step(tmp_path):
    """A state JAX placed itself (``model.init``, ``optax.init``) restored through
    ``abstract`` of itself runs in the user's ``jit(shard_map)`` step as the saved one
    did, to the same loss (it was pinned to device 0: "incompatible devices")."""
    params = {"w": jax.random.normal(jax.random.key(1), (4, 1))}
    opt = optax.sgd(0.1)

    def body(p, o, batch):
        loss = lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)  # noqa: E731
        value, grads = jax.value_and_grad(loss)(sc.vary(p))
        updates, o = opt.update(jax.lax.pmean(grads, "data"), o, p)
        return optax.apply_updates(p, updates), o, jax.lax.pmean(value, "data")

    specs = (P(), P(), P("data"))
    step = jax.jit(
        jax.shard_map(body, mesh=runtime.data_mesh(N), in_specs=specs, out_specs=(P(),) * 3)
    )
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(N, 4)).astype(np.float32), "y": np.ones((N, 1), np.float32)}
    state = (params, opt.init(params))
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, state, force=True)
        restored, _ = ckpt.restore(checkpoint.abstract(state))
    want = step(*state, batch)[2]
    assert float(step(*restored, batch)[2]) == float(want)


# ------------------------------------------------------------------ table ids

USER, ITEM = 10, 20


def two_tables(params, batch, ops):
    user = ops.lookup(params["user"], batch["user"])
    item = ops.lookup(params["item"], batch["item"])
    return jnp.mean(((user * item).sum(-1) - batch["label"]) ** 2)


def two_table_step(strategy, loss=two_tables, **kwargs):
    rng = np.random.default_rng(0)
    params = {
        "user": rng.normal(size=(USER, 4)).astype(np.float32),
        "item": rng.normal(size=(ITEM, 4)).astype(np.float32),
    }
    return sc.make_train_step(
        loss,
        optax.sgd(0.1),
        runtime.data_mesh(N),
        params,
        strategy,
        embedding_paths=[("user",), ("item",)],
        **kwargs,
    )


def two_table_batch(item_id: int | None = None) -> dict:
    rng = np.random.default_rng(3)
    batch = {
        "user": rng.integers(0, USER, N).astype(np.int32),
        "item": rng.integers(0, ITEM, N).astype(np.int32),
        "label": rng.random(N).astype(np.float32),
    }
    if item_id is not None:
        batch["item"][3] = item_id
    return batch


def user_read_directly(params, batch, ops):
    user = params["user"][batch["user"]]  # not through ops: a worker sees its shard only
    item = ops.lookup(params["item"], batch["item"])
    return jnp.mean(((user * item).sum(-1) - batch["label"]) ** 2)


def item_penalised(params, batch, ops):
    return two_tables(params, batch, ops) + 1e-3 * jnp.sum(params["item"] ** 2)


@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise", "sparse_allgather"])
@pytest.mark.parametrize("loss", [user_read_directly, item_penalised])
def test_a_table_read_outside_emb_is_refused_naming_it(strategy, loss):
    """A table indexed directly (or penalised whole) trained to finite wrong losses under
    ``embrace`` (each worker its own columns) and to NaN under ``embrace_rowwise``: now
    the first batch is refused in one line naming the table."""
    ts = two_table_step(strategy, loss=loss)
    name = "user" if loss is user_read_directly else "item"
    with pytest.raises(ValueError, match=f"the loss reads table {name} other than through emb"):
        ts.place_batch(two_table_batch())
    plain = two_table_step("dense", loss=loss)  # data parallel: the read sees the table
    plain.step(plain.state, plain.place_batch(two_table_batch()))


def test_a_plain_flax_nnx_embed_under_a_table_strategy_is_refused():
    """The two-tower model of plain ``flax.nnx.Embed`` tables, passed as a params tree
    with ``embedding_paths``: refused, naming the first table, instead of a loss of
    0.801 where one device gives 0.863."""
    from flax import nnx

    class TwoTower(nnx.Module):
        def __init__(self, rngs):
            self.user = nnx.Embed(USER, 4, rngs=rngs)
            self.item = nnx.Embed(ITEM, 4, rngs=rngs)

    graph, params = nnx.split(TwoTower(nnx.Rngs(0)), nnx.Param)

    def loss(p, batch, emb):
        model = nnx.merge(graph, p)
        score = (model.user(batch["user"]) * model.item(batch["item"])).sum(-1)
        return jnp.mean((score - batch["label"]) ** 2)

    ts = sc.make_train_step(
        loss,
        optax.sgd(0.1),
        runtime.data_mesh(N),
        params,
        "embrace",
        embedding_paths=lambda path, leaf: getattr(leaf, "ndim", 0) == 2,
    )
    with pytest.raises(ValueError, match=r"the loss reads table item\S* other than through emb"):
        ts.place_batch(two_table_batch())


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise", "sparse_allgather"])
def test_every_integer_key_that_feeds_a_table_is_checked(strategy):
    """``id_keys=("user",)`` leaves out ``item``, which feeds the item table: refused,
    naming it (an item id of V + 3 was read as zeros, inf or NaN). Named, an id out of
    the item table's range is refused; so it is under a ``{key: table}`` mapping."""
    with pytest.raises(ValueError, match=r"id_keys leaves out \['item'\], whose values the loss"):
        two_table_step(strategy, id_keys=("user",)).place_batch(two_table_batch(ITEM + 3))
    for keys in (("user", "item"), {"user": "user", "item": "item"}, None):
        ts = two_table_step(strategy, id_keys=keys)
        for bad in (ITEM + 3, 10**6):
            with pytest.raises(ValueError, match=rf"batch\['item'\].*outside \[0, {ITEM}\)"):
                ts.place_batch(two_table_batch(bad))
    state, loss = ts.step(ts.state, ts.place_batch(two_table_batch()))
    assert np.isfinite(sc.loss_value(loss))


def shifted(params, batch, ops):
    """The item ids computed by the model: ``item + shift``."""
    user = ops.lookup(params["user"], batch["user"])
    item = ops.lookup(params["item"], batch["item"] + batch["shift"])
    return jnp.mean(((user * item).sum(-1) - batch["label"]) ** 2)


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["embrace", "embrace_rowwise", "sparse_allgather"])
def test_an_id_the_model_computes_outside_its_table_skips_the_step(strategy):
    """``shift`` is no id (the model adds it to one): it may be left out of ``id_keys``.
    An item id the model computes past the table is caught where it is read, on every
    layout: the step is skipped (loss +inf, parameters unchanged), never answered with a
    zero or clamped row."""
    ts = two_table_step(strategy, id_keys=("user", "item"), loss=shifted)
    batch = {**two_table_batch(), "shift": np.zeros(N, np.int32)}
    state, loss = ts.step(ts.state, ts.place_batch(batch))
    assert np.isfinite(sc.loss_value(loss))
    before = ts.host_params(state)
    batch["shift"][2] = ITEM
    state, loss = ts.step(state, ts.place_batch(batch))
    assert sc.loss_value(loss) == np.inf
    for name, value in ts.host_params(state).items():
        np.testing.assert_array_equal(value, before[name])


@pytest.mark.matrix
@pytest.mark.parametrize("layout", ["row", "hot"])
def test_embrace_2d_skips_only_the_step_whose_computed_id_is_outside(layout):
    """In ``embrace_2d``'s pipelined program a carried table's rows for batch t+1 are
    fetched during step t, so an id the model computes outside the table in batch t+1
    reads a NaN row there: step t must train as ``embrace``'s does, step t+1 is skipped
    (loss +inf, parameters unchanged), and the step after it trains again, to
    ``embrace``'s losses and tables."""
    from sparsecomm_jax.embedding import hot

    item = hot.layout({"item": [0, 1]}) if layout == "hot" else layout
    layouts = {"user": "row", "item": item}

    def batch_at(k: int) -> dict:  # batch 1: an item id of V exactly (a row-wise
        batch = {**two_table_batch(), "shift": np.zeros(N, np.int32)}  # padding row)
        batch["shift"][2] = ITEM - batch["item"][2] if k == 1 else 0
        return batch

    kw = dict(id_keys=("user", "item"), loss=shifted, table_layouts=layouts)
    ref = two_table_step("embrace", **kw)
    ts = two_table_step("embrace_2d", collectives_overlap=True, **kw)
    assert ts.runs_as == "embrace_2d"
    want_state, got_state, want, got = ref.state, ts.state, [], []
    for k in range(3):
        want_state, loss = ref.step(want_state, ref.place_batch(batch_at(k)))
        want.append(sc.loss_value(loss))
        before = ts.host_params(got_state)
        got_state, loss = ts.step(got_state, sc.place_for_step(ts, batch_at, k, 3))
        got.append(sc.loss_value(loss))
        if k == 1:  # skipped: nothing moved
            for name, value in ts.host_params(got_state).items():
                np.testing.assert_array_equal(value, before[name])
        for name, value in ts.host_params(got_state).items():
            np.testing.assert_allclose(
                value, ref.host_params(want_state)[name], rtol=1e-5, atol=1e-6
            )
    assert want[1] == got[1] == np.inf and np.isfinite([want[0], want[2]]).all()
    assert got == pytest.approx(want, rel=1e-5)


def test_bool_ids_are_named_not_the_float_label():
    """A flax model given bool token ids: the error names the id key (it named the
    float label, the only float key, before)."""

    class Model(linen.Module):
        @linen.compact
        def __call__(self, tokens):
            return nn.Embed(10, 4, name="embed")(tokens).sum(-1)

    model = Model()
    params = model.init(jax.random.key(0), jnp.zeros((1,), jnp.int32))

    def loss(p, batch):
        return jnp.mean((model.apply(p, batch["tokens"]) - batch["label"]) ** 2)

    ts = sc.make_train_step(
        nn.loss_with_embeddings(loss),
        optax.sgd(0.1),
        runtime.data_mesh(N),
        params,
        "embrace",
        embedding_paths=nn.embedding_paths(params),
    )
    batch = {"tokens": np.arange(N) % 2 == 0, "label": np.ones(N, np.float32)}
    with pytest.raises(ValueError, match=r"looks up rows by \['tokens'\], give them as integers"):
        ts.place_batch(batch)


# ------------------------------------------------------------------ the Python API


def test_arguments_of_the_wrong_kind_name_themselves():
    with pytest.raises(ArgumentError, match="table_layouts must be a mapping .* got list") as e:
        two_table_step("embrace", table_layouts=[("user", "row")])
    assert e.value.argument == "table_layouts"
    with pytest.raises(ArgumentError, match="id_keys=5 must be batch keys") as e:
        two_table_step("embrace", id_keys=5)
    assert e.value.argument == "id_keys"
    with pytest.raises(ArgumentError, match=r"choose among \['column', .*'dense'.*\]"):
        two_table_step("embrace", table_layouts={"user": "colum"})
    with pytest.raises(ArgumentError, match="; strategy='topk_a2a' reads every table") as e:
        two_table_step("topk_a2a", table_layouts={"user": "row"})
    assert e.value.mentions == {"strategy": "topk_a2a"}


def test_a_plan_of_thousands_of_unknown_tables_is_one_short_line():
    plan = {f"params/t{i}/embedding": "row" for i in range(2000)}
    with pytest.raises(ArgumentError) as e:
        two_table_step("embrace", table_layouts=plan)
    assert "and 1,992 more" in str(e.value) and len(str(e.value)) < 600


def test_top_k_from_python_sends_the_command_lines_density():
    """``make_train_step(..., "topk_a2a")`` sends what ``--density``'s default sends
    (0.01), not everything: the same compiled bytes as ``density=0.01``."""
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4000,)).astype(np.float32)}

    def loss(p, batch, emb):
        return jnp.mean((batch["x"] * p["w"]).sum(-1) ** 2)

    def sent(**kw):
        ts = sc.make_train_step(
            loss, optax.sgd(0.1), runtime.data_mesh(N), params, "topk_a2a", **kw
        )
        batch = ts.place_batch({"x": rng.normal(size=(N, 4000)).astype(np.float32)})
        return hlo.total_bytes(hlo.collectives(ts.step, ts.state, batch))

    default = sent()
    assert default == sent(density=0.01) < 0.75 * sent(density=1.0)


def test_one_step_a_call_strategies_say_so_when_asked_for_several():
    ts = two_table_step("dense_pmap")
    batch = two_table_batch()
    assert not ts.scannable
    with pytest.raises(ValueError, match="ts.place_steps: strategy 'dense_pmap' runs one step"):
        ts.place_steps([batch, batch])
    with pytest.raises(ValueError, match=r"ts.steps: .*\(jax.pmap\)"):
        ts.steps(ts.state, ts.place_batch(batch))


def test_batches_of_one_call_with_other_keys_are_refused_before_the_loss_runs():
    ts = two_table_step("embrace")
    other = {k: v for k, v in two_table_batch().items() if k != "item"}
    with pytest.raises(ValueError, match="batches of one program call must be alike: batch 1"):
        ts.place_steps([two_table_batch(), other])


def test_a_wire_of_codec_names_and_a_wrong_field():
    """``Wire(forward="bfloat16")`` is the wire ``"forward=bfloat16"`` names (it raised
    ``AttributeError``); a field that names no codec is refused naming comm_dtype."""
    batch = two_table_batch()
    named = two_table_step("embrace", comm_dtype=wire.Wire(forward="bfloat16"))
    spec = two_table_step("embrace", comm_dtype="forward=bfloat16")
    wide = two_table_step("embrace")

    def sent(ts):
        return hlo.total_bytes(hlo.collectives(ts.step, ts.state, ts.place_batch(batch)))

    assert sent(named) == sent(spec) < sent(wide)
    assert float(named.step(named.state, named.place_batch(batch))[1]) == float(
        spec.step(spec.state, spec.place_batch(batch))[1]
    )
    with pytest.raises(ArgumentError, match="gives forward 'bf16'; choose one of") as e:
        two_table_step("embrace", comm_dtype=wire.Wire(forward="bf16"))
    assert e.value.argument == "comm_dtype"
    with pytest.raises(ArgumentError, match="comm_dtype='xxxx.*\\.\\.\\. is unknown"):
        two_table_step("embrace", comm_dtype="x" * 100_000)


@pytest.mark.parametrize("capacity", [True, False, 2.0, 0])
def test_a_capacity_that_is_no_count_is_refused_at_once(capacity):
    """``capacity=True`` was taken as 1 and failed only at the first step."""
    with pytest.raises(ArgumentError, match="capacity=.* must be an integer >= 1"):
        two_table_step("embrace_rowwise", capacity=capacity)


def test_placed_batches_that_would_run_nothing_say_so():
    """``placed_batches(ts, f, 10, 10)``, a resume that took ``steps`` for a count, ran
    nothing without a word: now it warns (a finished run resumed runs nothing too), and
    an end before the start is refused."""
    ts = two_table_step("embrace")
    with pytest.warns(UserWarning, match=r"start=10, steps=10\) runs nothing: steps is the"):
        assert list(sc.placed_batches(ts, lambda step: two_table_batch(), 10, 10)) == []
    with pytest.raises(ArgumentError, match="steps=5 is the step to end before .* start=10"):
        sc.placed_batches(ts, lambda step: two_table_batch(), 10, 5)
    with pytest.raises(ArgumentError, match="start=-1 must be >= 0"):
        sc.placed_batches(ts, lambda step: two_table_batch(), -1, 3)
    assert len(list(sc.placed_batches(ts, lambda step: two_table_batch(), 10, 12))) == 2


def test_embed_bag_lengths_of_the_wrong_shape():
    bag = nn.EmbedBag(10, 2)
    ids = jnp.array([[3, 5, 0], [7, 0, 0]])
    params = bag.init(jax.random.key(0), ids)
    with pytest.raises(ValueError, match=r"lengths must have the shape of the bags.*\(2,\)"):
        bag.apply(params, ids, jnp.array([2, 1, 1]))


# ------------------------------------------------------------------ the command line


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")


CRITEO = ["--model", "dlrm", "--tables", "64,48", "--dim", "4", "--devices", "2", "--steps", "2"]


def criteo_line(label="0", count="3", category="a0"):
    return "\t".join([label, count, *["1"] * 12, category, *["b1"] * 25])


@pytest.mark.parametrize(
    "line, message",
    [
        (criteo_line(label="5"), "the label is '5'; a Criteo label is 0 or 1"),
        (criteo_line(label="-1"), "the label is '-1'"),
        (criteo_line(count="9" * 400), "integer field 99999999999999999999... has 400 digits"),
        (criteo_line(category="f" * 17), "category fffffffffffffffff... has 17 hex digits"),
        (criteo_line(category="-5"), "category -5 is negative"),
    ],
)
def test_a_criteo_value_out_of_range_names_file_and_line(tmp_path, capsys, line, message):
    write_criteo(tmp_path / "train.txt", 2)
    with open(tmp_path / "train.txt", "a") as f:
        f.write(line + "\n")
    with pytest.raises(ValueError, match=f"train.txt, line 3: {message}"):
        dlrm.read_criteo(tmp_path / "train.txt", [64, 48])
    assert main([*CRITEO, "--batch", "4", "--data-dir", str(tmp_path)]) == 2
    assert f"train.txt, line 3: {message}" in one_line(capsys)


def test_a_criteo_file_too_small_to_hold_out_a_batch(tmp_path, capsys):
    """The held-out tenth of 40 lines is 4, fewer than a batch of 8: refused (it exited
    0 with no evaluation), as the text models refuse a split shorter than an example."""
    write_criteo(tmp_path / "train.txt", 40)
    args = [*CRITEO, "--batch", "8", "--data-dir", str(tmp_path), "--eval-every", "1"]
    assert main(args) == 2
    assert "held out, has 4, fewer than one --batch of 8" in one_line(capsys)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--comm-dtype", "fp8"], "--comm-dtype 'fp8' is unknown; choose one of"),
        (["--comm-dtype", "forward=e4m3"], "gives forward 'e4m3'; choose one of"),
        (["--comm-dtype", "sideways=bfloat16"], "names 'sideways'; directions are"),
        (["--comm-dtype", "dense=bfloat16,dense=float32"], "gives 'dense' twice"),
        (
            ["--comm-dtype", "float8_e4m3fn", "--strategy", "embrace_2d"],
            "--comm-dtype float8_e4m3fn is not available for embrace_2d",
        ),
        (
            ["--comm-dtype", "dense=float8_e5m2", "--strategy", "embrace+topk_a2a"],
            "narrows the dense mean, which embrace+topk_a2a sends by top-k in float32",
        ),
        (
            ["--comm-dtype", "float8_e4m3fn", "--strategy", "topk_allgather"],
            "--comm-dtype float8_e4m3fn is not available for topk_allgather",
        ),
    ],
)
def test_a_wire_that_cannot_be_is_one_line(capsys, flags, message):
    """Unknown codecs and directions, a direction twice, FP8 where the strategy cannot
    carry it: exit 2, one line naming --comm-dtype, before anything runs."""
    assert main([*TINY, "--strategy", "embrace", "--optimizer", "sgd", *flags]) == 2
    assert message in one_line(capsys)


def test_a_long_wire_spec_is_echoed_cut_short(capsys):
    """An invalid ``--comm-dtype`` of 100 KB: one line, its echo cut at 80 characters as
    ``--plan``'s is."""
    assert main([*TINY, "--strategy", "embrace", "--comm-dtype", "x" * 100_000]) == 2
    line = one_line(capsys)
    assert "--comm-dtype 'xxxx" in line and "... is unknown" in line and len(line) < 300


def test_a_deeply_nested_plan_is_one_line(capsys):
    plan = "[" * 100_000 + "]" * 100_000
    assert main([*TINY, "--strategy", "embrace", "--plan", plan]) == 2
    assert "argument --plan: must be auto, model or a JSON object" in one_line(capsys)


@pytest.mark.parametrize("kind", ["null", "fifo"])
def test_a_text_file_that_is_no_regular_file(tmp_path, capsys, kind):
    if kind == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
    else:
        path = "/dev/null"
    assert main([*TINY, "--text-file", str(path)]) == 2
    assert "is not a regular file (a device, FIFO or socket)" in one_line(capsys)


def test_the_slurm_batch_step_note_names_the_step(monkeypatch):
    """A batch script of a 4-task job runs python without srun: the note says which step
    it is in (it said "no SLURM_STEP_ID" with the batch step's id set)."""
    for name in distributed.SCHEDULER_VARS["slurm"]:
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_STEP_ID", "4294967294")
    note = distributed.slurm_without_srun()
    assert "SLURM_STEP_ID 4294967294, the batch script's step" in note
    monkeypatch.delenv("SLURM_STEP_ID")
    assert "(no SLURM_STEP_ID)" in distributed.slurm_without_srun()


@pytest.mark.processes
def test_the_command_line_process_exits_2_with_one_line_and_no_traceback(tmp_path):
    """The real process on two of the cases above: exit status 2, one line on stderr."""
    write_criteo(tmp_path / "train.txt", 2)
    with open(tmp_path / "train.txt", "a") as f:
        f.write(criteo_line(category="f" * 40) + "\n")
    cases = [
        [*CRITEO, "--batch", "4", "--data-dir", str(tmp_path)],
        [*TINY, "--strategy", "embrace", "--plan", "[" * 50_000],
        [*TINY, "--strategy", "embrace", "--comm-dtype", "forward=float8_e4m3fn,forward=float32"],
    ]
    for args in cases:
        done = subprocess.run(
            [sys.executable, "-m", "experiments.train", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = stderr_lines(done.stderr)
        assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
        assert lines[0].startswith("error: ") and "Traceback" not in done.stderr


def test_a_steps_bytes_are_a_method_of_the_step():
    """``ts.sent_bytes(batch)``: the compiled program's bytes per worker, as
    ``hlo.total_bytes`` counts them, in the wire's codecs (bfloat16 fewer)."""
    batch = two_table_batch()
    wide, narrow = two_table_step("embrace"), two_table_step("embrace", comm_dtype="bfloat16")
    placed = wide.place_batch(batch)
    assert wide.sent_bytes(placed) == hlo.total_bytes(
        hlo.collectives(wide.step, wide.state, placed)
    )
    assert 0 < narrow.sent_bytes(narrow.place_batch(batch)) < wide.sent_bytes(placed)
    wide.step(wide.state, placed)  # the state was not donated by compiling
