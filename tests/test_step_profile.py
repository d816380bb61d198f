"""experiments.studies.step_profile: per-device step breakdown read from profiler traces, checked
on synthetic traces whose parts are known and on a real trace of a jitted shard_map."""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from experiments.studies import step_profile as sp
from sparsecomm_jax import runtime


def _write(tmp_path, rank, events):
    folder = tmp_path / "trace" / f"rank{rank}" / "plugins" / "profile" / "2026_01_01"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def _rank_events(rng, steps, t=0.0):
    """Random steps of the step program (an all-gather, a fusion, an all-to-all), a
    check program between steps (no collective: not a step) and another program with a
    collective that runs once (not the step's); returns events and the parts."""
    events, parts = [], []
    for s in range(steps):
        gap = float(rng.uniform(100, 900))
        events.append(sp._x("reduce.1", t + gap / 2, 5.0, run=1000 + s, module="jit_finite"))
        t += gap
        a, c, b = (float(rng.uniform(100, 900)) for _ in range(3))
        run = 7 + s
        events += [
            sp._x("all_gather_invariant.3", t, a, run=run),
            sp._x("fusion.1", t + a, c, run=run),
            sp._x("all-to-all.2", t + a + c, b, run=run),
            {"ph": "X", "name": "$python frame", "ts": t, "dur": a, "pid": 1, "tid": 2},
        ]
        parts.append((gap, a + c + b, a, b))
        t += a + c + b
    events.append(sp._x("all-gather.9", t + 50, 10, run=99, module="jit_host_params"))
    return events, parts


def test_profile_parts_match_the_synthetic_trace(tmp_path):
    rng = np.random.default_rng()
    ev0, p0 = _rank_events(rng, 5)
    ev1, p1 = _rank_events(rng, 5, t=37.0)
    _write(tmp_path, 0, ev0)
    _write(tmp_path, 1, ev1)
    summary = sp.profile(tmp_path)
    r0 = summary["ranks"]["0"]
    med = lambda xs: pytest.approx(float(np.median(xs)) / 1e3, abs=1e-3)  # noqa: E731
    assert r0["steps"] == 5
    assert r0["program_ms"] == med([p for _, p, _, _ in p0])
    assert r0["collective_ms"] == med([a + b for _, _, a, b in p0])
    assert r0["compute_ms"] == med([p - a - b for _, p, a, b in p0])
    # the host gap: from one step's end to the next one's start (the first step has none)
    assert r0["host_ms"] == med([g for g, _, _, _ in p0[1:]])
    least = [min(x[2], y[2]) + min(x[3], y[3]) for x, y in zip(p0, p1, strict=True)]
    assert r0["transfer_ms"] == med(least)
    assert r0["wait_ms"] == med([a + b - t for (_, _, a, b), t in zip(p0, least, strict=True)])
    coll = summary["collectives"]["all-to-all.2"]
    assert coll["kind"] == "all-to-all"
    assert coll["ms_per_rank"]["1"] == med([b for _, _, _, b in p1])
    assert "all-gather.9" not in summary["collectives"]  # another program's collective
    assert "| 1 |" in sp.markdown(summary)


def test_steps_that_ran_other_collectives_are_an_error(tmp_path):
    _write(tmp_path, 0, [sp._x("all-to-all.1", 0, 5, run=1)])
    _write(tmp_path, 1, [sp._x("all-gather.2", 0, 5, run=1)])
    with pytest.raises(ValueError, match="other collectives"):
        sp.profile(tmp_path)


def test_a_real_trace_of_several_devices(tmp_path):
    """A jitted shard_map with a psum and an all_gather on 8 devices of one process,
    traced by jax.profiler: one entry per device, 3 steps each, and parts that add up."""
    mesh = runtime.data_mesh(8)

    def body(x):  # x: float[1, 64]
        y = jnp.tanh(x @ jnp.ones((64, 64)))
        return jax.lax.all_gather(jax.lax.psum(y, "data"), "data", tiled=True)[None]

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    x = runtime.put_global(np.ones((8, 64), np.float32), mesh, P("data"))
    step(x).block_until_ready()  # compiled outside the trace
    folder = tmp_path / "trace"
    jax.profiler.start_trace(str(folder))
    for _ in range(3):
        step(x).block_until_ready()
    jax.profiler.stop_trace()
    summary = sp.profile(tmp_path)
    assert sorted(summary["ranks"]) == [f"0/{d}" for d in range(8)]
    for r in summary["ranks"].values():
        assert r["steps"] == 3
        assert 0 < r["collective_ms"] <= r["program_ms"]
        assert 0 <= r["compute_ms"] <= r["program_ms"]  # medians of the parts of each step
        assert r["host_ms"] > 0  # the host's round trip between two runs
    kinds = {c["kind"] for c in summary["collectives"].values()}
    assert kinds == {"all-reduce", "all-gather"}


