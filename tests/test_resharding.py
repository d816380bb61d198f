"""Resharding: a checkpoint restores onto another device count and other table layouts
(``step.stored_form``), every layout and every optimizer's state, and continues exactly as the
run that was never interrupted; through the library and through ``--resume``.
"""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import REPO
from helpers import THREE as SIZES
from helpers import THREE_DIM as DIM
from helpers import assert_trees_close
from helpers import three_tables_batch as batch_of
from helpers import three_tables_loss as loss
from helpers import three_tables_params as fresh_params

import sparsecomm_jax as sc
from experiments.train import main, train_and_evaluate
from experiments.train.config import RunConfig
from sparsecomm_jax import checkpoint, runtime
from sparsecomm_jax.embedding.row_optimizers import lazy_adam
from sparsecomm_jax.step import stored_form


def step_of(params, devices, layouts, optimizer, strategy="embrace", **kw):
    return sc.make_train_step(
        loss,
        optimizer,
        runtime.data_mesh(devices),
        params,
        strategy,
        embedding_paths=list(SIZES),
        table_layouts=layouts,
        **kw,
    )


def run(ts, state, seed, steps):
    losses = []
    for s in steps:
        state, value = ts.step(state, ts.place_batch(batch_of(seed, s)))
        losses.append(float(value))
    return state, losses


PACKED = {"a": "table", "b": "table", "c": "row"}
CASES = [  # optimizer, table update, (devices, layouts) saved, (devices, layouts) resumed
    ("sgd", "dense", (4, PACKED), (2, {"a": "row", "b": "column", "c": "table"})),
    ("adam", "dense", (4, PACKED), (8, {"a": "column", "b": "table", "c": "dense"})),
    ("adagrad", "rows", (8, {"a": "column", "b": "row", "c": "row"}), (3, PACKED)),
    ("lazy_adam", "rows", (4, PACKED), (8, {"a": "table", "b": "replicated", "c": "table"})),
]
OPTIMIZERS = {
    "sgd": optax.sgd(0.1),
    "adam": optax.adam(0.02),
    "adagrad": optax.adagrad(0.1),
    "lazy_adam": lazy_adam(0.02),
}


@pytest.mark.matrix
@pytest.mark.parametrize("name, update, saved, resumed", CASES)
def test_a_checkpoint_resumes_on_another_count_and_layouts_exactly(
    tmp_path, name, update, saved, resumed
):
    """Four steps uninterrupted against two, saved, restored into another device count
    and other layouts (table-wise packs among them, both ways), and two more: the same
    losses and the same final tables."""
    seed = int(np.random.default_rng().integers(1 << 30))
    params, optimizer = fresh_params(seed), OPTIMIZERS[name]
    first = step_of(params, *saved, optimizer, table_update=update)
    state, before = run(first, first.state, seed, range(2))
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(2, first, state, force=True)
    state, after = run(first, state, seed, range(2, 4))
    then = step_of(params, *resumed, optimizer, table_update=update)
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        restored, step = ckpt.restore_state(then)
    assert step == 2
    restored, again = run(then, restored, seed, range(2, 4))
    assert again == pytest.approx(after, rel=1e-5, abs=1e-6), seed
    assert_trees_close(then.host_params(restored), first.host_params(state))


@pytest.mark.parametrize("devices", [2, 3, 5, 8])
def test_the_model_form_of_a_state_is_the_models_parameters(devices):
    """``to_model`` of a fresh step's state gives back the parameters it was built
    from, and ``to_stored`` of them the state as the step stores it (padding, packs,
    Adam's moments alike), for random layouts on several counts."""
    rng = np.random.default_rng()
    params = fresh_params(int(rng.integers(1 << 30)))
    names = ["column", "row", "table", "replicated", "dense"]
    layouts = {k: str(rng.choice(names)) for k in SIZES}
    ts = step_of(params, devices, layouts, optax.adam(0.1), table_update="dense")
    stored = jax.tree.map(runtime.to_host, checkpoint.portable(ts, ts.state))
    model = stored_form.to_model(ts.form, stored)
    assert_trees_close(model["params"], params)
    back = stored_form.to_stored(ts.form, model)
    assert_trees_close(back, stored, rtol=0, atol=0)
    shapes = stored_form.stored_shapes(ts.form, stored)
    assert [x.shape for x in jax.tree.leaves(shapes)] == [x.shape for x in jax.tree.leaves(stored)]


