"""Checkpoint and exact resume, one run per checkpoint folder, damaged checkpoints,
unwritable outputs, non-finite gradients and parameters, determinism, killed ranks."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from conftest import REPO
from helpers import place, record_loop_events, stderr_lines

import sparsecomm_jax as sc
from experiments.train import loop, main, train_and_evaluate
from experiments.train import run as cli
from experiments.train.config import RunConfig
from models import get_workload
from sparsecomm_jax import checkpoint, runtime
from sparsecomm_jax.cores import cpu_quota, usable_cores

SMALL = dict(vocab=256, dim=16, hidden=16, seq_len=8, batch=16, sampled_softmax=16, warmup=0)
# embrace_2d as its pipelined program (conftest), not as embrace on this CPU mesh
pytestmark = pytest.mark.usefixtures("pipelined_2d")

# one strategy per kind of state: per-device replicas, sharded columns, sharded rows,
# the pipelined carry, per-worker residuals (topk_a2a), and residuals with a count of
# deferred entries beside them (oktopk)
# embrace_rowwise's row state resumes in test_row_updates (on another device count too).
RESUMABLE = ["dense_pmap", "embrace", "embrace_2d", "topk_a2a", "oktopk"]


@pytest.mark.cli
@pytest.mark.parametrize("strategy", RESUMABLE)
def test_resume_is_exact(tmp_path, strategy):
    def run(steps, **kw):
        cfg = RunConfig(strategy=strategy, steps=steps, density=0.1, **SMALL, **kw)
        return train_and_evaluate(cfg, progress=False)

    full = run(4)  # never checkpointed: saving must not change the trajectory
    ckpt = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    first = run(2, **ckpt)
    resumed = run(4, resume=True, **ckpt)
    assert first["losses"] == full["losses"][:2]
    assert resumed["start_step"] == 2 and resumed["losses"] == full["losses"][2:]


def test_final_parameters_equal_after_resume(tmp_path):
    w = get_workload("lstm_lm", **{k: v for k, v in SMALL.items() if k != "warmup"})
    params = w.init(jax.random.key(0))

    def build():
        return sc.make_train_step(
            w.loss,
            optax.adam(1e-2),
            runtime.data_mesh(8),
            params,
            "embrace",
            replicated_keys=w.replicated_keys,
            embedding_paths=w.embedding_paths,
        )

    ts = build()
    state = ts.state
    for step in range(4):
        state, _ = ts.step(state, place(ts, w, step, 4))
        if step == 1:
            with checkpoint.Checkpointer(tmp_path) as ckpt:
                ckpt.save_state(2, ts, state, force=True)
    ts2 = build()
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        state2, start = ckpt.restore_state(ts2)
    for step in range(start, 4):
        state2, _ = ts2.step(state2, place(ts2, w, step, 4))
    for a, b in zip(
        jax.tree.leaves(ts.host_params(state)),
        jax.tree.leaves(ts2.host_params(state2)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.cli
def test_interrupted_write_keeps_previous_checkpoint(tmp_path):
    cfg = dict(steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=1, **SMALL)
    train_and_evaluate(RunConfig(**cfg), progress=False)
    # what a crash in the middle of writing step 3 leaves: an unfinished temporary folder
    partial = tmp_path / "3.orbax-checkpoint-tmp-1234"
    partial.mkdir()
    (partial / "junk").write_text("half a checkpoint")
    resumed = train_and_evaluate(RunConfig(**{**cfg, "steps": 3, "resume": True}), progress=False)
    assert resumed["start_step"] == 2
    assert not partial.exists()  # the unfinished write is cleaned at start


def _truncate_arrays(step_folder: Path) -> int:
    """Cuts every array data file of a checkpoint to half its size; returns how many."""
    files = [f for f in step_folder.rglob("*") if f.is_file() and f.parent.name == "d"]
    for f in files:
        os.truncate(f, f.stat().st_size // 2)
    return len(files)


@pytest.mark.cli
@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, damage, capsys):
    """Resume skips a newest checkpoint that does not restore, says so in one line (no
    leftover of its reads after it), and continues from the one before to the losses of
    an uninterrupted run."""
    cfg = dict(strategy="embrace", **SMALL)
    full = train_and_evaluate(RunConfig(steps=4, **cfg), progress=False)
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    train_and_evaluate(RunConfig(steps=3, **cfg, **ck), progress=False)
    assert checkpoint.saved_steps(tmp_path) == [2, 3]
    if damage == "truncated":
        assert _truncate_arrays(tmp_path / "3") > 0
    else:
        shutil.rmtree(tmp_path / "3")
        (tmp_path / "3").mkdir()
    capsys.readouterr()
    resumed = train_and_evaluate(RunConfig(steps=4, resume=True, **cfg, **ck), progress=False)
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "skipped" in line]
    assert len(notes) == 1 and "checkpoint step 3 skipped" in notes[0]
    # reads of the damaged step still in flight once their event loop closed: dropped
    assert "Event loop is closed" not in err and "Exception ignored" not in err
    assert damage != "empty" or "its folder is empty" in notes[0]
    assert resumed["start_step"] == 2 and resumed["losses"] == full["losses"][2:]
    assert checkpoint.saved_steps(tmp_path) == [3, 4]  # its own step 3 replaced the damaged one


@pytest.mark.cli
def test_resume_step_picks_a_checkpoint(tmp_path):
    full = train_and_evaluate(RunConfig(steps=4, **SMALL), progress=False)
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    train_and_evaluate(RunConfig(steps=3, **ck, **SMALL), progress=False)
    with pytest.raises(ValueError, match=r"no checkpoint of step 1 .* it has \[2, 3\]"):
        train_and_evaluate(
            RunConfig(steps=4, resume=True, resume_step=1, **ck, **SMALL), progress=False
        )
    resumed = train_and_evaluate(
        RunConfig(steps=4, resume=True, resume_step=2, **ck, **SMALL), progress=False
    )
    assert resumed["start_step"] == 2 and resumed["losses"] == full["losses"][2:]


@pytest.mark.cli
def test_fresh_run_refuses_another_runs_checkpoints(tmp_path):
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    train_and_evaluate(RunConfig(steps=2, **ck, **SMALL), progress=False)
    first = checkpoint.read_run(tmp_path)
    assert first["config"]["seed"] == 0 and first["config"]["devices"] == 8
    with pytest.raises(
        ValueError,
        match=rf"holds checkpoints \(steps \[1, 2\]\) of run "
        rf"{first['run_id'][:8]}.*--overwrite",
    ):
        train_and_evaluate(RunConfig(steps=4, **ck, **{**SMALL, "seed": 1}), progress=False)
    assert checkpoint.read_run(tmp_path) == first  # untouched
    result = train_and_evaluate(
        RunConfig(steps=1, overwrite=True, **ck, **{**SMALL, "seed": 1}), progress=False
    )
    second = checkpoint.read_run(tmp_path)
    assert result["start_step"] == 0 and checkpoint.saved_steps(tmp_path) == [1]
    assert second["run_id"] != first["run_id"] and second["config"]["seed"] == 1


def test_folder_used_for_other_things_is_refused(tmp_path, monkeypatch):
    (tmp_path / "2024").mkdir()
    (tmp_path / "2024" / "notes.txt").write_text("not a checkpoint")
    monkeypatch.setattr(cli, "build", lambda config: pytest.fail("built despite the folder"))
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"holds folders \['2024'\] that are not checkp"):
            train_and_evaluate(RunConfig(checkpoint_dir=str(tmp_path), overwrite=overwrite))
    assert (tmp_path / "2024" / "notes.txt").exists()


@pytest.mark.cli
def test_resume_refuses_a_different_trajectory_and_names_it(tmp_path):
    ck = str(tmp_path / "ck")
    base = dict(strategy="topk_a2a", density=0.1, checkpoint_dir=ck, checkpoint_every=1, **SMALL)
    train_and_evaluate(RunConfig(steps=2, **base), progress=False)
    changes = [
        ({"lr": 0.01}, ["--lr (0.001 there, 0.01 here)"]),
        ({"seed": 1}, ["--seed (0 there, 1 here)"]),
        ({"optimizer": "sgd", "density": 0.2}, ["--optimizer", "--density"]),
        ({"hidden": 8}, ["--hidden (16 there, 8 here)"]),
    ]
    for change, names in changes:
        with pytest.raises(ValueError, match="this run differs from run") as err:
            train_and_evaluate(
                RunConfig(**{**base, "steps": 3, "resume": True, **change}), progress=False
            )
        assert all(name in str(err.value) for name in names), str(err.value)
    # the run's length, outputs, policies and fields this model or strategy does not read
    # may change
    same = dict(
        steps=3,
        resume=True,
        warmup=1,
        checkpoint_every=2,
        nonfinite="error",
        image_size=8,
        link_gbit=1.0,
        out=str(tmp_path / "r.json"),
    )
    assert train_and_evaluate(RunConfig(**{**base, **same}), progress=False)["start_step"] == 2


@pytest.mark.cli
def test_resume_refuses_checkpoints_without_a_record(tmp_path):
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    train_and_evaluate(RunConfig(steps=1, **ck, **SMALL), progress=False)
    (tmp_path / checkpoint.RUN_FILE).unlink()  # as written before runs were recorded
    with pytest.raises(ValueError, match="records no configuration"):
        train_and_evaluate(RunConfig(steps=2, resume=True, **ck, **SMALL), progress=False)


@pytest.mark.processes
def test_two_runs_cannot_share_a_folder(tmp_path):
    """A second process holding the folder's lock stops this run; once that process is
    killed, the lock is free."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from sparsecomm_jax.checkpoint import "
            "DirectoryLock; lock = DirectoryLock(sys.argv[1]); print('locked', flush=True); "
            "time.sleep(120)",
            str(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"in use by another run \(process {holder.pid} "):
            train_and_evaluate(
                RunConfig(steps=1, checkpoint_dir=str(tmp_path), **SMALL), progress=False
            )
    finally:
        holder.kill()
        holder.wait()
    result = train_and_evaluate(
        RunConfig(steps=1, checkpoint_dir=str(tmp_path), **SMALL), progress=False
    )
    assert len(result["losses"]) == 1


