"""Starts N processes of one command per host as one multi-process JAX job.

One host::

    python -m sparsecomm_jax.launch --nproc 2 --devices-per-proc 2 -- \\
        python -m experiments.train --strategy dense --steps 5

Two hosts (the same command on each, ``--node-rank`` 0 on the host at ``--coordinator``)::

    python -m sparsecomm_jax.launch --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 \\
        --nproc 4 -- python -m experiments.train --strategy embrace --steps 5

Rank ``node_rank * nproc + local_rank`` gets ``SPARSECOMM_*`` variables (coordinator,
process count and id, local device ids) for ``distributed.initialize_distributed``; on a GPU
host local rank ``r`` drives GPUs ``r*M .. r*M+M-1`` (``M = --devices-per-proc``), on CPU
it simulates ``M`` devices. Several ranks on a host each get their share of its cores
for XLA's host thread pool, which runs XLA:CPU's programs (``NPROC``; XLA keeps at
least one thread per local CPU device; set ``NPROC`` or ``PJRT_NPROC`` to choose). Output
lines are prefixed ``[rank i]``.

The ranks die with the launcher, even under SIGKILL; a failing rank, one that exits 0
while others run past ``--exit-grace``, or SIGINT/SIGTERM stops them all, and further
signals cannot interrupt that clean-up; a busy port, an unreachable coordinator or a
missing command is a one-line error before any rank starts.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from errno import EADDRNOTAVAIL, EAFNOSUPPORT  # no IPv6 on this host
from typing import NamedTuple

from sparsecomm_jax.cores import compute_threads, host_cores

# Environment every rank gets (read by ``distributed.initialize_distributed``).
ENV_COORDINATOR = "SPARSECOMM_COORDINATOR"
ENV_NUM_PROCESSES = "SPARSECOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "SPARSECOMM_PROCESS_ID"
ENV_LOCAL_DEVICES = "SPARSECOMM_LOCAL_DEVICES"
ENV_LOCAL_DEVICE_IDS = "SPARSECOMM_LOCAL_DEVICE_IDS"
ENV_NODE_RANK = "SPARSECOMM_NODE_RANK"
ENV_INIT_TIMEOUT = "SPARSECOMM_INIT_TIMEOUT"
ENV_LAUNCHER = "SPARSECOMM_LAUNCHER"  # "pid:start time" of the launcher (watchdog)
# The threads of XLA's host pool, which runs XLA:CPU's programs: XLA sizes it from
# PJRT_NPROC, else NPROC, else the cores the process may use, and never below the
# process's CPU devices. Each of a host's several ranks gets its share of the host's
# cores in NPROC, unless the launcher's own environment sets either variable. (On a GPU
# host the same pool serves host-side work: transfers, dispatch.)
ENV_COMPUTE_THREADS = "NPROC"
USER_THREAD_VARS = ("PJRT_NPROC", ENV_COMPUTE_THREADS)  # set by the user: left alone

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Job(NamedTuple):
    """Where this launcher's ranks sit in the job."""

    nproc: int  # ranks on this host
    devices_per_proc: int
    nnodes: int
    node_rank: int
    coordinator: str  # host:port of the process with id 0
    init_timeout_s: int


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ``ValueError`` naming ``--coordinator``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator must be HOST:PORT (port 1-65535), got {address!r}")
    return host.strip("[]"), int(port)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` on every address of this host."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
                s.bind((host, port))
                s.listen(1)
        except OSError as e:
            if family == socket.AF_INET or e.errno not in (EAFNOSUPPORT, EADDRNOTAVAIL):
                return False
    return True


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout_s`` (retried)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def process_start_time(pid: int) -> str:
    """Start time of ``pid`` ("" unknown): with it, a reused pid is told apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ""


def process_alive(pid: int, start_time: str = "") -> bool:
    """Whether ``pid`` runs (not a zombie) and, when given, started at ``start_time``."""
    if not os.path.isdir("/proc/self"):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return fields[0] != "Z" and (not start_time or fields[19] == start_time)
    except OSError:
        return False


def make_job(
    nproc: int,
    devices_per_proc: int = 1,
    port: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: str | None = None,
    init_timeout_s: int = 300,
) -> Job:
    """Checks the flags and picks the coordinator; ``ValueError`` naming the bad flag."""
    for flag, value in (
        ("--nproc", nproc),
        ("--devices-per-proc", devices_per_proc),
        ("--nnodes", nnodes),
        ("--init-timeout", init_timeout_s),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes={nnodes}), got {node_rank}")
    if coordinator and port is not None:
        raise ValueError("give --coordinator HOST:PORT or --port, not both")
    if nnodes > 1 and not coordinator:
        raise ValueError("--nnodes > 1 needs --coordinator HOST:PORT (node 0's address)")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"--port must be in 1-65535, got {port}")
    coordinator = coordinator or f"127.0.0.1:{port or free_port()}"
    parse_address(coordinator)
    return Job(nproc, devices_per_proc, nnodes, node_rank, coordinator, init_timeout_s)


def check_coordinator(job: Job) -> None:
    """Node 0: the coordinator's port must be free here; other nodes: it must answer
    within the job's ``init_timeout_s``. ``ValueError`` (one line) otherwise."""
    host, port = parse_address(job.coordinator)
    try:
        socket.getaddrinfo(host, port)
    except OSError as e:
        raise ValueError(
            f"--coordinator host {host!r} does not resolve ({e.strerror or e}): check the address"
        ) from None
    if job.node_rank == 0 and not port_is_free(port):
        raise ValueError(
            f"port {port} of --coordinator/--port is in use on this host; "
            "pick another or leave --port out to use a free one"
        )
    if job.node_rank > 0 and not wait_for_port(host, port, job.init_timeout_s):
        raise ValueError(
            f"--coordinator {job.coordinator} did not answer within "
            f"--init-timeout {job.init_timeout_s} s: start node 0 first and "
            "check the address"
        )


def rank_env(job: Job, local_rank: int) -> dict[str, str]:
    """The environment of one rank (starts nothing; tested without starting anything).

    Args:
      job: where the launcher's ranks sit in the job.
      local_rank: the rank's index on this host.

    Returns:
      This process's environment with the job's ``SPARSECOMM_*`` variables, and with
      several ranks on the host each one's share of its cores for XLA's host thread
      pool (``ENV_COMPUTE_THREADS``) unless the user set it (``USER_THREAD_VARS``).
    """
    first, per = local_rank * job.devices_per_proc, job.devices_per_proc
    env = dict(os.environ)
    env.update(
        {
            ENV_COORDINATOR: job.coordinator,
            ENV_NUM_PROCESSES: str(job.nnodes * job.nproc),
            ENV_PROCESS_ID: str(job.node_rank * job.nproc + local_rank),
            ENV_LOCAL_DEVICES: str(per),
            ENV_LOCAL_DEVICE_IDS: ",".join(map(str, range(first, first + per))),
            ENV_NODE_RANK: str(job.node_rank),
            ENV_INIT_TIMEOUT: str(job.init_timeout_s),
            ENV_LAUNCHER: f"{os.getpid()}:{process_start_time(os.getpid())}",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if job.nproc > 1 and not any(v in os.environ for v in USER_THREAD_VARS):
        env[ENV_COMPUTE_THREADS] = str(compute_threads(job.nproc, host_cores()))
    return env


def _child_setup() -> Callable[[], None]:
    """A ``preexec_fn``: unblocks SIGINT/SIGTERM (blocked while the launcher forks) and
    makes the kernel send the child SIGKILL when this (the parent) process dies."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
    except (OSError, AttributeError):  # not Linux: the ranks' watchdog remains
        prctl = None

    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _start(cmd: Sequence[str], job: Job) -> list[subprocess.Popen]:
    """Starts this host's ranks (each in its own process group; a signal waits until the
    rank being started is recorded); ``ValueError`` when the command cannot be run."""
    if shutil.which(cmd[0]) is None:
        raise ValueError(f"command not found or not executable: {cmd[0]!r}")
    procs, preexec = [], _child_setup()
    for local in range(job.nproc):
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    env=rank_env(job, local),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            )
        except OSError as e:
            _stop(procs, 0.0)
            raise ValueError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return procs


def _stream(rank: int, pipe, out) -> None:
    for line in iter(pipe.readline, ""):
        print(f"[rank {rank}] {line}", end="", file=out, flush=True)


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every rank's process group, SIGKILL after ``grace_s``; SIGINT and
    SIGTERM to the launcher are ignored meanwhile so nothing interrupts it."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)


def _say(message: str) -> None:
    print(f"launch: {message}", file=sys.stderr, flush=True)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _wait(procs: Sequence[subprocess.Popen], first: int, poll_s: float, exit_grace_s: float) -> int:
    """Exit code: the first failure's in exit order (its peers' errors follow), 0 when all
    succeed, 1 when ranks outlive ``exit_grace_s`` (0: no limit) after one exited 0."""
    early_since, reported, exited = None, False, []
    for rank, p in enumerate(procs, first):  # one waiter each: ranks in exit order
        wait = lambda p=p, r=rank: (p.wait(), exited.append(r))  # noqa: E731
        threading.Thread(target=wait, daemon=True).start()
    while True:
        codes = [p.poll() for p in procs]
        order = list(exited) + [r for r in range(first, first + len(procs)) if r not in exited]
        failed = [r for r in order if codes[r - first] not in (None, 0)]
        if failed:
            rank, code = failed[0], codes[failed[0] - first]
            how = f"signal {-code}" if code < 0 else f"code {code}"
            _say(f"rank {rank} exited with {how}; stopping the other ranks")
            return code if code > 0 else 1
        running = [rank for rank, code in enumerate(codes, first) if code is None]
        if not running:
            return 0
        if early_since is None and len(running) < len(codes):
            early_since = time.monotonic()
        waited = time.monotonic() - early_since if early_since is not None else 0.0
        done = _ranks([rank for rank, code in enumerate(codes, first) if code == 0])
        if exit_grace_s and waited > exit_grace_s:
            _say(
                f"{done} exited 0 but {_ranks(running)} still ran {exit_grace_s:g} s later "
                "(see --exit-grace); stopping them"
            )
            return 1
        if waited > min(5.0, exit_grace_s or 5.0) and not reported:
            limit = f"up to {exit_grace_s:g} s" if exit_grace_s else "without limit"
            _say(f"{done} exited 0 while {_ranks(running)} still run; waiting {limit}")
            reported = True
        time.sleep(poll_s)


class _Stopped(Exception):
    """SIGINT or SIGTERM reached the launcher."""


def _on_signal(signum: int, _frame) -> None:
    for sig in _STOP_SIGNALS:  # the clean-up that follows must not be interrupted
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopped(signum)


def launch(
    cmd: Sequence[str],
    job: Job,
    grace_s: float = 10.0,
    exit_grace_s: float = 60.0,
    poll_s: float = 0.1,
) -> int:
    """Runs ``cmd`` as this host's ranks of ``job`` and waits.

    Args:
      cmd: the command every rank runs.
      job: from ``make_job`` (processes, devices per process, nodes, coordinator).
      grace_s: time between SIGTERM and SIGKILL when the ranks are stopped.
      exit_grace_s: how long ranks may run on after one exited 0 (0: no limit).
      poll_s: how often the ranks are checked.

    Returns:
      0 when every rank succeeded, else the code of the first rank that failed (1 when
      killed by a signal or stopped after ``exit_grace_s``), 128 + signal number when
      the launcher was interrupted.

    Raises:
      ValueError: a busy port, an unreachable coordinator or a missing command.

    Example:
      >>> launch([sys.executable, "-c", "print('hi')"], make_job(nproc=2))  # doctest: +SKIP
    """
    if not cmd:
        raise ValueError("no command given after --")
    if not (grace_s >= 0 and exit_grace_s >= 0):  # NaN fails too
        raise ValueError(f"--grace and --exit-grace must be >= 0, got {grace_s}, {exit_grace_s}")
    previous = {sig: signal.signal(sig, _on_signal) for sig in _STOP_SIGNALS}
    procs, threads = [], []
    try:
        check_coordinator(job)
        procs += _start(cmd, job)
        first = job.node_rank * job.nproc
        for rank, p in enumerate(procs, first):
            threads.append(
                threading.Thread(target=_stream, args=(rank, p.stdout, sys.stdout), daemon=True)
            )
            threads[-1].start()
        return _wait(procs, first, poll_s, exit_grace_s)
    except _Stopped as stop:
        previous = {}  # interrupted: SIGINT/SIGTERM stay ignored while the caller exits
        name = signal.Signals(stop.args[0]).name
        _say(f"got {name}; stopping the ranks (further signals are ignored)")
        return 128 + stop.args[0]
    finally:
        _stop(procs, grace_s)
        for t in threads:
            t.join(timeout=1.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parser() -> argparse.ArgumentParser:
    """The launcher's flags (everything after ``--`` is the command)."""
    p = argparse.ArgumentParser(
        prog="python -m sparsecomm_jax.launch", usage="%(prog)s --nproc N [options] -- CMD ..."
    )
    p.add_argument("--nproc", type=int, required=True, help="processes on this host")
    p.add_argument(
        "--devices-per-proc",
        type=int,
        default=1,
        help="GPUs per process (local rank r drives GPUs r*M..r*M+M-1), "
        "or simulated CPU devices per process",
    )
    p.add_argument(
        "--port", type=int, help="coordinator port on 127.0.0.1 (one host; default: a free one)"
    )
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the job")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    p.add_argument(
        "--coordinator",
        help="HOST:PORT of node 0, the same on every node (needed with --nnodes > 1)",
    )
    p.add_argument(
        "--init-timeout",
        type=int,
        default=300,
        help="seconds to wait for the coordinator and the other ranks",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping the ranks",
    )
    p.add_argument(
        "--exit-grace",
        type=float,
        default=60.0,
        help="seconds the other ranks may run on after one exited 0; then they are stopped "
        "and the job fails (0: no limit)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            parser().print_help()
            return 0
        _say("usage: launch --nproc N [options] -- CMD ... (see --help)")
        return 2
    split = argv.index("--")
    args = parser().parse_args(argv[:split])
    try:
        job = make_job(
            args.nproc,
            args.devices_per_proc,
            args.port,
            args.nnodes,
            args.node_rank,
            args.coordinator,
            args.init_timeout,
        )
        return launch(argv[split + 1 :], job, args.grace, args.exit_grace)
    except ValueError as e:
        _say(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
