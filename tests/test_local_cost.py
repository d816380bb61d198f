"""experiments.studies.local_cost: the timed aggregation is topk_allgather's, and the report."""

import json

import numpy as np
import pytest

from experiments.studies import local_cost


def test_aggregation_step_is_error_feedback_topk():
    rng = np.random.default_rng(0)
    g, r = rng.normal(size=(2, 1000)).astype(np.float32)
    mean, residual = local_cost.aggregation_step(0.05, "auto")(g, r)
    acc = g + r
    sent = np.zeros_like(acc)
    top = np.argsort(-np.abs(acc), kind="stable")[:50]
    sent[top] = acc[top]
    np.testing.assert_array_equal(np.asarray(mean), sent)
    np.testing.assert_array_equal(np.asarray(residual), acc - sent)


@pytest.mark.cli
def test_main_writes_passes(tmp_path):
    argv = [
        "--size",
        "4096",
        "--densities",
        "0.01,0.2",
        "--selectors",
        "auto,radix",
        "--repeats",
        "1",
        "--out-dir",
        str(tmp_path),
    ]
    assert local_cost.main(argv) == 0
    result = json.loads((tmp_path / "local_cost.json").read_text())
    assert [(r["density"], r["selector"]) for r in result["rows"]] == [
        (0.01, "auto"),
        (0.01, "radix"),
        (0.2, "auto"),
        (0.2, "radix"),
    ]
    assert all(r["select_passes"] > 0 and r["aggregate_passes"] > 0 for r in result["rows"])
