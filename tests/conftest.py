"""Every test runs on 8 simulated CPU devices (set before JAX starts)."""

import os
import sys

# Faster LLVM code generation: the suite is dominated by compiling small programs.
# HLO passes (and so the collectives and their bytes) are unaffected.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
).strip()

from sparsecomm_jax import runtime  # noqa: E402

NUM_DEVICES = 8
runtime.simulate_cpu_devices(NUM_DEVICES)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
