"""The multi-process launcher and multi-host start-up: a 2 x 2 job and a two-node job equal
single-process runs; failures, signals and a killed launcher leave nothing behind; bad
input is a one-line error; schedulers are read the way jax.distributed reads them."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import NUM_DEVICES, REPO
from helpers import stderr_lines
from jax.sharding import PartitionSpec as P

from experiments.train import train_and_evaluate
from experiments.train.config import RunConfig
from experiments.train.validate import flag_words
from sparsecomm_jax import cores, distributed, launch, runtime

pytestmark = pytest.mark.processes

ARGS = dict(vocab=300, dim=16, hidden=16, seq_len=8, batch=8, steps=3, warmup=1)
LAUNCH = [sys.executable, "-m", "sparsecomm_jax.launch"]


def _launch(nproc, per_proc, cmd, timeout=240, extra=()):
    return subprocess.run(
        [*LAUNCH, "--nproc", str(nproc), "--devices-per-proc", str(per_proc), *extra, "--", *cmd],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _train_cmd(out, devices=None, strategy="dense"):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]
    devices = ["--devices", str(devices)] if devices else []
    return [
        sys.executable,
        "-m",
        "experiments.train",
        "--strategy",
        strategy,
        *devices,
        *flags,
        "--out",
        str(out),
    ]


def _single(devices, strategy="dense"):
    assert jax.device_count() == NUM_DEVICES  # JAX starts with conftest's devices, not ours
    config = RunConfig(strategy=strategy, devices=devices, **ARGS)
    return train_and_evaluate(config, progress=False)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_lines(path, n, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().split()) >= n):
        assert time.monotonic() < deadline and proc.poll() is None, "ranks never started"
        time.sleep(0.05)
    return [int(pid) for pid in path.read_text().split()]


def _all_gone(pids, within_s):
    deadline = time.monotonic() + within_s
    while any(launch.process_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_rank_env_is_complete():
    job = launch.make_job(3, 2, nnodes=2, node_rank=1, coordinator="10.0.0.1:1234")
    env = launch.rank_env(job, 2)
    assert env[launch.ENV_PROCESS_ID] == str(1 * 3 + 2)
    assert env[launch.ENV_NUM_PROCESSES] == "6" and env[launch.ENV_NODE_RANK] == "1"
    assert env[launch.ENV_LOCAL_DEVICES] == "2" and env[launch.ENV_LOCAL_DEVICE_IDS] == "4,5"
    assert env[launch.ENV_COORDINATOR] == "10.0.0.1:1234"
    pid, start = env[launch.ENV_LAUNCHER].split(":")
    assert int(pid) == os.getpid() and launch.process_alive(int(pid), start)
    assert not launch.process_alive(int(pid), str(int(start) + 1))  # a reused pid is not us


def test_each_rank_computes_on_its_share_of_the_hosts_cores(monkeypatch):
    """Several ranks on a host: each gets its share of the host's cores for XLA:CPU's
    compute threads (at least one); one rank, or a share the user set, is left alone."""
    for var in launch.USER_THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(launch, "host_cores", lambda: 6)
    threads = [launch.rank_env(launch.make_job(n, 1), 0).get("NPROC") for n in (1, 2, 4, 8)]
    assert threads == [None, "3", "1", "1"]
    monkeypatch.setenv("PJRT_NPROC", "2")  # XLA reads it first: the user's choice
    assert "NPROC" not in launch.rank_env(launch.make_job(4, 1), 3)
    monkeypatch.setenv(launch.ENV_COMPUTE_THREADS, "5")
    assert launch.rank_env(launch.make_job(4, 1), 3)["NPROC"] == "5"


def test_the_share_reaches_xlas_compute_pool():
    """A rank's XLA:CPU runs its programs on as many threads as its share says (the
    pool's threads counted by name), and the launcher counts a host's cores as the job's
    host load does."""
    assert cores.host_cores() == runtime.busiest_host().cores  # this process alone
    env = launch.rank_env(launch.make_job(2, 1), 0)
    # one CPU device (XLA keeps a thread per device) and no other choice of the pool
    env.pop("PJRT_NPROC", None)
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "force_host_platform_device_count" not in f)
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    code = (
        "import os, jax.numpy as jnp; (jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()"
        "; tasks = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir("
        "'/proc/self/task')]; print(sum('XLAEigen' in t for t in tasks))"
    )
    for share in ("1", "3"):
        env[launch.ENV_COMPUTE_THREADS] = share
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-1] == share


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nproc", "0"], "--nproc must be >= 1"),
        (
            ["--nproc", "1", "--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1"],
            "--node-rank must be in [0, --nnodes=2)",
        ),
        (["--nproc", "1", "--node-rank", "-1"], "--node-rank"),
        (["--nproc", "1", "--nnodes", "2"], "needs --coordinator"),
        (["--nproc", "1", "--coordinator", "nohost"], "--coordinator must be HOST:PORT"),
        (["--nproc", "1", "--port", "1", "--coordinator", "h:2"], "not both"),
        (["--nproc", "1", "--exit-grace", "nan"], "--exit-grace must be >= 0"),
    ],
)
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    assert launch.main([*flags, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_missing_command_busy_port_and_absent_coordinator(capsys):
    assert launch.main(["--nproc", "2"]) == 2  # no "--"
    assert launch.main(["--nproc", "2", "--", "/nonexistent/cmd"]) == 2
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        assert launch.main(["--nproc", "1", "--port", port, "--", "true"]) == 2
    t = time.monotonic()
    absent = f"127.0.0.1:{_free_port()}"
    assert (
        launch.main(
            [
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--coordinator",
                absent,
                "--init-timeout",
                "1",
                "--",
                "true",
            ]
        )
        == 2
    )
    assert time.monotonic() - t < 10
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and "usage" in lines[0]
    assert "command not found" in lines[1] and "/nonexistent/cmd" in lines[1]
    assert f"port {port}" in lines[2] and "in use" in lines[2]
    assert absent in lines[3] and "did not answer" in lines[3]
    nowhere = ["--coordinator", "nonexistent.invalid:29517", "--", "true"]
    assert launch.main(["--nproc", "1", *nowhere]) == 2
    assert "'nonexistent.invalid' does not resolve" in capsys.readouterr().err


def test_one_launched_process_runs_on_its_devices(tmp_path):
    """``launch --nproc 1 --devices-per-proc 2``: the run has 2 devices, not the default."""
    proc = _launch(1, 2, _train_cmd(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["devices"] == 2


def test_failing_rank_stops_job_fast(tmp_path):
    marker = tmp_path / "pids"
    script = (
        "import os, signal, sys, time\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "if {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, []):\n"
        "    sys.exit(5)  # ranks must not inherit the launcher's blocked signals\n"
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


def test_rank_that_exits_early_is_reported_and_the_rest_stopped(tmp_path):
    marker = tmp_path / "pids"
    script = (
        "import os, time\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "if os.environ['SPARSECOMM_PROCESS_ID'] != '1': time.sleep(120)\n"
    )
    t = time.monotonic()
    proc = _launch(3, 1, [sys.executable, "-c", script], timeout=60, extra=["--exit-grace", "1"])
    assert time.monotonic() - t < 15 and proc.returncode == 1
    assert "rank 1 exited 0 but ranks 0, 2 still ran 1 s later" in proc.stderr
    assert _all_gone(map(int, marker.read_text().split()), within_s=0)


def test_sigkill_of_the_launcher_leaves_no_rank(tmp_path):
    """Ranks die with the launcher: its direct children by the parent-death signal, a
    process they started (not a child of the launcher) by the runtime's watchdog."""
    marker = tmp_path / "pids"
    grandchild = (
        "import os, time\n"
        "from sparsecomm_jax import distributed\n"
        "distributed.watch_launcher(poll_s=0.2)\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "time.sleep(120)\n"
    )
    rank = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "time.sleep(120)\n"
    )
    cmd = [*LAUNCH, "--nproc", "2", "--", sys.executable, "-c", rank]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = _wait_for_lines(marker, 4, job)
    job.kill()
    job.wait()
    assert _all_gone(pids, within_s=10), [p for p in pids if launch.process_alive(p)]


