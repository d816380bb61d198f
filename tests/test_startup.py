"""--bucket-mb auto: the search over measured step times, and the recorded result."""

import dataclasses

import jax
import numpy as np
import pytest

from experiments.train import build, startup, train_and_evaluate, validate
from experiments.train.config import RunConfig
from models import get_workload
from sparsecomm_jax.comm import fusion

TINY = dict(
    model="lstm_lm",
    strategy="topk_allgather",
    devices=2,
    batch=4,
    steps=2,
    warmup=0,
    vocab=100,
    dim=8,
    hidden=8,
    seq_len=4,
)


def test_choose_bucket_finds_the_least_stand_in_step_time(monkeypatch):
    config = RunConfig(**TINY, bucket_mb="auto")
    seen = []

    def stand_in(cfg, build_fn, bucket_bytes):  # unimodal in the threshold
        seen.append(bucket_bytes)
        return abs(bucket_bytes - 3000) + 1.0

    monkeypatch.setattr(startup, "measured_step_s", stand_in)
    chosen, record = startup.choose_bucket(config, build)
    params = jax.eval_shape(
        get_workload("lstm_lm", vocab=100, dim=8, hidden=8, seq_len=4, batch=4).init,
        jax.random.key(0),
    )
    sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]
    candidates = fusion.candidate_thresholds(sizes)
    best = min(candidates, key=lambda c: abs(c - 3000))
    assert record["bucket_bytes"] == best and float(chosen.bucket_mb) * 2**20 == best
    assert record["evaluations"] == len(set(seen)) < len(candidates)


def test_search_skips_thresholds_whose_buckets_keep_no_entry(monkeypatch):
    config = RunConfig(**TINY, bucket_mb="auto", density=0.01)
    sizes, seen = startup.leaf_sizes(config), []

    def stand_in(cfg, build_fn, bucket_bytes):  # smaller is faster: leaves alone would win
        seen.append(bucket_bytes)
        return float(bucket_bytes)

    monkeypatch.setattr(startup, "measured_step_s", stand_in)
    _, record = startup.choose_bucket(config, build)
    for threshold in seen:
        plan = fusion.plan_buckets(sizes, threshold)
        assert all(round(0.01 * sum(sizes[i] for i in b)) >= 1 for b in plan)
    valid = startup.selectable_thresholds(sizes, 0.01)
    assert record["bucket_bytes"] == valid[0] > fusion.candidate_thresholds(sizes)[0]


@pytest.mark.cli
def test_auto_bucket_run_records_the_threshold_and_resumes_with_it(tmp_path):
    """The search's threshold is in the result and in the checkpoint folder's record: the
    same command with ``--resume`` takes it instead of searching anew (which could pick
    another and change the trajectory)."""
    ck = dict(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    result = train_and_evaluate(RunConfig(**TINY, bucket_mb="auto", **ck), progress=False)
    search = result["bucket_search"]
    assert search["evaluations"] == len(search["step_s"]) >= 1
    assert str(search["bucket_bytes"]) in search["step_s"]
    assert float(result["config"]["bucket_mb"]) * 2**20 == search["bucket_bytes"]
    assert len(result["losses"]) == 2
    again = RunConfig(**{**TINY, "steps": 3}, bucket_mb="auto", resume=True, **ck)
    resumed = train_and_evaluate(again, progress=False)
    assert resumed["start_step"] == 2 and "bucket_search" not in resumed
    assert resumed["config"]["bucket_mb"] == result["config"]["bucket_mb"]


@pytest.mark.parametrize("value", ["-1", "big"])
def test_bad_bucket_mb(value):
    with pytest.raises(ValueError, match="--bucket-mb must be"):
        validate(dataclasses.replace(RunConfig(**TINY), bucket_mb=value))


def test_calibrated_adaptive_link_carries_local_work(monkeypatch):
    monkeypatch.setattr(startup, "calibrated_link", lambda devices: {"alpha": 1e-5, "beta": 1e-9})
    config = RunConfig(**{**TINY, "strategy": "adaptive"}, link_gbit=0.0)
    link = startup.adaptive_link(config)
    assert set(link.local.lines) == {"topk_allgather", "topk_a2a", "topk_balanced", "oktopk"}
    assert all(fixed >= 0 and per >= 0 for fixed, per in link.local.lines.values())
    assert startup.adaptive_link(dataclasses.replace(config, link_gbit=1.0)).local is None


def test_embrace_2d_keeps_the_planner_from_unpadded_column_tables():
    """``embrace_2d`` keeps its column tables unpadded: its planner constraint lets a
    table take the column layout only where D divides by P. ``embrace`` pads, and puts
    no constraint."""
    from sparsecomm_jax import STRATEGIES
    from sparsecomm_jax.embedding.column import COLUMN
    from sparsecomm_jax.embedding.layout import TableStats
    from sparsecomm_jax.embedding.row import ROW

    may = startup.step_may(STRATEGIES["embrace_2d"], 4)
    eight, six = TableStats("a", 100, 8, 16, 10, 4), TableStats("b", 100, 6, 16, 10, 4)
    assert (may(eight, COLUMN), may(six, COLUMN), may(six, ROW)) == (True, False, True)
    assert startup.step_may(STRATEGIES["embrace"], 4) is None
