"""Devices, meshes and multi-process start.

Three ways to get P workers:

* real accelerators (GPU hosts): ``data_mesh(P)`` over ``jax.devices()``;
* simulated CPU devices (tests, laptops): ``simulate_cpu_devices(8)`` before JAX starts;
* several processes on one host: ``python -m sparsecomm_jax.launch --nproc N -- CMD``
  sets the environment that ``initialize_distributed()`` reads.

Example:
    >>> from sparsecomm_jax import runtime
    >>> runtime.simulate_cpu_devices(8)          # before any other JAX call
    >>> mesh = runtime.data_mesh(8, axis_name="data")
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax._src import xla_bridge
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Environment set by ``sparsecomm_jax.launch`` for every rank.
ENV_COORDINATOR = "SPARSECOMM_COORDINATOR"
ENV_NUM_PROCESSES = "SPARSECOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "SPARSECOMM_PROCESS_ID"
ENV_LOCAL_DEVICES = "SPARSECOMM_LOCAL_DEVICES"


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


def has_accelerator() -> bool:
    """True when the default backend is not the CPU."""
    return jax.default_backend() != "cpu"


def data_mesh(num_devices: int | None = None, axis_name: str = "data") -> Mesh:
    """A 1-D mesh over the first ``num_devices`` global devices (all processes).

    Args:
      num_devices: how many devices; ``None`` means all of them.
      axis_name: name of the single mesh axis.

    Returns:
      A ``jax.sharding.Mesh`` with one axis called ``axis_name``.

    Raises:
      ValueError: more devices requested than exist, or fewer than one.
    """
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    if n > len(devices):
        raise ValueError(
            f"num_devices={n} but only {len(devices)} {jax.default_backend()} devices exist "
            "(on CPU, pass --devices before JAX starts to simulate more)"
        )
    if not axis_name or not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be a non-empty string, got {axis_name!r}")
    return Mesh(np.asarray(devices[:n]), (axis_name,))


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


def launched_env() -> dict[str, str] | None:
    """The launcher's environment for this rank, or ``None`` outside the launcher."""
    if ENV_NUM_PROCESSES not in os.environ:
        return None
    keys = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICES)
    return {k: os.environ.get(k, "") for k in keys}


def initialize_distributed() -> tuple[int, int]:
    """Joins the multi-process job described by the launcher's environment.

    Call before the first JAX computation. CPU collectives go through gloo and each
    process simulates ``SPARSECOMM_LOCAL_DEVICES`` CPU devices (both settings are
    harmless on GPU hosts, where the GPUs are the devices). Outside the launcher this
    does nothing: a single process.

    Returns:
      ``(process_id, num_processes)``.
    """
    env = launched_env()
    if env is None:
        return 0, 1
    num, pid = int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    simulate_cpu_devices(int(env[ENV_LOCAL_DEVICES] or 1))
    jax.distributed.initialize(env[ENV_COORDINATOR], num_processes=num, process_id=pid)
    return pid, num
