"""Sampling with a KV cache, for the Llama and the transformer LM.

`generate(model, prompt, num_tokens)` runs one jitted program: the prompt is
read once (the prefill), writing every layer's keys and values into a cache,
then each step feeds one token at the next position, writes its keys and
values at that position and attends over the cache. The cache holds only the
key/value heads (grouped-query attention reads them group by group), as two
arrays [layers, batch, kv_heads, max_len, head_dim] in the compute dtype
(each head's keys one [max_len, head_dim] matrix, as the TPU decode kernel
reads them), with the logical axes `CACHE_AXES`: under `rules` and a `mesh` (the training
mesh's) they are constrained by the same rules as the activations, e.g.
`fsdp_tp` splits the batch over data/fsdp and the key/value heads over
tensor; without them it all runs where the parameters are (one device).

Tokens are chosen greedily (`temperature=0`), or drawn from the softmax of
the logits over `temperature`, restricted to the `top_k` largest when
`top_k > 0`, with a `jax.random` key folded with the step.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from trainers.models import llama
  >>> config = llama.LlamaConfig(seq_len=16, num_layers=1, d_model=32, num_heads=4,
  ...                            num_kv_heads=2, d_ff=64)
  >>> model = llama.Llama(config, rngs=nnx.Rngs(0))
  >>> prompt = jnp.array([[1, 2, 3]])
  >>> cached = generate(model, prompt, 5)
  >>> cached.shape, bool((cached == generate_uncached(model, prompt, 5)).all())
  ((1, 8), True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmd import rules as rules_lib
from spmd.rules import constrain
from trainers.models import attention, decode_attention, embedding, llama
from trainers.models import transformer as lm
from trainers.models.layers import dense

CACHE_AXES = ("layers", "batch", "kv_heads", "length", "kv")
"""Logical axes of the cache's keys and values [layers, batch, kv_heads, max_len, head_dim]."""
_RESIDUAL = ("batch", "length", "embed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Every layer's keys and values, [layers, batch, kv_heads, max_len, head_dim] each."""

  keys: Any
  values: Any


@dataclasses.dataclass(frozen=True)
class CacheShape:
  """What the cache of a model holds per token: layers x kv_heads x head_dim, in `dtype`."""

  num_layers: int
  kv_heads: int
  head_dim: int
  dtype: jnp.dtype

  def bytes(self, batch: int, max_len: int) -> int:
    """The cache's bytes in all (keys and values), before any sharding.

    Example:
      >>> CacheShape(2, 4, 8, jnp.dtype("bfloat16")).bytes(batch=3, max_len=16)
      12288
    """
    return (
      2 * self.num_layers * batch * max_len * self.kv_heads * self.head_dim * self.dtype.itemsize
    )


def cache_shape(config: Any) -> CacheShape | None:
  """The cache's per-token shape for a model config, or None if it is no decoder known here.

  Example:
    >>> cache_shape(llama.LlamaConfig(num_heads=8, num_kv_heads=2, d_model=64))
    CacheShape(num_layers=2, kv_heads=2, head_dim=8, dtype=dtype('float32'))
  """
  if isinstance(config, llama.LlamaConfig):
    kv_heads = config.num_kv_heads
  elif isinstance(config, lm.TransformerConfig):
    kv_heads = config.num_heads  # multi-head attention: every head has its own keys
  else:
    return None
  return CacheShape(config.num_layers, kv_heads, config.head_dim, jnp.dtype(config.dtype))


def abstract_cache(
  shape: CacheShape, batch: int, max_len: int, mesh: jax.sharding.Mesh, rules: rules_lib.Rules
) -> KVCache:
  """The cache as `ShapeDtypeStruct`s with their `NamedSharding`s on `mesh` (no memory).

  Raises:
    ValueError: a dimension the rules split does not divide (names it and the mesh).

  Example:
    >>> from spmd.mesh import create_mesh
    >>> mesh = create_mesh("data=-1,tensor=2")
    >>> cache = abstract_cache(CacheShape(2, 4, 8, jnp.float32), 4, 16, mesh, rules_lib.FSDP_TP)
    >>> cache.keys.shape, cache.keys.sharding.spec
    ((2, 4, 4, 16, 8), P(None, 'data', 'tensor'))
  """
  dims = (shape.num_layers, batch, shape.kv_heads, max_len, shape.head_dim)
  leaf = jax.ShapeDtypeStruct(dims, shape.dtype)
  shardings = rules_lib.logical_to_sharding(
    {"keys": CACHE_AXES, "values": CACHE_AXES},
    mesh,
    rules_lib.whole_sequence(rules),  # as `generate` holds it
    shapes={"keys": leaf, "values": leaf},
  )
  return KVCache(
    **{k: jax.ShapeDtypeStruct(dims, shape.dtype, sharding=s) for k, s in shardings.items()}
  )


def init_cache(shape: CacheShape, batch: int, max_len: int) -> KVCache:
  """A cache of zeros, constrained by the active rules (`spmd.rules.activation_rules`)."""
  zeros = jnp.zeros((shape.num_layers, batch, shape.kv_heads, max_len, shape.head_dim), shape.dtype)
  return KVCache(constrain(zeros, CACHE_AXES), constrain(zeros, CACHE_AXES))


def _heads_first(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """[B, T, kv_heads, head_dim] as the cache's [1, B, kv_heads, T, head_dim] slice."""
  return jnp.swapaxes(x, 1, 2)[None].astype(dtype)


def _use_kernel(q: jax.Array, keys: jax.Array) -> bool:
  """Whether this attention runs `decode_attention`'s kernel: one query a row, the
  cache in the compute dtype, a TPU program on one device (or none named), and
  shapes the kernel takes."""
  if attention.current_platform() != "tpu" or keys.dtype != q.dtype:
    return False
  active = rules_lib.active_rules()
  if active is not None and active[1].devices.size > 1:
    return False  # a split cache would need the kernel placed per device (shard_map)
  return decode_attention.supported(q.shape, keys.shape, keys.dtype.itemsize)


def _write(cache: KVCache, layer: jax.Array | int, index: jax.Array, k: jax.Array, v: jax.Array):
  """The cache with layer `layer`'s slots index..index+T set to k, v [B, T, kv_heads, head_dim]."""
  at = (layer, 0, 0, index, 0)
  keys = jax.lax.dynamic_update_slice(cache.keys, _heads_first(k, cache.keys.dtype), at)
  values = jax.lax.dynamic_update_slice(cache.values, _heads_first(v, cache.values.dtype), at)
  return KVCache(constrain(keys, CACHE_AXES), constrain(values, CACHE_AXES))


def _attend(
  q: jax.Array, cache: KVCache, layer: jax.Array | int, index: jax.Array, starts: jax.Array | None
) -> jax.Array:
  """Queries [B, T, heads, hd] in slots index..index+T-1 over the cached keys of slots
  starts[b]..their own (`starts`: each row's first live slot, [B]; None: slot 0).

  One query a row on a single TPU device runs `decode_attention`'s kernel,
  which reads the layer's keys and values from the cache in place (XLA
  copied them out first and multiplied them slowly); anything else, XLA's
  einsums below, which the kernel computes alike.
  """
  b, t, heads, head_dim = q.shape
  if _use_kernel(q, cache.keys):
    starts = jnp.zeros((b,), jnp.int32) if starts is None else starts
    y = decode_attention.decode_attention(q[:, 0], cache.keys, cache.values, layer, index, starts)
    return y[:, None]
  keys = jax.lax.dynamic_index_in_dim(cache.keys, layer, keepdims=False).astype(q.dtype)
  values = jax.lax.dynamic_index_in_dim(cache.values, layer, keepdims=False).astype(q.dtype)
  kv_heads, max_len = keys.shape[1], keys.shape[2]
  # The model's own einsums: query head i reads key/value head i // group.
  q = q.reshape(b, t, kv_heads, heads // kv_heads, head_dim)
  logits = jnp.einsum("bqhgk,bhsk->bhgqs", q, keys, preferred_element_type=jnp.float32)
  logits = logits * head_dim**-0.5
  # Causal over the whole cache: slots after a query's position are not written yet.
  slots = jnp.arange(max_len)
  mask = slots[None, :] <= index + jnp.arange(t)[:, None]  # [T, max_len]
  if starts is not None:  # a left-padded row: its padding's slots are no keys of its own
    mask = mask[None] & (slots[None, None, :] >= starts[:, None, None])  # [B, T, max_len]
    mask = mask[:, None, None]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  y = jnp.einsum("bhgqs,bhsk->bqhgk", probs, values).reshape(b, t, heads, head_dim)
  return constrain(y, ("batch", "length", "heads", "kv"))


def _llama_layer(block: llama.Block, x, cache, layer, index, sin, cos, starts=None):
  attn = block.attn
  q, k, v = attn.project(block.attn_norm(x))
  q, k = llama.apply_rope(q, sin, cos), llama.apply_rope(k, sin, cos)
  cache = _write(cache, layer, index, k, v)
  y = _attend(q, cache, layer, index, starts)
  x = constrain(x + attn.output(y), _RESIDUAL)
  return constrain(x + block.mlp(block.mlp_norm(x)), _RESIDUAL), cache


def _transformer_layer(block, x, cache, layer, index, starts=None):
  attn, dt = block.attn, x.dtype
  h = block.attn_norm(x)
  q, k, v = (dense(h, w[...].astype(dt)) for w in (attn.query, attn.key, attn.value))
  cache = _write(cache, layer, index, k, v)
  x = x + dense(_attend(q, cache, layer, index, starts), attn.out[...].astype(dt), contract=2)
  return x + block.mlp(block.mlp_norm(x)), cache


def _layers(blocks, scanned: bool, layer_fn: Callable, x, cache: KVCache, index):
  """Runs the blocks in order (a scan over stacked weights, or a loop), threading the cache."""
  if not scanned:
    for i, block in enumerate(blocks):
      x, cache = layer_fn(block, x, cache, i, index)
    return x, cache
  graphdef, state = nnx.split(blocks)
  num_layers = cache.keys.shape[0]

  def body(carry, xs):
    params, i = xs
    return layer_fn(nnx.merge(graphdef, params), *carry, i, index), None

  return jax.lax.scan(body, (x, cache), (state, jnp.arange(num_layers)))[0]


def forward(
  model: nnx.Module,
  tokens: jax.Array,
  cache: KVCache,
  index: jax.Array,
  starts: jax.Array | None = None,
  last_only: bool = False,
):
  """Logits [B, T, vocab] (float32) of `tokens` [B, T] in cache slots index.., and the new cache.

  `last_only`: the last slot's logits only, [B, 1, vocab], as a prefill that
  samples the next token needs (all of them are batch x prompt x vocab floats).

  A token's position is its slot, or with `starts` ([B], each row's first
  live slot: a left-padded batch) its slot less its row's start; a row
  attends to its own slots only, so it decodes as it would alone.
  """
  config = model.config
  batch, t = tokens.shape
  dt = jnp.dtype(config.dtype)
  positions = jnp.broadcast_to(index + jnp.arange(t), (batch, t))
  if starts is not None:  # padding slots (negative) take position 0; no live row reads them
    positions = jnp.maximum(positions - starts[:, None], 0)
  if isinstance(model, llama.Llama):
    table = model.token_embed[...].astype(dt)
    x = constrain(embedding.lookup(table, tokens), _RESIDUAL)
    inv_freq = llama.rope_frequencies(config)
    sin, cos = llama.rope_angles(positions, config.head_dim, config.rope_theta, inv_freq)
    layer_fn = functools.partial(_llama_layer, sin=sin, cos=cos, starts=starts)
  elif isinstance(model, lm.TransformerLM):
    x = embedding.lookup(model.token_embed[...].astype(dt), tokens)
    x = x + embedding.lookup(model.pos_embed[...].astype(dt), positions, ("positions", "embed"))
    layer_fn = functools.partial(_transformer_layer, starts=starts)
  else:
    raise TypeError(f"no cached decoding for {type(model).__name__}: Llama or TransformerLM")
  x, cache = _layers(model.blocks, config.scan_layers, layer_fn, x, cache, index)
  x = model.final_norm(x[:, -1:] if last_only else x)
  if getattr(config, "tie_embeddings", False):
    logits = jnp.einsum("bld,vd->blv", x, table, preferred_element_type=jnp.float32)
  else:
    w = model.unembed[...].astype(dt)
    logits = dense(x, w, preferred_element_type=jnp.float32)
  return constrain(logits, ("batch", "length", "vocab")), cache


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """int32 [B] tokens from float logits [B, vocab]: argmax at temperature 0, else drawn.

  Example:
    >>> logits = jnp.array([[0.0, 3.0, 1.0]])
    >>> sample_logits(logits, jax.random.key(0), 0.0, 0).tolist()
    [1]
    >>> sample_logits(logits, jax.random.key(7), 5.0, 1).tolist()  # top_k=1: the argmax
    [1]
  """
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _check(model, prompt, num_tokens: int, max_len: int | None, temperature: float, top_k: int):
  if not isinstance(model, llama.Llama | lm.TransformerLM):
    raise TypeError(f"no cached decoding for {type(model).__name__}: Llama or TransformerLM")
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"prompt must be integers [batch, length >= 1], got {prompt.shape=}")
  seq_len = model.config.seq_len
  max_len = seq_len if max_len is None else max_len
  if not 0 < max_len <= seq_len:
    raise ValueError(f"{max_len=} must be in 1..{seq_len} (the model's seq_len)")
  if num_tokens < 0 or prompt.shape[1] + num_tokens > max_len:
    raise ValueError(
      f"prompt length {prompt.shape[1]} + {num_tokens=} must be at most {max_len=} "
      "(and num_tokens >= 0)"
    )
  if temperature < 0 or top_k < 0 or top_k > model.config.vocab_size:
    raise ValueError(
      f"{temperature=} must be >= 0 and {top_k=} in 0..{model.config.vocab_size} (vocab_size)"
    )
  return prompt.astype(jnp.int32), max_len


def _rules_context(rules, mesh):
  # Decoding holds whole sequences: a mesh's `context` axis is gathered, not split.
  if not rules:
    return contextlib.nullcontext()
  return rules_lib.activation_rules(rules_lib.whole_sequence(rules), mesh)


def generate(
  model: nnx.Module,
  prompt: jax.Array,
  num_tokens: int,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  key: jax.Array | None = None,
  max_len: int | None = None,
  rules: rules_lib.Rules = (),
  mesh: jax.sharding.Mesh | None = None,
) -> jax.Array:
  """The prompt [B, P] followed by `num_tokens` sampled tokens: int32 [B, P + num_tokens].

  Args:
    model: a `Llama` or `TransformerLM`, its parameters on one device or on `mesh`.
    prompt: int [B, P], P >= 1.
    num_tokens: tokens to add; P + num_tokens <= max_len.
    temperature: 0 picks the argmax; else the logits are divided by it and sampled.
    top_k: with temperature > 0, sample among the k largest logits only (0: all).
    key: the `jax.random` key of the draws (default key 0); each step folds in its index.
    max_len: the cache's length, default (and at most) the model's `seq_len`.
    rules, mesh: constrain the cache and activations by these rules on this
      mesh (the training mesh's); the batch must divide over its batch axes.
  """
  prompt, max_len = _check(model, prompt, num_tokens, max_len, temperature, top_k)
  key = jax.random.key(0) if key is None else key
  graphdef, state = nnx.split(model)
  static = (num_tokens, max_len, float(temperature), int(top_k), tuple(rules), mesh)
  return _generate(graphdef, state, prompt, key, *static)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8, 9))
