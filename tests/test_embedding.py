"""`trainers.models.embedding.lookup`: the same rows and gradients on every mesh and preset.

Whether a layout makes XLA copy whole arrays is tests/test_layout_fallbacks.py's job;
here the numbers: the shard_map lookup equals the plain gather, forward and
backward, ids outside the table give zeros, and a bf16 table's gradient is
summed in float32.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd import rules
from spmd.mesh import create_mesh
from trainers.models import embedding

MESHES = ["data=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2", "data=1,fsdp=2,tensor=4"]


def _inputs():
  table = jax.random.normal(jax.random.key(0), (64, 16))
  ids = jax.random.randint(jax.random.key(1), (8, 12), -3, 70)  # some out of range
  weights = jax.random.normal(jax.random.key(2), (8, 12, 16))
  return table, ids, weights


def _loss(table, ids, weights):
  return jnp.sum(embedding.lookup(table, ids) * weights)


def test_ids_outside_the_table_look_up_zeros_negative_ones_included():
  table, ids, _ = _inputs()
  inside = (ids >= 0) & (ids < 64)
  expected = jnp.where(inside[..., None], table[jnp.clip(ids, 0, 63)], 0.0)
  np.testing.assert_array_equal(embedding.lookup(table, ids), expected)


def _cases():
  for ici in MESHES:
    for rules_name in sorted(rules.PRESETS):
      fast = (ici, rules_name) in {("data=2,fsdp=2,tensor=2", "fsdp_tp"), ("data=2,fsdp=4", "fsdp")}
      yield pytest.param(ici, rules_name, marks=() if fast else (pytest.mark.slow,))


@pytest.mark.parametrize("ici,rules_name", list(_cases()))
def test_the_laid_out_lookup_equals_the_plain_one_forward_and_backward(ici, rules_name):
  table, ids, weights = _inputs()
  value, grad = jax.value_and_grad(_loss)(table, ids, weights)
  mesh = create_mesh(ici)
  with rules.activation_rules(rules.preset(rules_name), mesh):
    laid_out = jax.jit(jax.value_and_grad(_loss))
    text = laid_out.lower(table, ids, weights).as_text()
    sharded_value, sharded_grad = laid_out(table, ids, weights)
  if rules_name != "dp" and "fsdp=1" not in ici and "data=8" not in ici:
    assert "all_gather" in text  # the FSDP-split table is gathered, not left to XLA
  np.testing.assert_allclose(sharded_value, value, rtol=1e-5)
  np.testing.assert_allclose(sharded_grad, grad, rtol=1e-5, atol=1e-6)


def test_a_bf16_tables_gradient_is_summed_in_float32():
  # 4096 occurrences of one id, each adding 1 + 2**-8: in bf16 the running sum
  # stops growing long before the end; summed in float32 and rounded once it
  # is the nearest bf16 to 4096 * (1 + 2**-8) = 4112.
  table = jnp.zeros((4, 2), jnp.bfloat16)
  ids = jnp.zeros((64, 64), jnp.int32)
  grad = jax.grad(lambda t: jnp.sum(embedding.lookup(t, ids).astype(jnp.float32) * (1 + 2**-8)))(
    table
  )
  assert grad.dtype == jnp.bfloat16
  assert float(grad[0, 0]) == float(jnp.bfloat16(4096 * (1 + 2**-8)))


def test_ids_fewer_than_the_batch_axes_are_looked_up_whole_on_every_device():
  """A micro-batch of 3 rows on data=2,fsdp=4 (train.micro_batches): the rows stay whole."""
  table, ids, weights = _inputs()
  ids, weights = ids[:3], weights[:3]
  value, grad = jax.value_and_grad(_loss)(table, ids, weights)
  with rules.activation_rules(rules.preset("fsdp"), create_mesh("data=2,fsdp=4")):
    sharded_value, sharded_grad = jax.jit(jax.value_and_grad(_loss))(table, ids, weights)
  np.testing.assert_allclose(sharded_value, value, rtol=1e-5)
  np.testing.assert_allclose(sharded_grad, grad, rtol=1e-5, atol=1e-6)


def test_on_data_2_fsdp_4_a_bf16_tables_gradient_is_reduced_across_devices_in_float32():
  """As the bf16 policy runs it: a float32 table cast to bf16 inside the differentiated loss."""
  table, ids, weights = _inputs()

  def loss(table, ids, weights):
    return _loss(table.astype(jnp.bfloat16), ids, weights.astype(jnp.bfloat16).astype(jnp.float32))

  mesh = create_mesh("data=2,fsdp=4")
  with rules.activation_rules(rules.preset("fsdp"), mesh):
    step = jax.jit(jax.grad(loss))
    text = step.lower(table, ids, weights).as_text(dialect="hlo")
    grad = step(table, ids, weights)
  reductions = re.findall(r"= (\w+)\[[^\]]*\]\S* (reduce-scatter|all-reduce)\(", text)
  # The columns' all-gather goes back as a reduce-scatter over fsdp, the rows'
  # gradient adds up over data: both in float32, rounded to bf16 once after.
  assert {kind for _, kind in reductions} >= {"reduce-scatter"}, reductions
  assert {dtype for dtype, _ in reductions} == {"f32"}, reductions
  want = jax.grad(loss)(table, ids, weights)
  np.testing.assert_allclose(grad, want, rtol=1e-2, atol=1e-2)
