"""The kernels as the chip compiles them: splash by Mosaic, the chunked loss, bf16 dots.

On a CPU these run in Pallas interpret mode or through the CPU compiler
(tests/test_attention.py, tests/test_chunked_loss.py, tests/test_precision.py);
here they are compiled for the TPU. Errors are normwise relative,
||a - b|| / ||b||, and each bound says why it is what it is:

- float32 under `jax.default_matmul_precision("highest")`: `F32_BOUND` = 1e-4.
  Interpret mode agrees to about 3e-7; on the chip the kernel's blockwise
  (online) softmax and its backward pass run on the TPU's own units, and its
  gradients agree to about 3e-5, so the bound is looser than the CPU test's
  1e-5, and still forty times tighter than one bfloat16 rounding.
- bfloat16, at the default precision: `BF16_BOUND` = 1e-2, the CPU test's: both kernels read bfloat16
  inputs and write a bfloat16 output (2^-8 = 3.9e-3 relative per rounding);
  interpret mode measured 2.8e-3 to 4.2e-3.

Each test prints its errors (`pytest -s`, or the report of `make test-tpu`).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers.models.attention import attend
from trainers.tasks import cross_entropy_sums
from trainers.tasks.losses import chunked_cross_entropy_sums

F32_BOUND = 1e-4
BF16_BOUND = 1e-2
# Rows, tokens, query heads over key/value heads (grouped-query), head_dim.
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 1024, 8, 2, 128


def _relative(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _attention_inputs(dtype, packed: bool):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (BATCH, LENGTH, HEADS, HEAD_DIM), jnp.float32)
  k = jax.random.normal(keys[1], (BATCH, LENGTH, KV_HEADS, HEAD_DIM), jnp.float32)
  v = jax.random.normal(keys[2], (BATCH, LENGTH, KV_HEADS, HEAD_DIM), jnp.float32)
  cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
  ids = None
  if packed:  # three documents in the first row, one in the second
    first = np.repeat([1, 2, 3], [300, 500, LENGTH - 800])
    ids = jnp.asarray(np.stack([first, np.ones(LENGTH, int)]), jnp.int32)
  cast = lambda x: x.astype(dtype)  # noqa: E731
  return cast(q), cast(k), cast(v), cast(cotangent), ids


def _forward_and_gradients(kernel: str, q, k, v, cotangent, ids):
  """The output and the q, k, v gradients of `attend` with `kernel`, compiled for the chip."""
  attend_jit = jax.jit(lambda q, k, v: attend(q, k, v, ids, kernel=kernel))
  out, pullback = jax.vjp(attend_jit, q, k, v)
  return (out, *pullback(cotangent)), attend_jit.lower(q, k, v).as_text()


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "segment_ids"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splash_compiled_by_mosaic_matches_xla_forward_and_gradients(dtype, packed):
  bound = F32_BOUND if dtype == "float32" else BF16_BOUND
  # "highest" asks float32 products of float32 inputs; for bfloat16 inputs the
  # chip's own bfloat16 products are the point (and Mosaic refuses a
  # bfloat16 kernel asked for "highest": "Bad lhs type").
  precision = "highest" if dtype == "float32" else "default"
  with jax.default_matmul_precision(precision):
    inputs = _attention_inputs(jnp.dtype(dtype), packed)
    splash, splash_text = _forward_and_gradients("splash", *inputs)
    xla, xla_text = _forward_and_gradients("xla", *inputs)
  # Splash is a Mosaic kernel on the chip (a TPU custom call), not interpret mode.
  assert "tpu_custom_call" in splash_text and "tpu_custom_call" not in xla_text
  errors = {
    name: _relative(s, x) for name, s, x in zip(("out", "dq", "dk", "dv"), splash, xla, strict=True)
  }
  print(f"splash vs xla, {dtype}, {'segment ids' if packed else 'unpacked'}: {errors}")
  assert all(s.dtype == jnp.dtype(dtype) for s in splash), [s.dtype for s in splash]
  assert max(errors.values()) < bound, (errors, bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_chunked_loss_matches_the_plain_loss_and_its_gradients(dtype):
  """Logits chunk by chunk (never the whole [rows, length, vocab]) against all at once.

  Both accumulate the logits in float32 from the same inputs, so they differ
  only in the order of the sums: 1e-5 of the loss, 1e-4 of the gradients.
  In bfloat16 the gradients come back in bfloat16, the inputs' dtype: one
  rounding each, 2^-8 = 3.9e-3 at most (the chip measured 8.4e-4).
  """
  rows, length, d_model, vocab = 4, 512, 256, 8192
  keys = jax.random.split(jax.random.key(1), 3)
  hidden = jax.random.normal(keys[0], (rows, length, d_model)).astype(dtype)
  unembed = (jax.random.normal(keys[1], (d_model, vocab)) * d_model**-0.5).astype(dtype)
  labels = jax.random.randint(keys[2], (rows, length), 0, vocab)
  mask = jnp.ones((rows, length)).at[:, -7:].set(0.0)

  def chunked(hidden, unembed):
    return chunked_cross_entropy_sums(hidden, unembed, labels, mask, chunk=128)[0]

  def plain(hidden, unembed):
    logits = jnp.einsum("bld,dv->blv", hidden, unembed, preferred_element_type=jnp.float32)
    return cross_entropy_sums(logits, labels, mask)[0]

  with jax.default_matmul_precision("highest"):
    got, got_grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, unembed)
    want, want_grads = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(hidden, unembed)
  errors = {
    "loss": _relative(got, want),
    "d_hidden": _relative(got_grads[0], want_grads[0]),
    "d_unembed": _relative(got_grads[1], want_grads[1]),
  }
  print(f"chunked vs plain loss, {dtype}: {errors}")
  assert errors["loss"] < 1e-5, errors
  gradient_bound = 1e-4 if dtype == "float32" else 2**-8
  assert max(errors["d_hidden"], errors["d_unembed"]) < gradient_bound, errors


_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[", re.M)
_MATMUL = re.compile(
  r"%([\w.\-]+)\s*=\s*(\w+)\[.*?\s(dot|convolution)\(%([\w.\-]+),\s*%([\w.\-]+)\)"
)


def _compiled_matmuls(hlo_text: str) -> list[tuple[str, str, str, str]]:
  """(name, result, lhs, rhs) dtypes of each dot and convolution in optimised HLO text.

  Optimised TPU HLO names operands without their types: each is looked up
  where it is defined (names are unique in a module).
  """
  dtypes = dict(_DEFINITION.findall(hlo_text))
  return [
    (name, out, dtypes.get(lhs, "?"), dtypes.get(rhs, "?"))
    for name, out, _, lhs, rhs in _MATMUL.findall(hlo_text)
  ]


def test_the_precision_policy_leaves_bf16_dots_in_the_chips_compiled_step():
  """llama_tiny's train step under `train.precision="bfloat16"`, compiled by libtpu for the chip.

  The CPU test reads the lowered program (the CPU's compiler may widen
  bfloat16 again); here the chip's own optimised HLO is read: its weight
  matmuls, forward and backward, take bfloat16 operands. The model
  accumulates two products in float32 (the attention scores and the
  logits), so up to 2 per layer + 2 may stay float32.
  """
  from configs import llama_tiny
  from spmd.layout import batch_sharding
  from trainers.step.loss import abstract_batch
  from trainers.step.mesh import build_mesh
  from trainers.step.state import make_state
  from trainers.step.train_step import make_train_step
  from trainers.tasks import make_task

  config = llama_tiny.get_config()
  config.train.precision = "bfloat16"
  config.model.attention = "xla"  # splash's matmuls are inside its kernel, not HLO dots
  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  step = make_train_step(setup, task, config, mesh, axes)
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  batch = abstract_batch(task, config.global_batch, batch_sharding(mesh, axes))
  compiled = step.lower(state, batch).compile()
  assert compiled.as_text() and jax.devices()[0].platform == "tpu"
  found = _compiled_matmuls(compiled.as_text())
  bf16 = [m for m in found if m[2:] == ("bf16", "bf16")]
  f32 = [m for m in found if "f32" in m[2:]]
  print(f"compiled matmuls: {len(found)}, bf16 x bf16: {len(bf16)}, with f32: {len(f32)}")
  assert found, compiled.as_text()[:3000]
  assert len(bf16) >= 0.75 * len(found), found
  assert len(f32) <= 2 * config.model.num_layers + 2, found


@pytest.mark.parametrize(
  "precision",
  ["default", "bfloat16", "high", "tensorfloat32", "highest", "float32"],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_attention_compiles_under_every_matmul_precision(dtype, precision):
  """`model.attention="auto"` compiles forward and backward for the chip under each precision.

  Where `choose_kernel` takes splash, Mosaic must compile it (a float32
  splash under "high" failed with `Unsupported dot precision: HIGH` while
  auto still chose it); where it takes XLA, XLA's einsums compile.
  """
  from trainers.models.attention import choose_kernel

  q = jnp.zeros((1, LENGTH, HEADS, HEAD_DIM), dtype)
  kv = jnp.zeros((1, LENGTH, KV_HEADS, HEAD_DIM), dtype)
  with jax.default_matmul_precision(precision):
    chosen = choose_kernel(
      "auto", platform="tpu", length=LENGTH, dtype=jnp.dtype(dtype), segments=False
    )

    def loss(q, k, v):
      return attend(q, k, v, kernel="auto").astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv)
    lowered.compile()  # Mosaic compiles splash's kernels here, or fails
  print(f"{dtype} under {precision!r}: {chosen.describe()}")
  assert ("tpu_custom_call" in lowered.as_text()) == (chosen.kernel == "splash"), chosen


def test_the_routed_mlp_with_megablox_kernels_matches_xla_ragged_dot_on_the_chip():
  """A routed MLP's output and gradients with megablox's gmm and tgmm, compiled by
  Mosaic, against XLA's ragged dot on the chip, in bfloat16 at uneven, tile-crossing
  group sizes (a router's real choices). Both multiply the same bfloat16 rows and
  weights and sum in float32, so they differ by the output's bfloat16 rounding."""
  from flax import nnx

  from trainers.models import moe

  config = moe.MoEConfig(d_model=512, num_experts=8, top_k=2, d_ff=1024)
  graphdef, params = nnx.split(moe.MoE(config, rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(1), (4, 2048, 512), jnp.bfloat16)

  def loss(params, x):
    y, stats = nnx.merge(graphdef, params).routed(x)
    return jnp.sum(y.astype(jnp.float32) ** 2) + stats.load_balancing_loss

  got = {}
  for weights, rows in (("xla", "xla"), ("tgmm", "gmm")):
    with moe._kernel(weights, rows=rows):
      step = jax.jit(jax.value_and_grad(loss))
      text = step.lower(params, x).as_text()
      assert ("tpu_custom_call" in text) == (rows == "gmm"), rows
      got[rows] = step(params, x)
  errors = {
    jax.tree_util.keystr(path): _relative(a, b)
    for (path, a), b in zip(
      jax.tree_util.tree_leaves_with_path(got["gmm"]), jax.tree.leaves(got["xla"])
    )
  }
  print("megablox vs XLA's ragged dot, normwise relative:", errors)
  assert max(errors.values()) < BF16_BOUND, errors
