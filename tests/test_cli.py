"""experiments.train: the result record, and one-line errors on bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from experiments.config import RunConfig
from experiments.train import adaptive_link, train_and_evaluate

SMALL = dict(vocab=300, dim=16, hidden=16, seq_len=8, batch=16, steps=3, warmup=1)


def test_result_record_fields():
    result = train_and_evaluate(RunConfig(strategy="dense", **SMALL), progress=False)
    for key in (
        "model",
        "strategy",
        "devices",
        "steps",
        "losses",
        "step_time_s",
        "tokens_per_s",
        "comm_bytes_per_step",
        "collectives",
        "config",
    ):
        assert key in result
    assert len(result["losses"]) == 3 and np.all(np.isfinite(result["losses"]))
    assert len(result["step_times_s"]) == 3 and min(result["step_times_s"]) > 0
    assert result["comm_bytes_per_step"] > 0 and result["collectives"][0]["kind"] == "all-reduce"
    assert result["config"]["model_config"]["vocab"] == 300
    json.dumps(result)  # JSON-ready


def test_pmap_and_shard_map_agree_through_cli():
    a = train_and_evaluate(RunConfig(strategy="dense", **SMALL), progress=False)
    b = train_and_evaluate(RunConfig(strategy="dense_pmap", **SMALL), progress=False)
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-6)
    assert a["comm_bytes_per_step"] == pytest.approx(b["comm_bytes_per_step"], rel=1e-6)


def test_calibrated_link_for_adaptive_and_in_the_result():
    config = RunConfig(strategy="adaptive", density=0.1, link_gbit=0, calibrate=True, **SMALL)
    link = adaptive_link(config)  # fitted on the 8 simulated devices
    assert link.beta > 0 and link.alpha >= 0
    result = train_and_evaluate(config, progress=False)
    assert result["link"]["beta"] > 0 and len(result["link"]["points"]) == 3
    assert np.all(np.isfinite(result["losses"]))


def test_more_devices_than_exist():
    with pytest.raises(ValueError, match="only 8"):
        train_and_evaluate(RunConfig(devices=16, **{**SMALL, "batch": 16}), progress=False)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "unknown --model"),
        (["--strategy", "nope"], "unknown --strategy"),
        (["--devices", "4", "--batch", "6"], "not divisible"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--steps", "-3"], "--steps must be >= 1"),
        (["--link-gbit", "-1"], "--link-gbit must be >= 0"),
    ],
)
def test_bad_input_is_one_line_error(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_writes_json(tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--devices",
            "2",
            "--steps",
            "2",
            "--batch",
            "4",
            "--vocab",
            "100",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and len(result["losses"]) == 2


def test_rowwise_run_survives_capacity_growth():
    """Bucket capacity grows mid-run (a new program); the runner recompiles, not fails."""
    config = RunConfig(model="transformer", strategy="embrace_rowwise", devices=4, batch=8,
                       steps=3, vocab=2000, dim=16, warmup=0)  # fmt: skip
    result = train_and_evaluate(config, progress=False)
    assert result["programs"] >= 2 and len(result["losses"]) == 3
    dense = train_and_evaluate(RunConfig(**{**config.__dict__, "strategy": "dense"}),
                               progress=False)  # fmt: skip
    np.testing.assert_allclose(result["losses"], dense["losses"], rtol=1e-5)
