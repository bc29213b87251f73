"""Attention kernels: splash (Pallas interpret mode on CPU) equals XLA's einsums, forward
and gradients, with and without packed segments, with grouped-query heads, also placed
on a mesh; the kernel each platform gets; the models run it.

Tolerances. float32: the forward pass agrees element-wise at rtol 1e-5; the
gradients by normwise relative error <= 1e-5 and element-wise within 1e-5 of
the largest gradient (the kernel sums its blocks in another order, so a
gradient near zero can differ by more than 1e-5 of itself). bfloat16 inputs:
both kernels compute the scores and softmax in float32 from the same bf16
operands and round their results to bf16, so they differ by bf16 rounding,
about as much as each differs from the float32 result: normwise <= 1e-2,
forward and gradients, and element-wise within 1e-2 of the largest gradient.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd import rules
from spmd.mesh import create_mesh
from trainers.models import attention, llama
from trainers.models import transformer as lm

LENGTH, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 8
BLOCK = 128  # two blocks per sequence: a skipped block, partial blocks and a full one


def _qkv(batch: int, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, LENGTH, HEADS, HEAD_DIM), dtype)
  k = jax.random.normal(keys[1], (batch, LENGTH, KV_HEADS, HEAD_DIM), dtype)
  v = jax.random.normal(keys[2], (batch, LENGTH, KV_HEADS, HEAD_DIM), dtype)
  cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
  return q, k, v, cotangent


def _segments(batch: int) -> jax.Array:
  """Documents whose boundaries cross the blocks, and padding (0) at the end of row 0."""
  rows = [[1] * 100 + [2] * 110 + [3] * 30 + [0] * 16, [1] * 150 + [2] * 106]
  return jnp.asarray((rows * batch)[:batch], jnp.int32)


def _value_and_grads(fn, q, k, v, cotangent):
  """(output, gradients of <output, cotangent> wrt q, k, v), jitted."""

  def weighted(q, k, v):
    y = fn(q, k, v)
    return jnp.sum(y.astype(jnp.float32) * cotangent), y

  return jax.jit(jax.value_and_grad(weighted, argnums=(0, 1, 2), has_aux=True))(q, k, v)


def _normwise(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check_f32(splash_result, xla_result):
  (_, y_splash), grads_splash = splash_result
  (_, y_xla), grads_xla = xla_result
  np.testing.assert_allclose(y_splash, y_xla, rtol=1e-5, atol=1e-6)
  for name, got, want in zip("qkv", grads_splash, grads_xla):
    assert _normwise(got, want) <= 1e-5, (name, _normwise(got, want))
    largest = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * largest, err_msg=name)


@pytest.mark.slow
def test_splash_equals_xla_with_grouped_heads_unpacked():
  q, k, v, cotangent = _qkv(batch=1)
  mask = attention.causal_mask(None, LENGTH)
  splash = _value_and_grads(
    lambda q, k, v: attention.splash_attention(q, k, v, block=BLOCK, interpret=True),
    q,
    k,
    v,
    cotangent,
  )
  xla = _value_and_grads(lambda q, k, v: attention.xla_attention(q, k, v, mask), q, k, v, cotangent)
  _check_f32(splash, xla)


@pytest.mark.slow
def test_splash_on_a_mesh_equals_xla_with_packed_segments_and_grouped_heads():
  # Rows over data, heads (and their key/value heads) over tensor: each of the
  # 8 devices runs the kernel on one row and two query heads reading one
  # key/value head, through shard_map.
  mesh = create_mesh("data=4,tensor=2")
  q, k, v, cotangent = _qkv(batch=4)
  ids = _segments(batch=4)
  mask = attention.causal_mask(ids, LENGTH)
  with rules.activation_rules(rules.FSDP_TP, mesh):
    splash = _value_and_grads(
      lambda q, k, v: attention.splash_attention(q, k, v, ids, block=BLOCK, interpret=True),
      q,
      k,
      v,
      cotangent,
    )
  xla = _value_and_grads(lambda q, k, v: attention.xla_attention(q, k, v, mask), q, k, v, cotangent)
  assert splash[0][1].sharding.spec == jax.sharding.PartitionSpec("data", None, "tensor")
  _check_f32(splash, xla)


@pytest.mark.slow
def test_splash_in_bfloat16_agrees_with_xla_to_bf16_rounding():
  q, k, v, cotangent = _qkv(batch=1, dtype=jnp.bfloat16)
  ids = _segments(batch=1)
  mask = attention.causal_mask(ids, LENGTH)
  (_, y_splash), g_splash = _value_and_grads(
    lambda q, k, v: attention.splash_attention(q, k, v, ids, block=BLOCK, interpret=True),
    q,
    k,
    v,
    cotangent,
  )
  (_, y_xla), g_xla = _value_and_grads(
    lambda q, k, v: attention.xla_attention(q, k, v, mask), q, k, v, cotangent
  )
  assert y_splash.dtype == jnp.bfloat16
  assert _normwise(y_splash, y_xla) <= 1e-2, _normwise(y_splash, y_xla)
  for name, got, want in zip("qkv", g_splash, g_xla):
    assert _normwise(got, want) <= 1e-2, (name, _normwise(got, want))
    largest = float(np.abs(np.asarray(want, np.float32)).max())
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=1e-2 * largest
    )


def test_each_platform_gets_its_kernel_and_falls_back_saying_why():
  def choose(requested, platform, length=8192, dtype=jnp.bfloat16, segments=False):
    return attention.choose_kernel(
      requested, platform=platform, length=length, dtype=dtype, segments=segments
    )

  assert choose("auto", "tpu").kernel == "splash" and choose("auto", "tpu").block == 1024
  assert choose("auto", "tpu", length=1536).block == 512
  assert choose("auto", "tpu", length=384).block == 128
  assert choose("auto", "tpu", dtype=jnp.float32).block == 512  # 1024 is out of VMEM
  assert choose("auto", "gpu").kernel == "cudnn"
  assert choose("auto", "cpu").kernel == "xla"
  short = choose("auto", "tpu", length=100)
  assert short.kernel == "xla" and "not a multiple of 128" in short.describe()
  packed = choose("cudnn", "gpu", segments=True)
  assert packed.kernel == "xla" and "segment ids" in packed.reason
  assert choose("auto", "gpu", dtype=jnp.float32).kernel == "xla"
  odd_heads = attention.choose_kernel(
    "auto", platform="gpu", length=512, dtype=jnp.bfloat16, segments=False, head_dim=12
  )
  assert odd_heads.kernel == "xla" and "head_dim" in odd_heads.reason
  assert choose("cudnn", "cpu").kernel == "xla"
  interpreted = choose("splash", "cpu")
  assert interpreted.kernel == "splash" and interpreted.interpret
  assert choose("xla", "tpu").kernel == "xla"
  with pytest.raises(ValueError, match="model.attention='flash' is not one of"):
    llama.LlamaConfig(attention="flash")
  with pytest.raises(ValueError, match="model.attention='flash' is not one of"):
    lm.TransformerConfig(attention="flash")


def test_splash_refuses_rules_that_split_the_sequence():
  mesh = create_mesh("data=4,tensor=2")
  sequence_split = (("length", "tensor"), *(r for r in rules.FSDP if r[0] != "length"))
  q, k, v, _ = _qkv(batch=4)
  with rules.activation_rules(sequence_split, mesh):
    with pytest.raises(ValueError, match="splits rows and heads only"):
      attention.splash_attention(q, k, v, interpret=True)


@pytest.mark.slow
def test_both_decoders_give_the_same_logits_with_splash_as_with_xla():
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 128)), jnp.int32)
  ids = jnp.asarray([[1] * 70 + [2] * 58, [1] * 128], jnp.int32)
  positions = jnp.concatenate([jnp.arange(70), jnp.arange(58)])[None].repeat(2, 0)
  sizes = dict(vocab_size=64, seq_len=128, num_layers=1, d_model=32, num_heads=4, d_ff=48)
  for make in (
    lambda kernel: llama.Llama(
      llama.LlamaConfig(**sizes, num_kv_heads=2, attention=kernel), rngs=nnx.Rngs(0)
    ),
    lambda kernel: lm.TransformerLM(
      lm.TransformerConfig(**sizes, attention=kernel), rngs=nnx.Rngs(0)
    ),
  ):
    with attention.recorded_choices() as choices:
      splash = make("splash")(tokens, ids, positions)
    xla = make("xla")(tokens, ids, positions)
    assert [c.kernel for c in choices] == ["splash"] and choices[0].interpret
    np.testing.assert_allclose(splash, xla, rtol=1e-5, atol=1e-5)


def test_under_a_matmul_precision_splash_cannot_take_auto_picks_xla_and_splash_is_an_error():
  def choose(requested, dtype=jnp.bfloat16):
    return attention.choose_kernel(
      requested, platform="tpu", length=1024, dtype=dtype, segments=True
    )

  assert choose("auto").kernel == "splash"
  with jax.default_matmul_precision("bfloat16"):  # one bf16 pass: what splash computes
    assert choose("auto").kernel == "splash"
  for precision in ("highest", "float32", "high"):
    with jax.default_matmul_precision(precision):
      picked = choose("auto")
      assert picked.kernel == "xla", precision
      assert f"jax_default_matmul_precision={precision!r}" in picked.describe()
      with pytest.raises(
        ValueError, match=rf"model.attention='splash' .*jax_default_matmul_precision='{precision}'"
      ) as raised:
        choose("splash")
      assert "\n" not in str(raised.value)


def test_float32_splash_only_under_the_precisions_mosaic_compiles_for_it():
  """Float32 inputs: Mosaic compiles one pass ("default") and full float32 ("highest"), not HIGH.

  Under "high" or "tensorfloat32" (three bf16 passes) the chip's compile
  failed with `Unsupported dot precision: HIGH`, yet auto chose splash.
  """

  def choose(requested):
    return attention.choose_kernel(
      requested, platform="tpu", length=1024, dtype=jnp.float32, segments=False
    )

  for precision in (None, "default", "bfloat16", "highest", "float32"):
    with jax.default_matmul_precision(precision):
      assert choose("auto").kernel == "splash", precision
      assert choose("splash").kernel == "splash", precision
  for precision in ("high", "tensorfloat32", "BF16_BF16_F32_X3"):
    with jax.default_matmul_precision(precision):
      picked = choose("auto")
      assert picked.kernel == "xla", precision
      assert f"jax_default_matmul_precision={precision!r}" in picked.describe()
      with pytest.raises(ValueError, match=rf"model.attention='splash' .*'{precision}'"):
        choose("splash")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_every_precision_the_splash_error_offers_is_one_jax_accepts(dtype):
  """The error's list of precisions is advice a user copies: each must be a value JAX takes."""
  with jax.default_matmul_precision("tensorfloat32"), pytest.raises(ValueError) as raised:
    attention.choose_kernel("splash", platform="tpu", length=1024, dtype=dtype, segments=False)
  offered = re.search(r"matmuls in \(([^)]*)\)", str(raised.value)).group(1).split(", ")
  refused = []
  for precision in offered:
    try:
      with jax.default_matmul_precision(precision):
        pass
    except ValueError:
      refused.append(precision)
  assert offered and not refused, f"{str(raised.value)!r} offers {refused}, which JAX refuses"
