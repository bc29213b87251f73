"""A small decoder-only language model, written plainly with `flax.nnx`.

Pre-norm blocks of RMSNorm, causal self-attention (rotary position
embeddings, or none) and a SwiGLU MLP; a final RMSNorm, then logits through
the token embedding (tied) or a separate output layer (untied). No biases.

Parameters name their logical axes with `nnx.with_partitioning` ("embed",
"mlp", "heads", "vocab", "norm": `spmd.rules.LOGICAL_AXES`), so the
harness's `config.mesh.rules` preset decides the layout: FSDP by default,
tensor parallelism with "fsdp_tp", with no change here. `eager_sharding=False`
because the names are logical, not mesh axes: the trainer places the values,
and the model can still be built bare, as below.

  >>> import jax.numpy as jnp
  >>> model = DecoderLM(vocab_size=256, d_model=32, num_layers=1, num_heads=2, d_ff=64,
  ...                   rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 8), jnp.int32)).shape
  (2, 8, 256)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _init(initializer, *axes: str):
  return nnx.with_partitioning(initializer, axes, eager_sharding=False)


def _dense(d_in: int, d_out: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(
    d_in,
    d_out,
    use_bias=False,
    kernel_init=_init(nnx.initializers.lecun_normal(), *axes),
    rngs=rngs,
  )


def _rms_norm(dim: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(dim, scale_init=_init(nnx.initializers.ones, "norm"), rngs=rngs)


def rotary(x: jax.Array) -> jax.Array:
  """Rotary position embedding of `x` [batch, length, heads, head_dim] (head_dim even)."""
  length, half = x.shape[1], x.shape[-1] // 2
  frequencies = 10_000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * frequencies  # [length, half]
  sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
  first, second = x[..., :half], x[..., half:]
  return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


class Attention(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, use_rotary: bool, *, rngs: nnx.Rngs):
    if d_model % num_heads or (use_rotary and (d_model // num_heads) % 2):
      raise ValueError(f"d_model={d_model} must split into num_heads={num_heads} even heads")
    self.num_heads, self.use_rotary = num_heads, use_rotary
    self.query = _dense(d_model, d_model, ("embed", "heads"), rngs)
    self.key = _dense(d_model, d_model, ("embed", "heads"), rngs)
    self.value = _dense(d_model, d_model, ("embed", "heads"), rngs)
    self.out = _dense(d_model, d_model, ("heads", "embed"), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, d_model = x.shape
    shape = (batch, length, self.num_heads, d_model // self.num_heads)
    q, k, v = (proj(x).reshape(shape) for proj in (self.query, self.key, self.value))
    if self.use_rotary:
      q, k = rotary(q), rotary(k)
    causal = jnp.tril(jnp.ones((length, length), bool))
    return self.out(jax.nn.dot_product_attention(q, k, v, mask=causal).reshape(x.shape))


class SwiGLU(nnx.Module):
  def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs):
    self.gate = _dense(d_model, d_ff, ("embed", "mlp"), rngs)
    self.up = _dense(d_model, d_ff, ("embed", "mlp"), rngs)
    self.down = _dense(d_ff, d_model, ("mlp", "embed"), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  def __init__(self, d_model: int, num_heads: int, d_ff: int, use_rotary: bool, *, rngs):
    self.attn_norm = _rms_norm(d_model, rngs)
    self.attn = Attention(d_model, num_heads, use_rotary, rngs=rngs)
    self.mlp_norm = _rms_norm(d_model, rngs)
    self.mlp = SwiGLU(d_model, d_ff, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nnx.Module):
  """Token ids [batch, length] -> float32 logits [batch, length, vocab_size]."""

  def __init__(
    self,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    d_ff: int,
    *,
    rotary: bool = True,
    tie_embeddings: bool = True,
    rngs: nnx.Rngs,
  ):
    self.embed = nnx.Embed(
      vocab_size,
      d_model,
      embedding_init=_init(nnx.initializers.normal(0.02), "vocab", "embed"),
      rngs=rngs,
    )
    # nnx.List: a plain list of modules is not part of the model's state.
    self.blocks = nnx.List(
      [Block(d_model, num_heads, d_ff, rotary, rngs=rngs) for _ in range(num_layers)]
    )
    self.final_norm = _rms_norm(d_model, rngs)
    self.unembed = None if tie_embeddings else _dense(d_model, vocab_size, ("embed", "vocab"), rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.unembed is None else self.unembed(x)
    return logits.astype(jnp.float32)
