"""Devices and meshes: where a step's workers are.

Three ways to get P workers in one process's view:

* real accelerators (GPU hosts): ``data_mesh(P)`` over ``jax.devices()``;
* simulated CPU devices (tests, laptops): ``simulate_cpu_devices(8)`` before JAX starts;
* several processes, one host or several (``sparsecomm_jax.distributed`` starts the
  job): ``data_mesh()`` spans every process's devices.

``host_mesh()`` arranges the devices as ``(hosts, local)`` so a collective can stay
inside a host; ``replica_mesh`` adds the replica groups' axis; ``put_global`` and
``to_host`` move arrays on and off the mesh.

Example:
    >>> from sparsecomm_jax import runtime
    >>> runtime.simulate_cpu_devices(8)          # before any other JAX call
    >>> mesh = runtime.data_mesh(8, axis_name="data")
    >>> runtime.host_mesh(hosts=2).shape         # 8 devices as 2 simulated hosts x 4
    OrderedDict([('hosts', 2), ('local', 4)])
"""

from __future__ import annotations

import os
import socket
import zlib
from typing import NamedTuple

import jax
import numpy as np
from jax._src import xla_bridge
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsecomm_jax.cores import capped_cores, cpu_quota, usable_cores
from sparsecomm_jax.errors import ArgumentError, Call
from sparsecomm_jax.launch import (
    ENV_NODE_RANK,
)

GPU_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
)


def enable_collective_overlap() -> None:
    """Adds ``GPU_OVERLAP_FLAGS`` to ``XLA_FLAGS`` (call before JAX starts)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    missing = [f for f in GPU_OVERLAP_FLAGS if f.split("=")[0] not in " ".join(flags)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, *missing])


def collectives_overlap(mesh: Mesh) -> bool:
    """Whether one program's collectives can run beside its compute on ``mesh``'s
    devices: not on XLA:CPU, which runs a program's thunks one after the other (two
    programs on two host threads can: ``schedule.overlap``). Where they cannot,
    ``embrace_2d`` runs as ``embrace`` (``strategies.registry.Strategy.serial``)."""
    return mesh.devices.flat[0].platform != "cpu"


def backend_started() -> bool:
    """Whether JAX has already created its backends (device counts are then fixed)."""
    return xla_bridge.backends_are_initialized()


def simulate_cpu_devices(n: int) -> None:
    """Makes the CPU backend expose ``n`` devices; call before JAX starts.

    Args:
      n: number of simulated devices, >= 1.

    Raises:
      ValueError: ``n`` < 1, or JAX already started with a different CPU device count.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if backend_started():
        have = len(jax.devices("cpu"))
        if have != n:
            raise ValueError(
                f"JAX already started with {have} CPU devices; simulate_cpu_devices({n}) "
                "must run before the first JAX computation"
            )
        return
    jax.config.update("jax_num_cpu_devices", n)


def data_mesh(num_devices: int | None = None, axis_name: str = "data") -> Mesh:
    """A 1-D mesh over the first ``num_devices`` global devices (all processes).

    Args:
      num_devices: how many devices; ``None`` means all of them.
      axis_name: name of the single mesh axis.

    Returns:
      A ``jax.sharding.Mesh`` with one axis called ``axis_name``.

    Raises:
      ValueError: more devices requested than exist, or fewer than one, or (several
        processes) fewer than every device of the job.
    """
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not isinstance(n, int) or n < 1:
        raise ArgumentError("num_devices", num_devices, "must be an integer >= 1")
    if n > len(devices):
        raise ArgumentError(
            "num_devices",
            n,
            f"but only {len(devices)} {jax.default_backend()} devices exist (on CPU, "
            "$simulate before the first JAX computation to simulate more)",
            simulate=Call("runtime.simulate_cpu_devices", "num_devices", n),
        )
    if not axis_name or not isinstance(axis_name, str):
        raise ArgumentError("axis_name", axis_name, "must be a non-empty string")
    _check_spans_job(n)
    return Mesh(np.asarray(devices[:n]), (axis_name,))


