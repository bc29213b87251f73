"""The TPU decode kernel (`trainers.models.decode_attention`), run in Pallas interpret mode:
it computes what XLA's cached attention computes, bit for bit, over ragged rows; and
`generate_batch` through it makes the tokens the XLA path makes, each row its prompt's alone."""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from trainers.models import attention, decode, decode_attention, decode_batch, llama


def test_the_kernel_equals_xlas_cached_attention_bit_for_bit_over_ragged_rows():
  layers, batch, kv_heads, max_len, head_dim, heads = 2, 8, 2, 32, 128, 6
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  shape = (layers, batch, kv_heads, max_len, head_dim)
  cache = decode.KVCache(
    jax.random.normal(k1, shape).astype(jnp.bfloat16),
    jax.random.normal(k2, shape).astype(jnp.bfloat16),
  )
  q = jax.random.normal(k3, (batch, 1, heads, head_dim)).astype(jnp.bfloat16)
  starts = jnp.array([0, 3, 0, 7, 1, 0, 2, 20], jnp.int32)
  for layer, index in ((1, 20), (0, 31)):
    want = decode._attend(q, cache, layer, jnp.int32(index), starts)  # XLA's, on a CPU
    got = decode_attention.decode_attention(
      q[:, 0], cache.keys, cache.values, layer, index, starts, interpret=True
    )
    assert got.dtype == want.dtype and bool((got == want[:, 0]).all()), (layer, index)


@pytest.mark.slow
def test_generate_batch_through_the_kernel_makes_xlas_tokens_each_row_as_alone(monkeypatch):
  """Decodes 16 ragged rows (the kernel's least batch) with the kernel forced, as on a TPU."""
  config = llama.LlamaConfig(
    vocab_size=96, seq_len=16, num_layers=2, d_model=512, num_heads=4, num_kv_heads=2, d_ff=64,
    dtype="bfloat16",
  )  # fmt: skip
  model = llama.Llama(config, rngs=nnx.Rngs(1))
  prompts = [[(7 * row + t) % 96 for t in range(1 + row % 5)] for row in range(16)]
  xla = decode_batch.generate_batch(model, prompts, 4, max_len=16)
  monkeypatch.setattr(attention, "current_platform", lambda: "tpu")
  kernel = functools.partial(decode_attention.decode_attention, interpret=True)
  monkeypatch.setattr(decode_attention, "decode_attention", kernel)
  chosen = []
  real = decode._use_kernel
  monkeypatch.setattr(decode, "_use_kernel", lambda *a: chosen.append(real(*a)) or chosen[-1])
  jax.clear_caches()  # the programs compiled above took XLA's path: trace them again
  try:
    through = decode_batch.generate_batch(model, prompts, 4, max_len=16)
    assert True in chosen  # the decode steps (one query a row) took the kernel
    assert through.tokens.tolist() == xla.tokens.tolist()
    alone = decode_batch.generate_batch(model, [prompts[3]], 4, max_len=16)  # XLA's path
    assert alone.tokens[0].tolist() == through.tokens[3].tolist()
  finally:
    jax.clear_caches()  # no later test reuses a program traced with the kernel forced


def test_the_kernel_takes_one_query_a_row_at_16_rows_or_more_and_blocks_that_fit():
  ok = (16, 1, 12, 128), (16, 16, 4, 320, 128)
  assert decode_attention.supported(*ok, 2)
  assert not decode_attention.supported((8, 1, 12, 128), (16, 8, 4, 320, 128), 2)  # few rows
  assert not decode_attention.supported((16, 4, 12, 128), ok[1], 2)  # a prefill
  assert not decode_attention.supported((16, 1, 12, 64), (16, 16, 4, 320, 64), 2)  # head_dim
  assert not decode_attention.supported((16, 1, 64, 128), (1, 16, 8, 32768, 128), 2)  # VMEM