def test_collective_kinds():
    assert sp.collective_kind("all_gather_invariant.10") == "all-gather"
    assert sp.collective_kind("psum_invariant.7") == "all-reduce"
    assert sp.collective_kind("psum_scatter.2") == "reduce-scatter"
    assert sp.collective_kind("all-to-all") == "all-to-all"
    assert sp.collective_kind("fusion.all-to-all") is None
    assert sp.collective_kind("psumfoo") is None


def test_no_trace_is_a_clear_error(tmp_path, capsys):
    assert sp.main([str(tmp_path)]) == 2
    assert "--profile-steps" in capsys.readouterr().err
    _write(tmp_path, 0, [sp._x("fusion", 0, 10)])  # a trace with no step in it
    assert sp.main([str(tmp_path)]) == 2
    assert "no step with a collective" in capsys.readouterr().err


SCOPED = {  # instruction -> the op_name its metadata carries, as XLA prints a step's
    "fusion.1": "jit(step)/shard_map/jvp(DLRM)/MLP_0/Dense_1/add",
    "fusion.2": "jit(step)/shard_map/transpose(jvp(DLRM))/bfd,bgd->bfg/dot_general",
    "sort.3": "jit(step)/shard_map/jit(_unique_sorted_mask)/jit(lexsort)/sort",
    "scatter.4": "jit(step)/shard_map/scatter-add",
    "fusion.5": "jit(step)/mul",
}
HLO = "\n".join(
    ["HloModule jit_step", "ENTRY %main {"]
    + [f'  %{n} = f32[8] fusion(%p), metadata={{op_name="{op}"}}' for n, op in SCOPED.items()]
    + ["  ROOT %copy.6 = f32[8] copy(%w)", "}"]
)


def test_each_thunk_lands_in_the_part_its_op_name_names(tmp_path):
    """With the step's HLO, every thunk's time goes to one part (the MLPs, the
    interaction, the exchange's work, the scatters, the optimizer, the collectives,
    the rest), and the parts of a step add up to its thunks' time."""
    rng = np.random.default_rng()
    names = ["fusion.1", "fusion.2", "sort.3", "scatter.4", "fusion.5", "copy.6", "all-to-all.7"]
    want = {
        "fusion.1": "MLPs (forward, backward)",
        "fusion.2": "interaction (forward, backward)",
        "sort.3": "exchange's local work (ids sorted, deduplicated, bucketed; rows gathered)",
        "scatter.4": "gradient rows summed, tables updated (scatter)",
        "fusion.5": "optimizer, step checks (outside shard_map)",
        "copy.6": sp.OTHER,
        "all-to-all.7": sp.COLLECTIVES,
    }
    events, t, durations = [], 0.0, []
    for step in range(3):
        dur = {n: float(rng.uniform(10, 500)) for n in names}
        for n in names:
            events.append(sp._x(n, t, dur[n], run=step + 1))
            t += dur[n]
        durations.append(dur)
        t += 100.0
    _write(tmp_path, 0, events)
    (tmp_path / "step.txt").write_text(HLO)
    parts = sp.profile(tmp_path, tmp_path / "step.txt")["ranks"]["0"]["parts_ms"]
    for name, part in want.items():
        assert parts[part] == pytest.approx(np.median([d[name] for d in durations]) / 1e3, abs=1e-3)
    assert "part of the step" in sp.markdown(sp.profile(tmp_path, tmp_path / "step.txt"))
    assert "parts_ms" not in sp.profile(tmp_path)["ranks"]["0"]  # no HLO: no parts
