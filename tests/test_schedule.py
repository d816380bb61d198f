"""2D scheduling: planning on hand examples, exact equivalence with embrace and dense,
and the order and dependencies of the compiled step's collectives."""

import re

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, place, reference_run, strategy_run

import sparsecomm_jax as sc
from models import get_workload
from sparsecomm_jax import runtime
from sparsecomm_jax.comm import hlo
from sparsecomm_jax.embedding import access, column, priority, tables
from sparsecomm_jax.schedule import pipeline, scopes

# embrace_2d as its pipelined program (conftest), not as embrace on this CPU mesh
pytestmark = pytest.mark.usefixtures("pipelined_2d")

V, B, T = 256, 16, 8


def test_planning_hand_example():
    ids = np.array([5, 7, 2, 5])
    levels = priority.priority_levels(ids, np.array([7, 2]))
    np.testing.assert_array_equal(levels, [1, 0, 0, 1])
    np.testing.assert_array_equal(priority.priority_order(levels), [1, 2, 0, 3])
    assert priority.chunk_bounds(4, [2]) == [(0, 2), (2, 4)]
    assert priority.chunk_bounds(4, [8]) == [(0, 4)]
    assert priority.chunk_bounds(5, [2, 2]) == [(0, 2), (2, 4), (4, 5)]
    workers = [np.array([5, 7, 2, 5]), np.array([1, 1, 9, 9])]
    assert priority.high_priority_capacity(workers, np.array([7, 2, 1])) == 2


def test_more_than_two_levels():
    levels = np.array([2, 0, 1, 0, 2, 1])  # e.g. needed by t+1, by t+2, later
    np.testing.assert_array_equal(priority.priority_order(levels), [1, 3, 2, 5, 0, 4])


def _lm(batches=None):
    w = get_workload(
        "lstm_lm", vocab=V, dim=16, hidden=16, seq_len=T, batch=B, sampled_softmax=16, seed=2
    )
    if batches is None:
        return w
    return w._replace(batch_at=lambda s: {**w.batch_at(s), "tokens": batches(s)})


def _disjoint(step):  # t and t+1 share no id
    rng = np.random.default_rng(step)
    return rng.integers(0, V // 2, (B, T + 1)).astype(np.int32) + (step % 2) * (V // 2)


def _same(step):  # every step reads the same ids
    return np.random.default_rng(0).integers(0, V, (B, T + 1)).astype(np.int32)


def _repeats(step):  # few distinct ids, repeated within rows and across workers
    return np.random.default_rng(step).integers(0, 3, (B, T + 1)).astype(np.int32) * 7


CASES = {"zipf": None, "disjoint": _disjoint, "same": _same, "repeats": _repeats}


@pytest.mark.matrix
@pytest.mark.parametrize(
    "case, opt",
    [
        ("zipf", "adam"),  # the dense table update; the row update on the other patterns
        ("disjoint", "sgd"),
        ("same", "sgd"),
        ("repeats", "adam"),
    ],
)
def test_embrace_2d_equals_embrace_and_dense(case, opt):
    w = _lm(CASES[case])
    params = w.init(jax.random.key(0))
    optimizer = optax.sgd(0.5) if opt == "sgd" else optax.adam(1e-2, eps=1e-3)
    steps = 5
    ref_losses, ref_params = reference_run(w, optimizer, params, steps)
    embrace, _, _ = strategy_run(w, optimizer, params, steps, "embrace")
    losses, got, _ = strategy_run(w, optimizer, params, steps, "embrace_2d")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(losses, embrace, rtol=1e-5)
    assert_trees_close(got, ref_params, rtol=1e-4, atol=1e-5)


@pytest.mark.matrix
@pytest.mark.parametrize("steps", [1, 2])
def test_first_and_last_steps(steps):
    """One step (no t-1, no t+1) and two steps (a first and a last) are exact."""
    w = _lm()
    params = w.init(jax.random.key(1))
    ref_losses, ref_params = reference_run(w, optax.sgd(0.5), params, steps)
    losses, got, ts = strategy_run(w, optax.sgd(0.5), params, steps, "embrace_2d")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params)
    assert ts.lookahead == pipeline.LOOKAHEAD


def _middle_step_program(table_update="dense"):
    """The compiled program of a middle step (rows carried in, next batch given)."""
    w = _lm(_disjoint)  # disjoint halves: a real low-priority chunk exists
    ts = sc.make_train_step(
        w.loss,
        optax.sgd(0.1),
        runtime.data_mesh(8),
        w.init(jax.random.key(0)),
        "embrace_2d",
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        table_update=table_update,
    )
    state, _ = ts.step(ts.state, place(ts, w, 0, 3))
    return hlo.compiled_text(ts.step, state, place(ts, w, 1, 3))


