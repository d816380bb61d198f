"""Devices, meshes and multi-process start.

Four ways to get P workers:

* real accelerators (GPU hosts): ``data_mesh(P)`` over ``jax.devices()``;
* simulated CPU devices (tests, laptops): ``simulate_cpu_devices(8)`` before JAX starts;
* several processes, one host or several: ``python -m sparsecomm_jax.launch --nproc N
  [--nnodes H --node-rank h --coordinator HOST:PORT] -- CMD`` sets the environment that
  ``initialize_distributed()`` reads;
* a scheduler (SLURM ``srun``, Open MPI ``mpirun``, a Kubernetes indexed Job):
  ``initialize_distributed()`` lets ``jax.distributed`` read the job from its variables.

``host_mesh()`` arranges the devices as ``(hosts, local)`` so a collective can stay
inside a host.

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
import sys
import threading
import time
import zlib
from typing import NamedTuple

import jax
import numpy as np
from jax._src import clusters, xla_bridge
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsecomm_jax import launch
from sparsecomm_jax.cores import capped_cores, cpu_quota, usable_cores
from sparsecomm_jax.errors import ArgumentError, Call
from sparsecomm_jax.launch import (
    ENV_COORDINATOR,
    ENV_INIT_TIMEOUT,
    ENV_LAUNCHER,
    ENV_LOCAL_DEVICE_IDS,
    ENV_LOCAL_DEVICES,
    ENV_NODE_RANK,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

DEFAULT_INIT_TIMEOUT_S = 300

# The variables jax.distributed's cluster detectors read (jax/_src/clusters), in its order.
SCHEDULER_VARS = {
    "ompi": ("OMPI_MCA_orte_hnp_uri",),  # mpirun / mpiexec (Open MPI)
    "slurm": (
        "SLURM_JOB_ID",
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
    ),  # srun
    "k8s": ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"),  # an indexed Job
}
_TASK_COUNT = {"ompi": "OMPI_COMM_WORLD_SIZE", "slurm": "SLURM_NTASKS"}
# The variables that carry a task's id and the task count, as errors name them.
_RANK_VARS = {
    "ompi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS"),
    "k8s": ("JOB_COMPLETION_INDEX", "the Job's completions"),
}
# SLURM_STEP_ID of the steps srun does not start.
_NOT_SRUN_STEPS = {
    "4294967293": "the interactive step",
    "4294967294": "the batch script's step",
    "4294967295": "the extern step",
}


# XLA flags that let collectives run asynchronously and overlap computation on GPU
# (the latency-hiding scheduler reorders async collective start/done pairs around
# compute). The CPU backend ignores them.
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


def put_global(x: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
    """Places a host array, identical on every process, as a global sharded array."""
    x = np.asarray(x)
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


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


class JobError(RuntimeError):
    """The multi-process job cannot be formed: a one-line reason and what to do."""


def _started_by_srun() -> bool:
    """Whether this process is a task of an ``srun`` step (not the batch script)."""
    step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID"))
    return step is not None and step not in _NOT_SRUN_STEPS


def detect_scheduler() -> str | None:
    """The scheduler that started this process as one task of several: ``"slurm"``,
    ``"ompi"`` or ``"k8s"`` (by the variables jax's cluster detectors read), else
    ``None`` (also for a job of one task, which needs no coordination, and for a batch
    script that SLURM started without ``srun``: it is one process)."""
    for name, names in SCHEDULER_VARS.items():
        if all(v in os.environ for v in names):
            count = os.environ.get(_TASK_COUNT.get(name, ""), "")
            if count == "1" or (name == "slurm" and not _started_by_srun()):
                return None
            return name
    return None


def slurm_without_srun() -> str | None:
    """A note when SLURM's variables describe several tasks but this process was not
    started by ``srun`` (a batch script running python directly): it runs alone."""
    if not all(v in os.environ for v in SCHEDULER_VARS["slurm"]) or _started_by_srun():
        return None
    tasks = os.environ.get("SLURM_NTASKS", "1")
    if tasks == "1":
        return None
    step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID"))
    seen = "no SLURM_STEP_ID" if step is None else f"SLURM_STEP_ID {step}, {_NOT_SRUN_STEPS[step]}"
    return (
        f"SLURM job of {tasks} tasks, but this process was not started by srun ({seen}): "
        "it runs alone; start it with srun to run one process per task"
    )


def _int_list(text: str) -> list[int] | None:
    return [int(i) for i in text.split(",")] if text.strip() else None


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise JobError(f"{name}={value!r} is not an integer") from None


def _check_rank(process_id: int, num_processes: int, names: tuple[str, str]) -> None:
    if num_processes < 1:
        raise JobError(f"{names[1]}={num_processes}: a job has at least one process")
    if not 0 <= process_id < num_processes:
        raise JobError(
            f"{names[0]}={process_id} is not a process id of a job of {num_processes} "
            f"({names[1]}): ids are 0..{num_processes - 1}"
        )


def _launcher_job() -> tuple[tuple[str, int, int], list[int] | None]:
    """The launcher's variables: coordinator, count, id; local device ids."""
    missing = [v for v in (ENV_COORDINATOR, ENV_PROCESS_ID) if not os.environ.get(v)]
    if missing:
        raise JobError(
            f"{ENV_NUM_PROCESSES} is set but {' and '.join(missing)} not: start the "
            "processes with python -m sparsecomm_jax.launch, or set all three"
        )
    explicit = (
        os.environ[ENV_COORDINATOR],
        _env_int(ENV_NUM_PROCESSES),
        _env_int(ENV_PROCESS_ID),
    )
    _check_rank(explicit[2], explicit[1], (ENV_PROCESS_ID, ENV_NUM_PROCESSES))
    return explicit, _int_list(os.environ.get(ENV_LOCAL_DEVICE_IDS, ""))


def _scheduler_job(name: str, timeout: int) -> tuple[tuple[str, int, int], list[int] | None]:
    """A scheduler's job as jax's own cluster detection reads it."""
    ids = _int_list(os.environ.get("JAX_LOCAL_DEVICE_IDS", ""))
    try:
        *explicit, ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, ids, None, timeout
        )
    except (KeyError, ValueError) as e:
        raise JobError(f"the {name} job could not be read by jax ({e!r} in its variables)") from e
    if None in explicit:
        raise JobError(
            f"the {name} job could not be read by jax (for Kubernetes: pip install 'jax[k8s]')"
        )
    _check_rank(explicit[2], explicit[1], _RANK_VARS[name])
    return tuple(explicit), ids


