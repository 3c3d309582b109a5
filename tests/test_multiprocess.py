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
TOTAL = NUM_PROCESSES * LOCAL_DEVICES


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


def test_two_processes_match_one_process(tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    outs = [tmp_path / f"proc{i}.npz" for i in range(NUM_PROCESSES)]
    single_out = tmp_path / "single.npz"
    common = ["--total_devices", str(TOTAL)]
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
                        f"--local_devices={LOCAL_DEVICES}",
                        *common,
                    ],
                    worker_env(),
                )
            )
        procs.append(launch(["--mode=single", f"--out={single_out}", *common], worker_env(TOTAL)))
    finally:
        wait_all(procs)  # bounded by TIMEOUT_S each; kills whatever is left

    results = [np.load(o) for o in outs]
    single = np.load(single_out)
    for key in ("w", "b"):
        np.testing.assert_array_equal(results[0][key], results[1][key])  # identical replicas
        np.testing.assert_allclose(results[0][key], single[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[0]["losses"], single["losses"], rtol=1e-5)
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trained
    assert np.any(results[0]["w"] != 0)
