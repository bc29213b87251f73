"""The chunked cross-entropy equals the plain one, loss and gradients, for the built-in
decoders' task losses too, and its compiled step never holds the whole logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd import rules
from spmd.mesh import create_mesh
from trainers.models import llama
from trainers.models import transformer as lm
from trainers.tasks import cross_entropy_sums, losses
from trainers.tasks import llama as llama_task
from trainers.tasks import lm as lm_task


def _inputs(batch=2, length=24, d=16, vocab=300, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(0), 4)
  hidden = jax.random.normal(keys[0], (batch, length, d), dtype)
  unembed = (jax.random.normal(keys[1], (d, vocab)) / 4).astype(dtype)
  labels = jax.random.randint(keys[2], (batch, length), 0, vocab)
  mask = (jax.random.uniform(keys[3], (batch, length)) > 0.25).astype(jnp.float32)
  return hidden, unembed, labels, mask


def _plain(hidden, unembed, labels, mask):
  logits = jnp.einsum("bld,dv->blv", hidden, unembed, preferred_element_type=jnp.float32)
  return cross_entropy_sums(logits, labels, mask)


def _loss_and_grads(loss, hidden, unembed, labels, mask):
  def total(hidden, unembed):
    loss_sum, weight, sums = loss(hidden, unembed, labels, mask)
    return loss_sum, (weight, sums["accuracy"])

  return jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))(hidden, unembed)


@pytest.mark.parametrize("chunk", [1, 4, 24])
def test_chunked_equals_plain_loss_and_gradients_in_float32(chunk):
  inputs = _inputs()
  (loss, (weight, correct)), grads = _loss_and_grads(
    lambda *a: losses.chunked_cross_entropy_sums(*a, chunk=chunk), *inputs
  )
  (want_loss, (want_weight, want_correct)), want_grads = _loss_and_grads(_plain, *inputs)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert float(weight) == float(want_weight) and float(correct) == float(want_correct)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_in_bfloat16_the_projections_gradient_is_rounded_once():
  inputs = _inputs(length=64, dtype=jnp.bfloat16)
  (loss, _), grads = _loss_and_grads(
    lambda *a: losses.chunked_cross_entropy_sums(*a, chunk=8), *inputs
  )
  (want_loss, _), want_grads = _loss_and_grads(_plain, *inputs)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)  # float32 logits either way
  assert all(g.dtype == jnp.bfloat16 for g in grads)
  for got, want in zip(grads, want_grads):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # The chunked backward rounds the logits' gradient to bf16 before its two
    # matmuls (the plain one keeps it in float32): about bf16's own rounding.
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_bad_shapes_and_chunks_are_errors_naming_them():
  hidden, unembed, labels, mask = _inputs()
  with pytest.raises(ValueError, match="chunk=5 must be a positive integer dividing the length 24"):
    losses.chunked_cross_entropy_sums(hidden, unembed, labels, mask, chunk=5)
  with pytest.raises(ValueError, match="unembed"):
    losses.chunked_cross_entropy_sums(hidden, unembed.T, labels, mask)
  with pytest.raises(ValueError, match="labels and mask"):
    losses.chunked_cross_entropy_sums(hidden, unembed, labels[:, :3], mask)


def test_the_compiled_gradient_never_holds_the_whole_logits():
  # [2, 512, 16384] float32 logits are 64 MiB; a chunk of 64 tokens is 8 MiB.
  hidden, unembed, labels, mask = _inputs(length=512, d=32, vocab=16384)
  logits_bytes = 2 * 512 * 16384 * 4

  def temp_bytes(loss):
    def total(hidden, unembed):
      return loss(hidden, unembed, labels, mask)[0]

    compiled = jax.jit(jax.grad(total, argnums=(0, 1))).lower(hidden, unembed).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  chunked = temp_bytes(lambda *a: losses.chunked_cross_entropy_sums(*a, chunk=64))
  plain = temp_bytes(_plain)
  assert plain >= logits_bytes, plain
  assert chunked < logits_bytes / 2, (chunked, logits_bytes)


def _batch(vocab, length=16, packed=False):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, vocab, (2, length + 1)), jnp.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, length))}
  if packed:
    ids = jnp.asarray([[1] * 6 + [2] * (length - 6)] * 2, jnp.int32)
    batch["segment_ids"] = ids
    batch["positions"] = jnp.concatenate([jnp.arange(6), jnp.arange(length - 6)])[None].repeat(2, 0)
    batch["mask"] = batch["mask"].at[:, 5].set(0.0)
  return batch


SIZES = dict(vocab_size=96, num_layers=1, d_model=16, num_heads=2, scan_layers=False)


@pytest.mark.slow
@pytest.mark.parametrize(
  "task,make",
  [
    (llama_task, lambda: llama.Llama(llama.LlamaConfig(**SIZES, num_kv_heads=1), rngs=nnx.Rngs(0))),
    (
      llama_task,
      lambda: llama.Llama(
        llama.LlamaConfig(**SIZES, num_kv_heads=1, tie_embeddings=True), rngs=nnx.Rngs(0)
      ),
    ),
    (
      lm_task,
      lambda: lm.TransformerLM(
        lm.TransformerConfig(**SIZES, seq_len=16, d_ff=32), rngs=nnx.Rngs(0)
      ),
    ),
  ],
  ids=["llama", "llama-tied", "transformer"],
)
def test_the_decoders_task_losses_chunk_and_equal_the_plain_loss(task, make, monkeypatch):
  # At most 2 rows x 4 tokens x 96 logits: the 16 tokens in chunks of 4.
  monkeypatch.setattr(losses, "CHUNK_LOGITS", 2 * 4 * 96)
  assert losses.default_chunk(16, 96, rows=2) == 4
  model = make()
  batch = _batch(96, packed=True)

  def chunked(model):
    return task.next_token_loss(model, batch, None, True)[0]

  def plain(model):
    packing = {k: batch[k] for k in ("segment_ids", "positions")}
    return cross_entropy_sums(model(batch["inputs"], **packing), batch["targets"], batch["mask"])[0]

  loss, grads = nnx.jit(nnx.value_and_grad(chunked))(model)
  want_loss, want_grads = nnx.jit(nnx.value_and_grad(plain))(model)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  # Through the network a different summation order shows in single elements
  # more than in the whole: each parameter's gradient agrees normwise to 1e-5.
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    error = np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(want)
    assert error <= 1e-5, error


@pytest.mark.slow
def test_on_a_mesh_each_device_sums_its_rows_and_the_result_is_the_plain_one():
  mesh = create_mesh("data=2,fsdp=4")  # 8 row shards; the projection split over fsdp
  hidden, unembed, labels, mask = _inputs(batch=8, length=16)
  place = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
  rows = jax.sharding.PartitionSpec(("data", "fsdp"))
  hidden, labels, mask = place(hidden, rows), place(labels, rows), place(mask, rows)
  unembed = place(unembed, jax.sharding.PartitionSpec("fsdp"))
  with rules.activation_rules(rules.FSDP, mesh):
    assert losses._row_shards(8) == 8  # the path with a share of the gradient per row shard
    (loss, _), grads = _loss_and_grads(
      lambda *a: losses.chunked_cross_entropy_sums(*a, chunk=4), hidden, unembed, labels, mask
    )
  (want_loss, _), want_grads = _loss_and_grads(_plain, hidden, unembed, labels, mask)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _with_labels_outside_the_vocabulary(vocab=300):
  """HF's ignore index (-100) and `vocab` itself as labels, where the mask is 0."""
  hidden, unembed, labels, mask = _inputs(vocab=vocab)
  mask = mask.at[:, :3].set(0.0)
  outside = labels.at[0, 0].set(-100).at[1, 1].set(vocab).at[0, 2].set(-1)
  return hidden, unembed, labels, outside, mask


