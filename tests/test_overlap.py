"""Horizontal scheduling across steps (``overlap``): exactly ``embrace`` every step, on
tied tables, with Adam, after a skipped step; the late program runs beside the next
step's compute; many steps on 2 processes under the launcher end without deadlock."""

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from test_pipeline_exact import _poisoned, _run, _workload

from sparsecomm_jax import overlap, runtime


def _overlapped(w, steps, params, optimizer, devices=4, timeline=None):
    ov = overlap.make_overlapped(
        w.loss, optimizer, runtime.data_mesh(devices), params,
        replicated_keys=w.replicated_keys, embedding_paths=w.embedding_paths,
        id_keys=w.id_keys,
    )  # fmt: skip
    state, losses = ov.run(ov.state, w.batch_at, steps, timeline)
    return np.array(losses), ov.host_params(state)


@pytest.mark.parametrize("name, opt, poison", [("gpt2", "sgd", None), ("lstm_lm", "adam", 1)])
def test_overlapped_equals_embrace(name, opt, poison):
    w = _workload(name, seed=4)
    if poison is not None:
        w = _poisoned(w, poison)
    optimizer = optax.sgd(0.5) if opt == "sgd" else optax.adam(1e-2, eps=1e-3)
    params = w.init(jax.random.key(0))
    ref_losses, ref = _run(w, "embrace", 4, params, optimizer=optimizer)
    timeline = []
    losses, got = _overlapped(w, 4, params, optimizer, timeline=timeline)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)
    phases = [p for p, *_ in timeline]
    assert phases.count("high") == phases.count("low") == 4
    assert phases.count("compute") >= 4


def test_overlapped_guard_when_the_first_chunk_is_too_small(monkeypatch):
    """Capacity 1: the device flags the spill, the driver fetches batch t+1's rows
    again after the full update and recomputes: still exactly embrace."""
    from sparsecomm_jax import schedule

    monkeypatch.setattr(schedule, "first_chunk_need", lambda *a: 1)
    w = _workload("gpt2", seed=5)
    params = w.init(jax.random.key(0))
    ref_losses, ref = _run(w, "embrace", 3, params, optimizer=optax.sgd(0.5))
    timeline = []
    losses, got = _overlapped(w, 3, params, optax.sgd(0.5), timeline=timeline)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)
    assert [p for p, *_ in timeline].count("fetch") > 1  # the guard fetched again


def test_many_overlapped_steps_on_two_processes(tmp_path):
    """12 steps on 2 gloo processes: no deadlock, no collective mismatch (only the late
    program communicates while the next step computes), losses equal embrace's."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    out, steps = tmp_path / "t.json", 12
    cmd = [sys.executable, "-m", "sparsecomm_jax.launch", "--nproc", "2", "--",
           sys.executable, "-m", "experiments.timeline", "--strategies", "embrace,overlap",
           "--vocab", "64", "--dim", "8", "--hidden", "8", "--seq-len", "8", "--batch", "8",
           "--sampled-softmax", "4", "--steps", str(steps), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        runs = json.loads((tmp_path / f"t.rank{rank}.json").read_text())["runs"]
        np.testing.assert_allclose(runs["overlap"]["losses"], runs["embrace"]["losses"],
                                   rtol=1e-5)  # fmt: skip
        phases = [p for p, *_ in runs["overlap"]["timeline"]]
        assert phases.count("low") == phases.count("high") == steps
