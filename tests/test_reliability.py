"""Checkpoint and exact resume, non-finite gradients, determinism, killed ranks."""

import json
import os
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
from helpers import place

from experiments.config import RunConfig
from experiments.train import train_and_evaluate
from models import get_workload
from sparsecomm_jax import checkpoint, runtime, train

SMALL = dict(vocab=256, dim=16, hidden=16, seq_len=8, batch=16, sampled_softmax=16, warmup=0)
RESUMABLE = ["dense_pmap", "dense", "sparse_allgather", "embrace", "embrace_rowwise",
             "embrace_2d", "topk_a2a", "gtopk", "embrace+topk_allgather"]  # fmt: skip


@pytest.mark.parametrize("strategy", RESUMABLE)
def test_resume_is_exact(tmp_path, strategy):
    def run(steps, **kw):
        cfg = RunConfig(strategy=strategy, steps=steps, density=0.1, **SMALL, **kw)
        return train_and_evaluate(cfg, progress=False)

    full = run(4)
    ckpt = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    first = run(2, **ckpt)
    resumed = run(4, resume=True, **ckpt)
    assert first["losses"] == full["losses"][:2]
    assert resumed["start_step"] == 2 and resumed["losses"] == full["losses"][2:]


def test_final_parameters_equal_after_resume(tmp_path):
    w = get_workload("lstm_lm", **{k: v for k, v in SMALL.items() if k != "warmup"})
    params = w.init(jax.random.key(0))

    def build():
        return train.make_train_step(w.loss, optax.adam(1e-2), runtime.data_mesh(8), params,
                                     "embrace", replicated_keys=w.replicated_keys,
                                     embedding_paths=w.embedding_paths)  # fmt: skip

    ts = build()
    state = ts.state
    for step in range(4):
        state, _ = ts.step(state, place(ts, w, step, 4))
        if step == 1:
            checkpoint.Checkpointer(tmp_path).save(2, ts, state, force=True)
    ts2 = build()
    state2, start = checkpoint.Checkpointer(tmp_path).restore(ts2)
    for step in range(start, 4):
        state2, _ = ts2.step(state2, place(ts2, w, step, 4))
    for a, b in zip(jax.tree.leaves(ts.host_params(state)),
                    jax.tree.leaves(ts2.host_params(state2)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)


def test_interrupted_write_keeps_previous_checkpoint(tmp_path):
    cfg = dict(steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=1, **SMALL)
    train_and_evaluate(RunConfig(**cfg), progress=False)
    # what a crash in the middle of writing step 3 leaves: an unfinished temporary folder
    partial = tmp_path / "3.orbax-checkpoint-tmp-1234"
    partial.mkdir()
    (partial / "junk").write_text("half a checkpoint")
    resumed = train_and_evaluate(RunConfig(**{**cfg, "steps": 3, "resume": True}),
                                 progress=False)  # fmt: skip
    assert resumed["start_step"] == 2


def test_resume_on_another_device_count(tmp_path):
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    base = {**SMALL, "steps": 2}
    # replicated state and column-sharded tables move from 8 to 4 devices
    for strategy in ("dense", "embrace"):
        d = tmp_path / strategy
        train_and_evaluate(RunConfig(strategy=strategy, **base, **{**ck, "checkpoint_dir": str(d)}),
                           progress=False)  # fmt: skip
        full = train_and_evaluate(RunConfig(strategy=strategy, **{**base, "steps": 3}),
                                  progress=False)  # fmt: skip
        resumed = train_and_evaluate(
            RunConfig(strategy=strategy, devices=4, resume=True, **{**base, "steps": 3},
                      **{**ck, "checkpoint_dir": str(d)}), progress=False)  # fmt: skip
        assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=1e-5)
    # per-worker residuals cannot: a clear error
    d = str(tmp_path / "topk")
    train_and_evaluate(RunConfig(strategy="topk_a2a", **base, checkpoint_dir=d,
                                 checkpoint_every=1), progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="same number of devices"):
        train_and_evaluate(RunConfig(strategy="topk_a2a", devices=4, resume=True, checkpoint_dir=d,
                                     **{**base, "steps": 3}), progress=False)  # fmt: skip


