"""`x @ w` in `x`'s dtype for a wider weight, whose gradient is computed and kept in float32.

Under the bfloat16 policy a float32 weight is multiplied in bfloat16. Cast
before the matmul (`x @ w.astype(bf16)`), its gradient comes out of the
transposed dot in bfloat16: the per-device partial sums over the batch are
then summed across devices (the all-reduce over `data`, the reduce-scatter
over `fsdp`) in bfloat16, rounding at every step, and the sum is only then
widened to the parameter's float32. Rounding the float32 sum to bfloat16
after the reduction is no cure either: XLA:TPU moves such a rounding ahead
of the all-reduce, since the result is the same dtype either way.

`matmul(x, w)` casts `w` to `x`'s dtype inside a custom VJP: the forward
product is bfloat16 x bfloat16 as before, the input's gradient is JAX's own,
and the weight's gradient is a dot of the bfloat16 operands with a float32
result, returned in `w`'s dtype. For a float32 weight nothing narrows it on
the way to the parameter, so every sum across devices is float32. The
residuals are those of the plain product (the input and the cast weight), so
the activations held for the backward pass are unchanged.

Example:
  >>> import jax, jax.numpy as jnp
  >>> x, w = jnp.ones((4, 3), jnp.bfloat16), jnp.full((3, 2), 0.1)
  >>> matmul(x, w).dtype, jax.grad(lambda w: matmul(x, w).astype(jnp.float32).sum())(w).dtype
  (dtype(bfloat16), dtype('float32'))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
  """`x @ w.astype(x.dtype)` for `x` [tokens, in] (or [..., in]) and `w` [in, out]; `w`'s gradient in `w`'s dtype.

  Where `w` already has `x`'s dtype this is the plain `jnp.dot`.
  `preferred_element_type` is the product's result dtype (float32 logits).
  """
  if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
    raise ValueError(f"matmul takes [tokens, in] @ [in, out]; got {x.shape=} {w.shape=}")
  if jnp.dtype(w.dtype) == jnp.dtype(x.dtype):
    return jnp.dot(x, w, preferred_element_type=preferred_element_type)
  return _narrowed(x, w, preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _narrowed(x: jax.Array, w: jax.Array, preferred) -> jax.Array:
  return jnp.dot(x, w.astype(x.dtype), preferred_element_type=preferred)


def _narrowed_fwd(x, w, preferred):
  narrow = w.astype(x.dtype)
  # A zero-size marker carries w's dtype into the backward pass (a residual
  # must be an array); the weight itself is kept as the plain product keeps it.
  marker = jnp.zeros((0,), w.dtype)
  return jnp.dot(x, narrow, preferred_element_type=preferred), (x, narrow, marker)


def _narrowed_bwd(preferred, residuals, g):
  x, narrow, marker = residuals
  _, x_vjp = jax.vjp(lambda x: jnp.dot(x, narrow, preferred_element_type=preferred), x)
  (dx,) = x_vjp(g)
  # The weight's gradient sums over the tokens, across devices too: a float32
  # result from the forward's operand and the cotangent as it comes (a float32
  # cotangent, the logits', is taken as JAX's own transpose takes it).
  tokens = tuple(range(x.ndim - 1))
  dims = ((tokens, tokens), ((), ()))
  dw = jax.lax.dot_general(x, g, dims, preferred_element_type=jnp.float32)
  return dx, dw.astype(marker.dtype)


_narrowed.defvjp(_narrowed_fwd, _narrowed_bwd)
