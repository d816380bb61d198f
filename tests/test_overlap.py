"""Horizontal scheduling across steps (``make_overlapped``): exactly ``embrace`` every step,
on tied tables, with Adam and with the row-sparse update, after a skipped step, in two
programs or one; the late program runs beside the next
step's compute; many steps on 2 processes under the launcher end without deadlock."""

import types

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trees_close
from test_pipeline_exact import _poisoned, _run, _workload

import sparsecomm_jax as sc
from sparsecomm_jax import runtime
from sparsecomm_jax.embedding import priority
from sparsecomm_jax.schedule import overlap, scopes


def _overlapped(w, steps, params, optimizer, devices=4, timeline=None, fused=False, **kw):
    ov = sc.make_overlapped(
        w.loss,
        optimizer,
        runtime.data_mesh(devices),
        params,
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
        id_keys=w.id_keys,
        **kw,
    )
    state, losses = ov.run(ov.state, w.batch_at, steps, timeline, fused=fused)
    return np.array(losses), ov.host_params(state)


@pytest.mark.matrix
@pytest.mark.parametrize(
    "name, opt, poison, fused",
    [
        ("gpt2", "rows", 1, False),
        ("lstm_lm", "adam", 1, False),
        ("gpt2", "adam", 2, True),
        ("lstm_lm", "rows", None, True),  # the one-program form with the row-sparse update
    ],
)
def test_overlapped_equals_embrace(name, opt, poison, fused):
    """``rows``: SGD with the row-sparse table update (``table_update="rows"``) in both."""
    w = _workload(name, seed=4)
    if poison is not None:
        w = _poisoned(w, poison)
    optimizer = optax.sgd(0.5) if opt in ("sgd", "rows") else optax.adam(1e-2, eps=1e-3)
    kw = {"table_update": "rows"} if opt == "rows" else {}
    params = w.init(jax.random.key(0))
    ref_losses, ref = _run(w, "embrace", 4, params, optimizer=optimizer, **kw)
    timeline = []
    losses, got = _overlapped(w, 4, params, optimizer, timeline=timeline, fused=fused, **kw)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)
    count = [p for p, *_ in timeline].count
    if fused:  # one program per middle step; the first step's high, the last's low
        assert (count("fused"), count("high"), count("low")) == (3, 1, 1)
    else:
        assert count("high") == count("low") == 4 and count("compute") >= 4


def test_overlapped_guard_when_the_first_chunk_is_too_small(monkeypatch):
    """Capacity 1: the device flags the spill, the driver fetches batch t+1's rows
    again after the full update and recomputes: still exactly embrace."""
    monkeypatch.setattr(
        priority, "first_chunk_need", lambda reads, tables, workers: {t.index: 1 for t in tables}
    )
    w = _workload("gpt2", seed=5)
    params = w.init(jax.random.key(0))
    ref_losses, ref = _run(w, "embrace", 3, params, optimizer=optax.sgd(0.5))
    timeline = []
    losses, got = _overlapped(w, 3, params, optax.sgd(0.5), timeline=timeline)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(got, ref, rtol=1e-4, atol=1e-5)
    assert [p for p, *_ in timeline].count("fetch") > 1  # the guard fetched again


