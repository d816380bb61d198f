"""Several steps in one program call (``TrainStep.steps``, ``--steps-per-call``): the same
arithmetic as one call a step, the batches checked and sized as one by one, the calls
planned around the steps whose state must be seen."""

import random

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, strategy_run

import sparsecomm_jax as sc
from models import get_workload
from sparsecomm_jax import runtime
from sparsecomm_jax.comm import hlo

SMALL = dict(vocab=256, dim=16, hidden=16, seq_len=8, batch=16, sampled_softmax=16)


def build(workload, strategy, optimizer=None, params=None, **kwargs):
    """``make_train_step`` of ``workload`` on 8 devices (SGD 0.1 and its initial
    parameters unless given)."""
    return sc.make_train_step(
        workload.loss,
        optimizer or optax.sgd(0.1),
        runtime.data_mesh(8),
        workload.init(jax.random.key(0)) if params is None else params,
        strategy,
        replicated_keys=workload.replicated_keys,
        embedding_paths=workload.embedding_paths,
        id_keys=workload.id_keys,
        **kwargs,
    )


def scanned_run(workload, optimizer, params, sizes, strategy, **kwargs):
    """Steps in calls of ``sizes`` steps (``ts.steps`` for several, ``ts.step`` for
    one); returns (losses, host params, TrainStep)."""
    ts = build(workload, strategy, optimizer, params, **kwargs)
    steps, first = sum(sizes), 0
    calls = [(first := first + s) - s for s in sizes]
    state, losses = ts.state, []
    for start, size in zip(calls, sizes, strict=True):
        batch = sc.place_for_call(ts, workload.batch_at, (start, size), steps)
        state, loss = (ts.steps if size > 1 else ts.step)(state, batch)
        losses += sc.loss_values(loss)
    return losses, ts.host_params(state), ts


