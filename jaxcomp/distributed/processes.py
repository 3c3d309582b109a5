"""Several processes (JAX's multi-controller runtime): :func:`initialize_multiprocess`."""

from __future__ import annotations

import jax
import jax.extend

__all__ = [
    "initialize_multiprocess",
]


# --- several processes --------------------------------------------------------------


def initialize_multiprocess(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    local_device_count: int | None = None,
) -> None:
    """Joins JAX's multi-controller runtime (call once per process, before any JAX work).

    Wraps ``jax.distributed.initialize``; with ``local_device_count`` it first
    sets ``jax_num_cpu_devices`` so each process simulates that many CPU
    devices (the CPU collectives then run over gloo). Never called at import:
    gate it behind your program's flags. Afterwards ``jax.devices()`` lists
    the devices of all processes; build the mesh over them and run the same
    program in every process (no collective under ``if process_index == 0``).

    Args:
      coordinator_address: ``"host:port"`` of process 0's coordinator.
      num_processes: total number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_count: CPU devices to create in this process (None: the
        platform default).

    Example:
      >>> # In each process i of 2 (not run here):
      >>> # initialize_multiprocess("127.0.0.1:12345", 2, i, local_device_count=2)
      >>> # mesh = jax.make_mesh((jax.device_count(),), ("data",))
    """
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