def _read_only_dir(tmp_path):
    """A folder that cannot be written, and the command prefix that makes it so: for
    root (whom permission bits do not stop) a read-only tmpfs mounted over it in a
    private mount namespace."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() != 0:
        return folder, []
    script = 'mount -t tmpfs -o ro none "$0" && exec "$@"'
    return folder, ["unshare", "-m", "sh", "-c", script, str(folder)]


@pytest.mark.processes
@pytest.mark.parametrize("where", ["a regular file", "a read-only folder"])
def test_unwritable_checkpoint_dir_exits_fast(tmp_path, where):
    if where == "a regular file":
        target, prefix = tmp_path / "file", []
        target.write_text("not a folder")
    else:
        target, prefix = _read_only_dir(tmp_path)
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "experiments.train",
        "--devices",
        "2",
        "--batch",
        "4",
        "--vocab",
        "100",
        "--steps",
        "2",
        "--checkpoint-dir",
        str(target),
    ]
    t = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert time.monotonic() - t < 30
    lines = stderr_lines(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: --checkpoint-dir {target}")


FAILED_SAVE = """
import shutil, sys
from pathlib import Path
from sparsecomm_jax import runtime
runtime.simulate_cpu_devices(2)
import jax, optax
from models import get_workload
import sparsecomm_jax as sc
from sparsecomm_jax import checkpoint

