"""Every test runs on 8 simulated CPU devices (set before JAX starts).

Two tiers, decided here and only here, by what a test is (its markers), never by a list
of names:

- the **fast tier**, ``python -m pytest``: every test except those below, each module's
  unit tests, one case of each matrix, the docs' and docstrings' examples and the
  structure tests;
- the **full tier**, ``python -m pytest --full`` (it includes the fast one; CI runs
  it): also every test marked ``cli`` (it runs the command line, ``experiments.train``,
  or an experiment's script: a study, ``experiments.gpu_schedule``), ``processes`` (it starts other
  programs: a job of several processes, the launcher, the emulated cluster, a killed
  rank, the notebook's kernel, the C++ kernel built and run under sanitizers) and every
  case of a ``matrix`` (a test parametrized over models, strategies, layouts or
  optimizers) after its first.

A test leaves the fast tier only by taking one of these markers, and stays in the full
one. ``-m`` selects within the tier as usual (``--full -m cli``: the command-line runs).

Compiled programs are shared through a persistent compilation cache, fresh for each
test run (a temporary folder made by the first process and inherited by the xdist
workers and the processes tests start, removed at exit): many tests build the same
small programs (a run and its resumed twin, a strategy and its reference), and each is
compiled once per run.
"""

import atexit
import os
import shutil
import sys
import tempfile

# Faster code generation: the suite is dominated by compiling small programs. LLVM
# without optimisation and XLA:CPU's classic fusion emitters (about half the compile
# time of the newer ones on these programs); HLO passes, and so the collectives and
# their bytes, are unaffected. Subprocesses started by tests inherit the flags.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()
# The suite runs on CPU devices; with the gpu-compile extra installed, the CUDA plugin
# then makes compile-only GPUs (test_compile_only) instead of looking for a driver.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from sparsecomm_jax import runtime  # noqa: E402

CACHE_ENV = "SPARSECOMM_TEST_COMPILE_CACHE"
if not os.environ.get(CACHE_ENV):
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="sparsecomm-test-cache-")
    atexit.register(shutil.rmtree, os.environ[CACHE_ENV], ignore_errors=True)
# the same settings as environment variables, read by JAX in the processes tests start
CACHE_SETTINGS = {
    "JAX_COMPILATION_CACHE_DIR": os.environ[CACHE_ENV],
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
os.environ.update(CACHE_SETTINGS)
jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

NUM_DEVICES = 8
runtime.simulate_cpu_devices(NUM_DEVICES)
# Start the backend now: an in-process run (experiments.train.main with --devices 4)
# that came first in a worker would otherwise start it with its own count, and every
# test after it in that worker would see 4 devices (which tests a worker gets varies).
jax.devices()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


import pytest  # noqa: E402

FULL_ONLY = ("cli", "processes")  # markers whose tests run in the full tier alone
MARKERS = {
    "cli": "runs the command line (experiments.train) or an experiment's script (a study, "
    "experiments.gpu_schedule): full tier",
    "processes": "starts other programs (a job of several processes, the launcher, the "
    "emulated cluster, a kernel, a sanitized build): full tier",
    "matrix": "parametrized over models, strategies, layouts or optimizers: its first case "
    "in the fast tier, every case in the full one",
}


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="run the full tier: the command-line runs, the multi-process jobs and every "
        "case of each matrix besides the fast tier",
    )


def pytest_configure(config):
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def full_tier_only(item) -> bool:
    """Whether ``item`` runs in the full tier alone (see the module doc)."""
    if any(item.get_closest_marker(name) for name in FULL_ONLY):
        return True
    callspec = getattr(item, "callspec", None)
    later_case = callspec is not None and any(callspec.indices.values())
    return bool(item.get_closest_marker("matrix")) and later_case


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    full = [item for item in items if full_tier_only(item)]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not full_tier_only(item)]


def pytest_report_header(config):
    if config.getoption("--full"):
        return "tier: full (every test)"
    return "tier: fast (python -m pytest --full also runs the cli, processes and matrix tests)"


@pytest.fixture
def pipelined_2d(monkeypatch):
    """``embrace_2d`` builds its pipelined program on these CPU devices. By default a
    CPU mesh runs it as ``embrace`` (XLA:CPU cannot overlap a program's collectives with
    its compute, so the cost model sends every row in one chunk): the tests of the
    schedule declare the overlap an accelerator has, as ``make_train_step(...,
    collectives_overlap=True)`` does. An explicit ``collectives_overlap`` still wins."""
    monkeypatch.setattr(runtime, "collectives_overlap", lambda mesh: True)
