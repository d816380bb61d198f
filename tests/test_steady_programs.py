"""One program from the second step on: the tables' slots, sized from the first batch with
a margin (``layout.grow_with_margin``), hold every later batch of a long Zipf stream whose
distinct ids keep growing, so no step compiles after the warm-up; a late compile is
recorded and warned about, naming ``--capacity``."""

import types
import warnings

import jax
import numpy as np
import optax
import pytest

import sparsecomm_jax as sc
from experiments.train import loop, train_and_evaluate
from experiments.train.config import RunConfig
from models import get_workload
from sparsecomm_jax import runtime

STEPS = 200
#: The DLRM of the comparison with TorchRec (8 tables of 100k..100 rows, 128 samples a
#: worker on 4 workers; D made small: slots do not depend on it) and an LM of V = 100k.
DLRM = dict(
    tables="100000,50000,20000,10000,5000,1000,500,100", dim=8, batch=512, zipf_exponent=1.0
)
LM = dict(vocab=100_000, dim=8, hidden=8, seq_len=20, batch=128, sampled_softmax=64)


def _train_step(w, strategy):
    return sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        runtime.data_mesh(4),
        w.init(jax.random.key(0)),
        strategy,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        id_keys=w.id_keys,
    )


def _distinct_seen(w, steps, key) -> int:
    ids = np.concatenate([np.asarray(w.batch_at(s)[key]).ravel() for s in range(steps)])
    return np.unique(ids).size


@pytest.mark.matrix
@pytest.mark.parametrize(
    "model, strategy",
    [
        ("dlrm", "embrace"),
        ("dlrm", "embrace_rowwise"),
        ("lstm_lm", "embrace"),
        ("dlrm", "embrace_2d"),
    ],
)
def test_a_long_zipf_stream_needs_no_new_program_after_its_first_batch(model, strategy):
    """200 batches placed as a run places them: every capacity equals the first batch's
    (one program shape), though the stream keeps reading ids it never read before.

    A property of the streams' statistics, not of each stream: the seed is fixed (a
    stream whose slots grew late would fail this test with a warning; how often that
    happens, and what each margin costs in slots, ``experiments.studies.steady_slots``
    measures over many seeds)."""
    seed = 7
    w = get_workload(model, seed=seed, **(DLRM if model == "dlrm" else LM))
    key = "sparse_0" if model == "dlrm" else "tokens"
    assert _distinct_seen(w, STEPS, key) > 1.5 * _distinct_seen(w, 20, key)  # ids keep coming
    ts = _train_step(w, strategy)
    caps = [sc.place_for_step(ts, w.batch_at, s, STEPS).capacity for s in range(STEPS)]
    late = [s for s in range(1, STEPS) if caps[s] != caps[0]]
    assert not late, (late, caps[0], caps[late[0]] if late else None)
    assert sum(caps[0]) > 0


def _loop(warmup=2):
    config = types.SimpleNamespace(in_flight="no", warmup=warmup)
    ts = types.SimpleNamespace(capacity_slots=(("embed", "distinct rows"),))
    return loop.StepLoop(config, ts, workload=None)


def test_a_late_compile_is_recorded_and_warned_about_naming_capacity():
    """The loop records the first step of every call that compiles; a compile after the
    warm-up whose batch has other slots than the last program of its call size warns,
    naming ``--capacity``; a new call size, or a new structure with the same slots (the
    carried rows of a pipelined step), does not."""
    steps = _loop()
    steps.log.call_sizes.extend([1] * 10)
    batch = types.SimpleNamespace
    steps._note_compile(batch(capacity=(32,)), (1, "a"), 0)
    steps._note_compile(batch(capacity=(32,)), (1, "carry"), 3)  # same slots
    steps._note_compile(batch(capacity=(40,)), (4, "a"), 6)  # a new call size
    with pytest.warns(loop.RecompileWarning, match=r"step 7 .*embed 48.*--capacity"):
        steps._note_compile(batch(capacity=(48,)), (1, "b"), 7)
    assert steps.log.compiled_at == [0, 3, 6, 7]
    with warnings.catch_warnings():
        warnings.simplefilter("error", loop.RecompileWarning)
        _loop()._note_compile(batch(capacity=(8,)), (1, "a"), 5)  # the first program


@pytest.mark.cli
def test_a_200_step_dlrm_run_compiles_one_program_and_warns_of_none():
    """The training command with default flags: 200 steps of the DLRM above compile one
    program, at step 0, and no late-compile warning is raised."""
    config = RunConfig(
        model="dlrm",
        strategy="embrace",
        devices=4,
        steps=200,
        optimizer="sgd",
        lr=0.1,
        bottom="16",
        top="16",
        **DLRM,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", loop.RecompileWarning)
        result = train_and_evaluate(config, progress=False)
    assert result["programs"] == 1 and result["compiled_at_steps"] == [0]
    assert len(result["losses"]) == 200