w = get_workload("lstm_lm", vocab=64, dim=8, hidden=8, seq_len=4, batch=4)
ts = sc.make_train_step(w.loss, optax.sgd(0.1), runtime.data_mesh(2),
                           w.init(jax.random.key(0)), "dense")
folder = Path(sys.argv[1])
ckpt = checkpoint.Checkpointer(folder)
checkpoint.files.write_json = lambda path, record: None  # the run record aside,
shutil.rmtree(folder)
folder.write_text("the folder became a file")  # orbax's own write fails midway
try:
    ckpt.save_state(1, ts, ts.state, force=True)
except OSError as e:
    print("raised:", e)
"""


@pytest.mark.processes
def test_failed_save_raises_and_the_process_still_exits(tmp_path):
    """A save that cannot be written raises at once, and nothing it started keeps the
    process alive at exit (a plain interpreter exit, no forced one)."""
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", FAILED_SAVE, str(tmp_path / "ck")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert time.monotonic() - t < 30
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "raised: cannot write checkpoint step 1 into" in proc.stdout


@pytest.mark.parametrize("where", ["directory", "under a file"])
def test_unwritable_out_is_refused_before_the_run(tmp_path, where, monkeypatch, capsys):
    monkeypatch.setattr(cli, "build", lambda config: pytest.fail("trained despite bad --out"))
    (tmp_path / "file").write_text("x")
    out = tmp_path if where == "directory" else tmp_path / "file" / "r.json"
    assert main(["--steps", "1", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}")


@pytest.mark.cli
def test_resume_on_another_device_count(tmp_path):
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    base = {**SMALL, "steps": 2}
    # replicated state and column-sharded tables move from 8 to 4 devices
    for strategy in ("dense", "embrace"):
        d = tmp_path / strategy
        train_and_evaluate(
            RunConfig(strategy=strategy, **base, **{**ck, "checkpoint_dir": str(d)}), progress=False
        )
        full = train_and_evaluate(
            RunConfig(strategy=strategy, **{**base, "steps": 3}), progress=False
        )
        resumed = train_and_evaluate(
            RunConfig(
                strategy=strategy,
                devices=4,
                resume=True,
                **{**base, "steps": 3},
                **{**ck, "checkpoint_dir": str(d)},
            ),
            progress=False,
        )
        assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)
    # per-worker residuals cannot: a clear error
    d = str(tmp_path / "topk")
    train_and_evaluate(
        RunConfig(strategy="topk_a2a", **base, checkpoint_dir=d, checkpoint_every=1), progress=False
    )
    with pytest.raises(
        ValueError,
        match="residuals of error feedback for 8 workers; this step has 4: resume it on 8 devices",
    ):
        train_and_evaluate(
            RunConfig(
                strategy="topk_a2a",
                devices=4,
                resume=True,
                checkpoint_dir=d,
                **{**base, "steps": 3},
            ),
            progress=False,
        )


def _poisoned(w, bad_steps, through_gradient=True):
    """``w`` whose loss is NaN at ``bad_steps`` (an int or a predicate on the step): with
    a NaN gradient for a replicated weight, or (``through_gradient=False``) none."""
    is_bad = bad_steps if callable(bad_steps) else (lambda step: step == bad_steps)

    def batch_at(step):
        batch = w.batch_at(step)
        value = np.nan if is_bad(step) else 0.0
        batch["poison"] = np.full((SMALL["batch"],), value, np.float32)
        return batch

    def loss(params, batch, emb=None):
        dense = jax.tree.leaves(params["lstm"])[0].reshape(-1)[0]  # a replicated weight
        if not through_gradient:
            dense = jax.lax.stop_gradient(dense)
        return w.loss(params, batch, emb) + jax.numpy.mean(batch["poison"]) * dense

    return w._replace(batch_at=batch_at, loss=loss)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy, through_gradient",
    [
        ("dense", True),
        ("embrace", True),
        ("topk_a2a", True),
        ("embrace_2d", True),
        ("dense", False),
        ("embrace", False),
        ("dense_pmap", False),
    ],
)
def test_nonfinite_step_is_skipped_and_state_kept(strategy, through_gradient):
    """A NaN gradient, or a NaN loss whose gradient is finite (``through_gradient``
    False): the step is skipped, nothing changes."""
    w = get_workload("lstm_lm", **{k: v for k, v in SMALL.items() if k != "warmup"})
    bad = _poisoned(w, bad_steps=1, through_gradient=through_gradient)
    params = w.init(jax.random.key(0))
    ts = sc.make_train_step(
        bad.loss,
        optax.adam(1e-2),
        runtime.data_mesh(8),
        params,
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        density=0.1,
    )
    state, _ = ts.step(ts.state, place(ts, bad, 0, 4))
    before = jax.tree.map(np.asarray, (ts.host_params(state), state.agg_state))
    after_state, loss = ts.step(state, place(ts, bad, 1, 4))
    assert np.isnan(sc.loss_value(loss))
    after = jax.tree.map(np.asarray, (ts.host_params(after_state), after_state.agg_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # parameters, tables, residuals untouched
        assert np.all(np.isfinite(b))


@pytest.mark.matrix
@pytest.mark.parametrize("strategy", ["dense", "embrace", "dense_pmap"])
def test_a_donated_state_or_an_unplaced_batch_is_a_clear_error(strategy):
    """The step donates its state: calling it again on the old state is a ValueError
    (the runtime would crash on the deleted buffers), as is a batch not placed."""
    w = get_workload("lstm_lm", **{k: v for k, v in SMALL.items() if k != "warmup"})
    params = w.init(jax.random.key(0))
    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        runtime.data_mesh(8),
        params,
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
    )
    with pytest.raises(ValueError, match="batch must be placed first"):
        ts.step(ts.state, w.batch_at(0))
    old, batch = ts.state, place(ts, w, 0, 4)
    state, _ = ts.step(old, batch)
    if strategy != "dense_pmap":  # pmap on CPU keeps the donated buffers: nothing to catch
        with pytest.raises(ValueError, match="donated to an earlier step"):
            ts.step(old, batch)
    _, loss = ts.step(state, place(ts, w, 1, 4))
    assert np.isfinite(sc.loss_value(loss))


def _poison_runs(monkeypatch, bad_steps, through_gradient=True):
    """Makes ``experiments.train`` build poisoned workloads."""
    real = cli.get_workload

    def poisoned(*args, **kwargs):
        return _poisoned(real(*args, **kwargs), bad_steps, through_gradient)

    monkeypatch.setattr(cli, "get_workload", poisoned)


@pytest.mark.cli
def test_nonfinite_policy_in_the_runner(monkeypatch):
    _poison_runs(monkeypatch, 2)
    cfg = dict(strategy="dense", steps=4, **SMALL)
    result = train_and_evaluate(RunConfig(**cfg), progress=False)
    assert result["skipped_steps"] == [2] and np.isfinite(result["losses"][3])
    with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step 2"):
        train_and_evaluate(RunConfig(nonfinite="error", **cfg), progress=False)


@pytest.mark.cli
def test_nonfinite_off_lists_no_applied_step(monkeypatch):
    """A NaN loss whose gradient is finite is applied under ``off``: not 'skipped'."""
    _poison_runs(monkeypatch, 2, through_gradient=False)
    result = train_and_evaluate(RunConfig(nonfinite="off", steps=4, **SMALL), progress=False)
    assert np.isnan(result["losses"][2]) and np.all(np.isfinite(result["losses"][3]))
    assert result["skipped_steps"] == []


@pytest.mark.cli
def test_nonfinite_parameters_stop_the_run_unsaved(monkeypatch, tmp_path):
    """``off`` applies the NaN gradient of step 2: the run stops there, non-zero, and its
    checkpoints end with the state before that step."""
    _poison_runs(monkeypatch, 2)
    args = [
        "--nonfinite",
        "off",
        "--steps",
        "5",
        "--vocab",
        "256",
        "--dim",
        "16",
        "--hidden",
        "16",
        "--seq-len",
        "8",
        "--batch",
        "16",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--checkpoint-every",
        "1",
        "--out",
        str(tmp_path / "r.json"),
    ]
    assert main(args) == 2
    assert checkpoint.saved_steps(tmp_path / "ck") == [1, 2]
    assert not (tmp_path / "r.json").exists()


@pytest.mark.cli
def test_the_loop_keeps_one_step_in_flight_and_it_changes_nothing(monkeypatch, tmp_path):
    """Step t + 1 is handed to the devices before step t's loss is read (the host's work
    between steps overlaps the devices'); a run that saves after every step, or is told
    ``--in-flight no``, waits for each one instead; all give the same losses, bitwise.
    ``auto`` (the default) keeps one in flight for one process on this node's cores."""
    events = record_loop_events(monkeypatch, loop)
    cfg = RunConfig(strategy="embrace", steps=4, **SMALL)
    ahead = train_and_evaluate(cfg, progress=False)
    assert events == ["run", "run", "read", "run", "read", "run", "read", "read"]
    assert ahead["config"]["in_flight"] == "yes"  # decided, and recorded as decided
    events.clear()
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    settled = train_and_evaluate(
        RunConfig(strategy="embrace", steps=4, **ck, **SMALL), progress=False
    )
    assert events == ["run", "read"] * 4
    assert ahead["losses"] == settled["losses"] and np.all(np.isfinite(ahead["losses"]))
    events.clear()
    told = train_and_evaluate(
        RunConfig(strategy="embrace", steps=4, in_flight="no", **SMALL), progress=False
    )
    assert events == ["run", "read"] * 4 and told["losses"] == ahead["losses"]


