"""The CPU cores a host lends a process, and how many compute threads each of a host's
processes should run (without JAX: the launcher reads them before any rank starts).

Example:
    >>> from sparsecomm_jax import cores
    >>> cores.compute_threads(processes=4, cores=2)  # two ranks share each core
    1
    >>> cores.compute_threads(processes=2, cores=16)
    8
"""

from __future__ import annotations

import os


def usable_cores() -> set[int]:
    """The CPU ids this process may run on (its affinity mask; every CPU where the OS
    has no masks). A CPU quota is apart: ``cpu_quota``."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs this process's cgroup lets it use in all (a container's ``--cpus``):
    the smallest quota on its cgroup's path and the folders above it, cgroup v2
    (``cpu.max``) or v1 (``cpu.cfs_quota_us / cpu.cfs_period_us``).

    Args:
      proc_cgroup: the process's cgroup list.
      root: where the cgroup file systems are mounted.

    Returns:
      CPUs (1.5: one and a half), or None where no quota is set or none can be read.

    Example:
        >>> q = cpu_quota()
        >>> q is None or q > 0
        True
    """
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        if line.count(":") < 2:  # not hierarchy:controllers:path
            continue
        _, controllers, path = line.split(":", 2)
        if not controllers:  # cgroup v2: one hierarchy, mounted at root or root/unified
            bases, read = [root, os.path.join(root, "unified")], _cpu_max
        elif "cpu" in controllers.split(","):  # cgroup v1, e.g. root/cpu,cpuacct
            bases, read = [os.path.join(root, controllers), os.path.join(root, "cpu")], _cfs_quota
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for base in dict.fromkeys(bases):
            # the cgroup's folder and those above it (inside a container the mount may
            # show only the container's own cgroup: its root then holds the quota)
            for depth in range(len(parts), -1, -1):
                quota = read(os.path.join(base, *parts[:depth]))
                if quota is not None:
                    found.append(quota)
    return min(found) if found else None


def _cpu_max(folder: str) -> float | None:
    """cgroup v2's ``cpu.max``: ``max 100000`` (none) or ``150000 100000`` (1.5)."""
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = f.read().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _cfs_quota(folder: str) -> float | None:
    """cgroup v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (-1: none)."""
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def capped_cores(cpus: int, quota: float | None) -> int:
    """The cores ``cpus`` CPUs of an affinity mask give under a CPU ``quota``.

    Args:
      cpus: the CPUs the masks cover.
      quota: CPUs a cgroup allows (``cpu_quota``), or None for no quota.

    Returns:
      ``cpus``, no more than the quota's whole CPUs (1.5 is 1), at least one.

    Example:
        >>> capped_cores(16, 2.5), capped_cores(4, None), capped_cores(4, 0.5)
        (2, 4, 1)
    """
    cores = max(cpus, 1)
    return cores if quota is None else min(cores, max(int(quota), 1))


def host_cores() -> int:
    """The cores this process may use.

    Returns:
      Its affinity mask's CPUs, no more than the whole CPUs of its cgroup's quota (at
      least one): ``capped_cores``.
    """
    return capped_cores(len(usable_cores()), cpu_quota())


def compute_threads(processes: int, cores: int) -> int:
    """Each process's share of a host's ``cores`` when ``processes`` of one job run
    there: the threads its CPU programs should run on, at least one.

    Args:
      processes: the job's processes on the host.
      cores: the cores they share (``host_cores``).

    Returns:
      ``cores // processes``, at least 1.
    """
    return max(1, cores // processes)
