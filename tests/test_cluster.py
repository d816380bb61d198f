"""The emulated cluster: argument checks, clean-up, and a small throttled run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from experiments import cluster

pytestmark = pytest.mark.processes


def test_argument_checks():
    cluster.check_args(2, 1, "100mbit", "")
    cluster.check_args(2, 1, "1gbit", "50us")
    for args, message in [
        ((0, 1, "1gbit", ""), "--nproc"),
        ((2, 1, "1gb", ""), "--bandwidth"),
        ((2, 1, "1gbit", "fast"), "--latency"),
    ]:
        with pytest.raises(ValueError, match=message):
            cluster.check_args(*args)
    assert cluster.qdisc_args("1gbit", "")[:3] == ["tbf", "rate", "1gbit"]
    assert cluster.qdisc_args("1gbit", "1ms")[:3] == ["netem", "delay", "1ms"]
    assert cluster.loopback_rate("1gbit", 4, per_worker=False) == "1gbit"
    assert cluster.loopback_rate("1gbit", 4, per_worker=True) == "4000000kbit"
    assert cluster.loopback_rate("2.5mbit", 3, per_worker=True) == "7500kbit"
    assert cluster.main(["--nproc", "2", "--bandwidth", "fast", "--", "--steps", "1"]) == 2


CAN_RUN = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
WHY = "needs root and iproute2 (ip, tc) for a network namespace with a rate limit"


def _namespaces() -> set[str]:
    """The cluster's own namespaces (``sparsecomm<pid>``; other tools' are not ours)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in out.splitlines() if line.strip()}
    return {n for n in names if n.startswith("sparsecomm")}


def _cluster(tmp_path, strategy, extra=()):
    out = tmp_path / f"{strategy}.json"
    cmd = [
        sys.executable,
        "-m",
        "experiments.cluster",
        "--nproc",
        "2",
        "--bandwidth",
        "1gbit",
        "--",
        "--strategy",
        strategy,
        "--batch",
        "8",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--vocab",
        "10000",
        "--dim",
        "64",
        "--sampled-softmax",
        "64",
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    return proc, out


@pytest.mark.skipif(not CAN_RUN, reason=WHY)
def test_embrace_on_a_throttled_link_matches_dense_and_sends_less(tmp_path):
    """Two processes behind a rate-limited loopback: embrace's losses equal dense's and it
    sends a tenth of the bytes. (How much faster it is, is measured by the benchmarks in
    experiments/, not asserted here.)"""
    before = _namespaces()
    results = {}
    for strategy in ("dense", "embrace"):
        proc, out = _cluster(tmp_path, strategy)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        results[strategy] = json.loads(out.read_text())
    dense, embrace = results["dense"], results["embrace"]
    assert dense["devices"] == embrace["devices"] == 2  # --devices left out: the job's
    assert embrace["losses"] == pytest.approx(dense["losses"], rel=1e-5)
    assert embrace["comm_bytes_per_step"] < dense["comm_bytes_per_step"] / 10
    assert not _namespaces() - before  # ours removed (another run's may come and go)


@pytest.mark.skipif(not CAN_RUN, reason=WHY)
def test_cleanup_when_training_fails(tmp_path):
    before = _namespaces()
    proc, _ = _cluster(tmp_path, "dense", ["--model", "nope"])
    assert proc.returncode != 0
    assert not _namespaces() - before
