"""A decoder-only transformer language model in Flax NNX, every weight annotated.

Byte-level by default (vocabulary 256). Learned token and position
embeddings, pre-LayerNorm blocks of causal multi-head self-attention and a
GELU MLP, a final LayerNorm and an untied output projection. There are no
biases outside the norms (as in PaLM), which keeps `param_count` short.

Rows may be packed, several documents cut and concatenated: the forward pass
then takes each token's `segment_ids` and `positions`: each layer's
attention keeps to the query's segment (causal and same-segment, as
`attention_mask` shows), and the position embeddings are gathered at
`positions`, so that no document attends to another and each starts at
position 0. Unpacked rows pass neither and run the same program as before
packing existed.

Parameters (path in `nnx.state(model, nnx.Param)`, shape, logical axes):

  token_embed                    [vocab, d_model]            (vocab, embed)
  pos_embed                      [seq_len, d_model]          (positions, embed)
  blocks/attn_norm/scale, bias   [layers, d_model]           (layers, norm)
  blocks/attn/query, key, value  [layers, d_model, heads, head_dim]
                                                             (layers, embed, heads, kv)
  blocks/attn/out                [layers, heads, head_dim, d_model]
                                                             (layers, heads, kv, embed)
  blocks/mlp_norm/scale, bias    [layers, d_model]           (layers, norm)
  blocks/mlp/wi                  [layers, d_model, d_ff]     (layers, embed, mlp)
  blocks/mlp/wo                  [layers, d_ff, d_model]     (layers, mlp, embed)
  final_norm/scale, bias         [d_model]                   (norm,)
  unembed                        [d_model, vocab]            (embed, vocab)

The blocks' weights are stacked along a leading `layers` axis (size
num_layers; the rules presets never split it) and the forward pass is one
`jax.lax.scan` over them, so XLA compiles one block whatever the depth (as
MaxText's `scan_layers`, T5X and Levanter's `Stacked` do). Each layer is
rematerialised except for its matmul outputs (see `layers.scan_layers`: less
memory than unrolled, for a few percent more FLOPs); `remat_policy="none"`
keeps everything instead, and `scan_unroll` runs several layers (or all of
them) per loop iteration, for shallow models where the loop costs more
than it saves. `scan_layers=False`
builds the blocks unrolled instead, as `blocks/i/...` without the `layers`
axis and without remat; block i's weights are then exactly the stack's row
i for the same seed (see `layers.stacked`): only the checkpoint layout
differs.

Parameters are stored in `param_dtype` and cast to `dtype` for compute;
norms and softmax run in float32 and logits come back in float32. Attention
runs by the kernel `attention` names (`trainers.models.attention`), and a
loss that should not hold the whole logits takes `hidden_states` and
`unembedding` instead (`trainers.tasks.losses`). The model
sets no sharding constraints itself: the trainer places parameters (see
`trainers.models.logical_axes`) and inputs, and XLA propagates the rest,
except in the token and position lookups, which the active rules lay out
(`trainers.models.embedding`) so that XLA never copies whole activations.

A trainer reads the annotations off an abstract model (no memory, no
compile) and turns them into shardings; then
`jax.jit(lambda: nnx.state(TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param),
out_shardings=shardings)()` creates the parameters already placed, with the
same values on any mesh (tests/test_models.py does it):

  >>> from flax import nnx
  >>> from spmd import rules
  >>> from spmd.mesh import create_mesh
  >>> config = TransformerConfig(seq_len=16, num_layers=1, d_model=32, num_heads=2, d_ff=64)
  >>> abstract = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
  >>> state = nnx.state(abstract, nnx.Param)
  >>> mesh = create_mesh("data=-1,fsdp=2,tensor=2")
  >>> shardings = rules.logical_to_sharding(logical_axes(state), mesh, rules.FSDP_TP, shapes=state)
  >>> shardings["blocks"]["attn"]["query"].get_value().spec  # [layers, d_model, heads, head_dim]
  P(None, 'fsdp', 'tensor')
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd import context
from trainers.models import attention, embedding, param
from trainers.models import logical_axes as logical_axes
from trainers.models.layers import check_decoder_fields, dense, fan_in_init, scan_layers, stacked

_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


REMAT_POLICIES = ("minimal", "none")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes and dtypes of a `TransformerLM`.

  Example:
    >>> TransformerConfig(d_model=64, num_heads=4).head_dim
    16
    >>> TransformerConfig(d_model=64, num_heads=3)
    Traceback (most recent call last):
    ...
    ValueError: d_model=64 is not divisible by num_heads=3
  """

  vocab_size: int = 256
  """Token ids are in [0, vocab_size); 256 is byte-level."""
  seq_len: int = 128
  """The longest input (the learned position table has this many rows)."""
  num_layers: int = 2
  d_model: int = 128
  num_heads: int = 4
  d_ff: int = 512
  """Hidden width of each block's MLP."""
  dtype: str = "float32"
  """Compute dtype, e.g. "float32" or "bfloat16"."""
  param_dtype: str = "float32"
  """Storage dtype of the parameters."""
  scan_layers: bool = True
  """Stack the blocks' weights on a `layers` axis and `lax.scan` over them,
  rematerialised as `remat_policy` says (compile time independent of depth,
  less activation memory); False unrolls the blocks, without remat."""
  scan_unroll: int = 1
  """With scan_layers: layers per iteration of the scan's loop (`lax.scan`'s
  `unroll`). num_layers runs the stack as straight-line code: the same
  parameters, checkpoints and remat, compile time growing with depth, and
  no loop machinery (per-layer weight slices, stacked residual buffers,
  no overlap between layers). For a shallow model that is the faster
  choice: its compile time is small either way, and the loop machinery is
  paid every step."""
  remat_policy: str = "minimal"
  """With scan_layers: what each layer keeps for the backward pass.
  "minimal" keeps only the weight matmuls' outputs and recomputes the rest
  (attention scores, softmax, norms, GELU): far less activation memory for
  a few percent more compute. "none" keeps everything and recomputes
  nothing: faster where memory is plentiful (no recomputation), but in a
  rolled loop every intermediate becomes a stacked buffer."""
  attention: str = "auto"
  """The attention kernel: "auto" (splash on TPU, cuDNN on GPU, else XLA),
  "xla", "splash" or "cudnn" (`trainers.models.attention`)."""

  def __post_init__(self):
    sizes = ("vocab_size", "seq_len", "num_layers", "d_model", "num_heads", "d_ff")
    check_decoder_fields(self, sizes, REMAT_POLICIES)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