def test_in_flight_auto_waits_where_cpu_processes_outnumber_cores(monkeypatch):
    """``--in-flight auto``: no step in flight where a host's CPU processes outnumber its
    cores (a host thread would take a core from another process's program), one in
    flight otherwise and on accelerators; a choice given is kept; a loop handed an
    undecided ``auto`` refuses to start."""
    assert loop.in_flight_choice("auto", "cpu", processes=4, cores=2) == "no"
    assert loop.in_flight_choice("auto", "cpu", processes=2, cores=2) == "yes"
    assert loop.in_flight_choice("auto", "gpu", processes=8, cores=2) == "yes"
    assert loop.in_flight_choice("yes", "cpu", processes=4, cores=2) == "yes"
    assert loop.in_flight_choice("no", "gpu", processes=1, cores=64) == "no"
    alone = runtime.busiest_host()  # this process, alone in its job
    quota = cpu_quota()  # a container's, capping the cores in whole CPUs
    cores = len(usable_cores())
    assert alone == (1, cores if quota is None else min(cores, max(int(quota), 1)))
    on_cpu = jax.devices()[0].platform == "cpu"
    monkeypatch.setattr(runtime, "busiest_host", lambda: runtime.HostLoad(3, 2))
    assert loop.decide_in_flight(RunConfig(**SMALL)).in_flight == ("no" if on_cpu else "yes")
    assert loop.decide_in_flight(RunConfig(in_flight="yes", **SMALL)).in_flight == "yes"
    with pytest.raises(ValueError, match="decide_in_flight"):
        loop.run_steps(RunConfig(**SMALL), None, None, None, 0, None, False)


