"""Pieces the built-in decoders share: initializers, dtype checks and the dense matmul."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def fan_in_init(in_axis: int | tuple[int, ...], out_axis: int | tuple[int, ...]):
  """LeCun normal (untruncated: it compiles faster) over the input dimensions.

  Example:
    >>> w = fan_in_init(0, 1)(jax.random.key(0), (256, 4))
    >>> 0.8 < float(w.std() * 16) < 1.2
    True
  """
  return nnx.initializers.variance_scaling(
    1.0, "fan_in", "normal", in_axis=in_axis, out_axis=out_axis
  )


def float_dtype(name: str, value: str) -> jnp.dtype:
  """`value` as a floating dtype; a `ValueError` naming `name` otherwise.

  Example:
    >>> float_dtype("dtype", "bfloat16")
    dtype(bfloat16)
    >>> float_dtype("dtype", "int8")
    Traceback (most recent call last):
    ...
    ValueError: dtype='int8' is not a floating point dtype
  """
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise ValueError(f"{name}={value!r} is not a dtype") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name}={value!r} is not a floating point dtype")
  return dtype


def dense(x: jax.Array, w: jax.Array, contract: int = 1, **dot_kwargs) -> jax.Array:
  """Contracts the last `contract` dims of `x` with the first `contract` dims of `w`.

  The leading (token) dims of x and the trailing (feature) dims of w are
  flattened first. Why: the weight gradient then contracts one token axis,
  a plain [tokens, in]^T @ [tokens, out] that XLA:CPU's matmul kernels read
  in place. Written as an einsum over batch and length ("bld,blf->df"),
  XLA:CPU instead transposes the [tokens, d_ff] activation gradient through
  a strided copy fused with the activation's backward: a copy of the whole
  activation gradient every step, which the flattened form never makes.
  The reshapes are free (bitcasts), and the SPMD partitioner keeps a
  sharded batch dim sharded when it is merged with the length dim.

  Example:
    >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5, 6))
    >>> dense(x, w).shape
    (2, 3, 5, 6)
  """
  lead, features = x.shape[: x.ndim - contract], w.shape[contract:]
  inner = math.prod(w.shape[:contract])
  y = jnp.dot(x.reshape(-1, inner), w.reshape(inner, -1), **dot_kwargs)
  return y.reshape(*lead, *features)