class _LayerNorm(nnx.Module):
  def __init__(self, dim: int, param_dtype: jnp.dtype, *, rngs: nnx.Rngs):
    self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)
    self.bias = param(rngs, nnx.initializers.zeros, (dim,), ("norm",), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    # Statistics in float32: a bf16 variance of d_model terms loses most bits.
    y = x.astype(jnp.float32)
    mean = y.mean(axis=-1, keepdims=True)
    var = jnp.square(y - mean).mean(axis=-1, keepdims=True)
    y = (y - mean) * jax.lax.rsqrt(var + 1e-6)
    return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class _Attention(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    d, h, k = config.d_model, config.num_heads, config.head_dim
    pdt = jnp.dtype(config.param_dtype)
    qkv_init = fan_in_init(in_axis=0, out_axis=(1, 2))
    self.query = param(rngs, qkv_init, (d, h, k), ("embed", "heads", "kv"), pdt)
    self.key = param(rngs, qkv_init, (d, h, k), ("embed", "heads", "kv"), pdt)
    self.value = param(rngs, qkv_init, (d, h, k), ("embed", "heads", "kv"), pdt)
    self.out = param(
      rngs, fan_in_init(in_axis=(0, 1), out_axis=2), (h, k, d), ("heads", "kv", "embed"), pdt
    )
    self.kernel = config.attention

  def probabilities(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Attention weights [b, heads, query, key] (XLA's), in the compute dtype.

    `segment_ids` [b, length] keep each query in its segment; None is causal only.
    """
    q, k, _ = self._qkv(x)
    mask = attention.causal_mask(segment_ids, x.shape[1])
    return attention.attention_weights(q, k, mask).astype(x.dtype)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    q, k, v = self._qkv(x)
    y = attention.attend(q, k, v, segment_ids, kernel=self.kernel)
    return dense(y, self.out[...], contract=2)

  def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values [b, l, heads, head_dim] in the compute dtype."""
    # `dense` multiplies each weight in x's dtype (the compute dtype).
    return tuple(dense(x, w[...]) for w in (self.query, self.key, self.value))


class _MLP(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    d, f, pdt = config.d_model, config.d_ff, jnp.dtype(config.param_dtype)
    self.wi = param(rngs, fan_in_init(0, 1), (d, f), ("embed", "mlp"), pdt)
    self.wo = param(rngs, fan_in_init(0, 1), (f, d), ("mlp", "embed"), pdt)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.gelu(dense(x, self.wi[...]))
    return dense(h, self.wo[...])


class _Block(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    pdt = jnp.dtype(config.param_dtype)
    self.attn_norm = _LayerNorm(config.d_model, pdt, rngs=rngs)
    self.attn = _Attention(config, rngs=rngs)
    self.mlp_norm = _LayerNorm(config.d_model, pdt, rngs=rngs)
    self.mlp = _MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    x = x + self.attn(self.attn_norm(x), segment_ids)
    return x + self.mlp(self.mlp_norm(x))


def attention_mask(segment_ids: jax.Array) -> jax.Array:
  """Which keys each query may attend to in packed rows: bool [B, 1, L, L].

  True where the key is at or before the query (causal) AND in the query's
  segment, so attention never crosses from one document to another. The
  singleton axis broadcasts over heads. Padding (segment 0) attends to
  padding, which keeps every row of the softmax non-empty; its targets are
  masked out of the loss anyway. Derived from the batch's own
  `segment_ids`, the mask is split over the data axes as the batch is.

  Example:
    >>> mask = attention_mask(jnp.array([[1, 1, 2, 2, 0]]))
    >>> mask[0, 0].astype(int).tolist()  # rows: queries, columns: keys
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
  """
  if segment_ids.ndim != 2:
    raise ValueError(f"segment_ids must be [batch, length], got {segment_ids.shape=}")
  return attention.causal_mask(segment_ids, segment_ids.shape[1])[:, None]


class TransformerLM(nnx.Module):
  """Decoder-only transformer: int tokens [B, L] -> float32 logits [B, L, vocab].

  The logits at position t depend only on tokens 0..t (causal attention).
  L may be anything up to `config.seq_len`; a token id outside
  [0, vocab_size) embeds as zeros.

  Packed rows, several documents one after another, pass `segment_ids` and
  `positions` (int [B, L], as the tokens): then position t sees only the
  tokens 0..t of its own segment (`attention_mask`), and its position
  embedding is `positions[b, t]`'s, so each document is modelled as if it
  were alone at the start of a row. Without them (None, the default) the
  program is the unpacked one: the causal mask is a constant, and the
  positions are 0..L-1.

  The logits are `hidden_states(...)` times `unembedding()`, accumulated in
  float32.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> config = TransformerConfig(seq_len=16, num_layers=1, d_model=32, num_heads=2, d_ff=64)
    >>> model = TransformerLM(config, rngs=nnx.Rngs(0))
    >>> model(jnp.ones((3, 5), jnp.int32)).shape
    (3, 5, 256)

    A packed row of two documents and a padding token; the second
    document's logits are those it has alone:

    >>> tokens = jnp.array([[5, 6, 7, 8, 9, 0]])
    >>> segment_ids = jnp.array([[1, 1, 1, 2, 2, 0]])
    >>> positions = jnp.array([[0, 1, 2, 0, 1, 0]])
    >>> packed = model(tokens, segment_ids=segment_ids, positions=positions)
    >>> bool(jnp.allclose(packed[0, 3:5], model(jnp.array([[8, 9]]))[0], atol=1e-5))
    True
  """

  # Its weights are cast to `dtype` inside each product, whose weight
  # gradient comes back in `param_dtype`, summed in float32: the precision
  # policy hands it its parameters uncast.
  casts_own_weights = True

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    d, pdt = config.d_model, jnp.dtype(config.param_dtype)
    self.token_embed = param(rngs, _EMBED_INIT, (config.vocab_size, d), ("vocab", "embed"), pdt)
    # A weight, split like the others along `embed` (over `fsdp` and `context`);
    # its rows are not `length`, which would ask for `context` twice.
    self.pos_embed = param(rngs, _EMBED_INIT, (config.seq_len, d), ("positions", "embed"), pdt)
    # Stacked: one `_Block` of [layers, ...] weights; unrolled: a list of blocks.
    if config.scan_layers:
      self.blocks = stacked(lambda r: _Block(config, rngs=r), config.num_layers, rngs)
    else:
      self.blocks = nnx.List([_Block(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = _LayerNorm(d, pdt, rngs=rngs)
    self.unembed = param(rngs, fan_in_init(0, 1), (d, config.vocab_size), ("embed", "vocab"), pdt)

  def __call__(
    self,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """Logits [B, L, vocab] in float32 (the arguments are `hidden_states`')."""
    x = self.hidden_states(tokens, segment_ids, positions)
    # Accumulate the vocabulary projection in float32 (the loss wants f32 logits).
    return dense(x, self.unembedding(), preferred_element_type=jnp.float32)

  def unembedding(self) -> jax.Array:
    """The output projection [d_model, vocab] as stored.

    Its products cast it to the hidden states' dtype (`dense`,
    `chunked_cross_entropy_sums`), so its gradient stays in its own.
    """
    return self.unembed[...]

  def hidden_states(
    self,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """The last hidden states [B, L, d_model] after the final norm, in the compute dtype.

    Args:
      tokens: int [B, L], L <= `config.seq_len`.
      segment_ids: int [B, L] or None: the document of each token, numbered
        from 1 within its row, 0 for padding. Attention stays inside a
        segment. None: one segment per row.
      positions: int [B, L] or None: each token's index within its segment,
        below `config.seq_len`. None: 0..L-1.
    """
    config = self.config
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, length], got {tokens.shape=}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be integers, got {tokens.dtype=}")
    length = tokens.shape[1]
    if length > config.seq_len:
      raise ValueError(f"{tokens.shape=} is longer than seq_len={config.seq_len}")
    for name, value in (("segment_ids", segment_ids), ("positions", positions)):
      if value is None:
        continue
      if value.shape != tokens.shape or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(
          f"{name} must be integers shaped as the tokens {tokens.shape}, "
          f"got {value.shape=} {value.dtype=}"
        )
    dt = jnp.dtype(config.dtype)
    # Both lookups are laid out by the rules (`embedding.lookup`): left to
    # XLA, a gather from a table split over fsdp, or the one-hot matmul this
    # model once used instead, makes XLA copy the whole [B, L, d_model]
    # activation on meshes with data > 1 and fsdp > 1, forward or backward.
    x = embedding.lookup(self.token_embed[...], tokens, dtype=dt)
    index = context.token_index(length)
    if positions is None and (index != np.arange(length)).any():
      # The rows in the step's balanced order (`spmd.context`): each token's place.
      positions = jnp.broadcast_to(jnp.asarray(index), tokens.shape)
    if positions is None:
      # Added in the table's float32 and rounded once: its gradient, a sum
      # over the batch (across devices), is then float32 as well.
      x = (x + self.pos_embed[:length]).astype(dt)
    else:
      x = x + embedding.lookup(self.pos_embed[...], positions, ("positions", "embed"), dtype=dt)
    # Each layer's attention builds its mask (or its kernel reads the ids).
    if config.scan_layers:
      x = scan_layers(
        self.blocks, x, segment_ids, unroll=config.scan_unroll, remat_policy=config.remat_policy
      )
    else:
      for block in self.blocks:
        x = block(x, segment_ids)
    return self.final_norm(x)


def param_count(config: TransformerConfig) -> int:
  """The number of parameters of `TransformerLM(config)`, computed from the sizes.

  Example:
    >>> param_count(TransformerConfig(vocab_size=256, seq_len=16, num_layers=1,
    ...                               d_model=32, num_heads=2, d_ff=64))
    25280
  """
  d, f = config.d_model, config.d_ff
  # q, k, v, out (heads * head_dim == d_model), MLP in/out, two norms of scale + bias.
  per_layer = 4 * d * d + 2 * d * f + 2 * 2 * d
  embeddings = (config.vocab_size + config.seq_len) * d
  return embeddings + config.num_layers * per_layer + 2 * d + d * config.vocab_size


def flops_per_token(config: TransformerConfig) -> float:
  """Training FLOPs per token (forward + backward), PaLM's accounting.

  `6 * N + 12 * num_layers * d_model * seq_len` (PaLM, Chowdhery et al. 2022,
  appendix B; Chinchilla's 6N plus the attention term): N counts the
  non-embedding parameters, every parameter except the token and position
  embedding tables (lookups); the untied output projection is a
  matmul and is counted. Each parameter costs 2 FLOPs forward and 4 backward;
  the attention scores and weighted sum cost 12 * d_model * seq_len per
  layer, counted for the full square (neither causal nor segment masking is
  subtracted: packed rows compute the same dense scores), as MFU tables
  conventionally do. Norms, softmax and GELU are not counted.

  Example:
    >>> config = TransformerConfig(vocab_size=256, seq_len=16, num_layers=1, d_model=32,
    ...                            num_heads=2, d_ff=64)
    >>> flops_per_token(config)  # 6 * (25280 - (256 + 16) * 32) + 12 * 1 * 32 * 16
    105600.0
  """
  non_embedding = param_count(config) - (config.vocab_size + config.seq_len) * config.d_model
  return float(6 * non_embedding + 12 * config.num_layers * config.d_model * config.seq_len)
