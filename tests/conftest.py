"""Test set-up: 8 simulated CPU devices and a fast-compiling XLA:CPU, set before JAX initialises.

The tests compile thousands of small programs and run each a few times, so
compilation dominates their time. Three flags cut it:

- ``--xla_backend_optimization_level=0`` turns off LLVM's backend
  optimisation. It changes speed, not IEEE semantics (fast-math stays off).
- ``--xla_cpu_parallel_codegen_split_count=1`` hands LLVM a program's
  kernels as one module instead of splitting them into up to 32 modules
  compiled on XLA's thread pool: the same kernels, no semantic change.
  Splitting pays on a large program with idle cores; here the programs are
  small and the two xdist workers keep both cores busy, so it only costs
  CPU time (XLA's compile of 42 compressor updates: 10.8 -> 8.4 s of CPU).
- ``--xla_cpu_use_fusion_emitters=false`` makes XLA:CPU emit fusions with
  its classic elemental emitter, not the MLIR fusion emitters (which do not
  honour the level above): a single compressor update compiles 2.5-3x faster
  (``ldte_bs`` 3.1 -> 1.2 s) and ``make test`` takes about half the time.
  Same HLO and the same IEEE operations, but this emitter may round
  ``a * b + c`` with one rounding (a fused multiply-add) in one kernel and
  two in another kernel that recomputes it. The few tests that assert bit
  equality across two such kernels (or two different programs) are marked
  ``default_codegen``: with the flag set they are skipped here and run in
  ``make test``'s last tier, under XLA's default codegen (the codegen users
  run), with the x64 tier and the tests marked ``both_codegens`` (the
  nothing-lost check of one compressor per error-feedback family, run under
  both).

The emitter flag is set only when this jaxlib knows it (XLA aborts on an
unknown flag), not when ``XLA_FLAGS`` already names it, and not with
``JAXCOMP_TEST_CODEGEN=default`` in the environment (the last tier). The
other two leave IEEE semantics alone and are set in every tier (the split
count too only when this jaxlib knows it), unless ``XLA_FLAGS`` names them.
Benchmarks and ``make demo`` run with XLA's defaults.
"""

from __future__ import annotations

import gc
import glob
import importlib.util
import mmap
import os
import re
import shutil

import pytest

LEGACY_EMITTER_FLAG = "xla_cpu_use_fusion_emitters"
SPLIT_FLAG = "xla_cpu_parallel_codegen_split_count"
COMPILATION_CACHE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"
)
COMPILATION_CACHE_LIMIT = 2 * 2**30  # bytes; a whole make test writes about 150 MB


def _jaxlib_knows(flag: str) -> bool:
    """Whether a jaxlib shared library holds the flag's name (no import of JAX)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return False
    needle = flag.encode()
    for root in spec.submodule_search_locations:
        for path in glob.glob(os.path.join(root, "**", "*.so*"), recursive=True):
            try:  # a directory, broken link or unreadable file is not the library
                if not os.path.isfile(path) or os.path.getsize(path) < len(needle):
                    continue
                with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    if m.find(needle) >= 0:
                        return True
            except (OSError, ValueError):
                continue
    return False


def _legacy_emitter_value(flags: str) -> str | None:
    """The value ``XLA_FLAGS`` gives the fusion-emitter flag (the last one wins), or None."""
    values = re.findall(rf"--{LEGACY_EMITTER_FLAG}=(\S*)", flags)
    return values[-1].lower() if values else None


_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
if "xla_cpu_parallel_codegen_split_count" not in _flags and _jaxlib_knows(SPLIT_FLAG):
    _flags += f" --{SPLIT_FLAG}=1"
_default_codegen = os.environ.get("JAXCOMP_TEST_CODEGEN", "fast") == "default"
_emitters = _legacy_emitter_value(_flags)
if _emitters is None and not _default_codegen and _jaxlib_knows(LEGACY_EMITTER_FLAG):
    _flags += f" --{LEGACY_EMITTER_FLAG}=false"
    _emitters = "false"
LEGACY_EMITTERS = _emitters in ("false", "0")
if _default_codegen and LEGACY_EMITTERS:
    # The last tier must not silently skip what it selected.
    raise RuntimeError(
        f"JAXCOMP_TEST_CODEGEN=default, but XLA_FLAGS turns the fusion emitters off: {_flags!r}"
    )
os.environ["XLA_FLAGS"] = _flags.strip()

# JAX's persistent compilation cache, shared by the xdist workers, the
# subprocesses the tests start (experiment runs, notebook kernels, the
# multi-process workers inherit the environment) and make test's tiers: many
# tests build their own transform and compile a program another test already
# compiled (the same update on the same shapes under another closure), and the
# cache serves it by the lowered module's hash (which includes XLA_FLAGS, so
# each codegen has its own entries). make test empties it first, so every run
# compiles from scratch once; a pytest run by hand reuses it. Set
# JAX_COMPILATION_CACHE_DIR to move it, JAX_ENABLE_COMPILATION_CACHE=0 to
# turn it off. No size limit: JAX's eviction rescans the directory on every
# write (the per-compressor files took 5:19 instead of 3:50); instead the
# first process of a session empties the default directory once it passes
# COMPILATION_CACHE_LIMIT. Entries are written without a lock: a read that
# meets a half-written entry fails to decompress, and JAX then warns and
# compiles (jax._src.compiler._cache_read).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Python's cyclic garbage collector, at its default threshold (a young-generation
# pass every 700 allocations), ran ~20 full passes over a worker's heap per 80
# tests, 6-7% of their time (JAX's tracing allocates millions of objects, and
# the heap of compiled programs only grows). A pass every 10,000 allocations
# leaves 2 full passes there (GC 5.3 s -> 1.4 s); garbage is freed as before,
# a little later.
gc.set_threshold(10_000, *gc.get_threshold()[1:])


def pytest_sessionstart(session):
    """The first process empties the default compilation cache once it passes the limit."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller did it
        return
    if os.environ["JAX_COMPILATION_CACHE_DIR"] != COMPILATION_CACHE_DIR:
        return
    try:
        with os.scandir(COMPILATION_CACHE_DIR) as entries:
            size = sum(e.stat().st_size for e in entries if e.is_file())
    except FileNotFoundError:
        return
    if size > COMPILATION_CACHE_LIMIT:
        shutil.rmtree(COMPILATION_CACHE_DIR, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "default_codegen: asserts bit equality across separately compiled kernels; "
        "runs only under XLA:CPU's default fusion emitters (make test's last tier)",
    )
    config.addinivalue_line(
        "markers",
        "both_codegens: runs under the fast codegen and again under the default one "
        "(make test's last tier)",
    )


def pytest_collection_modifyitems(config, items):
    if not LEGACY_EMITTERS:
        return
    skip = pytest.mark.skip(
        reason="bit-exact across kernels: runs under XLA's default codegen "
        "(JAXCOMP_TEST_CODEGEN=default, make test's last tier)"
    )
    for item in items:
        if item.get_closest_marker("default_codegen"):
            item.add_marker(skip)