# sharded columns with capacities that grow between steps, dense, per-worker residuals,
# row-wise tables updated by their rows with their own optimizer state
@pytest.mark.matrix
@pytest.mark.parametrize(
    "strategy, optimizer, kwargs",
    [
        ("embrace", optax.adam(1e-2, eps=1e-3), {}),
        ("dense", optax.sgd(0.1), {}),
        ("topk_a2a", optax.sgd(0.1), dict(density=0.1)),
        ("embrace_rowwise", sc.lazy_adam(1e-2, eps=1e-3), dict(table_update="rows")),
    ],
)
def test_steps_in_one_call_equal_one_call_a_step(strategy, optimizer, kwargs):
    """Seven steps as calls of 3, 1 and 3 steps give the losses and parameters of seven
    calls of one step, on a fresh random model and data: to float rounding (XLA compiles
    the scanned step as a loop body and may fuse it otherwise; with its default flags
    they were bitwise equal, with this suite's fast-compile flags within rounding; Adam's
    ``eps`` as in ``test_equivalence``, so that rounding is not amplified)."""
    seed = random.randrange(2**16)
    print(f"seed {seed}")  # shown with a failure
    w = get_workload("lstm_lm", seed=seed, **SMALL)
    params = w.init(jax.random.key(seed))
    one, p_one, _ = strategy_run(w, optimizer, params, 7, strategy, **kwargs)
    many, p_many, ts = scanned_run(w, optimizer, params, [3, 1, 3], strategy, **kwargs)
    assert ts.scannable and np.all(np.isfinite(one)) and len(many) == 7
    np.testing.assert_allclose(many, one, rtol=1e-5, err_msg=f"seed {seed}")
    assert_trees_close(p_many, p_one, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sizes", [[3, 1, 3], [4, 3]])
def test_pipelined_steps_unrolled_in_one_call_equal_one_call_a_step(pipelined_2d, sizes):
    """``embrace_2d``'s pipelined step (its rows carried to the next step, batches read
    ahead) runs several steps a call unrolled: seven steps as calls of ``sizes`` give
    the losses and parameters of seven calls of one step, the carried rows threaded
    through (the calls before the run's end read past their own batches, the last one
    to the run's end), on a fresh random model and data."""
    seed = random.randrange(2**16)
    print(f"seed {seed}")  # shown with a failure
    w = get_workload("lstm_lm", seed=seed, **SMALL)
    params = w.init(jax.random.key(seed))
    optimizer = optax.adam(1e-2, eps=1e-3)
    one, p_one, ts_one = strategy_run(w, optimizer, params, 7, "embrace_2d")
    many, p_many, ts = scanned_run(w, optimizer, params, sizes, "embrace_2d")
    assert ts.runs_as == ts_one.runs_as == "embrace_2d" and ts.scannable
    assert len(many) == 7 and np.all(np.isfinite(one))
    np.testing.assert_allclose(many, one, rtol=1e-5, err_msg=f"seed {seed}")
    assert_trees_close(p_many, p_one, rtol=1e-4, atol=1e-5)


def test_a_call_of_pipelined_steps_names_each_step_in_its_program(pipelined_2d):
    """The unrolled steps of one call each run in their own name scope (``step0``,
    ``step1``, ...), so the compiled program tells them apart; a call reads at most the
    step's lookahead past its own batches."""
    w = get_workload("lstm_lm", **SMALL)
    ts = build(w, "embrace_2d")
    placed = sc.place_for_call(ts, w.batch_at, (0, 3), 10)
    assert placed.steps == 3 and jax.tree.leaves(placed.data)[0].shape[0] == 3 + ts.lookahead
    text = hlo.compiled_text(ts.steps, ts.state, placed)
    scopes = {c.op_name.split("/")[1] for c in hlo.scheduled_collectives(text)}
    assert {"step0", "step1", "step2"} <= scopes, scopes
    too_many = [w.batch_at(s) for s in range(3 + ts.lookahead + 1)]
    with pytest.raises(ValueError, match="at most 3 batches after the call"):
        ts.place_steps(too_many[:3], *too_many[3:])


def test_pmapped_steps_run_one_step_a_call():
    """A ``jax.pmap`` step cannot run several steps a call; asking for a call of
    several, or calling ``ts.steps`` itself, is an error naming the strategy."""
    w = get_workload("lstm_lm", **SMALL)
    ts = build(w, "dense_pmap")
    assert not ts.scannable
    refused = "strategy 'dense_pmap' runs one step a program call"
    with pytest.raises(ValueError, match=f"ts.place_steps: {refused}"):
        sc.place_for_call(ts, w.batch_at, (0, 2), 4)
    with pytest.raises(ValueError, match=f"ts.steps: {refused}"):
        ts.steps(ts.state, ts.place_batch(w.batch_at(0)))


def test_place_steps_checks_and_sizes_every_batch():
    """Each batch of a call passes the checks ``place_batch`` makes; the call gets the
    capacity of its largest batch; batches unlike the first, or none, are refused."""
    w = get_workload("lstm_lm", **SMALL)
    ts, twin = (build(w, "embrace") for _ in range(2))
    # the last batch reads one id: a call sized by its last batch alone would be short
    batches = [w.batch_at(s) for s in range(3)]
    batches.append({k: np.zeros_like(v) for k, v in w.batch_at(3).items()})
    singles = [twin.place_batch(b).capacity for b in batches]  # grown batch by batch
    placed = ts.place_steps(batches)
    assert placed.capacity == singles[-1] == tuple(np.max(singles, axis=0))
    alone = build(w, "embrace").place_batch(batches[-1]).capacity
    assert np.all(np.less(alone, placed.capacity)), (alone, placed.capacity)
    assert {k: v.shape for k, v in placed.data.items()} == {
        k: (4, *np.shape(v)) for k, v in batches[0].items()
    }
    bad = dict(batches[2], tokens=np.full_like(batches[2]["tokens"], SMALL["vocab"]))
    with pytest.raises(ValueError, match="tokens") as one:
        ts.place_batch(bad)
    with pytest.raises(ValueError, match="tokens") as call:
        ts.place_steps([batches[0], bad])
    assert str(one.value) == str(call.value)
    short = {k: v[:8] for k, v in batches[1].items()}
    with pytest.raises(ValueError, match="must be alike"):
        ts.place_steps([batches[0], short])
    with pytest.raises(ValueError, match="one step or more"):
        ts.place_steps([])
    # a call's batch goes to ts.steps, one step's to ts.step (on one device either
    # would otherwise run as something else)
    with pytest.raises(ValueError, match=r"holds 4 step\(s\) \(place_steps\): call ts.steps"):
        ts.step(ts.state, placed)
    with pytest.raises(ValueError, match=r"holds 1 step\(s\) \(place_batch\): call ts.step"):
        ts.steps(ts.state, ts.place_batch(batches[0]))
    state, losses = ts.steps(ts.state, placed)
    assert len(sc.loss_values(losses)) == 4


def test_call_plan_against_its_rules():
    """On random runs: every step once, in order; calls of ``size`` steps or of one; a
    step that ends a call is the last of its call; a call of one step only where a call
    of ``size`` would run past the end or past a step that ends a call."""
    rng = random.Random(0)
    for _ in range(300):
        start, steps, size = rng.randrange(5), rng.randrange(30), rng.randrange(1, 7)
        marked = {s for s in range(steps) if rng.random() < 0.15}
        calls = sc.call_plan(start, steps, size, ends=marked.__contains__)
        covered = [s for first, n in calls for s in range(first, first + n)]
        assert covered == list(range(start, steps))
        for first, n in calls:
            assert n in (1, size)
            assert not marked & set(range(first, first + n - 1))
            whole = range(first, first + size)
            could = whole.stop <= steps and not marked & set(whole[:-1])
            assert (n == size) == could or size == 1
