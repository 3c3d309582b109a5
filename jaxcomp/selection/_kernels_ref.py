"""Temporary simple kernels (replaced by _kernels)."""
import jax.numpy as jnp


def moments(x):
  x = x.astype(jnp.float32)
  m = jnp.mean(x)
  return m, jnp.mean(jnp.square(x - m)), jnp.max(jnp.abs(x))


def count_above(a, t):
  return jnp.sum(a > t, dtype=jnp.int32)


def count_above_many(a, ts):
  return jnp.sum(a[None, :] > ts[:, None], axis=1, dtype=jnp.int32)


def extract(x, t, capacity):
  n = x.shape[0]
  mask = jnp.abs(x) > t
  (idx,) = jnp.nonzero(mask, size=capacity, fill_value=n)
  vals = jnp.where(idx < n, x[jnp.minimum(idx, n - 1)], 0).astype(x.dtype)
  return idx.astype(jnp.int32), vals, jnp.sum(mask, dtype=jnp.int32)
