"""Starts N processes of one command on this host as a multi-process JAX job.

Usage::

    python -m sparsecomm_jax.launch --nproc 2 --devices-per-proc 2 -- \\
        python -m experiments.train --strategy dense --devices 4 --steps 5

Every rank gets ``SPARSECOMM_COORDINATOR``, ``SPARSECOMM_NUM_PROCESSES``,
``SPARSECOMM_PROCESS_ID`` and ``SPARSECOMM_LOCAL_DEVICES`` in its environment (read by
``runtime.initialize_distributed``). Output lines are prefixed ``[rank i]``. When a rank
exits non-zero the others are killed (whole process groups, so nothing is orphaned), the
launcher names the rank and exits with its code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from sparsecomm_jax import runtime


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, nproc: int, devices_per_proc: int, coordinator: str) -> dict[str, str]:
    """The environment of one rank (pure; tested without starting anything)."""
    env = dict(os.environ)
    env.update(
        {
            runtime.ENV_COORDINATOR: coordinator,
            runtime.ENV_NUM_PROCESSES: str(nproc),
            runtime.ENV_PROCESS_ID: str(rank),
            runtime.ENV_LOCAL_DEVICES: str(devices_per_proc),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _stream(rank: int, pipe, out) -> None:
    for line in iter(pipe.readline, ""):
        out.write(f"[rank {rank}] {line}")
        out.flush()


def _kill_all(procs: Sequence[subprocess.Popen], grace_s: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)


def launch(
    cmd: Sequence[str],
    nproc: int,
    devices_per_proc: int = 1,
    port: int | None = None,
    poll_s: float = 0.1,
) -> int:
    """Runs ``cmd`` as ``nproc`` ranks and waits; returns the job's exit code.

    Args:
      cmd: the command every rank runs.
      nproc: number of processes, >= 1.
      devices_per_proc: simulated CPU devices per process (ignored on GPU hosts).
      port: coordinator port on 127.0.0.1; a free one when ``None``.
      poll_s: how often the ranks are checked.

    Returns:
      0 when every rank succeeded, else the exit code of the first rank that failed
      (1 when it was killed by a signal).
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if devices_per_proc < 1:
        raise ValueError(f"--devices-per-proc must be >= 1, got {devices_per_proc}")
    if not cmd:
        raise ValueError("no command given after --")
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs: list[subprocess.Popen] = []
    threads = []
    try:
        for rank in range(nproc):
            p = subprocess.Popen(
                list(cmd),
                env=rank_env(rank, nproc, devices_per_proc, coordinator),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            procs.append(p)
            t = threading.Thread(target=_stream, args=(rank, p.stdout, sys.stdout), daemon=True)
            t.start()
            threads.append(t)
        return _wait(procs, poll_s)
    finally:
        _kill_all(procs)
        for t in threads:
            t.join(timeout=1.0)


def _wait(procs: Sequence[subprocess.Popen], poll_s: float) -> int:
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                how = f"signal {-code}" if code < 0 else f"code {code}"
                print(
                    f"launch: rank {rank} exited with {how}; stopping the other ranks",
                    file=sys.stderr,
                    flush=True,
                )
                return code if code > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(poll_s)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("launch: usage: launch --nproc N [--devices-per-proc M] -- CMD ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m sparsecomm_jax.launch")
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--devices-per-proc", type=int, default=1, help="CPU devices per proc")
    parser.add_argument("--port", type=int, default=None, help="coordinator port")
    args = parser.parse_args(argv[:split])
    try:
        return launch(argv[split + 1 :], args.nproc, args.devices_per_proc, args.port)
    except ValueError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