def distributed_args() -> dict | None:
    """The ``jax.distributed.initialize`` arguments of this process, ``None`` alone.

    The launcher's ``SPARSECOMM_*`` variables come first (explicit coordinator, process
    count and id, local device ids); else a scheduler's, resolved by jax's own cluster
    detection (one process per GPU: local device ``[local rank]``, or
    ``JAX_LOCAL_DEVICE_IDS``). Detection is then switched off so jax uses exactly these.
    ``SPARSECOMM_INIT_TIMEOUT`` (seconds, default 300) bounds the wait for the others.

    Returns:
      ``coordinator_address``, ``num_processes``, ``process_id``, ``local_device_ids``,
      ``initialization_timeout`` and ``cluster_detection_method``, or ``None``.

    Raises:
      JobError: the variables do not describe a job (one missing, not a number, an id
        outside ``0..n-1``), or jax could not read the scheduler's.

    Example:
      >>> distributed_args() is None  # a plain process: nothing to join
      True
    """
    timeout = _env_int(ENV_INIT_TIMEOUT) if os.environ.get(ENV_INIT_TIMEOUT) else None
    timeout = timeout or DEFAULT_INIT_TIMEOUT_S
    common = {"initialization_timeout": timeout, "cluster_detection_method": "deactivate"}
    if ENV_NUM_PROCESSES in os.environ:
        explicit, ids = _launcher_job()
    elif scheduler := detect_scheduler():
        explicit, ids = _scheduler_job(scheduler, timeout)
    else:
        return None
    keys = ("coordinator_address", "num_processes", "process_id")
    return {**dict(zip(keys, explicit, strict=True)), "local_device_ids": ids, **common}


