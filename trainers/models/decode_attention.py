"""One decode step's attention over the KV cache, as a Pallas kernel for a TPU.

`decode_attention(q, keys, values, layer, index, starts)` is what
`trainers.models.decode` computes for one new token a row: each query head
attends to its key/value head's cached slots `starts[b]..index`, scores and
softmax in float32, the weights cast to the compute dtype before they weigh
the values.

Why a kernel: XLA on a TPU v5e copied each layer's keys and values out of
the stacked cache into VMEM and then ran the scores and the weighted sum as
batched matmuls of 3 query rows each (the group of a key/value head), which
cost as much again as the copies; a decode step at batch 32 spent more time
in attention than in all the weight matrices. The kernel reads the layer's
blocks straight from the cache in HBM (the layer index is a scalar prefetched
into the block index, so nothing is sliced out first), pipelines each block
of rows behind the previous one's compute, and takes a row's queries of all
heads at once: one product [heads, head_dim] x [kv_heads * max_len, head_dim]
for the scores and one for the weighted sum, with the slots of the other
key/value heads masked. That multiplies kv_heads times the scores a head
needs, but a decode step is bound by reading the cache, not by the MXU, and
four times fewer, larger products ran faster on a v5e than one product per
(row, key/value head) of a group's 3 queries.

The cache must be laid out [layers, batch, kv_heads, max_len, head_dim]
(`decode.CACHE_AXES`): a (row, head) pair's keys are then one contiguous
[max_len, head_dim] matrix, tiled as a TPU tiles any matrix.

Example:
  >>> k = jax.random.normal(jax.random.key(0), (2, 4, 2, 16, 8))  # layers, B, H, S, D
  >>> q = jax.random.normal(jax.random.key(1), (4, 4, 8))          # B, heads, D
  >>> y = decode_attention(q, k, k, 1, 5, jnp.array([0, 2, 0, 1]), interpret=True)
  >>> y.shape
  (4, 4, 8)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Pallas's TPU half (Mosaic's lowering) is imported where the kernel is built, not
# here: every run imports this module through the sampler, and most never run it.

_ROWS = 8  # a float32 tile's rows
# A grid step's keys and values: small enough that several steps pipeline
# each block's copy behind the previous block's compute, and that two
# buffers of each fit VMEM with room to spare.
_BLOCK_BYTES = 4 * 2**20
_VMEM_LIMIT = 48 * 2**20
# Below this many rows XLA's attention is the faster: the kernel's fixed cost
# a layer (its first block's copy is not hidden) outweighs what it saves.
MIN_BATCH = 16


def rows_per_block(batch: int, kv_heads: int, max_len: int, head_dim: int, itemsize: int) -> int:
  """Rows of the batch a grid step reads: the most that divide `batch` within `_BLOCK_BYTES`; 0 if none.

  Example:
    >>> rows_per_block(32, 4, 320, 128, 2)
    4
    >>> rows_per_block(3, 8, 8192, 128, 2)
    0
  """
  per_row = 2 * kv_heads * max_len * head_dim * itemsize  # its keys and values
  fits = [r for r in range(1, batch + 1) if batch % r == 0 and r * per_row <= _BLOCK_BYTES]
  return max(fits, default=0)


def supported(q_shape, cache_shape, itemsize: int) -> bool:
  """Whether `decode_attention` takes these shapes: one query a row, blocks that fit VMEM.

  Example:
    >>> supported((32, 1, 12, 128), (16, 32, 4, 320, 128), 2)
    True
    >>> supported((32, 5, 12, 128), (16, 32, 4, 320, 128), 2)
    False
  """
  batch, t, heads, head_dim = q_shape
  _, _, kv_heads, max_len, _ = cache_shape
  scores = -(-heads // _ROWS) * _ROWS * kv_heads * max_len * 4  # a row's float32 scores
  return (
    t == 1
    and batch >= MIN_BATCH
    and 3 * scores <= _BLOCK_BYTES * 4  # the scores, their exponentials and the weights
    and head_dim % 128 == 0
    and max_len % 16 == 0
    and rows_per_block(batch, kv_heads, max_len, head_dim, itemsize) > 0
  )


def _kernel(layer_ref, index_ref, starts_ref, q_ref, k_ref, v_ref, o_ref, *, scale, group):
  # q_ref, o_ref: [rows, heads (padded), head_dim] float32; k_ref, v_ref: [rows, kv_heads, S, head_dim].
  # One product a row over all its key/value heads' slots, the other heads' slots masked.
  from jax.experimental import pallas as pl

  del layer_ref
  rows, padded, head_dim = q_ref.shape
  _, kv_heads, max_len, _ = k_ref.shape
  width = kv_heads * max_len
  first_row = pl.program_id(0) * rows
  index = index_ref[0]
  key = jax.lax.broadcasted_iota(jnp.int32, (padded, width), 1)
  query = jax.lax.broadcasted_iota(jnp.int32, (padded, width), 0)
  # lax's own integer ops (jnp's floor division lowers to no Mosaic op); all are >= 0.
  slot = jax.lax.rem(key, max_len)
  own = jax.lax.div(key, max_len) == jax.lax.div(query, group)

  def row(r, carry):
    live = own & (slot <= index) & (slot >= starts_ref[first_row + r])
    q = q_ref[r].astype(k_ref.dtype)
    k = k_ref[r].reshape(width, head_dim)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(live, s * scale, jnp.finfo(jnp.float32).min)
    p = jnp.exp(s - jnp.max(s, axis=1, keepdims=True))
    probs = (p / jnp.sum(p, axis=1, keepdims=True)).astype(v_ref.dtype)
    v = v_ref[r].reshape(width, head_dim)
    o_ref[r] = jnp.dot(probs, v, preferred_element_type=jnp.float32).astype(o_ref.dtype)
    return carry

  jax.lax.fori_loop(0, rows, row, 0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def decode_attention(
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  layer: jax.Array | int,
  index: jax.Array | int,
  starts: jax.Array,
  *,
  interpret: bool = False,
) -> jax.Array:
  """Each row's one query [B, heads, head_dim] over its cached slots starts[b]..index of `layer`.

  Args:
    q: the new tokens' queries [B, heads, head_dim], in the compute dtype.
    keys, values: the whole cache [layers, B, kv_heads, max_len, head_dim].
    layer: which layer's keys and values.
    index: the slot of the new token (its key is already written there).
    starts: int32 [B], each row's first live slot.
    interpret: run in Pallas interpret mode (any platform; slow).

  Returns:
    [B, heads, head_dim] in q's dtype.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  batch, heads, head_dim = q.shape
  _, _, kv_heads, max_len, _ = keys.shape
  group = heads // kv_heads
  rows = rows_per_block(batch, kv_heads, max_len, head_dim, keys.dtype.itemsize)
  padded = -(-heads // _ROWS) * _ROWS  # the query heads fill whole (8, 128) float32 tiles
  grouped = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, padded - heads), (0, 0)))
  tile = (rows, padded, head_dim)
  cache_block = (None, rows, kv_heads, max_len, head_dim)
  grid = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=3,
    grid=(batch // rows,),
    in_specs=[
      pl.BlockSpec(tile, lambda i, layer, index, starts: (i, 0, 0)),
      pl.BlockSpec(cache_block, lambda i, layer, index, starts: (layer[0], i, 0, 0, 0)),
      pl.BlockSpec(cache_block, lambda i, layer, index, starts: (layer[0], i, 0, 0, 0)),
    ],
    out_specs=pl.BlockSpec(tile, lambda i, layer, index, starts: (i, 0, 0)),
  )
  out = pl.pallas_call(
    functools.partial(_kernel, scale=head_dim**-0.5, group=group),
    grid_spec=grid,
    out_shape=jax.ShapeDtypeStruct(grouped.shape, jnp.float32),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel",), vmem_limit_bytes=_VMEM_LIMIT
    ),
    interpret=interpret,
  )(
    jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
    jnp.reshape(jnp.asarray(index, jnp.int32), (1,)),
    starts.astype(jnp.int32),
    grouped,
    keys,
    values,
  )
  return out[:, :heads].astype(q.dtype)