@pytest.mark.matrix
@pytest.mark.parametrize("update", ["dense", "rows"])
def test_compiled_order_and_dependencies(update):
    text = _middle_step_program(update)
    instrs = hlo.entry_instructions(text)
    colls = hlo.scheduled_collectives(text)
    order = [c.name for c in instrs]

    def named(scope, kind="all-to-all"):
        return [c for c in colls if scope in c.op_name and c.opcode == kind]

    high, low, nxt = (named(s) for s in (scopes.SCOPE_HIGH, scopes.SCOPE_LOW, scopes.SCOPE_NEXT))
    assert high and low and nxt
    # the shared negatives batch t+1 does not read travel late (a reduce-scatter in low)
    assert named(scopes.SCOPE_LOW, "reduce-scatter")
    if update == "rows":  # row-sparse: the tables are updated in place, never copied
        assert not re.search(rf"= f32\[{V},\d+\]\S* copy\(", text)
    # horizontal: every high-priority all-to-all is issued before any low-priority one
    assert max(order.index(c.name) for c in high) < min(order.index(c.name) for c in low)
    # the lookup of batch t+1 does not wait for the low-priority exchange
    low_names = {c.name for c in low}
    for c in nxt:
        assert not hlo.ancestors(instrs, c.name) & low_names
    # vertical: the dense layers' mean and the embedding exchange are independent (the
    # all-reduce of the loss and the finite flag reads every gradient on purpose: not here)
    dense = [c for c in colls if scopes.SCOPE_DENSE in c.op_name]
    assert dense
    for d in dense:
        assert not hlo.ancestors(instrs, d.name) & {c.name for c in high + low}
        for c in high:
            assert d.name not in hlo.ancestors(instrs, c.name)


def test_full_softmax_is_refused_clearly():
    w = get_workload("lstm_lm", vocab=V, dim=16, hidden=16, seq_len=T, batch=B)
    with pytest.raises(ValueError, match="use a sampled softmax"):
        strategy_run(w, optax.sgd(0.1), w.init(jax.random.key(0)), 1, "embrace_2d")


def _levels_reference(ids, future):
    """Brute force: the first future batch that reads each id, else len(future)."""
    out = []
    for v in ids:
        hits = [k for k, f in enumerate(future) if v in set(np.ravel(f))]
        out.append(hits[0] if hits else len(future))
    return np.array(out)


def test_next_use_levels_never_compares_every_pair():
    """n positions against m ids read next: sorted and searched, no n x m array in the
    compiled program (``jnp.isin``'s default builds one: at P = 32 with 2,048 ids a
    worker, more memory than this host has)."""
    n, m = 4096, 3072
    fn = jax.jit(lambda ids, nxt: priority.next_use_levels(ids, [nxt, nxt]))
    text = fn.lower(jax.numpy.zeros(n, "int32"), jax.numpy.zeros(m, "int32")).compile().as_text()
    assert f"[{n},{m}]" not in text and f"[{m},{n}]" not in text


@pytest.mark.parametrize("seed", range(3))
def test_next_use_levels_against_reference(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 12, 40)
    future = [rng.integers(0, 12, rng.integers(1, 6)) for _ in range(3)]
    want = _levels_reference(ids, future)
    np.testing.assert_array_equal(priority.next_use_levels(ids, future), want)
    got = priority.next_use_levels(jax.numpy.asarray(ids), [jax.numpy.asarray(f) for f in future])
    np.testing.assert_array_equal(np.asarray(got), want)
    order = priority.priority_order(want)  # t+1 first, then t+2, ...; stable within
    assert (np.diff(want[order]) >= 0).all()
    np.testing.assert_array_equal(order, sorted(range(40), key=lambda p: (want[p], p)))


@pytest.mark.parametrize("gbit, dim, workers", [(1.0, 512, 4), (0.2, 64, 2), (10.0, 8, 8)])
def test_late_chunk_rows_meets_the_latency_share(gbit, dim, workers):
    from sparsecomm_jax.comm import costmodel

    link = costmodel.Link.from_bandwidth(gbit)
    rows = priority.late_chunk_rows(link, 4 * dim, workers, overhead=0.1)

    def latency_share(n):
        wire = (workers - 1) / workers * n * 4 * dim * link.beta
        return (workers - 1) * link.alpha / ((workers - 1) * link.alpha + wire)

    assert latency_share(rows) <= 0.1 + 1e-9
    assert rows == 1 or latency_share(rows - 1) > 0.1


@pytest.mark.parametrize("n, first", [(1000, 100), (37, 37), (500, 0), (9, 3)])
def test_late_capacities_cover_every_position(n, first):
    """Chunk sizes in priority order: ``first``, then at most ``MAX_LATE_CHUNKS`` late
    chunks that hold every other position, none of them needless."""
    sizes = priority.late_capacities(n, first, 512, 4)
    late = sizes[1:]
    assert sizes[0] == first and sum(late) >= n - first
    assert all(c > 0 for c in late) and sum(late[:-1]) < max(1, n - first)
    assert len(late) <= priority.MAX_LATE_CHUNKS


def test_table_reads_count_every_read_of_a_tied_table():
    w = get_workload("gpt2", vocab=32, dim=8, seq_len=6, batch=8, sampled_softmax=5)
    params = w.init(jax.random.key(0))
    mask = tables.table_mask(params, w.embedding_paths)
    reads_of = access.host_reads(w.loss, params, mask, w.replicated_keys, 4)
    reads = reads_of(w.batch_at(0))
    [(table, (look, shared))] = reads.items()
    tokens = w.batch_at(0)["tokens"].reshape(4, 2, 7)
    want = np.concatenate([tokens[:, :, :-1].reshape(4, -1), tokens[:, :, 1:].reshape(4, -1)], 1)
    np.testing.assert_array_equal(look, want)
    np.testing.assert_array_equal(shared, w.batch_at(0)["negatives"])
    nxt = reads_of(w.batch_at(1))
    every = set(np.ravel(nxt[table][0])) | set(nxt[table][1])
    need = max(int(np.isin(row, list(every)).sum()) for row in want)
    found = tables.find_tables(params, mask, column.COLUMN)
    assert priority.first_chunk_need([reads, nxt], found, 4) == {table: need}
    per_key = max(int(np.isin(t.ravel(), list(every)).sum()) for t in tokens)
    assert need > per_key  # counting the key once under-sizes the chunk