@pytest.mark.cli
def test_a_run_on_an_oversubscribed_host_waits_for_every_step(monkeypatch):
    """A whole run where the busiest host has more CPU processes than cores: ``auto``
    decides ``no``, the loop reads every step before the next, and says so in its JSON."""
    monkeypatch.setattr(runtime, "busiest_host", lambda: runtime.HostLoad(3, 2))
    events = record_loop_events(monkeypatch, loop)
    done = train_and_evaluate(RunConfig(strategy="embrace", steps=4, **SMALL), progress=False)
    if jax.devices()[0].platform == "cpu":
        assert events == ["run", "read"] * 4 and done["config"]["in_flight"] == "no"
    assert np.all(np.isfinite(done["losses"]))


@pytest.mark.cli
def test_parameters_poisoned_while_the_next_step_runs_stop_the_run(monkeypatch):
    """``off`` applies step 2's NaN gradient while step 3 is in flight: the run stops at
    the newest state it can see, naming both steps."""
    _poison_runs(monkeypatch, 2)
    match = r"non-finite after step 3 \(step 2's loss was not finite; diverged"
    with pytest.raises(FloatingPointError, match=match):
        train_and_evaluate(RunConfig(nonfinite="off", steps=6, **SMALL), progress=False)


@pytest.mark.cli
def test_too_many_skipped_steps_stop_the_run(monkeypatch, tmp_path):
    """From step 1 on every gradient is NaN (as after a diverging update): more than
    --max-skipped skipped steps in a row stop the run, and the state they all started
    from is not left as a checkpoint."""
    _poison_runs(monkeypatch, lambda step: step >= 1)
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    with pytest.raises(FloatingPointError, match=r"steps 1-3 \(3 in a row\).*--max-skipped 2"):
        train_and_evaluate(RunConfig(steps=8, max_skipped=2, **ck, **SMALL), progress=False)
    assert checkpoint.saved_steps(tmp_path) == []
    # within the limit the run goes on, listing the skipped steps
    result = train_and_evaluate(RunConfig(steps=4, max_skipped=3, **SMALL), progress=False)
    assert result["skipped_steps"] == [1, 2, 3]


