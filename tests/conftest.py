"""Every test runs on 8 simulated CPU devices (set before JAX starts).

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


@pytest.fixture
def pipelined_2d(monkeypatch):
    """``embrace_2d`` builds its pipelined program on these CPU devices. By default a
    CPU mesh runs it as ``embrace`` (XLA:CPU cannot overlap a program's collectives with
    its compute, so the cost model sends every row in one chunk): the tests of the
    schedule declare the overlap an accelerator has, as ``make_train_step(...,
    collectives_overlap=True)`` does. An explicit ``collectives_overlap`` still wins."""
    from sparsecomm_jax.schedule import priority

    monkeypatch.setattr(priority, "collectives_overlap", lambda mesh: True)