def initialize_distributed() -> tuple[int, int]:
    """Joins the multi-process job this process belongs to (see ``distributed_args``).

    Call before the first JAX computation. CPU collectives go through gloo and a
    launched process simulates ``SPARSECOMM_LOCAL_DEVICES`` CPU devices (both harmless
    on GPU hosts, where each process drives its local device ids). A launched process
    also watches its launcher and exits when it is gone. Calling it again, or outside a
    job, does nothing.

    A job that does not assemble within the timeout (a process never started) ends
    the process with one line on stderr and exit status 2, where jax would abort with a
    C++ stack; after ``NOTICE_AFTER_S`` it says what it is waiting for.

    Returns:
      ``(process_id, num_processes)``.

    Raises:
      JobError: the job's variables are wrong, the coordinator's host does not resolve,
        its port is busy (process 0) or it does not answer within the timeout (the
        others), instead of jax aborting the process.
    """
    if jax.distributed.is_initialized():
        return jax.process_index(), jax.process_count()
    local = os.environ.get(ENV_LOCAL_DEVICES)
    if local and not backend_started():  # a launched process, alone or one of several
        simulate_cpu_devices(_env_int(ENV_LOCAL_DEVICES))
    args = distributed_args()
    if args is None:
        if note := slurm_without_srun():
            print(note, file=sys.stderr)
        return 0, 1
    _check_reachable(args)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get(ENV_LAUNCHER):
        watch_launcher()
    timeout = args["initialization_timeout"]
    assembled = _watch_assembly(args)
    try:  # jax's own deadline comes after ours: it aborts the process
        jax.distributed.initialize(**{**args, "initialization_timeout": timeout + 30})
    finally:
        assembled.set()
    return args["process_id"], args["num_processes"]


NOTICE_AFTER_S = 10.0


def _watch_assembly(args: dict) -> threading.Event:
    """A thread that says what this process waits for after ``NOTICE_AFTER_S``, and
    ends it in one line when the job has not assembled within the timeout; set the
    returned event once it has."""
    done, timeout = threading.Event(), args["initialization_timeout"]
    me = f"process {args['process_id']} of {args['num_processes']}"
    where = args["coordinator_address"]

    def watch() -> None:
        start = time.monotonic()
        if done.wait(min(NOTICE_AFTER_S, timeout / 2)):
            return
        print(
            f"{me}: waiting for the job's other processes at {where} (up to {timeout} s, "
            f"{ENV_INIT_TIMEOUT})",
            file=sys.stderr,
            flush=True,
        )
        if done.wait(max(0.0, timeout - (time.monotonic() - start))):
            return
        print(
            f"error: {me}: the job did not assemble at {where} within {timeout} s: are all "
            f"{args['num_processes']} processes started, with ids 0..{args['num_processes'] - 1} "
            "and this coordinator?",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)

    threading.Thread(target=watch, name="job-assembly-watchdog", daemon=True).start()
    return done


def _check_reachable(args: dict) -> None:
    host, port = launch.parse_address(args["coordinator_address"])
    timeout = args["initialization_timeout"]
    try:
        socket.getaddrinfo(host, port)
    except OSError as e:
        raise JobError(
            f"coordinator host {host!r} does not resolve ({e.strerror or e}): check the address"
        ) from None
    if args["process_id"] == 0 and not launch.port_is_free(port):
        raise JobError(f"coordinator port {port} is in use on this host: pick another")
    if args["process_id"] > 0 and not launch.wait_for_port(host, port, timeout):
        raise JobError(
            f"coordinator {host}:{port} did not answer within {timeout} s: is "
            "process 0 running and the address right?"
        )


def watch_launcher(poll_s: float = 0.5) -> threading.Thread | None:
    """Ends this process (exit code 1) within ``poll_s`` once the launcher that started
    it (``SPARSECOMM_LAUNCHER``) is gone, even if it was killed with SIGKILL and this
    process is not its direct child; ``None`` outside the launcher."""
    pid, _, start = os.environ.get(ENV_LAUNCHER, "").partition(":")
    if not pid.isdigit():
        return None

    def watch() -> None:
        while launch.process_alive(int(pid), start):
            time.sleep(poll_s)
        try:  # the launcher read our output: the pipe may be broken
            print(f"the launcher (pid {pid}) is gone; exiting", file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="launcher-watchdog", daemon=True)
    thread.start()
    return thread
