"""The multi-process launcher: a 2 x 2 job equals a 4-device run; failures stop fast."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO

from experiments.config import RunConfig
from experiments.train import train_and_evaluate
from sparsecomm_jax import launch, runtime

ARGS = dict(vocab=300, dim=16, hidden=16, seq_len=8, batch=8, steps=3, warmup=1)


def _launch(nproc, per_proc, cmd, timeout=240):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sparsecomm_jax.launch",
            "--nproc",
            str(nproc),
            "--devices-per-proc",
            str(per_proc),
            "--",
            *cmd,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_rank_env_is_complete():
    env = launch.rank_env(1, 3, 2, "127.0.0.1:1234")
    assert env[runtime.ENV_PROCESS_ID] == "1" and env[runtime.ENV_NUM_PROCESSES] == "3"
    assert env[runtime.ENV_LOCAL_DEVICES] == "2"
    assert env[runtime.ENV_COORDINATOR] == "127.0.0.1:1234"


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path):
    out = tmp_path / "mp.json"
    flags = []
    for k, v in ARGS.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    cmd = [
        sys.executable,
        "-m",
        "experiments.train",
        "--strategy",
        "dense",
        "--devices",
        "4",
        *flags,
        "--out",
        str(out),
    ]
    proc = _launch(2, 2, cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0]" in proc.stdout and "[rank 1]" in proc.stdout
    multi = json.loads(out.read_text())
    single = train_and_evaluate(RunConfig(strategy="dense", devices=4, **ARGS), progress=False)
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-6)
    assert multi["comm_bytes_per_step"] == pytest.approx(single["comm_bytes_per_step"])


def test_failing_rank_stops_job_fast(tmp_path):
    marker = tmp_path / "pids"
    script = (
        "import os, sys, time\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "if os.environ['SPARSECOMM_PROCESS_ID'] == '1':\n"
        "    time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    t = time.monotonic()
    proc = _launch(3, 1, [sys.executable, "-c", script], timeout=60)
    assert time.monotonic() - t < 15
    assert proc.returncode == 3
    assert "rank 1 exited with code 3" in proc.stderr
    for pid in map(int, marker.read_text().split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_killed_rank_is_named():
    script = (
        "import os, signal, time\n"
        "if os.environ['SPARSECOMM_PROCESS_ID'] == '0': os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    proc = _launch(2, 1, [sys.executable, "-c", script], timeout=60)
    assert proc.returncode == 1
    assert f"rank 0 exited with signal {int(signal.SIGKILL)}" in proc.stderr


def test_launcher_usage_errors():
    assert launch.main(["--nproc", "2"]) == 2
    assert launch.main(["--nproc", "0", "--", "true"]) == 2
