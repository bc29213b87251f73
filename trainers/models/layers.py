"""Pieces the built-in decoders share: config checks, initializers, the dense matmul, layer stacks.

`trainers.models.transformer` and `trainers.models.llama` both validate the
same sizes and layout fields, contract weights through `dense`, and can stack
their blocks on a `layers` axis and scan over them (`stacked`, `scan_layers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmd import context
from trainers.models.attention import SPLASH_RESIDUALS, check_kernel
from trainers.models.matmul import matmul


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


def check_decoder_fields(config: Any, sizes: tuple[str, ...], remat_policies: tuple[str, ...]):
  """The checks every decoder config shares; a `ValueError` naming the field otherwise.

  `sizes` must be positive integers and `d_model` a multiple of `num_heads`;
  `dtype` and `param_dtype` floating dtypes; `scan_layers` a bool,
  `scan_unroll` a positive integer, `remat_policy` one of `remat_policies`
  and `attention` one of `trainers.models.attention.KERNELS`.

  Example:
    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(d_model=64, num_heads=3, dtype="float32",
    ...                          param_dtype="float32", scan_layers=True, scan_unroll=1,
    ...                          remat_policy="none", attention="auto")
    >>> check_decoder_fields(config, ("d_model", "num_heads"), ("minimal", "none"))
    Traceback (most recent call last):
    ...
    ValueError: d_model=64 is not divisible by num_heads=3
  """
  for name in sizes:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive integer")
  if config.d_model % config.num_heads:
    raise ValueError(f"d_model={config.d_model} is not divisible by num_heads={config.num_heads}")
  float_dtype("dtype", config.dtype)
  float_dtype("param_dtype", config.param_dtype)
  if not isinstance(config.scan_layers, bool):
    raise ValueError(f"scan_layers={config.scan_layers!r} must be True or False")
  unroll = config.scan_unroll
  if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1:
    raise ValueError(f"scan_unroll={unroll!r} must be a positive integer")
  if config.remat_policy not in remat_policies:
    raise ValueError(f"remat_policy={config.remat_policy!r} is not one of {remat_policies}")
  check_kernel(config.attention)


def dense(
  x: jax.Array, w: jax.Array, contract: int = 1, preferred_element_type: Any = None
) -> jax.Array:
  """Contracts the last `contract` dims of `x` with the first `contract` dims of `w`.

  `w` is multiplied in `x`'s dtype; a wider `w` (a float32 parameter under
  the bfloat16 policy) is cast inside `matmul.matmul`, so its gradient is
  summed across devices in float32 and comes back in `w`'s dtype.

  The leading (token) dims of x and the trailing (feature) dims of w are
  flattened first. Why: the weight gradient then contracts one token axis,
  a plain [tokens, in]^T @ [tokens, out] that XLA:CPU's matmul kernels read
  in place. Written as an einsum over batch and length ("bld,blf->df"),
  XLA:CPU instead transposes the [tokens, d_ff] activation gradient through
  a strided copy fused with the activation's backward: a copy of the whole
  activation gradient every step, which the flattened form never makes.
  The reshapes are free (bitcasts), and the SPMD partitioner keeps a
  sharded batch dim sharded when it is merged with the length dim. A length
  dim split over `context` is not kept so: then the token dims stay as they are.

  Example:
    >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5, 6))
    >>> dense(x, w).shape
    (2, 3, 5, 6)
  """
  lead, features = x.shape[: x.ndim - contract], w.shape[contract:]
  inner = math.prod(w.shape[:contract])
  # With the sequence split over `context` too, the tokens stay [batch, length]:
  # flattened, a device's tokens would not be one block of the token axis.
  tokens = (-1,) if context.active_shards() == 1 else lead
  y = matmul(x.reshape(*tokens, inner), w.reshape(inner, -1), preferred_element_type)
  return y.reshape(*lead, *features)


def stacked(make: Callable[[nnx.Rngs], nnx.Module], num_layers: int, rngs: nnx.Rngs) -> nnx.Module:
  """One module `make(rngs)` whose parameters have a leading `layers` axis of size `num_layers`.

  Layer i draws the keys that the unrolled model's layer i draws from the
  same stream (its counter advanced by i layers' worth of draws), so a seed
  gives the same weights in either layout, on any mesh: `jax.vmap` over the
  layer index traces one layer, and partitionable threefry makes each value
  depend on its key and index only. Each parameter's logical axes gain a
  leading "layers".

  Example:
    >>> from trainers.models import param
    >>> class Layer(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.w = param(rngs, fan_in_init(0, 1), (4, 2), ("embed", "mlp"))
    >>> stack = stacked(Layer, 3, nnx.Rngs(0))
    >>> stack.w.shape, stack.w.get_metadata("out_sharding")
    ((3, 4, 2), ('layers', 'embed', 'mlp'))
    >>> bool((stack.w[0] == Layer(nnx.Rngs(0)).w[...]).all())  # the unrolled first layer's
    True
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  draws = len(jax.tree.leaves(abstract))  # `param` draws one key per parameter
  stream = rngs.params
  key, start = stream.key.get_value(), stream.count.get_value()

  def one(layer: jax.Array) -> nnx.State:
    layer_rngs = nnx.Rngs(params=key)
    layer_rngs.params.count.set_value(start + layer * draws)
    return nnx.split(make(layer_rngs))[1]

  # uint32 like the stream's counter, so the keys are the unrolled model's exactly.
  state = jax.vmap(one)(jnp.arange(num_layers, dtype=start.dtype))
  for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    var.set_metadata(out_sharding=("layers", *var.get_metadata("out_sharding")))
  stream.count.set_value(start + num_layers * draws)
  return nnx.merge(graphdef, state)


CHECKPOINT_POLICIES = {
  # MaxText's "minimal": keep the weight matmuls' outputs, recompute the rest
  # (attention scores, softmax, norms, activations) in the backward pass.
  "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  # Keep only each layer's input: least memory, one more forward pass.
  "full": jax.checkpoint_policies.nothing_saveable,
  # Keep everything: in a rolled loop every intermediate becomes a stacked buffer.
  "none": None,
  # "minimal" less the query, key and value projections: keep the outputs a
  # block names (the attention's output projection, the MLP's gate and up)
  # and splash's residuals (its output and log-sum-exp, `SPLASH_RESIDUALS`).
  # The three cheapest weight matmuls are recomputed in the backward pass,
  # and each layer holds a third less, which is what lets a chip's largest
  # batch fit without XLA rematerializing a bigger product. Splash's
  # residuals cost about what the query projection would and save running
  # the attention's forward kernel again in the backward pass (P9,
  # docs/performance.md); "minimal", which keeps every weight matmul's
  # output, does not keep them: with them the check model's 8 rows do not fit.
  "minimal_no_qkv": jax.checkpoint_policies.save_only_these_names(
    "attention_out", "mlp_gate", "mlp_up", SPLASH_RESIDUALS
  ),
}


def scan_layers(
  blocks: nnx.Module,
  x: jax.Array,
  *args: Any,
  unroll: int = 1,
  remat_policy: str = "minimal",
  with_outputs: bool = False,
) -> Any:
  """Applies `stacked` blocks in order, `blocks(x, *args)`, one `lax.scan` step per layer.

  With `with_outputs` each block returns `(x, out)`, and this returns `(x,
  outs)`, the outs stacked on a leading layers axis (a routed layer's
  router statistics).

  `args` are the same for every layer (a mask, RoPE's angles): inputs of
  each step, not outputs, so the remat never recomputes them. Each step is
  rematerialised as `remat_policy` (a key of `CHECKPOINT_POLICIES`) says; without
  remat the backward pass keeps every intermediate of every layer as a
  stacked loop output that XLA cannot fuse away. `unroll` layers run per
  loop iteration.

  Example:
    >>> from trainers.models import param
    >>> class Block(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.w = param(rngs, nnx.initializers.ones, (2, 2), ("embed", "mlp"))
    ...   def __call__(self, x, scale):
    ...     return x @ self.w[...] * scale
    >>> scan_layers(stacked(Block, 3, nnx.Rngs(0)), jnp.ones((1, 2)), 0.5).tolist()
    [[1.0, 1.0]]
  """
  graphdef, state = nnx.split(blocks)

  def layer(x, params):
    out = nnx.merge(graphdef, params)(x, *args)
    return out if with_outputs else (out, None)

  policy = CHECKPOINT_POLICIES[remat_policy]
  if policy is not None:
    # prevent_cse only when unrolled: a rolled loop already keeps XLA from
    # merging the recomputation into the forward pass (they are in different
    # loops), and the barrier would only cost speed. Unrolled, forward and
    # backward can end up in one computation, and only the barrier keeps the remat.
    layer = jax.checkpoint(layer, policy=policy, prevent_cse=unroll > 1)
  x, outs = jax.lax.scan(layer, x, state, unroll=unroll)
  return (x, outs) if with_outputs else x