@pytest.mark.parametrize("chunk", [4, 24])  # 24: the plain path (one chunk)
def test_labels_outside_the_vocabulary_are_ignored_where_the_mask_is_0(chunk):
  hidden, unembed, labels, outside, mask = _with_labels_outside_the_vocabulary()

  def loss(*a):
    return losses.chunked_cross_entropy_sums(*a, chunk=chunk)

  (got, (weight, correct)), grads = _loss_and_grads(loss, hidden, unembed, outside, mask)
  (want, (_, want_correct)), want_grads = _loss_and_grads(_plain, hidden, unembed, labels, mask)
  np.testing.assert_allclose(got, want, rtol=1e-5)  # the same, as if those labels were any other
  assert float(correct) == float(want_correct) and float(weight) == float(jnp.sum(mask))
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [4, 24])
def test_a_label_outside_the_vocabulary_under_mask_1_is_an_error_naming_it(chunk):
  hidden, unembed, _, outside, mask = _with_labels_outside_the_vocabulary()
  mask = mask.at[1, 1].set(1.0)  # labels[1, 1] = 300 now counts
  message = r"labels\[1, 1\]=300 is outside \[0, 300\) where the mask is 1"
  with pytest.raises(ValueError, match=message):
    losses.chunked_cross_entropy_sums(hidden, unembed, outside, mask, chunk=chunk)
  # In a compiled step it is NaN, for the non-finite guard (see `check_labels`: a
  # callback raising from the device would keep the step out of JAX's cache).
  jitted = jax.jit(lambda *a: losses.chunked_cross_entropy_sums(*a, chunk=chunk)[0])
  assert np.isnan(jitted(hidden, unembed, outside, mask))


def test_the_chunk_budget_counts_every_row_a_device_holds(monkeypatch):
  # 4 rows of 64 tokens, a vocabulary of 300: a budget of 4 rows x 16 tokens.
  monkeypatch.setattr(losses, "CHUNK_LOGITS", 4 * 16 * 300)
  assert losses.default_chunk(64, 300, rows=4) == 16 and losses.default_chunk(64, 300) == 64
  inputs = _inputs(batch=4, length=64, vocab=300)
  found = [
    e.params["length"]
    for e in jax.make_jaxpr(lambda *a: losses.chunked_cross_entropy_sums(*a)[0])(*inputs).eqns
    if e.primitive.name == "custom_vjp_call"
    for e in e.params["call_jaxpr"].jaxpr.eqns
    if e.primitive.name == "scan"
  ]
  assert found == [4], found  # 64 tokens in 4 chunks of 16, not one chunk of 64 per row


def test_a_length_with_no_good_divisor_is_padded_to_a_multiple_of_the_chunk(monkeypatch):
  monkeypatch.setattr(losses, "CHUNK_LOGITS", 2 * 8 * 300)  # 2 rows x 8 tokens
  assert losses.default_chunk(61, 300, rows=2) == 8  # 61 is prime: not 61 chunks of 1
  assert losses.default_chunk(60, 300, rows=2) == 6  # a divisor at least half the budget
  inputs = _inputs(length=61, vocab=300)
  (loss, (weight, correct)), grads = _loss_and_grads(losses.chunked_cross_entropy_sums, *inputs)
  (want, (want_weight, want_correct)), want_grads = _loss_and_grads(_plain, *inputs)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert float(weight) == float(want_weight) and float(correct) == float(want_correct)
  assert grads[0].shape == inputs[0].shape
  for got, w in zip(grads, want_grads):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-7)
