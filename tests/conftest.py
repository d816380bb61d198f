"""Every test runs on 8 simulated CPU devices (set before JAX starts)."""

import os
import sys

from sparsecomm_jax import runtime

NUM_DEVICES = 8
runtime.simulate_cpu_devices(NUM_DEVICES)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
