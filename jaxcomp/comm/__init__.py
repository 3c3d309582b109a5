"""Collectives that move compressed gradients inside ``jax.shard_map``."""

from jaxcomp.comm.collectives import axis_size, dense_mean, sparse_mean

__all__ = ["axis_size", "dense_mean", "sparse_mean"]