def test_per_worker_residuals_refuse_another_count(tmp_path):
    """Error feedback keeps a residual per worker: a checkpoint of 4 workers' residuals
    does not restore onto 2 (one line naming both counts), and restores onto 4."""
    params = fresh_params(0)
    four = step_of(params, 4, None, optax.sgd(0.1), "embrace+topk_a2a", density=0.5)
    assert jax.tree.leaves(four.state.agg_state), "top-k keeps per-worker residuals"
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save_state(1, four, four.state, force=True)
        two = step_of(params, 2, None, optax.sgd(0.1), "embrace+topk_a2a", density=0.5)
        with pytest.raises(checkpoint.MismatchError, match="for 4 workers; this step has 2"):
            ckpt.restore_state(two)
        ckpt.restore_state(step_of(params, 4, PACKED, optax.sgd(0.1), "embrace+topk_a2a"))


@pytest.mark.parametrize(
    "record, message",
    [
        ({"workers": 4}, "unreadable"),
        ({"workers": 4, "tables": [["a", 38, DIM, "row"]]}, "table a of 38 x 6; this model has"),
        ({"workers": 4, "tables": [["z", 37, DIM, "row"]]}, "no such table"),
        ({"workers": 4, "tables": [["a", 37, DIM, "diagonal"]]}, "'diagonal', which no one"),
    ],
)
def test_a_recorded_form_that_is_not_this_models_is_refused(record, message):
    ts = step_of(fresh_params(0), 2, None, optax.sgd(0.1))
    with pytest.raises(ValueError, match=message):
        stored_form.recorded(ts.form, record)


PATHS = ["/".join(("params", f"sparse_{f}", "embedding")) for f in range(4)]


def plan(*layouts: str) -> str:
    return json.dumps(dict(zip(PATHS, layouts, strict=True)))


@pytest.mark.cli
def test_resume_on_another_device_count_through_the_command_line(tmp_path):
    """DLRM, lazy Adam (per-row counts), every table table-wise on 4 devices; resumed
    with ``--resume`` on 2 devices table-wise and on 8 with rows, packs and columns:
    the resumed steps equal those of the run that was never interrupted."""
    base = dict(
        model="dlrm",
        tables="64,48,24,16",
        dim=8,
        batch=32,
        strategy="embrace",
        optimizer="lazy_adam",
        lr=0.05,
    )
    packed = plan("table", "table", "table", "table")
    full = train_and_evaluate(RunConfig(steps=4, devices=4, plan=packed, **base), progress=False)
    saved = tmp_path / "saved"
    ck = dict(checkpoint_dir=str(saved), checkpoint_every=1)
    train_and_evaluate(RunConfig(steps=2, devices=4, plan=packed, **base, **ck), progress=False)
    for devices, layouts in ((2, packed), (8, plan("row", "table", "column", "table"))):
        folder = tmp_path / str(devices)
        shutil.copytree(saved, folder)
        out = tmp_path / f"{devices}.json"
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in base.items()]
        argv += ["--steps=4", f"--devices={devices}", f"--plan={layouts}", "--resume"]
        assert main([*argv, f"--checkpoint-dir={folder}", f"--out={out}"]) == 0
        resumed = json.loads(out.read_text())
        assert resumed["start_step"] == 2 and resumed["restore_s"] > 0
        assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)


@pytest.mark.processes
def test_a_checkpoint_converts_when_each_process_holds_part_of_the_devices(tmp_path):
    """Saved by one process on 4 simulated devices (table-wise and hot tables, Adam),
    resumed by 2 processes of one device each: each process reads the checkpoint whole
    on its CPU and places its part; the losses of the run never interrupted."""
    layouts = plan("table", "table", "hot", "row")
    args = ["--model", "dlrm", "--tables", "64,48,24,16", "--dim", "8", "--batch", "32"]
    args += ["--strategy", "embrace", "--optimizer", "adam", "--lr", "0.01"]
    args += [f"--plan={layouts}", "--hot-rows", "4"]
    full, ck, out = tmp_path / "full.json", tmp_path / "ck", tmp_path / "r.json"
    assert main([*args, "--devices", "4", "--steps", "4", f"--out={full}"]) == 0
    assert main([*args, "--devices", "4", "--steps", "2", f"--checkpoint-dir={ck}"]) == 0
    launch = [sys.executable, "-m", "sparsecomm_jax.launch", "--nproc", "2", "--"]
    train = [sys.executable, "-m", "experiments.train", *args, "--steps", "4", "--resume"]
    done = subprocess.run(
        [*launch, *train, f"--checkpoint-dir={ck}", f"--out={out}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads(full.read_text())["losses"][2:]
    assert json.loads(out.read_text())["losses"] == pytest.approx(want, rel=1e-5)
