"""An emulated bandwidth-limited cluster on one host: N training processes in a private
network namespace whose loopback is rate-limited with ``tc``, so every collective crosses
a real, slow TCP path (gloo).

    python -m experiments.cluster --nproc 4 --bandwidth 1gbit -- \\
        --model lstm_lm --strategy embrace --steps 20 --out run.json

All processes share the one loopback, so ``--bandwidth`` is the capacity of a shared link:
each of N workers sending at once gets about 1/N of it (measured: a 2-process all-reduce
at 100mbit runs at 50 Mbit/s). ``--per-worker`` gives each worker ``--bandwidth`` of its
own on average, as with one NIC per node: the loopback is set to N x ``--bandwidth``.

Everything after ``--`` goes to ``experiments.train`` (rank 0 writes ``--out``; its
``--devices`` defaults to every device of the job, ``nproc x devices-per-proc``). Needs
root and iproute2 (``ip``, ``tc``). ``--latency`` needs the kernel's ``netem`` qdisc;
without it only the rate is limited (``tbf``). The namespace and every process are
removed on every exit path.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")
_TIME = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
NO_NETEM = (
    "this kernel has no netem qdisc: --latency cannot be emulated here; leave it out to "
    "limit the rate only"
)


def check_environment() -> None:
    """``RuntimeError`` naming what is missing: root, ``ip`` or ``tc``."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"{' and '.join(missing)} not found: install iproute2")
    if os.geteuid() != 0:
        raise RuntimeError("network namespaces and tc need root (run as root or with sudo)")


def check_args(nproc: int, devices_per_proc: int, bandwidth: str, latency: str) -> None:
    """``ValueError`` for a bad process count, rate (e.g. ``1gbit``) or latency (``50us``)."""
    if nproc < 1 or devices_per_proc < 1:
        raise ValueError(
            f"--nproc and --devices-per-proc must be >= 1, got {nproc}, {devices_per_proc}"
        )
    if not _RATE.match(bandwidth):
        raise ValueError(f"--bandwidth must look like 100mbit or 1gbit, got {bandwidth!r}")
    if latency and not _TIME.match(latency):
        raise ValueError(f"--latency must look like 50us or 1ms, got {latency!r}")


def qdisc_args(bandwidth: str, latency: str) -> list[str]:
    """The ``tc qdisc add dev lo root ...`` arguments for a rate (and a delay)."""
    if latency:
        return ["netem", "delay", latency, "rate", bandwidth, "limit", "100000"]
    return ["tbf", "rate", bandwidth, "burst", "1mb", "latency", "100ms"]


def loopback_rate(bandwidth: str, nproc: int, per_worker: bool) -> str:
    """The loopback's rate: ``bandwidth``, or ``nproc`` times it (in kbit) per worker."""
    if not per_worker:
        return bandwidth
    number, unit = _RATE.match(bandwidth).group(0, 2)
    scale = {"bit": 1e-3, "kbit": 1.0, "mbit": 1e3, "gbit": 1e6}[unit]
    return f"{round(float(number[: -len(unit)]) * scale * nproc)}kbit"


def _run(*cmd: str) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


class Namespace:
    """A network namespace with a rate-limited loopback; removed on exit."""

    def __init__(self, bandwidth: str, latency: str = "", name: str | None = None):
        self.name = name or f"sparsecomm{os.getpid()}"
        self.bandwidth, self.latency = bandwidth, latency

    def __enter__(self) -> Namespace:
        _run("ip", "netns", "add", self.name)
        try:
            _run("ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up")
            qdisc = qdisc_args(self.bandwidth, self.latency)
            _run(
                "ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc
            )
        except RuntimeError as e:
            self.__exit__()
            if self.latency and "unknown" in str(e):
                raise RuntimeError(NO_NETEM) from e
            raise
        return self

    def __exit__(self, *exc) -> None:
        pids = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)

    def command(self, cmd: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]


def run_cluster(
    nproc: int,
    devices_per_proc: int,
    bandwidth: str,
    latency: str,
    train_args: Sequence[str],
    per_worker: bool = False,
) -> int:
    """Runs ``experiments.train train_args`` as ``nproc`` ranks in a throttled namespace;
    returns the job's exit code."""
    check_args(nproc, devices_per_proc, bandwidth, latency)
    bandwidth = loopback_rate(bandwidth, nproc, per_worker)
    check_environment()
    launcher = [
        sys.executable,
        "-m",
        "sparsecomm_jax.launch",
        "--nproc",
        str(nproc),
        "--devices-per-proc",
        str(devices_per_proc),
        "--",
        sys.executable,
        "-m",
        "experiments.train",
        *train_args,
    ]
    with Namespace(bandwidth, latency) as ns:
        proc = subprocess.Popen(ns.command(launcher), start_new_session=True)
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m experiments.cluster", description=__doc__)
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--devices-per-proc", type=int, default=1)
    parser.add_argument("--bandwidth", default="1gbit", help="loopback rate, e.g. 100mbit")
    parser.add_argument("--latency", default="", help="added delay, e.g. 50us (needs netem)")
    parser.add_argument(
        "--per-worker", action="store_true", help="--bandwidth per worker (lo: nproc x it)"
    )
    args = parser.parse_args(argv[:split])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_cluster(
            args.nproc,
            args.devices_per_proc,
            args.bandwidth,
            args.latency,
            argv[split + 1 :],
            args.per_worker,
        )
    except (ValueError, RuntimeError) as e:
        print(f"cluster: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