@pytest.mark.cli
@pytest.mark.parametrize("strategy", ["dense", "embrace_rowwise", "topk_a2a"])
def test_same_seed_same_losses_bitwise(strategy):
    cfg = RunConfig(strategy=strategy, steps=3, density=0.05, **SMALL)
    a = train_and_evaluate(cfg, progress=False)["losses"]
    b = train_and_evaluate(cfg, progress=False)["losses"]
    assert a == b


@pytest.mark.processes
def test_killed_rank_then_resume(tmp_path):
    """SIGKILL one rank mid-run: the job stops fast naming it, nothing is left behind, and
    --resume continues from the last checkpoint to the same losses."""
    out, ck = tmp_path / "run.json", tmp_path / "ck"
    marker = tmp_path / "started"
    args = [
        "--strategy",
        "dense",
        "--devices",
        "2",
        "--batch",
        "4",
        "--vocab",
        "200",
        "--steps",
        "60",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "1",
    ]
    launch = [
        sys.executable,
        "-m",
        "sparsecomm_jax.launch",
        "--nproc",
        "2",
        "--",
        sys.executable,
        "-m",
        "experiments.train",
        *args,
    ]
    env = {**os.environ, "SPARSECOMM_TEST_MARK": str(marker)}
    job = subprocess.Popen(
        launch, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 180
    while not (ck.exists() and any(p.name.isdigit() and int(p.name) >= 2 for p in ck.iterdir())):  # noqa: E501
        assert time.monotonic() < deadline and job.poll() is None, "job never checkpointed"
        time.sleep(0.2)
    victim = _rank_pid(1)
    os.kill(victim, signal.SIGKILL)
    t = time.monotonic()
    _, err = job.communicate(timeout=60)
    assert time.monotonic() - t < 30
    assert job.returncode != 0 and "rank 1 exited with signal 9" in err
    assert _rank_pid(0) is None and _rank_pid(1) is None  # no orphans
    steps = 2 + max(int(p.name) for p in ck.iterdir() if p.name.isdigit())  # 2 past the last
    resumed = subprocess.run(
        [*launch[: -len(args)], *args, "--resume", "--steps", str(steps), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["start_step"] >= 2 and len(result["losses"]) == steps - result["start_step"]
    single = train_and_evaluate(
        RunConfig(strategy="dense", devices=2, batch=4, vocab=200, steps=steps), progress=False
    )
    np.testing.assert_allclose(
        result["losses"], single["losses"][result["start_step"] :], rtol=1e-6
    )


def _rank_pid(rank: int):
    """PID of a live experiments.train process of ``rank`` started by this test, if any."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (
            b"experiments.train" in cmd
            and f"SPARSECOMM_PROCESS_ID={rank}".encode() in env
            and any(e.startswith(b"SPARSECOMM_TEST_MARK=") for e in env)
        ):
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
            if state != "Z":
                return int(pid)
    return None


@pytest.mark.cli
def test_calls_of_several_steps_change_nothing(monkeypatch, tmp_path):
    """``--steps-per-call 4``: the losses and bytes a step of one step a call (losses to
    float rounding); a step whose state is saved ends its call (the first, then every
    5th), the steps that cannot make a whole call before it run one a call; a resumed run
    goes on alike."""
    events = record_loop_events(monkeypatch, loop)
    base = dict(strategy="embrace", steps=12, **SMALL)
    one = train_and_evaluate(RunConfig(**base), progress=False)
    events.clear()
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=5)
    calls = train_and_evaluate(RunConfig(steps_per_call=4, **ck, **base), progress=False)
    np.testing.assert_allclose(calls["losses"], one["losses"], rtol=1e-5)
    assert calls["comm_bytes_per_step"] == one["comm_bytes_per_step"] > 0
    assert len(calls["step_times_s"]) == len(calls["place_times_s"]) == 12
    assert checkpoint.saved_steps(tmp_path) == [10, 12]  # 1 and 5 kept no longer (keep 2)
    # calls (0, 1) (1, 4) (5, 4) (9, 1) (10, 1) (11, 1), saved after 1, 5, 10 and 12 steps
    assert events.count("run") == events.count("read") == 6
    with pytest.warns(UserWarning, match="no call of 4 steps fits"):  # 12-15: 14 is saved
        resumed = train_and_evaluate(
            RunConfig(steps_per_call=4, resume=True, **{**ck, **base, "steps": 16}),
            progress=False,
        )
    assert resumed["start_step"] == 12
    full = train_and_evaluate(RunConfig(**{**base, "steps": 16}), progress=False)
    np.testing.assert_allclose(resumed["losses"], full["losses"][12:], rtol=1e-5)


@pytest.mark.cli
def test_a_nonfinite_step_inside_a_call(monkeypatch):
    """A NaN gradient at step 2 of a call of steps 0-3 is skipped and named as one step
    a call names it; applied (``off``), the run stops at the newest state it sees."""
    _poison_runs(monkeypatch, 2)
    cfg = dict(strategy="embrace", steps=8, steps_per_call=4, **SMALL)
    result = train_and_evaluate(RunConfig(**cfg), progress=False)
    one = train_and_evaluate(RunConfig(**{**cfg, "steps_per_call": 1}), progress=False)
    assert result["skipped_steps"] == one["skipped_steps"] == [2]
    np.testing.assert_allclose(result["losses"][3:], one["losses"][3:], rtol=1e-5)
    assert np.isnan(result["losses"][2])
    with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step 2"):
        train_and_evaluate(RunConfig(nonfinite="error", **cfg), progress=False)
    match = r"non-finite after step 7 \(step 2's loss was not finite; diverged"
    with pytest.raises(FloatingPointError, match=match):
        train_and_evaluate(RunConfig(**{**cfg, "nonfinite": "off"}), progress=False)


@pytest.mark.cli
def test_calls_after_a_resume_and_host_work_between_calls(monkeypatch, tmp_path):
    """A resumed run plans no save after its first step (its folder has checkpoints):
    steps 10-17 run as two calls of 4. The host's work before a call (here a save made
    to take 0.6 s) goes into the wall time of the call's first step only, so the median
    wall time stays a step's; ``--warmup`` counts program calls."""
    base = dict(strategy="embrace", steps_per_call=4, checkpoint_dir=str(tmp_path), **SMALL)
    train_and_evaluate(RunConfig(steps=10, checkpoint_every=10, **base), progress=False)
    events = record_loop_events(monkeypatch, loop)
    resumed = train_and_evaluate(
        RunConfig(steps=18, checkpoint_every=10, resume=True, **base), progress=False
    )
    assert resumed["start_step"] == 10 and events.count("run") == 2
    real_save = loop.StepLoop._save

    def slow_save(*args):
        time.sleep(0.6)
        return real_save(*args)

    monkeypatch.setattr(loop.StepLoop, "_save", slow_save)
    # calls (0, 1) (1, 1) (2, 1) (3, 1) (4, 4) (8, 4): saves after steps 0, 3, 7, 11; a
    # fixed capacity, so that no call after the first two compiles (no wall time)
    slow = dict(base, checkpoint_dir=str(tmp_path / "slow"), warmup=2, capacity=256)
    result = train_and_evaluate(RunConfig(steps=12, checkpoint_every=4, **slow), progress=False)
    assert result["programs"] == 2
    assert result["wall_time_s"] < 0.1, result["wall_time_s"]  # 0.6 s spread: >= 0.15 a step
    log = loop.RunLog([], [], [], {}, {}, 0.0, call_sizes=[1, 1, 4, 4])
    assert loop.warm_steps(log, 3) == 6 and loop.warm_steps(log, 9) == 10
    with pytest.raises(ValueError, match="one step or more"):
        sc.call_plan(0, 5, 0)
