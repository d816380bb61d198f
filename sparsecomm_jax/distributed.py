"""Starting a job of several processes, one host or several.

* the project's launcher, ``python -m sparsecomm_jax.launch --nproc N [--nnodes H
  --node-rank h --coordinator HOST:PORT] -- CMD``, sets the environment that
  ``initialize_distributed()`` reads;
* a scheduler (SLURM ``srun``, Open MPI ``mpirun``, a Kubernetes indexed Job):
  ``initialize_distributed()`` lets ``jax.distributed`` read the job from its
  variables (``detect_scheduler``).

``initialize_distributed`` starts ``jax.distributed`` with a timeout that names what
did not assemble; ``watch_launcher`` ends a rank whose launcher died.

Example:
    >>> from sparsecomm_jax import distributed
    >>> distributed.distributed_args() is None  # no launcher, no scheduler: one process
    True
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import jax
from jax._src import clusters

from sparsecomm_jax import launch
from sparsecomm_jax.launch import (
    ENV_COORDINATOR,
    ENV_INIT_TIMEOUT,
    ENV_LAUNCHER,
    ENV_LOCAL_DEVICE_IDS,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from sparsecomm_jax.runtime import backend_started, simulate_cpu_devices

DEFAULT_INIT_TIMEOUT_S = 300


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


_RANK_VARS = {
    "ompi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS"),
    "k8s": ("JOB_COMPLETION_INDEX", "the Job's completions"),
}


_NOT_SRUN_STEPS = {
    "4294967293": "the interactive step",
    "4294967294": "the batch script's step",
    "4294967295": "the extern step",
}


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


def joined() -> bool:
    """Whether this process has joined a multi-process job (``initialize_distributed``).

    Example:
      >>> joined()  # a plain process
      False
    """
    return jax.distributed.is_initialized()


def launched_devices() -> int | None:
    """The job's device count as the launcher's variables give it, before JAX starts
    (process count x each process's devices: ``SPARSECOMM_LOCAL_DEVICE_IDS`` on a GPU
    host, ``SPARSECOMM_LOCAL_DEVICES`` simulated on CPU); ``None`` outside the launcher.
    Every process can check what depends on the count before joining, so none of them
    refuses while the others are still assembling (and die with it, loudly).

    Example:
      >>> launched_devices() is None  # a plain process
      True
    """
    if ENV_NUM_PROCESSES not in os.environ:
        return None
    ids = _int_list(os.environ.get(ENV_LOCAL_DEVICE_IDS, ""))
    local = os.environ.get(ENV_LOCAL_DEVICES)
    per_process = len(ids) if ids else (_env_int(ENV_LOCAL_DEVICES) if local else 0)
    return _env_int(ENV_NUM_PROCESSES) * per_process or None


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