def _poisoned(w, bad_step):
    def batch_at(step):
        batch = w.batch_at(step)
        if step == bad_step:
            batch["poison"] = np.full((SMALL["batch"],), np.nan, np.float32)
        else:
            batch["poison"] = np.zeros((SMALL["batch"],), np.float32)
        return batch

    def loss(params, batch, emb=None):
        dense = jax.tree.leaves(params["lstm"])[0].reshape(-1)[0]  # a replicated weight
        return w.loss(params, batch, emb) + jax.numpy.mean(batch["poison"]) * dense

    return w._replace(batch_at=batch_at, loss=loss)


@pytest.mark.parametrize("strategy", ["dense", "embrace", "topk_a2a", "embrace_2d"])
def test_nonfinite_step_is_skipped_and_state_kept(strategy):
    w = get_workload("lstm_lm", **{k: v for k, v in SMALL.items() if k != "warmup"})
    bad = _poisoned(w, bad_step=1)
    params = w.init(jax.random.key(0))
    ts = train.make_train_step(bad.loss, optax.adam(1e-2), runtime.data_mesh(8), params,
                               strategy, replicated_keys=w.replicated_keys,
                               embedding_paths=w.embedding_paths, density=0.1)  # fmt: skip
    state, _ = ts.step(ts.state, place(ts, bad, 0, 4))
    before = jax.tree.map(np.asarray, (ts.host_params(state), state.agg_state))
    after_state, loss = ts.step(state, place(ts, bad, 1, 4))
    assert np.isnan(train.loss_value(loss))
    after = jax.tree.map(np.asarray, (ts.host_params(after_state), after_state.agg_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # parameters, tables, residuals untouched
        assert np.all(np.isfinite(b))


def test_nonfinite_policy_in_the_runner(monkeypatch):
    import models

    real = models.get_workload
    monkeypatch.setattr(models, "get_workload", lambda *a, **k: _poisoned(real(*a, **k), 2))
    cfg = dict(strategy="dense", steps=4, **SMALL)
    result = train_and_evaluate(RunConfig(**cfg), progress=False)
    assert result["skipped_steps"] == [2] and np.isfinite(result["losses"][3])
    with pytest.raises(FloatingPointError, match="non-finite gradient at step 2"):
        train_and_evaluate(RunConfig(nonfinite="error", **cfg), progress=False)


@pytest.mark.parametrize("strategy", ["dense", "embrace_rowwise", "topk_a2a"])
def test_same_seed_same_losses_bitwise(strategy):
    cfg = RunConfig(strategy=strategy, steps=3, density=0.05, **SMALL)
    a = train_and_evaluate(cfg, progress=False)["losses"]
    b = train_and_evaluate(cfg, progress=False)["losses"]
    assert a == b


@pytest.mark.slow
def test_killed_rank_then_resume(tmp_path):
    """SIGKILL one rank mid-run: the job stops fast naming it, nothing is left behind, and
    --resume continues from the last checkpoint to the same losses."""
    out, ck = tmp_path / "run.json", tmp_path / "ck"
    marker = tmp_path / "started"
    args = ["--strategy", "dense", "--devices", "2", "--batch", "4", "--vocab", "200",
            "--steps", "60", "--checkpoint-dir", str(ck), "--checkpoint-every", "1"]  # fmt: skip
    launch = [sys.executable, "-m", "sparsecomm_jax.launch", "--nproc", "2", "--",
              sys.executable, "-m", "experiments.train", *args]  # fmt: skip
    env = {**os.environ, "SPARSECOMM_TEST_MARK": str(marker)}
    job = subprocess.Popen(launch, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env)  # fmt: skip
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
    resumed = subprocess.run([*launch[:-len(args)], *args, "--resume", "--steps", "62",
                              "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                             timeout=240)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["start_step"] >= 2 and len(result["losses"]) == 62 - result["start_step"]
    single = train_and_evaluate(RunConfig(strategy="dense", devices=2, batch=4, vocab=200,
                                          steps=62), progress=False)  # fmt: skip
    np.testing.assert_allclose(result["losses"], single["losses"][result["start_step"]:],
                               rtol=1e-6)  # fmt: skip


def _rank_pid(rank: int):
    """PID of a live experiments.train process of ``rank`` started by this test, if any."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (b"experiments.train" in cmd and f"SPARSECOMM_PROCESS_ID={rank}".encode() in env
                and any(e.startswith(b"SPARSECOMM_TEST_MARK=") for e in env)):  # fmt: skip
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
            if state != "Z":
                return int(pid)
    return None
