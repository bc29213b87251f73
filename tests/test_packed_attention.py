"""Packed rows (issue 32): attention stays inside each document, and a packed batch's
loss is the sum of its documents' losses alone; without segments nothing changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import lm_tiny_bytes
from spmd.layout import batch_sharding
from spmd.mesh import create_mesh
from trainers.models.transformer import (
  TransformerConfig,
  TransformerLM,
  _Attention,
  attention_mask,
)
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import lm, make_task

LENGTH = 16

# The document of each of a window's LENGTH + 1 tokens (0: padding), as the
# packer cuts them: the inputs are the first LENGTH, the targets the last.
# Row 0: three documents and padding. Row 1: a document that began in an
# earlier row, then one that goes on past this row's window (its last
# target is its own next token). Row 2: one document filling the row.
WINDOW_DOCS = np.array(
  [
    [1] * 5 + [2] * 7 + [3] * 3 + [0] * 2,
    [1] * 6 + [2] * 11,
    [1] * 17,
  ]
)


def _config(scan_layers: bool = True) -> TransformerConfig:
  return TransformerConfig(
    seq_len=LENGTH, num_layers=2, d_model=32, num_heads=2, d_ff=64, scan_layers=scan_layers
  )


def _packed_batch(seed: int = 0) -> dict[str, np.ndarray]:
  """inputs, targets, mask, segment_ids, positions of WINDOW_DOCS, by hand."""
  window = np.random.default_rng(seed).integers(1, 256, WINDOW_DOCS.shape, dtype=np.int32)
  window = np.where(WINDOW_DOCS > 0, window, 0)
  docs = WINDOW_DOCS
  segment_ids = docs[:, :-1].astype(np.int32)
  # A target counts when it is a real token of its input's document.
  mask = ((docs[:, :-1] == docs[:, 1:]) & (docs[:, :-1] > 0)).astype(np.float32)
  positions = np.zeros_like(segment_ids)
  for row in range(len(docs)):
    for t in range(1, LENGTH):
      if segment_ids[row, t] == segment_ids[row, t - 1] and segment_ids[row, t] > 0:
        positions[row, t] = positions[row, t - 1] + 1
  return {
    "inputs": window[:, :-1],
    "targets": window[:, 1:],
    "mask": mask,
    "segment_ids": segment_ids,
    "positions": positions,
  }


def _alone(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Each segment of `batch` in its own unpacked row, from position 0, padding masked."""
  rows = {key: [] for key in ("inputs", "targets", "mask")}
  for row, ids in enumerate(batch["segment_ids"]):
    for segment in sorted(set(ids.tolist()) - {0}):
      where = ids == segment
      for key in rows:
        piece = batch[key][row][where]
        rows[key].append(np.pad(piece, (0, LENGTH - len(piece))))
  return {key: np.stack(value) for key, value in rows.items()}


def test_attention_mask_is_causal_and_same_segment():
  ids = WINDOW_DOCS[:, :-1]
  mask = np.asarray(attention_mask(jnp.asarray(ids)))
  assert mask.shape == (len(ids), 1, LENGTH, LENGTH) and mask.dtype == bool
  for b in range(len(ids)):
    for q in range(LENGTH):
      for k in range(LENGTH):
        assert mask[b, 0, q, k] == (k <= q and ids[b, q] == ids[b, k]), (b, q, k)
  with pytest.raises(ValueError, match=r"segment_ids must be \[batch, length\]"):
    attention_mask(jnp.ones(4, jnp.int32))


