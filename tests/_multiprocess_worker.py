"""Worker launched by tests/test_multiprocess.py: trains a few LDTE-BS steps, saves params.

``--mode=multi``: one of several processes joined with
``jaxcomp.distributed.initialize_multiprocess`` (each with ``--local_devices``
CPU devices). ``--mode=single``: one process whose XLA_FLAGS simulate all the
devices. Both build the same global mesh and data, so they must agree.
``--two_level_local=L``: the two-level mesh ``("node", "local")`` of
``jaxcomp.distributed.two_level_mesh(local=L)`` (with one process per node
when ``L`` is the local device count) and a two-level top_k instead.
"""

import argparse

import numpy as np

FEATURES = 64
ROWS_PER_DEVICE = 4
STEPS = 5
LINK_METRICS = ("intra_node_bytes", "inter_node_bytes", "wire_bytes")


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
    parser.add_argument("--two_level_local", type=int, default=0)
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
    axis = "data"
    tx = optax.chain(
        jaxcomp.ldte_bs(ratio=0.1, axis_name="data", min_dense_size=1), optax.sgd(0.05)
    )
    if args.two_level_local:
        mesh = dist.two_level_mesh(local=args.two_level_local)
        axis = ("node", "local")
        if args.mode == "multi":  # each process is one node: its devices, one row
            for row in mesh.devices:
                assert len({d.process_index for d in row}) == 1, mesh.devices
        tx = optax.chain(
            jaxcomp.top_k(ratio=0.1, axis_name=axis, exchange="sparse"), optax.sgd(0.05)
        )

    def loss_fn(params, batch):
        pred = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((pred - batch["y"]) ** 2)

    data = global_data(args.total_devices)
    local = jax.local_device_count()
    start = args.process_id * local * ROWS_PER_DEVICE if args.mode == "multi" else 0
    stop = start + local * ROWS_PER_DEVICE
    batch = dist.shard_batch({k: v[start:stop] for k, v in data.items()}, mesh, axis)
    params = dist.replicate(
        {"w": np.zeros(FEATURES, np.float32), "b": np.zeros((), np.float32)}, mesh
    )
    state = dist.init_opt_state(tx, params, mesh, axis)
    step = dist.make_train_step(loss_fn, tx, mesh, axis)
    losses, link_bytes = [], []
    for _ in range(STEPS):
        params, state, metrics = step(params, state, batch)
        jax.block_until_ready((params, metrics))
        losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
        if "intra_node_bytes" in metrics:
            link_bytes.append(
                [float(np.asarray(metrics[k].addressable_data(0))) for k in LINK_METRICS]
            )
    host = {k: np.asarray(v.addressable_data(0)) for k, v in params.items()}
    np.savez(args.out, losses=np.array(losses), link_bytes=np.array(link_bytes), **host)
    if args.mode == "multi":
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
