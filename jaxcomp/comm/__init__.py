"""Collectives that move (compressed) gradients inside ``jax.shard_map``."""

from jaxcomp.comm.collectives import (
    EXCHANGES,
    allgather_bytes,
    allreduce_bytes,
    axis_size,
    dense_mean,
    exchange_mean,
    fastest_mask,
    gossip_mean,
    include_fastest,
    prefer_sparse,
    server_link_bytes,
    server_mean,
    server_sparse_mean,
    sparse_mean,
    weighted_mean,
)
from jaxcomp.comm.local import without_communication

__all__ = [
    "EXCHANGES",
    "allgather_bytes",
    "allreduce_bytes",
    "axis_size",
    "dense_mean",
    "exchange_mean",
    "fastest_mask",
    "gossip_mean",
    "include_fastest",
    "prefer_sparse",
    "server_link_bytes",
    "server_mean",
    "server_sparse_mean",
    "sparse_mean",
    "weighted_mean",
    "without_communication",
]