def _generate(graphdef, state, prompt, key, num_tokens, max_len, temperature, top_k, rules, mesh):
  with _rules_context(rules, mesh):
    model = nnx.merge(graphdef, state)
    batch, start = prompt.shape
    tokens = jnp.zeros((batch, start + num_tokens), jnp.int32).at[:, :start].set(prompt)
    if num_tokens == 0:
      return tokens
    cache = init_cache(cache_shape(model.config), batch, max_len)
    logits, cache = forward(model, prompt, cache, jnp.int32(0))
    first = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_k)
    tokens = tokens.at[:, start].set(first)

    def step(i, carry):
      tokens, cache = carry
      last = jax.lax.dynamic_slice_in_dim(tokens, start + i - 1, 1, axis=1)
      logits, cache = forward(model, last, cache, start + i - 1)
      nxt = sample_logits(logits[:, 0], jax.random.fold_in(key, i), temperature, top_k)
      return jax.lax.dynamic_update_index_in_dim(tokens, nxt, start + i, axis=1), cache

    return jax.lax.fori_loop(1, num_tokens, step, (tokens, cache))[0]


def prefill(
  model: nnx.Module,
  prompt: jax.Array,
  max_len: int | None = None,
  *,
  rules: rules_lib.Rules = (),
  mesh: jax.sharding.Mesh | None = None,
) -> tuple[jax.Array, KVCache]:
  """The prompt's logits [B, P, vocab] and the cache holding its keys and values.

  Example:
    >>> from trainers.models import llama
    >>> model = llama.Llama(llama.LlamaConfig(seq_len=8, num_layers=1, d_model=16, num_heads=2,
    ...                                       num_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
    >>> logits, cache = prefill(model, jnp.array([[1, 2, 3]]))
    >>> logits.shape, cache.keys.shape
    ((1, 3, 256), (1, 1, 1, 8, 8))
  """
  prompt, max_len = _check(model, prompt, 0, max_len, 0.0, 0)
  graphdef, state = nnx.split(model)
  return _prefill(graphdef, state, prompt, max_len, tuple(rules), mesh)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _prefill(graphdef, state, prompt, max_len, rules, mesh):
  with _rules_context(rules, mesh):
    model = nnx.merge(graphdef, state)
    cache = init_cache(cache_shape(model.config), prompt.shape[0], max_len)
    return forward(model, prompt, cache, jnp.int32(0))