def test_repeated_signals_cannot_interrupt_the_clean_up(tmp_path):
    """Ctrl-C: no traceback; SIGINT/SIGTERM storms during the clean-up are ignored and
    ranks that ignore SIGTERM are still killed after --grace."""
    marker = tmp_path / "pids"
    script = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "time.sleep(120)\n"
    )
    job = subprocess.Popen(
        [*LAUNCH, "--nproc", "2", "--grace", "1.5", "--", sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = _wait_for_lines(marker, 2, job)
    job.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline and job.poll() is None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            job.send_signal(sig)
            time.sleep(0.02)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 128 + signal.SIGINT, err
    assert "got SIGINT" in err and "Traceback" not in err
    assert _all_gone(pids, within_s=0)


def test_two_processes_match_single_process(tmp_path):
    """2 processes x 2 devices equal one process with 4; ``--devices`` left out means
    every device of the job. The strategy crosses the processes every way a step can:
    the tables' all-to-alls, oktopk's all-to-all to hashed owners, its histogram
    all-reduces and all-gathers, and the run's count of deferred entries (the dense
    mean across processes: tests/test_cluster.py)."""
    out = tmp_path / "mp.json"
    proc = _launch(2, 2, _train_cmd(out, strategy="embrace+oktopk"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[rank 0]" in proc.stdout and "[rank 1]" in proc.stdout
    multi, single = json.loads(out.read_text()), _single(4, "embrace+oktopk")
    assert multi["devices"] == 4
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-6)
    assert multi["comm_bytes_per_step"] == pytest.approx(single["comm_bytes_per_step"])
    assert multi["deferred_entries"] == single["deferred_entries"] == 0


def test_an_nnx_model_on_two_processes_matches_one(tmp_path):
    """The LSTM LM written in flax NNX (``--model lstm_lm_nnx``), ``embrace``: 2 processes
    x 2 devices equal one process with 4."""
    out = tmp_path / "nnx.json"
    cmd = [*_train_cmd(out, strategy="embrace"), "--model", "lstm_lm_nnx"]
    proc = _launch(2, 2, cmd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = RunConfig(model="lstm_lm_nnx", strategy="embrace", devices=4, **ARGS)
    single = train_and_evaluate(config, progress=False)
    multi = json.loads(out.read_text())
    assert multi["devices"] == 4
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=1e-6)
    assert multi["comm_bytes_per_step"] == pytest.approx(single["comm_bytes_per_step"])


AGREE = """
from sparsecomm_jax import distributed, runtime
from sparsecomm_jax.comm import costmodel
rank, _ = distributed.initialize_distributed()
link, points = costmodel.calibrate(runtime.data_mesh(2), sizes=(256, 4096), repeats=2)
host = runtime.busiest_host()
print("agreed", runtime.agreed_mean(float(rank) + 0.5), link.alpha, link.beta, *host, flush=True)
"""


def test_timings_that_decide_are_the_same_on_every_process():
    """Each process times a program itself; what they choose on it (a plan, a fusion
    threshold, a strategy per bucket, the link's fit) must agree, or their programs
    differ and the job hangs in a collective. Both see the host's two processes."""
    proc = _launch(2, 1, [sys.executable, "-c", AGREE], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split("agreed ")[1] for line in proc.stdout.splitlines() if "agreed " in line]
    assert len(lines) == 2 and lines[0] == lines[1], lines  # the mean of 0.5 and 1.5
    assert lines[0].split()[0] == "1.0" and lines[0].split()[-2] == "2"


def _row(host: int, cpus: list[int], quota_millis: int = 0) -> list[int]:
    """One process's row for ``runtime.host_loads``: its host id, CPU quota (thousandths
    of a CPU, 0: none) and affinity mask."""
    mask = np.zeros(runtime.MASK_BITS, bool)
    mask[cpus] = True
    return [host, quota_millis, *np.packbits(mask).view(np.int32)]


def test_host_loads_group_processes_by_host_and_join_their_cores():
    """Two processes pinned to cores of their own are one per core; three sharing two
    cores are the busiest host, whichever order their rows come in."""
    rows = np.array([_row(7, [0]), _row(9, [0, 1]), _row(7, [1]), _row(9, [1]), _row(9, [0])])
    assert runtime.host_loads(rows) == [(3, 2), (2, 2)]
    assert runtime.host_loads(rows[::-1])[0] == (3, 2)
    assert runtime.host_loads(np.array([_row(1, [5, 4095])])) == [(1, 2)]


def test_host_loads_cap_a_hosts_cores_by_its_cpu_quota():
    """A container's quota (``--cpus 2.5`` on a 64-core machine) caps the cores its
    processes count on, in whole CPUs; a host where one process has no quota keeps its
    masks' count."""
    every = list(range(64))
    quota = np.array([_row(3, every, 2500), _row(3, every, 2500), _row(3, every, 2500)])
    assert runtime.host_loads(quota) == [(3, 2)]
    assert runtime.host_loads(np.array([_row(3, every, 500)])) == [(1, 1)]
    mixed = np.array([_row(3, every, 2500), _row(3, every, 0)])
    assert runtime.host_loads(mixed) == [(2, 64)]
    assert runtime.host_loads(np.array([_row(3, [0, 1], 8000)])) == [(1, 2)]  # masks smaller


def _cgroup(tmp_path, lines: list[str], files: dict[str, str]) -> tuple[str, str]:
    """A fake ``/proc/self/cgroup`` and cgroup mount: ``files`` maps paths under the
    mount to their contents."""
    (tmp_path / "proc_cgroup").write_text("\n".join(lines) + "\n")
    for rel, text in files.items():
        (tmp_path / "cg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cg" / rel).write_text(text)
    return str(tmp_path / "proc_cgroup"), str(tmp_path / "cg")


@pytest.mark.parametrize(
    "lines, files, cpus",
    [
        (["0::/job"], {"job/cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2
        (["0::/job"], {"job/cpu.max": "max 100000\n"}, None),
        (["0::/a/b"], {"a/cpu.max": "200000 100000", "a/b/cpu.max": "max 100000"}, 2.0),
        (["0::/"], {"cpu.max": "300000 100000"}, 3.0),  # inside a container's namespace
        (["0::/host/path"], {"cpu.max": "50000 100000"}, 0.5),  # the mount shows its root
        (
            ["4:memory:/x", "2:cpu,cpuacct:/x"],  # cgroup v1
            {
                "cpu,cpuacct/x/cpu.cfs_quota_us": "400000",
                "cpu,cpuacct/x/cpu.cfs_period_us": "100000",
            },
            4.0,
        ),
        (
            ["1:cpu:/x"],
            {"cpu/x/cpu.cfs_quota_us": "-1", "cpu/x/cpu.cfs_period_us": "100000"},
            None,
        ),
        (["3:cpuset:/"], {}, None),  # no cpu controller
        (["garbled", "0::/job"], {"job/cpu.max": "100000 100000"}, 1.0),  # a bad line skipped
        (["0::/job"], {"job/cpu.max": "garbled"}, None),
    ],
)
def test_cpu_quota_reads_cgroup_v1_and_v2(tmp_path, lines, files, cpus):
    assert cores.cpu_quota(*_cgroup(tmp_path, lines, files)) == cpus


def test_cpu_quota_without_a_cgroup_list_is_none(tmp_path):
    assert cores.cpu_quota(str(tmp_path / "absent"), str(tmp_path)) is None


def test_two_nodes_on_the_loopback_match_single_process(tmp_path):
    """Two launcher invocations (--nnodes 2, --node-rank 0 and 1) form one job."""
    out, coordinator = tmp_path / "nodes.json", f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [
                *LAUNCH,
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--coordinator",
                coordinator,
                "--init-timeout",
                "60",
                "--",
                *_train_cmd(out, devices=2),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (1, 0)
    ]  # node 1 first: it waits for the coordinator
    logs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)
    assert "[rank 1]" in logs[0] and "[rank 0]" in logs[1]
    multi = json.loads(out.read_text())
    np.testing.assert_allclose(multi["losses"], _single(2)["losses"], rtol=1e-6)


HOST_MESH_SCRIPT = """
import json, sys
import jax, numpy as np
from jax.sharding import PartitionSpec as P
from sparsecomm_jax import distributed, runtime
distributed.initialize_distributed()
mesh, spec = runtime.host_mesh(), P(("hosts", "local"))
x = runtime.put_global(np.asarray(json.loads(sys.argv[1]), np.float32), mesh, spec)
local = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "local"), mesh=mesh, in_specs=spec,
                              out_specs=spec))(x)
rows = [[d.process_index for d in row] for row in mesh.devices]
print("RESULT", json.dumps([dict(mesh.shape), rows, runtime.to_host(local).tolist()]))
"""


def test_host_mesh_of_two_nodes_keeps_local_collectives_inside_a_node(tmp_path):
    x = np.random.default_rng().normal(size=4).round(3)
    coordinator = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-c", HOST_MESH_SCRIPT, json.dumps(x.tolist())]
    nodes = [
        subprocess.Popen(
            [
                *LAUNCH,
                "--nproc",
                "1",
                "--devices-per-proc",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--coordinator",
                coordinator,
                "--init-timeout",
                "60",
                "--",
                *cmd,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    for node in nodes:
        log = node.communicate(timeout=120)[0]
        assert node.returncode == 0, log
        line = next(ln for ln in log.splitlines() if "RESULT" in ln)
        shape, rows, local = json.loads(line.split("RESULT", 1)[1])
        assert shape == {"hosts": 2, "local": 2} and rows == [[0, 0], [1, 1]]
        # The reference adds the same float32 pair the psum adds (x is sent as float32), so
        # a sum that nearly cancels is compared bit for bit, not against a float64 sum.
        expected = x.astype(np.float32).reshape(2, 2).sum(1)
        np.testing.assert_array_equal(np.float32(local), np.repeat(expected, 2))


def test_every_rank_refuses_a_mesh_smaller_than_the_job(tmp_path):
    out = tmp_path / "never.json"
    proc = _launch(2, 2, _train_cmd(out, devices=2), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: --devices 2 but this job of 2 processes has 4" in proc.stdout
    assert "pass --devices 4" in proc.stdout
    assert not out.exists()


def test_mesh_must_span_a_multi_process_job(monkeypatch):
    """The rule uses only facts every process shares, so every rank decides alike."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=f"pass num_devices={NUM_DEVICES}"):  # Python words
        runtime.data_mesh(NUM_DEVICES // 2)
    assert runtime.data_mesh().size == NUM_DEVICES


def test_errors_speak_to_the_caller():
    """A Python caller is told the Python call, a command-line user the flag."""
    with pytest.raises(ValueError, match=r"call runtime.simulate_cpu_devices\(16\)") as err:
        runtime.data_mesh(16)
    told = err.value.render(flag_words)
    assert told.startswith("--devices 16 but only 8") and "pass --devices 16 before" in told


def test_host_mesh_rows_are_hosts_and_local_collectives_stay_inside():
    devices = jax.devices()
    n = len(devices)
    mesh = runtime.host_mesh(hosts=2)
    assert dict(mesh.shape) == {"hosts": 2, "local": n // 2}
    assert mesh.devices.tolist() == [devices[: n // 2], devices[n // 2 :]]
    assert runtime.host_mesh().devices.tolist() == [devices]  # one process: one host
    x = np.random.default_rng().normal(size=(n, 3)).astype(np.float32)

    def sums(x):  # x: f32[1, 3] per device
        return jax.lax.psum(x, "local"), jax.lax.psum(x, "hosts")

    spec = P(("hosts", "local"))
    local, across = jax.shard_map(sums, mesh=mesh, in_specs=spec, out_specs=(spec, spec))(x)
    rows = x.reshape(2, n // 2, 3)
    # Sums of fresh normals may nearly cancel: an absolute bound, not only a relative one.
    tol = dict(rtol=1e-6, atol=1e-6 * np.abs(x).sum())
    np.testing.assert_allclose(local, np.repeat(rows.sum(1), n // 2, axis=0), **tol)
    np.testing.assert_allclose(across, np.tile(rows.sum(0), (2, 1)), **tol)
    with pytest.raises(ValueError, match="hosts=3"):
        runtime.host_mesh(hosts=3)


# Variables each scheduler sets for one task (values as srun / mpirun / an indexed Job would).
SLURM = {
    "SLURM_JOB_ID": "12345",
    "SLURM_STEP_ID": "0",  # srun's first step
    "SLURM_STEP_NODELIST": "gpu[007-010],cpu1",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
}
OMPI = {
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
}
K8S = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "SPARSECOMM_", "JAX_COORDINATOR", "KUBERNETES_")):
            monkeypatch.delenv(name)
    return monkeypatch


def _set(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_schedulers_are_read_as_jax_distributed_reads_them(clean_env):
    assert distributed.detect_scheduler() is None and distributed.distributed_args() is None
    _set(clean_env, SLURM)
    assert distributed.detect_scheduler() == "slurm"
    args = distributed.distributed_args()  # port: the job id mapped into 61440..65535
    assert args["coordinator_address"] == f"gpu007:{12345 % 4096 + 61440}"
    assert (args["num_processes"], args["process_id"], args["local_device_ids"]) == (8, 5, [1])
    assert args["cluster_detection_method"] == "deactivate"  # resolved once, used as is
    clean_env.setenv("SLURM_NTASKS", "1")  # one task: nothing to join
    assert distributed.detect_scheduler() is None and distributed.distributed_args() is None
    clean_env.setenv("SLURM_NTASKS", "8")
    _set(clean_env, {"JAX_COORDINATOR_PORT": "4321", "JAX_LOCAL_DEVICE_IDS": "0,1"})
    args = distributed.distributed_args()
    assert args["coordinator_address"] == "gpu007:4321" and args["local_device_ids"] == [0, 1]
    clean_env.delenv("JAX_COORDINATOR_PORT")
    _set(clean_env, OMPI)  # Open MPI comes first in jax's order
    args = distributed.distributed_args()  # port: from the job id in the ORTE URI
    assert distributed.detect_scheduler() == "ompi"
    assert args["coordinator_address"] == f"10.96.0.1:{(1531576320 // 4096) % 4096 + 61440}"
    assert (args["num_processes"], args["process_id"]) == (4, 2)


def test_kubernetes_without_its_client_is_a_clear_error(clean_env):
    _set(clean_env, K8S)
    assert distributed.detect_scheduler() == "k8s"
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=r"jax\[k8s\]"):
        distributed.distributed_args()


def test_launcher_environment_comes_before_a_scheduler(clean_env):
    _set(clean_env, SLURM)
    job = launch.make_job(2, 2, nnodes=3, node_rank=2, coordinator="10.1.1.1:29500")
    _set(clean_env, {k: v for k, v in launch.rank_env(job, 1).items() if "SPARSECOMM" in k})
    args = distributed.distributed_args()
    assert args["coordinator_address"] == "10.1.1.1:29500"
    assert (args["num_processes"], args["process_id"], args["local_device_ids"]) == (6, 5, [2, 3])


def test_initialize_calls_jax_with_the_resolved_job(clean_env):
    calls, port = [], _free_port()
    clean_env.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    clean_env.setattr(jax.config, "update", lambda *a: None)  # keep this process's config
    _set(
        clean_env,
        {
            **SLURM,
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "JAX_COORDINATOR_PORT": str(port),
        },
    )
    assert distributed.initialize_distributed() == (0, 8)
    assert calls == [
        dict(
            coordinator_address=f"localhost:{port}",
            num_processes=8,
            process_id=0,
            local_device_ids=[0],
            initialization_timeout=330,  # jax's deadline after ours (300 s)
            cluster_detection_method="deactivate",
        )
    ]


def test_unreachable_coordinator_or_busy_port_is_an_error_not_an_abort(clean_env):
    calls = []
    clean_env.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    _set(
        clean_env,
        {
            launch.ENV_COORDINATOR: f"127.0.0.1:{_free_port()}",
            launch.ENV_NUM_PROCESSES: "2",
            launch.ENV_PROCESS_ID: "1",
            launch.ENV_INIT_TIMEOUT: "1",
        },
    )
    with pytest.raises(distributed.JobError, match="did not answer within 1 s"):
        distributed.initialize_distributed()
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen(1)
        clean_env.setenv(launch.ENV_COORDINATOR, f"127.0.0.1:{busy.getsockname()[1]}")
        clean_env.setenv(launch.ENV_PROCESS_ID, "0")
        with pytest.raises(distributed.JobError, match="in use"):
            distributed.initialize_distributed()
    clean_env.setenv(launch.ENV_COORDINATOR, "nonexistent.invalid:29517")
    with pytest.raises(distributed.JobError, match="'nonexistent.invalid' does not resolve"):
        distributed.initialize_distributed()
    assert calls == []  # jax would have aborted the process


@pytest.mark.parametrize(
    "env, message",
    [
        ({**SLURM, "SLURM_PROCID": "7", "SLURM_NTASKS": "4"}, "SLURM_PROCID=7 is not a process id"),
        (
            {launch.ENV_COORDINATOR: "127.0.0.1:1", launch.ENV_NUM_PROCESSES: "2"}
            | {launch.ENV_PROCESS_ID: "5"},
            "SPARSECOMM_PROCESS_ID=5 is not a process id of a job of 2",
        ),
        ({launch.ENV_NUM_PROCESSES: "2"}, "SPARSECOMM_COORDINATOR and SPARSECOMM_PROCESS_ID not"),
        (
            {launch.ENV_COORDINATOR: "h:1", launch.ENV_NUM_PROCESSES: "two"}
            | {launch.ENV_PROCESS_ID: "0"},
            "SPARSECOMM_NUM_PROCESSES='two' is not an integer",
        ),
        ({**SLURM, "SLURM_NTASKS": "x"}, "could not be read by jax"),
    ],
)
def test_a_job_that_cannot_be_is_refused_in_one_line(clean_env, env, message):
    """Ids outside 0..n-1, missing or non-numeric variables: refused before anyone
    waits (the launcher's and the schedulers')."""
    _set(clean_env, env)
    with pytest.raises(distributed.JobError, match=message):
        distributed.distributed_args()


def test_a_batch_script_without_srun_runs_alone_and_says_so(clean_env, capsys):
    """``sbatch --ntasks 4`` running python directly: SLURM's variables are there but no
    srun step; the process runs alone at once instead of waiting for three others."""
    _set(clean_env, {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"})
    assert distributed.detect_scheduler() is None and distributed.distributed_args() is None
    assert distributed.initialize_distributed() == (0, 1)
    assert "not started by srun" in capsys.readouterr().err
    clean_env.setenv("SLURM_STEP_ID", "4294967294")  # the batch step
    assert distributed.detect_scheduler() is None


ALONE = (
    "from sparsecomm_jax import distributed; distributed.initialize_distributed(); print('joined')"
)


def test_a_job_that_never_assembles_ends_in_one_line(clean_env):
    """Process 0 of 2 whose partner never starts: it says what it waits for, then ends
    with one line and exit status 2 when the timeout passes (jax would abort with a
    C++ stack)."""
    env = {
        **os.environ,
        launch.ENV_COORDINATOR: f"127.0.0.1:{_free_port()}",
        launch.ENV_NUM_PROCESSES: "2",
        launch.ENV_PROCESS_ID: "0",
        launch.ENV_INIT_TIMEOUT: "3",
    }
    proc = subprocess.run(
        [sys.executable, "-c", ALONE], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    lines = stderr_lines(proc.stderr)
    assert proc.returncode == 2 and "joined" not in proc.stdout, proc.stderr[-2000:]
    assert len(lines) == 2, lines
    assert "process 0 of 2: waiting for the job's other processes" in lines[0]
    assert lines[1].startswith("error: process 0 of 2: the job did not assemble")


def test_every_rank_refuses_a_count_dependent_flag_before_joining(tmp_path):
    """``--replicas 3`` on a launched job of 4 devices (``--devices`` left out): every
    rank refuses it from the launcher's variables before JAX starts, so none dies in
    the backend's start because rank 0, the coordinator, left first (the launcher stops
    the ranks still refusing when the first has)."""
    cmd = [*_train_cmd(tmp_path / "never.json", strategy="embrace"), "--replicas", "3"]
    proc = _launch(2, 2, cmd, timeout=120)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-2000:]
    assert "] error: --replicas 3 must divide the 4 devices" in said  # the first to exit
    assert re.search(r"launch: rank [01] exited with code 2;", said)
    assert "Traceback" not in said and "Unable to initialize backend" not in said


def test_a_gone_peer_is_one_line_not_a_traceback(monkeypatch):
    """What a gloo collective raises when another process of a job is killed: one line
    that points to that process's output and the launcher, exit status 1 (a process
    alone has no peer to lose: its error keeps its traceback)."""
    from experiments.train import command

    error = RuntimeError("INTERNAL: Gloo AllGather failed: Connection closed by peer [::1]:1")
    assert command.peer_gone(error) == ""  # not in a job
    monkeypatch.setattr(distributed, "joined", lambda: True)
    assert command.peer_gone(error).startswith("another process of the job is gone (INTERNAL")
    assert command.peer_gone(RuntimeError("an error of this process")) == ""
    script = (
        "from experiments.train import command\n"
        "command.distributed.joined = lambda: True\n"
        "def main():\n"
        "    raise RuntimeError('Gloo AllGather failed: Connection closed by peer')\n"
        "command.main = main\n"
        "command.cli()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    lines = [x for x in stderr_lines(proc.stderr) if x.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: another process of the job is gone")