@pytest.mark.processes
@pytest.mark.parametrize("nproc", [2])
def test_many_overlapped_steps_on_processes(tmp_path, nproc):
    """8 steps on 2 gloo processes: no deadlock, no collective mismatch (only the late
    program communicates while the next step computes), losses equal embrace's."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    out, steps = tmp_path / "t.json", 8
    cmd = [
        sys.executable,
        "-m",
        "sparsecomm_jax.launch",
        "--nproc",
        str(nproc),
        "--",
        sys.executable,
        "-m",
        "experiments.studies.timeline",
        "--strategies",
        "embrace,overlap",
        "--vocab",
        "64",
        "--dim",
        "8",
        "--hidden",
        "8",
        "--seq-len",
        "8",
        "--batch",
        "8",
        "--sampled-softmax",
        "4",
        "--steps",
        str(steps),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(nproc):
        runs = json.loads((tmp_path / f"t.rank{rank}.json").read_text())["runs"]
        np.testing.assert_allclose(runs["overlap"]["losses"], runs["embrace"]["losses"], rtol=1e-5)
        phases = [p for p, *_ in runs["overlap"]["timeline"]]
        assert phases.count("low") == phases.count("high") == steps


def test_optimizer_halves_merge_to_one_update():
    """Adam on the dense leaves (``dense_half``: the row view of no table rows) then on
    the table from the old count (``with_other`` + ``pick``) equals one Adam step on
    everything."""
    import jax.numpy as jnp

    from sparsecomm_jax.embedding import column, row_optimizers, update
    from sparsecomm_jax.embedding.tables import find_tables
    from sparsecomm_jax.step.state import StepContext, TrainState

    rng = np.random.default_rng(0)
    params = {
        "embed": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
    }
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    opt, mask = optax.adam(0.1), {"embed": True, "w": False}
    tables = find_tables(params, mask, column.COLUMN)
    ctx = StepContext(
        None,
        opt,
        None,
        params,
        "data",
        (),
        tables,
        mask,
        (6,),
        None,
        None,
        None,
        "skip",
        update.DENSE,
        jnp.float32,
        True,
    )
    state = TrainState(params, opt.init(params), ())
    kinds = overlap.split_roles(ctx, state.opt_state)
    view = types.SimpleNamespace(  # one device: rows read and written in place
        roles=row_optimizers.state_roles(opt, state.opt_state, params),
        take=lambda i, x, ids: row_optimizers.take_rows(x, ids),
        put=lambda i, x, ids, rows: row_optimizers.put_rows(x, ids, rows),
    )
    mean = {"embed": None, "w": grads["w"]}
    dense = overlap.dense_half(ctx, state, mean, jnp.array(True), view)
    leaves = jax.tree.leaves(state.opt_state)
    other = [x for k, x in zip(kinds, leaves, strict=True) if k == "other"]
    opt_in = overlap.with_other(kinds, dense.opt_state, other)
    tables_new, opt_t = update.dense_apply(
        opt, dense.params, opt_in, {"embed": grads["embed"], "w": jnp.zeros(3)}
    )
    merged_opt = overlap.pick(kinds, "table", opt_t, dense.opt_state)
    merged = {"embed": tables_new["embed"], "w": dense.params["w"]}
    ref_params, ref_opt = update.dense_apply(opt, params, state.opt_state, grads)
    assert_trees_close(merged, ref_params, rtol=1e-6, atol=1e-7)
    assert_trees_close(merged_opt, ref_opt, rtol=1e-6, atol=1e-7)


def test_fused_program_keeps_the_late_exchange_off_the_next_step_path():
    """In the one-program form, step t's first-chunk all-to-alls (fed by step t's
    compute) do not wait for step t-1's late all-to-alls: a scheduler may overlap them."""
    from test_pipeline_exact import _alternating

    from sparsecomm_jax.comm import hlo

    w = _alternating()
    ov = sc.make_overlapped(
        w.loss,
        optax.sgd(0.5),
        runtime.data_mesh(4),
        w.init(jax.random.key(0)),
        replicated_keys=w.replicated_keys,
        embedding_paths=w.embedding_paths,
    )
    progs, at = ov.programs, w.batch_at
    b0, b1 = ov.place(*(at(s) for s in range(4))), ov.place(*(at(s) for s in range(1, 5)))
    rows = progs.fetch(ov.state.params, b0.data)
    state, rows, pend, _, _ = progs.high(
        ov.state, *progs.compute(ov.state.params, rows, b0.data), b0
    )
    text = hlo.compiled_text(progs.fused, state, pend, rows, b1, b0.capacity)
    instrs, colls = hlo.entry_instructions(text), hlo.scheduled_collectives(text)
    low = {c.name for c in colls if scopes.SCOPE_LOW in c.op_name and c.opcode == "all-to-all"}
    first = [
        c
        for c in colls
        if scopes.SCOPE_HIGH in c.op_name
        and c.opcode == "all-to-all"
        and scopes.SCOPE_NEXT not in c.op_name
    ]
    assert low and first
    for c in first:
        assert not hlo.ancestors(instrs, c.name) & low


def test_what_make_overlapped_cannot_split_is_refused():
    """A table of another layout (its trainer carries column-wise rows only) and an
    optimizer that couples rows: each refused when built, naming what to use."""
    from sparsecomm_jax.embedding.tables import table_name

    w = _workload("gpt2", seed=4)
    params = w.init(jax.random.key(0))
    name = table_name(w.embedding_paths[0])
    with pytest.raises(ValueError, match=rf"column-wise tables only; \['{name}'\] have other"):
        _overlapped(w, 2, params, optax.sgd(0.5), table_layouts={name: "row"})
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5))
    with pytest.raises(ValueError, match="this one couples rows"):
        _overlapped(w, 2, params, clipped)