def generate_uncached(model: nnx.Module, prompt: jax.Array, num_tokens: int) -> jax.Array:
  """Greedy decoding without a cache: the whole forward pass again for every token.

  The reference the cached decoder is tested against (and timed against):
  a fixed-length buffer, so one compiled program; causality makes the zeros
  after the last written token harmless.
  """
  prompt, _ = _check(model, prompt, num_tokens, None, 0.0, 0)
  graphdef, state = nnx.split(model)
  return _uncached(graphdef, state, prompt, num_tokens)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _uncached(graphdef, state, prompt, num_tokens):
  model = nnx.merge(graphdef, state)
  batch, start = prompt.shape
  tokens = jnp.zeros((batch, start + num_tokens), jnp.int32).at[:, :start].set(prompt)

  def step(i, tokens):
    logits = jax.lax.dynamic_index_in_dim(model(tokens), start + i - 1, axis=1, keepdims=False)
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.lax.dynamic_update_index_in_dim(tokens, nxt, start + i, axis=1)

  return jax.lax.fori_loop(0, num_tokens, step, tokens)


def cache_bytes_per_device(cache: KVCache) -> int:
  """Bytes one device holds of an (abstract or real) sharded cache: its largest shard."""
  return sum(
    math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    for leaf in (cache.keys, cache.values)
  )