def _check_spans_job(n: int) -> None:
    """A multi-process mesh must use every device of the job: a smaller one would leave
    some processes without a device. Every process decides from the same global facts."""
    total, procs = jax.device_count(), jax.process_count()
    if procs > 1 and n != total:
        raise ArgumentError(
            "num_devices",
            n,
            f"but this job of {procs} processes has {total} devices: a multi-process mesh "
            "uses every one; pass $num_devices",
            num_devices=total,
        )


def host_mesh(hosts: int | None = None, axis_names: tuple[str, str] = ("hosts", "local")) -> Mesh:
    """A 2-D mesh ``(hosts, local)`` over every device: row ``h`` holds host ``h``'s
    devices, so a collective over ``"local"`` stays inside a host and one over
    ``"hosts"`` crosses hosts (one device per host). A collective over both axes spans
    the whole job, as on ``data_mesh``.

    Args:
      hosts: ``None``: the job's real hosts (processes grouped by the launcher's node
        rank, else by host name; collective, call on every process); an int splits the
        devices in order into that many equal simulated hosts.
      axis_names: the names of the two axes.

    Returns:
      A ``Mesh`` of shape ``(hosts, devices per host)``; devices in ``jax.devices()`` order.

    Raises:
      ValueError: hosts that do not divide the devices or hold unequal numbers of them.

    Example:
      >>> mesh = host_mesh(hosts=2)  # 8 simulated devices -> {'hosts': 2, 'local': 4}
    """
    devices = jax.devices()
    if hosts is None:
        node = dict(enumerate(_process_nodes()))
        keys = [node[d.process_index] for d in devices]
    elif not isinstance(hosts, int) or hosts < 1 or len(devices) % hosts:
        raise ValueError(f"hosts={hosts!r} must be an integer >= 1 dividing {len(devices)}")
    else:
        keys = [i * hosts // len(devices) for i in range(len(devices))]
    groups = {k: [d for d, kd in zip(devices, keys, strict=True) if kd == k] for k in keys}
    sizes = sorted({len(g) for g in groups.values()})
    if len(sizes) > 1:
        raise ValueError(f"hosts hold different numbers of devices {sizes}: no (hosts, local) mesh")
    return Mesh(np.asarray(list(groups.values())), axis_names)


def _host_id() -> int:
    """This machine's host name as a non-negative int32 (its CRC-32, 30 bits)."""
    return zlib.crc32(socket.gethostname().encode()) & 0x3FFFFFFF


def _process_nodes() -> list[int]:
    """One node id per process (launcher node rank, else a hash of the host name)."""
    rank = os.environ.get(ENV_NODE_RANK)
    mine = int(rank) if rank else _host_id()
    if jax.process_count() == 1:
        return [mine]
    return [int(v) for v in np.ravel(multihost_utils.process_allgather(np.int32(mine)))]


MASK_BITS = 4096  # CPU ids a process's affinity mask is shared with (higher ids ignored)


class HostLoad(NamedTuple):
    """A host's processes of the job and the CPU cores they may run on together."""

    processes: int
    cores: int


def busiest_host() -> HostLoad:
    """The job's host with the most processes per core: its processes (grouped by host
    name, so two launcher nodes on one machine count as one host) and the cores they
    may use together: those their affinity masks cover, no more than their CPU quota
    allows (``cpu_quota``). The same on every process; one collective in a job of
    several processes: call it on every process.

    Returns:
      A ``HostLoad``; ``HostLoad(1, cores)`` in a job of one process.

    Example:
        >>> busiest_host().processes  # one process
        1
    """
    mask = np.zeros(MASK_BITS, bool)
    mask[[c for c in usable_cores() if c < MASK_BITS]] = True
    quota = cpu_quota()
    millis = 0 if quota is None else max(1, round(quota * 1000))  # 0: no quota
    head = [_host_id(), min(millis, 2**31 - 1)]
    mine = np.concatenate([head, np.packbits(mask).view(np.int32)]).astype(np.int32)
    if jax.process_count() == 1:
        every = mine[None]
    else:
        every = np.asarray(multihost_utils.process_allgather(mine))  # int32[processes, 130]
    return host_loads(every)[0]


def host_loads(rows: np.ndarray) -> list[HostLoad]:
    """Per host, busiest first: ``rows`` has one row per process, its host's id, its
    CPU quota in thousandths of a CPU (0: none) and its affinity mask as packed bits
    (``busiest_host``). A host's cores are the union of its processes' masks, capped by
    the whole CPUs of their largest quota when every one of them has a quota (processes
    of one job on one host share a container)."""
    hosts: dict[int, tuple[int, np.ndarray, list[int]]] = {}
    for row in rows:
        bits = np.unpackbits(row[2:].astype(np.int32).view(np.uint8)).astype(bool)
        count, union, quotas = hosts.get(int(row[0]), (0, np.zeros_like(bits), []))
        hosts[int(row[0])] = (count + 1, union | bits, [*quotas, int(row[1])])
    loads = []
    for count, union, quotas in hosts.values():
        quota = max(quotas) / 1000 if all(quotas) else None  # thousandths of a CPU
        loads.append(HostLoad(count, capped_cores(int(union.sum()), quota)))
    return sorted(loads, key=lambda h: h.processes / h.cores, reverse=True)


REPLICA_AXIS = "replica"  # the mesh axis of the replica groups (2-D sparse parallelism)


def replica_mesh(mesh: Mesh, axis_name: str, replicas: int) -> Mesh:
    """``mesh`` (one axis, ``axis_name``, of P devices) as ``replicas`` groups of P / R
    consecutive devices: axes ``(REPLICA_AXIS, axis_name)``. Consecutive devices share a
    host first, so a group's exchanges stay on its fastest links.

    Example:
        >>> dict(replica_mesh(data_mesh(8), "data", 2).shape)
        {'replica': 2, 'data': 4}
    """
    if tuple(mesh.axis_names) != (axis_name,):
        raise ValueError(
            f"replica groups split a mesh of the one axis {axis_name!r}; got axes "
            f"{tuple(mesh.axis_names)}"
        )
    devices = mesh.devices.reshape(replicas, -1)
    return Mesh(devices, (REPLICA_AXIS, axis_name))


def mesh_axis_size(mesh: Mesh, axis_name: str) -> int:
    """Size of ``axis_name`` in ``mesh``; a clear error when the axis is not there."""
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name {axis_name!r} is not in the mesh axes {tuple(mesh.shape)}")
    return mesh.shape[axis_name]


def put_global(x: np.ndarray, mesh: Mesh, spec: P) -> jax.Array | jax.ShapeDtypeStruct:
    """Places a host array, identical on every process, as a global sharded array. On a
    mesh of compile-only devices (``compile_only``: they hold no data) the array as it
    would lie there, a ``jax.ShapeDtypeStruct`` with its sharding, for a program to be
    lowered and compiled on."""
    x = np.asarray(x)
    sharding = NamedSharding(mesh, spec)
    if compile_only(mesh):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def compile_only(mesh: Mesh) -> bool:
    """Whether ``mesh``'s devices compile programs but hold no data (GPUs described, not
    present: ``sparsecomm_jax.compile_only.gpu_mesh``)."""
    client = getattr(mesh.devices.flat[0], "client", None)
    return getattr(client, "runtime_type", "") == "compile_only_runtime"


def to_host(x: jax.Array) -> np.ndarray:
    """A global array as one numpy array on this process (gathers across processes)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def agreed_mean(value: float) -> float:
    """The mean of ``value`` over the job's processes (``value`` itself in one process).

    Each process times the same program itself and gets a slightly different figure; a
    choice made on those figures (a plan, a fusion threshold) must be the same on every
    process, or their programs differ and the job hangs in a collective. Call it on
    every process.
    """
    if jax.process_count() == 1:
        return float(value)
    return float(np.mean(multihost_utils.process_allgather(np.float32(value))))
