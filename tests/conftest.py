"""Test set-up: 8 simulated CPU devices, set before JAX initialises.

The tests compile thousands of small programs and run each a few times, so
compilation dominates their time: LLVM's backend optimisation is turned off
(``--xla_backend_optimization_level=0``, about a quarter off the suite). It
changes speed, not IEEE semantics (fast-math stays off). Benchmarks and
``make demo`` run with XLA's defaults.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
