"""Steps compiled for GPUs that are not there: the program XLA would run on H100s, read on
a host with no GPU.

JAX compiles for devices described rather than present: ``gpu_mesh("h100", hosts=2,
per_host=8)`` makes a mesh of 16 compile-only devices from a description of the card
(``sparsecomm_jax/gpu_targets/*.txtpb``, written from the vendor's datasheet in the form
of XLA's ``GpuTargetConfigProto``) through ``jax.experimental.topologies``.
``make_train_step`` takes such a mesh like any other: nothing is placed (the state and
the batches are ``jax.ShapeDtypeStruct`` s with their shardings: ``runtime.put_global``),
and the step compiles through XLA's GPU pipeline, whose latency-hiding scheduler decides
what runs between an asynchronous collective's start and its done. ``compile_step``
lowers and compiles a built step on a batch; ``report`` reads what the program says: its
collectives and the bytes each device sends, its memory per device
(``memory_analysis``), and for each asynchronous collective the operations scheduled
between its start and its done (``comm.hlo.async_windows``).

These are schedules, not timings: what XLA's cost model placed, for a card it has never
run on. Sorts print "Missing deviceless CUB scratch size data for sort": XLA then uses
a fallback sort (it cannot tune one without a device).

Requires the ``gpu-compile`` extra (the CUDA plugin at JAX's version and ``ptxas``; no
driver, no CUDA libraries) and ``JAX_PLATFORMS=cpu`` set before JAX starts (the plugin
would look for a driver otherwise).

Example:
    >>> from sparsecomm_jax import compile_only
    >>> sorted(compile_only.GPUS)
    ['h100', 'h200']
    >>> compile_only.topology_name(hosts=2, per_host=8)
    '1x2x8'

References:
    JAX's ahead-of-time compilation (``jax.experimental.topologies``: deviceless AOT);
    XLA's latency-hiding scheduler.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from sparsecomm_jax.comm import hlo
from sparsecomm_jax.errors import ArgumentError

#: The GPUs described in ``sparsecomm_jax/gpu_targets`` (name -> file).
GPUS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}

NEEDS = (
    "compile-only GPU devices need the CUDA plugin at JAX's version and ptxas "
    '(pip install -e ".[gpu-compile]") and JAX_PLATFORMS=cpu set before JAX starts'
)


def topology_name(hosts: int = 1, per_host: int = 8) -> str:
    """The topology JAX's CUDA plugin reads: ``1 x hosts x GPUs per host``."""
    return f"1x{hosts}x{per_host}"


def target_config(gpu: str) -> str:
    """The text description of ``gpu`` (a key of ``GPUS``).

    Raises:
      ArgumentError: an unknown GPU.
    """
    if gpu not in GPUS:
        raise ArgumentError("gpu", gpu, f"must be one of {sorted(GPUS)}")
    return (resources.files("sparsecomm_jax") / "gpu_targets" / GPUS[gpu]).read_text()


@functools.cache
def gpu_devices(gpu: str = "h100", hosts: int = 1, per_host: int = 8) -> tuple:
    """``hosts * per_host`` compile-only devices of ``gpu``, host-major (device ``i`` on
    host ``i // per_host``, its ``process_index``).

    Raises:
      ArgumentError: an unknown GPU, a count below 1, or the plugin missing (``NEEDS``).
    """
    for name, value in (("hosts", hosts), ("per_host", per_host)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArgumentError(name, value, "must be a positive integer")
    config = target_config(gpu)
    if os.environ.get("JAX_PLATFORMS", "") != "cpu":
        raise ArgumentError("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS"), NEEDS)
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology=topology_name(hosts, per_host), target_config=config
        )
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise ArgumentError("gpu", gpu, f"{NEEDS} ({type(e).__name__}: {e})") from None
    return tuple(topology.devices)


def gpu_mesh(gpu: str = "h100", hosts: int = 1, per_host: int = 8, axis_name: str = "data") -> Mesh:
    """A mesh of ``hosts * per_host`` compile-only GPU devices along ``axis_name``, for
    ``make_train_step`` (``runtime.data_mesh``'s shape; ``replicas=`` makes groups).

    Args:
      gpu: a key of ``GPUS``.
      hosts: hosts of the job (2: a two-node job, its collectives spanning both).
      per_host: GPUs on each host.
      axis_name: the mesh axis.

    Returns:
      A ``jax.sharding.Mesh`` whose devices hold no data (``runtime.compile_only``).
    """
    return Mesh(np.array(gpu_devices(gpu, hosts, per_host)), (axis_name,))


class Report(NamedTuple):
    """What a compiled program says.

    Attributes:
      collectives: every collective, in scheduled order (``hlo.Collective``).
      bytes_per_device: bytes each device sends per call (conditional branches left
        out, as ``hlo.total_bytes`` counts).
      memory: per device, bytes of the arguments, outputs, temporaries and aliases and
        the peak (``compiled.memory_analysis()``).
      windows: each asynchronous collective's start and done, and what runs between
        (``hlo.Window``).
      text: the scheduled HLO module.
    """

    collectives: list
    bytes_per_device: float
    memory: dict[str, int]
    windows: list
    text: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the text left out: it goes to a file of its own)."""
        return {
            "collectives": [c.as_dict() for c in self.collectives],
            "bytes_per_device": self.bytes_per_device,
            "memory": self.memory,
            "windows": [w.as_dict() for w in self.windows],
        }


MEMORY = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
    "alias_size_in_bytes",
    "peak_memory_in_bytes",
)


def report(compiled) -> Report:
    """What ``compiled`` (a ``jax.stages.Compiled``) says: collectives, bytes, memory and
    the asynchronous collectives' windows."""
    text = compiled.as_text()
    colls = hlo.parse_collectives(text)
    analysis = compiled.memory_analysis()
    memory = {k: int(getattr(analysis, k, 0) or 0) for k in MEMORY}
    return Report(colls, hlo.total_bytes(colls), memory, hlo.async_windows(text), text)


def abstract(tree):
    """``tree``'s arrays as ``jax.ShapeDtypeStruct`` s with their shardings (a lowered
    program's ``out_info``, or placed arrays)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def compile_step(step, state, batch):
    """``step`` (a built ``TrainStep``'s ``step`` or ``steps``) lowered and compiled on
    ``state`` and ``batch`` (abstract on a compile-only mesh).

    Returns:
      ``(compiled, state)``: the ``jax.stages.Compiled`` program, and the abstract state
      it returns (for the next call's program: a pipelined step's carried rows).
    """
    lowered = step.lower(state, batch)
    return lowered.compile(), abstract(lowered.out_info[0])
