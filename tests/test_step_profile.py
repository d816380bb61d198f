"""experiments.step_profile: per-rank step breakdown read from profiler traces, checked
on synthetic traces whose parts are known."""

import gzip
import json

import numpy as np
import pytest

from experiments import step_profile as sp

TOP = sp.TOP


def _x(name, ts, dur):
    return sp._x(name, ts, dur)


def _write(tmp_path, rank, events):
    folder = tmp_path / "trace" / f"rank{rank}" / "plugins" / "profile" / "2026_01_01"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def _rank_events(rng, steps, t=0.0):
    """Random steps: a program with an all-gather and an all-to-all at random places,
    a host check program (no collective) between steps; returns events and the parts."""
    events, parts = [], []
    for _ in range(steps):
        gap = float(rng.uniform(100, 900))
        events.append(_x(TOP, t + gap / 2, 5.0))  # a check with no collective: not a step
        t += gap
        prog = float(rng.uniform(5_000, 9_000))
        a, b = float(rng.uniform(100, 900)), float(rng.uniform(100, 900))
        events += [
            _x(TOP, t, prog),
            _x("all_gather_invariant.3", t + 10, a),
            _x("fusion.1", t + 10 + a, 50),
            _x("all-to-all.2", t + prog - b - 1, b),
            _x("$python frame", t, prog),  # python tracer frames are ignored
        ]
        parts.append((gap, prog, a, b))
        t += prog
    return events, parts


def test_profile_parts_match_the_synthetic_trace(tmp_path):
    rng = np.random.default_rng(0)
    ev0, p0 = _rank_events(rng, 5)
    ev1, p1 = _rank_events(rng, 5, t=37.0)
    _write(tmp_path, 0, ev0)
    _write(tmp_path, 1, ev1)
    summary = sp.profile(tmp_path)
    r0 = summary["ranks"][0]
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
    assert coll["ms_per_rank"][1] == med([b for _, _, _, b in p1])
    assert "| 1 |" in sp.markdown(summary)


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
    _write(tmp_path, 0, [_x(TOP, 0, 10)])  # a trace with no step in it
    assert sp.main([str(tmp_path)]) == 2
    assert "no step with a collective" in capsys.readouterr().err
