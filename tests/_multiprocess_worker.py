"""Worker launched by tests/test_multiprocess.py: trains a few LDTE-BS steps, saves params.

``--mode=multi``: one of several processes joined with
``jaxcomp.distributed.initialize_multiprocess`` (each with ``--local_devices``
CPU devices). ``--mode=single``: one process whose XLA_FLAGS simulate all the
devices. Both build the same global mesh and data, so they must agree.
"""

import argparse

import numpy as np

FEATURES = 64
ROWS_PER_DEVICE = 4
STEPS = 5


def global_data(n_devices):
    rng = np.random.default_rng(0)
    rows = n_devices * ROWS_PER_DEVICE
    x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal(FEATURES) + 0.3).astype(np.float32)
    return {"x": x, "y": y}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["multi", "single"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--total_devices", type=int, required=True)
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--process_id", type=int, default=0)
    parser.add_argument("--local_devices", type=int, default=1)
    args = parser.parse_args()

    import jax  # imported after parsing: nothing touches the backend before init

    from jaxcomp import distributed as dist

    if args.mode == "multi":
        dist.initialize_multiprocess(
            args.coordinator, args.num_processes, args.process_id, args.local_devices
        )
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh

    import jaxcomp

    assert jax.device_count() == args.total_devices, jax.devices()
    # Process-major device order: each process owns a contiguous block of rows.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("data",))

    def loss_fn(params, batch):
        pred = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((pred - batch["y"]) ** 2)

    tx = optax.chain(
        jaxcomp.ldte_bs(ratio=0.1, axis_name="data", min_dense_size=1), optax.sgd(0.05)
    )
    data = global_data(args.total_devices)
    local = jax.local_device_count()
    start = args.process_id * local * ROWS_PER_DEVICE if args.mode == "multi" else 0
    stop = start + local * ROWS_PER_DEVICE
    batch = dist.shard_batch({k: v[start:stop] for k, v in data.items()}, mesh)
    params = dist.replicate(
        {"w": np.zeros(FEATURES, np.float32), "b": np.zeros((), np.float32)}, mesh
    )
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh)
    losses = []
    for _ in range(STEPS):
        params, state, metrics = step(params, state, batch)
        jax.block_until_ready((params, metrics))
        losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
    host = {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}
    np.savez(args.out, losses=np.array(losses), **host)
    if args.mode == "multi":
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
