"""Two processes on 127.0.0.1 train with LDTE-BS exchange and match one process.

Each worker (``tests/_multiprocess_worker.py``) runs in its own Python
process with a subprocess timeout; every process started here is killed if
anything fails.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from helpers import compile_flags_without_devices

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 180
NUM_PROCESSES = 2
LOCAL_DEVICES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(xla_device_count=None):
    env = dict(os.environ)
    # conftest's 8 devices must not leak into the workers (its compile flags may).
    env["XLA_FLAGS"] = compile_flags_without_devices()
    env["JAX_PLATFORMS"] = "cpu"
    if xla_device_count is not None:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={xla_device_count}"
    return env


def launch(args, env):
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_all(procs):
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 0, f"worker failed ({p.returncode}):\n{out[-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_processes(tmp_path, local_devices=LOCAL_DEVICES, extra=()):
    """The workers' results: ``([one per process], the single process's)``."""
    total = NUM_PROCESSES * local_devices
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    outs = [tmp_path / f"proc{i}.npz" for i in range(NUM_PROCESSES)]
    single_out = tmp_path / "single.npz"
    common = ["--total_devices", str(total), *extra]
    try:
        for i in range(NUM_PROCESSES):
            procs.append(
                launch(
                    [
                        "--mode=multi",
                        f"--out={outs[i]}",
                        f"--coordinator={coordinator}",
                        f"--num_processes={NUM_PROCESSES}",
                        f"--process_id={i}",
                        f"--local_devices={local_devices}",
                        *common,
                    ],
                    worker_env(),
                )
            )
        procs.append(launch(["--mode=single", f"--out={single_out}", *common], worker_env(total)))
    finally:
        wait_all(procs)  # bounded by TIMEOUT_S each; kills whatever is left
    return [np.load(o) for o in outs], np.load(single_out)


def test_two_processes_match_one_process(tmp_path):
    results, single = run_processes(tmp_path)
    for key in ("w", "b"):
        np.testing.assert_array_equal(results[0][key], results[1][key])  # identical replicas
        np.testing.assert_allclose(results[0][key], single[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[0]["losses"], single["losses"], rtol=1e-5)
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trained
    assert np.any(results[0]["w"] != 0)


def test_two_level_with_one_node_per_process_matches_one_process(tmp_path):
    """2 processes x 4 devices as the ("node", "local") mesh: node = process, top_k two-level."""
    local = 4
    results, single = run_processes(tmp_path, local, ["--two_level_local", str(local)])
    for key in ("w", "b"):
        np.testing.assert_array_equal(results[0][key], results[1][key])  # identical replicas
        np.testing.assert_allclose(results[0][key], single[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[0]["losses"], single["losses"], rtol=1e-5)
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trained
    # Bytes: intra 2 (L - 1) / L of the padded leaves (w: 64 -> 16 per shard, b: 1 -> 1);
    # inter the sparse all-gather to the other node of min(n, ceil(1.5 k)) pairs per shard.
    padded = 4 * (64 + 4)
    pairs = 3 + 1  # w's shard of 16: k = 2, capacity 3; b's shard of 1: 1
    want = [2 * (local - 1) / local * padded, 8 * pairs, 0.0]
    want[2] = want[0] + want[1]
    np.testing.assert_allclose(results[0]["link_bytes"], [want] * len(results[0]["losses"]))
    np.testing.assert_allclose(single["link_bytes"], results[0]["link_bytes"])
