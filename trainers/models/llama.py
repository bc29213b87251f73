"""A Llama-family decoder in Flax NNX: RMSNorm, RoPE, SwiGLU, grouped-query attention.

The architecture of Llama 2/3 (Touvron et al. 2023; Meta 2024): pre-RMSNorm
blocks of causal self-attention with rotary position embeddings and
grouped-query attention (`num_kv_heads` key/value heads shared by groups of
`num_heads` query heads), a SwiGLU MLP, a final RMSNorm and an output
projection, tied to the token embedding or not. No biases, except on the
query, key and value projections with `qkv_bias` (Qwen2's). RoPE's frequencies
are Llama 2's, or stretched as Llama 3.1's (`rope_scaling="llama3"`).

Parameters (path in `nnx.state(model, nnx.Param)`, shape, logical axes):

  token_embed                  [vocab, d_model]                      (vocab, embed)
  blocks/attn_norm/scale       [layers, d_model]                     (layers, norm)
  blocks/attn/query            [layers, d_model, heads, head_dim]    (layers, embed, heads, kv)
  blocks/attn/key, value       [layers, d_model, kv_heads, head_dim] (layers, embed, kv_heads, kv)
  blocks/attn/out              [layers, heads, head_dim, d_model]    (layers, heads, kv, embed)
  blocks/attn/query_bias       [layers, heads, head_dim]  (qkv_bias)  (layers, heads, kv)
  blocks/attn/key_bias, value_bias [layers, kv_heads, head_dim] (qkv_bias) (layers, kv_heads, kv)
  blocks/mlp_norm/scale        [layers, d_model]                     (layers, norm)
  blocks/mlp/gate, up          [layers, d_model, d_ff]               (layers, embed, mlp)
  blocks/mlp/down              [layers, d_ff, d_model]               (layers, mlp, embed)
  (a routed layer, `moe_experts` > 0: `blocks/mlp/` holds `trainers.models.moe`'s
  router, experts and shared expert instead)
  final_norm/scale             [d_model]                             (norm,)
  unembed                      [d_model, vocab]  (untied only)       (embed, vocab)

Layers are stacked and scanned, rematerialised by `remat_policy`, or
unrolled (`trainers.models.layers.stacked` and `scan_layers`: the same seed
gives the same weights in either layout).

Activations are constrained explicitly by logical names (MaxText's way):
the residual stream is (batch, length, embed), queries (batch, length,
heads, kv), keys and values (batch, length, kv_heads, kv), the MLP's hidden
layer (batch, length, mlp), the logits (batch, length, vocab). The trainer
says which rules and mesh apply (`spmd.rules.activation_rules`, entered by
the train and eval steps); with `mesh.rules=fsdp_tp` that is Megatron's
layout (heads and MLP split over `tensor`, the batch over data and fsdp).
With no rules active the constraints do nothing, so the model runs as is
in a plain process.

Packed data: `model(tokens, segment_ids, positions)` attends only within a
segment (causally), and RoPE counts positions within the segment.

Attention runs by the kernel `attention` names (`trainers.models.attention`:
splash on TPU, cuDNN on GPU, XLA's einsums otherwise). A loss that should not
hold the whole logits takes `hidden_states` and `unembedding` instead of the
logits (`trainers.tasks.losses.chunked_cross_entropy_sums`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> config = LlamaConfig(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64)
  >>> model = Llama(config, rngs=nnx.Rngs(0))
  >>> model(jnp.ones((2, 5), jnp.int32)).shape
  (2, 5, 256)
  >>> model.blocks.attn.key.shape, model.blocks.attn.key.get_metadata("out_sharding")
  ((1, 32, 2, 8), ('layers', 'embed', 'kv_heads', 'kv'))
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spmd import context
from spmd.rules import constrain
from trainers.models import attention, embedding, lora, moe, param
from trainers.models.layers import check_decoder_fields, dense, fan_in_init, scan_layers, stacked

_EMBED_INIT = nnx.initializers.normal(stddev=0.02)
REMAT_POLICIES = ("minimal", "minimal_no_qkv", "full", "none")
ROPE_SCALINGS = ("none", "llama3")
MOE_FIELDS = (
  "moe_experts",
  "moe_top_k",
  "moe_d_ff",
  "moe_every",
  "moe_gate",
  "moe_norm_topk",
  "moe_shared_d_ff",
  "moe_shared_gate",
  "moe_load_balancing_coef",
  "moe_z_loss_coef",
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes and dtypes of a `Llama`.

  Example:
    >>> LlamaConfig(d_model=64, num_heads=8, num_kv_heads=2).head_dim
    8
    >>> LlamaConfig(num_heads=4, num_kv_heads=3)
    Traceback (most recent call last):
    ...
    ValueError: num_kv_heads=3 must divide num_heads=4 (grouped-query attention)
  """

  vocab_size: int = 256
  seq_len: int = 128
  """The training length (windows of the data; RoPE itself has no limit)."""
  num_layers: int = 2
  d_model: int = 128
  num_heads: int = 4
  num_kv_heads: int = 2
  """Key/value heads; each serves num_heads // num_kv_heads query heads."""
  d_ff: int = 384
  """Hidden width of each SwiGLU MLP."""
  rope_theta: float = 10000.0
  """RoPE's base period (Llama 2: 1e4, Llama 3: 5e5)."""
  rope_scaling: str = "none"
  """"none", or "llama3": Llama 3.1's stretch of the low frequencies, by the
  four `rope_*` fields below (Hugging Face's `rope_scaling` of that type)."""
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_length: int = 8192
  """The context length the unscaled model was trained on."""
  qkv_bias: bool = False
  """Biases on the query, key and value projections (Qwen2)."""
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  """Use the token embedding, transposed, as the output projection."""
  dtype: str = "float32"
  """Compute dtype, e.g. "float32" or "bfloat16"."""
  param_dtype: str = "float32"
  scan_layers: bool = True
  """Stack the layers' weights and `lax.scan` over them (see the transformer)."""
  scan_unroll: int = 1
  """With scan_layers: layers per iteration of the scan's loop."""
  remat_policy: str = "minimal"
  """With scan_layers, what each layer keeps for the backward pass: "minimal"
  (the weight matmuls' outputs), "minimal_no_qkv" (those less the query, key
  and value projections, recomputed: a third less memory), "full" (only its input: least memory, one
  more forward pass) or "none" (everything)."""
  attention: str = "auto"
  """The attention kernel: "auto" (splash on TPU, cuDNN on GPU, else XLA),
  "xla", "splash" or "cudnn" (`trainers.models.attention`)."""
  moe_experts: int = 0
  """Routed experts per routed layer (`trainers.models.moe`); 0: every MLP dense."""
  moe_top_k: int = 2
  """Experts each token is routed to."""
  moe_d_ff: int = 0
  """Hidden width of each routed expert; 0: `d_ff`."""
  moe_every: int = 1
  """Layer i is routed when (i + 1) % moe_every == 0 (1: all; 2: every other,
  the first dense). With scan_layers only 1: scanned layers must be alike."""
  moe_gate: str = "softmax"
  """"softmax" (Mixtral, Qwen2-MoE) or "sigmoid" (DeepSeek-V3) gates."""
  moe_norm_topk: bool = True
  """Renormalise the k chosen gates to sum to 1 (Mixtral; Qwen2-MoE's `norm_topk_prob`)."""
  moe_shared_d_ff: int = 0
  """Hidden width of a shared expert every token takes (Qwen2-MoE, DeepSeek); 0: none."""
  moe_shared_gate: bool = True
  """Scale the shared expert by a per-token sigmoid gate (Qwen2-MoE; DeepSeek: False)."""
  moe_load_balancing_coef: float = 0.01
  """Weight of the load-balancing loss in the training loss (Switch's 0.01)."""
  moe_z_loss_coef: float = 0.001
  """Weight of the router z-loss in the training loss (ST-MoE's 0.001)."""

  def __post_init__(self):
    sizes = ("vocab_size", "seq_len", "num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff")
    check_decoder_fields(self, sizes, REMAT_POLICIES)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
        "(grouped-query attention)"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} (d_model / num_heads) must be even for RoPE")
    if not self.rope_theta > 1:
      raise ValueError(f"rope_theta={self.rope_theta!r} must be > 1")
    for name in ("tie_embeddings", "qkv_bias"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(f"rope_scaling={self.rope_scaling!r} must be one of {ROPE_SCALINGS}")
    if self.rope_scaling == "llama3" and not (
      self.rope_factor >= 1
      and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
      and self.rope_original_length > 0
    ):
      raise ValueError(
        f"rope_scaling='llama3' needs rope_factor >= 1, 0 < rope_low_freq_factor < "
        f"rope_high_freq_factor and rope_original_length > 0, got {self.rope_factor=}, "
        f"{self.rope_low_freq_factor=}, {self.rope_high_freq_factor=}, "
        f"{self.rope_original_length=}"
      )

    self._check_moe()

  def _check_moe(self):
    experts = self.moe_experts
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
      raise ValueError(f"moe_experts={experts!r} must be a non-negative integer (0: dense)")
    every = self.moe_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
      raise ValueError(f"moe_every={every!r} must be a positive integer")
    for name in ("moe_load_balancing_coef", "moe_z_loss_coef"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name}={value!r} must be a number >= 0")
    if self.moe_config is None:  # building it validates the routed layer's fields
      return
    if self.scan_layers and every != 1:
      raise ValueError(
        f"moe_every={every} needs scan_layers=False: scanned layers share one shape, "
        "so with scan_layers every layer is routed (moe_every=1)"
      )
    if every > self.num_layers:
      raise ValueError(f"moe_every={every} routes none of num_layers={self.num_layers}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def moe_config(self) -> moe.MoEConfig | None:
    """The routed layers' `MoEConfig`; None for a dense model."""
    if not self.moe_experts:
      return None
    return moe.MoEConfig(
      d_model=self.d_model,
      num_experts=self.moe_experts,
      top_k=self.moe_top_k,
      d_ff=self.moe_d_ff or self.d_ff,
      gate=self.moe_gate,
      norm_topk=self.moe_norm_topk,
      shared_d_ff=self.moe_shared_d_ff,
      shared_gate=self.moe_shared_gate,
      param_dtype=self.param_dtype,
      chunk_bytes=moe.CHUNK_BYTES if self.remats_whole_layers else 0,
    )

  @property
  def remats_whole_layers(self) -> bool:
    """Whether each layer keeps only its input for the backward pass (scanned, "full" remat)."""
    return self.scan_layers and self.remat_policy == "full"

  def routed_layer(self, layer: int) -> bool:
    """Whether layer `layer` (from 0) has a routed MLP.

    Example:
      >>> config = LlamaConfig(num_layers=4, moe_experts=4, moe_every=2, scan_layers=False)
      >>> [config.routed_layer(i) for i in range(4)]
      [False, True, False, True]
    """
    return bool(self.moe_experts) and (layer + 1) % self.moe_every == 0


def _unscaled_frequencies(head_dim: int, theta: float) -> np.ndarray:
  exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
  return (np.float32(1.0) / np.float32(theta) ** exponents).astype(np.float32)


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
  """RoPE's inverse frequencies, float32 [head_dim // 2], scaled as `config.rope_scaling` says.

  Frequency i is `theta ** (-2i / head_dim)`, as in Llama, computed in
  float32 as Hugging Face computes it (so imported models agree to rounding).
  Llama 3.1's scaling divides the frequencies whose wavelength exceeds
  `rope_original_length / rope_low_freq_factor` by `rope_factor`, keeps those
  below `rope_original_length / rope_high_freq_factor`, and blends between.

  Example:
    >>> config = LlamaConfig(d_model=16, num_heads=2, rope_theta=100.0)
    >>> rope_frequencies(config).tolist()
    [1.0, 0.3162277638912201, 0.10000000149011612, 0.03162277862429619]
    >>> scaled = dataclasses.replace(config, rope_scaling="llama3", rope_original_length=64)
    >>> [round(f, 6) for f in rope_frequencies(scaled).tolist()]
    [1.0, 0.244385, 0.013042, 0.003953]
  """
  inv_freq = _unscaled_frequencies(config.head_dim, config.rope_theta)
  if config.rope_scaling == "none":
    return inv_freq
  factor, low, high = config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
  original = config.rope_original_length
  wavelength = np.float32(2 * np.pi) / inv_freq
  scaled = np.where(wavelength > original / low, inv_freq / factor, inv_freq)
  smooth = (original / wavelength - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelength >= original / high) & (wavelength <= original / low)
  return np.where(medium, blended, scaled).astype(np.float32)


def rope_angles(
  positions: jax.Array, head_dim: int, theta: float, inv_freq: np.ndarray | None = None
) -> tuple[jax.Array, jax.Array]:
  """(sin, cos) of RoPE's angles, float32 [..., head_dim // 2], for integer positions.

  `inv_freq` is the frequencies (`rope_frequencies`); None: Llama 2's,
  `theta ** (-2i / head_dim)`.

  Example:
    >>> sin, cos = rope_angles(jnp.array([[0, 1]]), head_dim=4, theta=10000.0)
    >>> sin.shape, cos[0, 0].tolist()
    ((1, 2, 2), [1.0, 1.0])
  """
  if inv_freq is None:
    inv_freq = _unscaled_frequencies(head_dim, theta)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """Rotates `x` [batch, length, heads, head_dim] by the angles [batch, length, head_dim // 2].

  The two halves of each head are the pairs' coordinates (the "rotate half"
  layout of Hugging Face's and MaxText's Llama); computed in float32.
  """
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  sin, cos = sin[:, :, None, :], cos[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nnx.Module):
  """`x / rms(x) * scale`, statistics in float32."""

  def __init__(self, dim: int, eps: float, param_dtype: jnp.dtype, *, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    # A bf16 mean of d_model squares loses most of its bits.
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
  """`y + bias` in y's dtype, added in float32 so that the bias's gradient, a sum
  over every token, is summed in float32 (as `dense` sums the weights')."""
  return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)


def _product(module: nnx.Module, name: str, x: jax.Array, contract: int = 1) -> jax.Array:
  """`x` times the weight `name` of `module`, plus its LoRA adapters' product if it has them."""
  y = dense(x, getattr(module, name)[...], contract=contract)
  delta = lora.low_rank(module, name, x, contract)
  return y if delta is None else y + delta


class Attention(nnx.Module):
  """Grouped-query causal self-attention with RoPE and an optional segment mask."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    d, h, g, k = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim
    pdt = jnp.dtype(config.param_dtype)
    init = fan_in_init(in_axis=0, out_axis=(1, 2))
    self.query = param(rngs, init, (d, h, k), ("embed", "heads", "kv"), pdt)
    self.key = param(rngs, init, (d, g, k), ("embed", "kv_heads", "kv"), pdt)
    self.value = param(rngs, init, (d, g, k), ("embed", "kv_heads", "kv"), pdt)
    self.out = param(
      rngs, fan_in_init(in_axis=(0, 1), out_axis=2), (h, k, d), ("heads", "kv", "embed"), pdt
    )
    if config.qkv_bias:
      zeros = nnx.initializers.zeros
      self.query_bias = param(rngs, zeros, (h, k), ("heads", "kv"), pdt)
      self.key_bias = param(rngs, zeros, (g, k), ("kv_heads", "kv"), pdt)
      self.value_bias = param(rngs, zeros, (g, k), ("kv_heads", "kv"), pdt)
    self.qkv_bias = config.qkv_bias
    self.kernel = config.attention

  def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values of `x` [batch, length, d_model], before RoPE."""
    # `dense` multiplies each weight in x's dtype (the compute dtype).
    q = _product(self, "query", x)
    k = _product(self, "key", x)
    v = _product(self, "value", x)
    if self.qkv_bias:
      q, k, v = (
        _add_bias(y, b[...])
        for y, b in zip((q, k, v), (self.query_bias, self.key_bias, self.value_bias))
      )
    q = constrain(q, ("batch", "length", "heads", "kv"))
    k = constrain(k, ("batch", "length", "kv_heads", "kv"))
    return q, k, constrain(v, ("batch", "length", "kv_heads", "kv"))

  def __call__(
    self, x: jax.Array, segment_ids: jax.Array | None, sin: jax.Array, cos: jax.Array
  ) -> jax.Array:
    q, k, v = self.project(x)
    q, k = apply_rope(q, sin, cos), apply_rope(k, sin, cos)
    y = attention.attend(q, k, v, segment_ids, kernel=self.kernel)
    y = constrain(y, ("batch", "length", "heads", "kv"))
    return checkpoint_name(self.output(y), "attention_out")

  def output(self, y: jax.Array) -> jax.Array:
    """The output projection of the attended values `y` [batch, length, heads, head_dim]."""
    return _product(self, "out", y, contract=2)


class MLP(nnx.Module):
  """SwiGLU: `down(silu(gate(x)) * up(x))`."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    d, f, pdt = config.d_model, config.d_ff, jnp.dtype(config.param_dtype)
    self.gate = param(rngs, fan_in_init(0, 1), (d, f), ("embed", "mlp"), pdt)
    self.up = param(rngs, fan_in_init(0, 1), (d, f), ("embed", "mlp"), pdt)
    self.down = param(rngs, fan_in_init(0, 1), (f, d), ("mlp", "embed"), pdt)

  def __call__(self, x: jax.Array) -> jax.Array:
    # On the tokens flattened into one axis [batch * length, d_ff], from the
    # first matmul to the last: with the gate's and up's outputs reshaped
    # back to [batch, length, d_ff] between the matmuls, XLA on a TPU copied
    # the scanned layers' saved outputs out of their stack in the backward
    # pass (docs/performance.md, "On a TPU chip").
    lead = x.shape[:-1]
    tokens, names = x.reshape(-1, x.shape[-1]), (("batch", "length"), "mlp")
    if context.active_shards() > 1:
      # The sequence split over `context`: flattened, a device's tokens would
      # not be one block of the token axis (`layers.dense`).
      tokens, names = x, ("batch", "length", "mlp")
    gate = checkpoint_name(constrain(_product(self, "gate", tokens), names), "mlp_gate")
    up = checkpoint_name(constrain(_product(self, "up", tokens), names), "mlp_up")
    return _product(self, "down", jax.nn.silu(gate) * up).reshape(*lead, -1)


class Block(nnx.Module):
  """Pre-norm residual block: attention, then the MLP (routed with `routed`)."""

  def __init__(self, config: LlamaConfig, *, routed: bool = False, rngs: nnx.Rngs):
    pdt = jnp.dtype(config.param_dtype)
    self.attn_norm = RMSNorm(config.d_model, config.norm_eps, pdt, rngs=rngs)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, pdt, rngs=rngs)
    self.routed = routed
    self.mlp = moe.MoE(config.moe_config, rngs=rngs) if routed else MLP(config, rngs=rngs)
    # A routed layer under full remat runs its attention's forward pass once
    # more in the backward pass, after the routed MLP's backward pass: kept
    # from the layer's own recomputation, the attention's residuals (queries,
    # keys, values, splash's output and log-sum-exp) were held across the
    # routed MLP's backward pass, where the layer's memory peaks.
    self.attention_remat = routed and config.remats_whole_layers

  def __call__(
    self, x: jax.Array, segment_ids: jax.Array | None, sin: jax.Array, cos: jax.Array
  ) -> tuple[jax.Array, moe.RouterStats | None]:
    """The block's output and, for a routed MLP, its `RouterStats` (else None)."""
    residual = ("batch", "length", "embed")

    def attention(x, segment_ids, sin, cos):
      return self.attn(self.attn_norm(x), segment_ids, sin, cos)

    if self.attention_remat:
      attention = jax.checkpoint(attention, policy=jax.checkpoint_policies.nothing_saveable)
    x = constrain(x + attention(x, segment_ids, sin, cos), residual)
    if not self.routed:
      return constrain(x + self.mlp(self.mlp_norm(x)), residual), None
    y, stats = self.mlp.routed(self.mlp_norm(x))
    return constrain(x + y, residual), stats


class Llama(nnx.Module):
  """Llama decoder: int tokens [B, L] -> float32 logits [B, L, vocab].

  `segment_ids` (int [B, L], packed data) restricts attention to keys of the
  query's own segment; `positions` (int [B, L], the index within the
  segment) are RoPE's positions, else 0..L-1. A token id outside
  [0, vocab_size) embeds as zeros.

  The logits are `hidden_states(...)` times `unembedding()`, accumulated in
  float32.

  Its weights are stored in `param_dtype` and cast to `dtype` inside each
  product, whose weight gradient comes back in `param_dtype`, summed across
  devices in float32 (`casts_own_weights`: the precision policy hands it
  its parameters uncast).
  """

  casts_own_weights = True
  # `config.lora.targets`' short names, and the query, key and value's one
  # input dim (embed; the others contract all but their last), for
  # `trainers.models.lora`.
  lora_targets: ClassVar[dict[str, str]] = {
    "q": r"attn/query$",
    "k": r"attn/key$",
    "v": r"attn/value$",
    "o": r"attn/out$",
    "gate": r"mlp/gate$",
    "up": r"mlp/up$",
    "down": r"mlp/down$",
  }
  lora_input_dims: ClassVar[dict[str, int]] = {r"attn/(query|key|value)$": 1}
  # Its products add the adapters' low-rank product themselves (`lora.low_rank`):
  # no merged weight, no gradient of a frozen one.
  applies_lora = True

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    d, pdt = config.d_model, jnp.dtype(config.param_dtype)
    self.token_embed = param(rngs, _EMBED_INIT, (config.vocab_size, d), ("vocab", "embed"), pdt)
    if config.scan_layers:
      # Scanned, every layer is alike: all routed or all dense (moe_every=1).
      routed = config.routed_layer(0)
      self.blocks = stacked(lambda r: Block(config, routed=routed, rngs=r), config.num_layers, rngs)
    else:
      self.blocks = nnx.List(
        [Block(config, routed=config.routed_layer(i), rngs=rngs) for i in range(config.num_layers)]
      )
    self.final_norm = RMSNorm(d, config.norm_eps, pdt, rngs=rngs)
    if not config.tie_embeddings:
      self.unembed = param(rngs, fan_in_init(0, 1), (d, config.vocab_size), ("embed", "vocab"), pdt)

  def __call__(
    self,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    x = self.hidden_states(tokens, segment_ids, positions)
    # The loss wants float32 logits: accumulate the projection in float32.
    logits = dense(x, self.unembedding(), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "length", "vocab"))

  def unembedding(self) -> jax.Array:
    """The output projection [d_model, vocab] as stored (tied: the table, transposed).

    Its products cast it to the hidden states' dtype (`dense`,
    `chunked_cross_entropy_sums`), so its gradient stays in its own.
    """
    if self.config.tie_embeddings:
      return self.token_embed[...].T
    return self.unembed[...]

  def hidden_states(
    self,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """The last hidden states [B, L, d_model] after the final norm, in the compute dtype."""
    return self.hidden_states_and_stats(tokens, segment_ids, positions)[0]

  def hidden_states_and_stats(
    self,
    tokens: jax.Array,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
  ) -> tuple[jax.Array, moe.RouterStats | None]:
    """`hidden_states` and the routed layers' `RouterStats`, averaged over those layers.

    The stats are None for a dense model. Each routed layer's are over the
    tokens of this call (padding included).

    Example:
      >>> config = LlamaConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
      ...                      moe_experts=4, moe_top_k=2)
      >>> hidden, stats = Llama(config, rngs=nnx.Rngs(0)).hidden_states_and_stats(
      ...   jnp.ones((1, 4), jnp.int32))
      >>> hidden.shape, stats.expert_share.shape, float(stats.expert_share.sum())
      ((1, 4, 32), (4,), 1.0)
    """
    config = self.config
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
        f"tokens must be integers [batch, length], got {tokens.shape=} {tokens.dtype=}"
      )
    for name, value in (("segment_ids", segment_ids), ("positions", positions)):
      if value is not None and value.shape != tokens.shape:
        raise ValueError(f"{name}.shape={value.shape} must equal {tokens.shape=}")
    batch, length = tokens.shape
    dt = jnp.dtype(config.dtype)
    # A lookup, not a one-hot matmul: at a 128k vocabulary the one-hot
    # product costs a few percent of the step for nothing. The lookup is laid
    # out by the rules (`embedding.lookup`: the FSDP-split table gathered,
    # the vocabulary split Megatron's way, the batch's rows looked up where
    # they live), which XLA's own gather partitioning cannot do without
    # copying the whole activation on meshes with data > 1 and fsdp > 1.
    x = embedding.lookup(self.token_embed[...], tokens, dtype=dt)
    x = constrain(x, ("batch", "length", "embed"))
    if positions is None:
      # Each token's place in its row, whatever order the step put the row in.
      positions = jnp.broadcast_to(jnp.asarray(context.token_index(length)), (batch, length))
    sin, cos = rope_angles(positions, config.head_dim, config.rope_theta, rope_frequencies(config))
    if config.scan_layers:
      x, stacked_stats = scan_layers(
        self.blocks,
        x,
        segment_ids,
        sin,
        cos,
        unroll=config.scan_unroll,
        remat_policy=config.remat_policy,
        with_outputs=True,
      )
      stats = None if stacked_stats is None else jax.tree.map(lambda s: s.mean(0), stacked_stats)
    else:
      per_layer = []
      for block in self.blocks:
        x, layer_stats = block(x, segment_ids, sin, cos)
        if layer_stats is not None:
          per_layer.append(layer_stats)
      stats = None
      if per_layer:
        stats = jax.tree.map(lambda *s: sum(s) / len(s), *per_layer)
    return self.final_norm(x), stats


def param_count(config: LlamaConfig) -> int:
  """The number of parameters of `Llama(config)`, computed from the sizes.

  Example:
    >>> param_count(LlamaConfig(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64))
    25696
  """
  return _param_count(config, active=False)


def _param_count(config: LlamaConfig, active: bool) -> int:
  """All parameters, or (`active`) those one token uses: a routed layer's top-k experts only."""
  d, f, hd = config.d_model, config.d_ff, config.head_dim
  attention = 2 * d * config.num_heads * hd + 2 * d * config.num_kv_heads * hd
  if config.qkv_bias:
    attention += (config.num_heads + 2 * config.num_kv_heads) * hd
  layers = config.num_layers * (attention + 2 * d)  # + two RMSNorm scales
  routed = sum(config.routed_layer(i) for i in range(config.num_layers))
  layers += (config.num_layers - routed) * 3 * d * f
  if routed:
    count = moe.active_params if active else moe.total_params
    layers += routed * count(config.moe_config)
  embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
  return embeddings + layers + d


def flops_per_token(config: LlamaConfig, adapter_params: int | None = None) -> float:
  """Training FLOPs per token (forward + backward), PaLM's accounting, for MFU.

  `6 * N + 12 * num_layers * d_model * seq_len` (PaLM, Chowdhery et al. 2022,
  appendix B): N counts the parameters that take part in matmuls, i.e.
  every parameter except the token embedding table (a lookup), plus the
  output projection's `d_model * vocab` whether tied or not (the tied table
  is still multiplied). 2 FLOPs per parameter forward, 4 backward; the
  attention scores and weighted sum cost 12 * d_model * seq_len per layer
  (heads * head_dim = d_model; the full square, causal masking not
  subtracted; grouped-query attention saves no attention FLOPs). Norms,
  RoPE, softmax and SiLU are not counted.

  With routed layers (`moe_experts`) N counts the *active* parameters: the
  router, the `moe_top_k` experts a token takes and the shared expert, so
  MFU is on the FLOPs done; the dispatch's sort and gathers are not counted.

  With LoRA (`adapter_params`: the adapters' A and B, which alone train) no
  weight gradient of a frozen matrix is computed (the model adds
  `s (x A) B` itself, `applies_lora`): 2 FLOPs per matmul parameter forward
  and 2 for the input gradient, 6 per adapter parameter, and the attention
  as before (its backward is all input gradients).

  Example:
    >>> config = LlamaConfig(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
    ...                      seq_len=16)
    >>> flops_per_token(config)  # 6 * (25696 - 256 * 32) + 12 * 1 * 32 * 16
    111168.0
    >>> flops_per_token(config, adapter_params=1000)  # 4 * 17504 + 6 * 1000 + 6144
    82160.0
  """
  output = config.d_model * config.vocab_size
  non_embedding = (
    _param_count(config, active=True) - output * (1 if config.tie_embeddings else 2) + output
  )
  attention = 12 * config.num_layers * config.d_model * config.seq_len
  if adapter_params is not None:
    return float(4 * non_embedding + 6 * adapter_params + attention)
  return float(6 * non_embedding + attention)