def test_attention_gives_zero_weight_across_segments():
  config = _config()
  attn = _Attention(config, rngs=nnx.Rngs(0))
  ids = jnp.asarray(WINDOW_DOCS[:, :-1])
  x = jax.random.normal(jax.random.key(1), (len(ids), LENGTH, config.d_model))
  probs = np.asarray(attn.probabilities(x, ids))  # [b, heads, q, k]
  ids = np.asarray(ids)
  other = ids[:, None, :, None] != ids[:, None, None, :]
  future = np.triu(np.ones((LENGTH, LENGTH), bool), 1)
  assert (probs[np.broadcast_to(other, probs.shape)] == 0).all()
  assert (probs[:, :, future] == 0).all()
  # Every query, padding included, still has a full distribution (no NaN).
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
  same_before = ~other & ~future
  assert (probs[np.broadcast_to(same_before, probs.shape)] > 0).all()
  # Without a mask the layer is causal only, as before packing.
  unpacked = np.asarray(attn.probabilities(x))
  assert (unpacked[:, :, future] == 0).all() and (unpacked[:, :, ~future] > 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_segment_does_not_see_the_other_segments_tokens(scan_layers):
  model = TransformerLM(_config(scan_layers), rngs=nnx.Rngs(0))
  batch = _packed_batch()
  ids, row, segment = batch["segment_ids"], 0, 2
  changed = batch["inputs"].copy()
  others = ids[row] != segment
  changed[row, others] = (changed[row, others] + 100) % 256
  packing = {"segment_ids": ids, "positions": batch["positions"]}
  before = model(jnp.asarray(batch["inputs"]), **packing)
  after = model(jnp.asarray(changed), **packing)
  np.testing.assert_allclose(after[row, ~others], before[row, ~others], rtol=0, atol=1e-6)
  assert not np.allclose(after[row, others], before[row, others])  # the change did something


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_packed_loss_is_the_sum_of_each_documents_loss_alone(scan_layers):
  model = TransformerLM(_config(scan_layers), rngs=nnx.Rngs(0))
  packed = _packed_batch()
  alone = _alone(packed)
  assert len(alone["inputs"]) == 6  # 3 + 2 + 1 segments
  loss, weight, sums = lm.next_token_loss(model, packed, None, False)
  loss_alone, weight_alone, sums_alone = lm.next_token_loss(model, alone, None, False)
  assert float(weight) == float(weight_alone) == packed["mask"].sum()
  np.testing.assert_allclose(loss, loss_alone, rtol=1e-5)
  assert float(sums["accuracy"]) == float(sums_alone["accuracy"])
  # Without the segments the packed documents see each other: a different loss.
  unpacked = {key: packed[key] for key in ("inputs", "targets", "mask")}
  assert not np.isclose(lm.next_token_loss(model, unpacked, None, False)[0], loss, rtol=1e-3)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_one_segment_from_position_zero_is_the_unpacked_model(scan_layers):
  model = TransformerLM(_config(scan_layers), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(2), (3, LENGTH), 0, 256)
  plain = model(tokens)
  one = model(
    tokens,
    segment_ids=jnp.ones_like(tokens),
    positions=jnp.broadcast_to(jnp.arange(LENGTH), tokens.shape),
  )
  np.testing.assert_allclose(one, plain, rtol=0, atol=1e-6)


def test_segment_ids_and_positions_must_be_shaped_as_the_tokens():
  model = TransformerLM(_config(), rngs=nnx.Rngs(0))
  tokens = jnp.ones((2, 8), jnp.int32)
  with pytest.raises(ValueError, match=r"segment_ids must be integers shaped as the tokens"):
    model(tokens, segment_ids=jnp.ones((2, 7), jnp.int32))
  with pytest.raises(ValueError, match=r"positions must be .*dtype\('float32'\)"):
    model(tokens, positions=jnp.zeros((2, 8), jnp.float32))


@pytest.mark.slow
def test_a_packed_train_step_on_four_devices_matches_one_device():
  """fsdp=2 x tensor=2 splits the weights, the batch and so the mask; the loss agrees."""
  packed = _packed_batch()
  # A global batch of 4 rows: the three packed ones and one more of another seed.
  packed = {key: np.concatenate([packed[key], _packed_batch(1)[key][:1]]) for key in packed}
  runs = {}
  for ici, count in (("data=1,fsdp=1,tensor=1", 1), ("data=1,fsdp=2,tensor=2", 4)):
    config = lm_tiny_bytes.get_config()
    config.mesh.ici, config.mesh.rules = ici, "fsdp_tp"
    # One layer: each layer is split and masked alike; another only adds compile time.
    config.model.num_layers = 1
    config.model.d_model, config.model.d_ff, config.model.seq_len = 32, 64, LENGTH
    config.global_batch = 4
    mesh = create_mesh(ici, devices=jax.devices()[:count])
    task = make_task(config)
    setup = make_state(task.model, config, mesh)
    axes = ("data", "fsdp")
    spec = batch_sharding(mesh, axes)
    batch = {key: jax.device_put(value, spec) for key, value in packed.items()}
    step = make_train_step(setup, task, config, mesh, axes)
    state = setup.init()
    losses = []
    for _ in range(3):  # the warmup's first step has a learning rate of 0
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    runs[count] = losses
  np.testing.assert_allclose(runs[4], runs[1], rtol=1e-5)
  assert runs[1][2] < runs[1][0]  # it trains
