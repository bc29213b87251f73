"""Context parallelism (`spmd.context`): sequences split over the mesh axis `context`.

Exactness in one process on CPU devices: the loss and the gradients of the
built-in Llama (grouped-query attention, packed documents with segment ids,
float32 policy) and of a user's own model are the same with the sequence
split over 4 context devices, or 2 data x 2 context, as with it whole;
under the bfloat16 policy 20 steps' losses stay within 1e-2. And
the balanced order's point: the causal attention work each device does.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import llama_tiny
from spmd import context, rules
from spmd.mesh import create_mesh
from trainers.models import attention
from trainers.step.loss import batch_shardings
from trainers.step.mesh import build_mesh
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import Task, cross_entropy_sums, make_task
from trainers.tasks.losses import chunked_cross_entropy_sums

SEQ = 32
ROWS = 4


def test_the_balanced_order_gives_each_device_the_same_causal_work():
  """(query block, key block) pairs with an unmasked entry, per device: max / mean."""
  ratio = {}
  for balanced in (False, True):
    counts = context.causal_blocks(4096, 4, balanced=balanced, block=16)
    ratio[balanced] = max(counts) / np.mean(counts)
  assert ratio[True] == 1.0
  assert 1.7 < ratio[False] <= 1.75, ratio
  # Nothing is computed twice: the balanced total is the unsplit triangle's.
  unsplit = context.causal_blocks(4096, 1, balanced=False, block=16)
  assert sum(context.causal_blocks(4096, 4, balanced=True, block=16)) <= 1.02 * unsplit[0]


def test_splash_kernels_own_block_mask_does_the_counted_work_on_each_shard():
  """The blocks splash's block mask marks for each query shard are `causal_blocks`' count.

  At context=8 (the issue's C3): max / mean 1.0 balanced, and no block computed twice
  (the shards' total over the unsplit run's within 5%).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info

  length, block = 8192, 128
  for shards in (4, 8):
    for balanced in (False, True):
      places = context.balanced_order(length, shards) if balanced else np.arange(length)
      mask = masks.MultiHeadMask([attention._placed_causal_mask()(places)])
      found, _ = info.process_mask(mask, (block, block), q_seq_shards=shards)
      rows = np.asarray(found.block_mask)[0] != 0
      per = length // shards // block
      kernel = [int(rows[i * per : (i + 1) * per].sum()) for i in range(shards)]
      assert kernel == context.causal_blocks(length, shards, balanced, block), (shards, balanced)
  unsplit = context.causal_blocks(length, 1, balanced=False, block=block)[0]
  assert max(kernel) / np.mean(kernel) == 1.0 and sum(kernel) / unsplit <= 1.05


def test_to_balanced_gives_device_i_chunks_i_and_2c_minus_1_minus_i():
  x = np.arange(16)[None]
  out = np.asarray(context.to_balanced(jnp.asarray(x), 4))
  chunks = out.reshape(8, 2)[:, 0] // 2
  assert chunks.tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
  assert (out[0] == context.balanced_order(16, 4)).all()
  with pytest.raises(ValueError, match="must be a multiple of 8"):
    context.to_balanced(jnp.ones((1, 12)), 4)


def _packed(rows: int = ROWS, seq: int = SEQ, vocab: int = 128, seed: int = 0):
  """A packed batch: documents of several lengths per row, their positions, some padding."""
  rng = np.random.default_rng(seed)
  ids, positions = np.zeros((rows, seq), np.int32), np.zeros((rows, seq), np.int32)
  for r in range(rows):
    start, doc = 0, 1
    while start < seq - 3:
      n = int(rng.integers(3, seq // 2))
      n = min(n, seq - 3 - start)
      ids[r, start : start + n], positions[r, start : start + n] = doc, np.arange(n)
      start, doc = start + n, doc + 1
  tokens = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "mask": (ids != 0).astype(np.float32),
    "segment_ids": ids,
    "positions": positions,
  }


def test_attention_across_context_shards_equals_attention_on_one_device():
  """GQA, packed rows, the balanced order: each device's queries against all gathered keys."""
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(2, SEQ, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, SEQ, 2, 8)), jnp.float32) for _ in range(2))
  ids = jnp.asarray(_packed(rows=2)["segment_ids"])
  expected = attention.xla_attention(q, k, v, attention.causal_mask(ids, SEQ))
  mesh = create_mesh("data=2,context=4", devices=jax.devices()[:8])
  shuffled = [context.to_balanced(x, 4) for x in (q, k, v, ids)]
  with rules.activation_rules(rules.FSDP_TP, mesh), context.order(4):
    with attention.recorded_choices() as choices:
      got = jax.jit(lambda *a: attention.attend(*a, kernel="auto"))(*shuffled)
  assert (
    choices[0].reason == "no fused kernel chosen on cpu; the sequence split over 4 context devices"
  )
  np.testing.assert_allclose(got, context.to_balanced(expected, 4), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_splash_across_context_shards_equals_xla_forward_and_backward(fused, monkeypatch):
  """Pallas interpret mode on CPU: blocks of 128 of each device's 128 queries, GQA, segments.

  Both backward kernels: the fused one, and the separate dq kernel that long
  gathered keys get (`attention.SPLASH_FUSED_BACKWARD_MAX_KEY_BLOCKS`).
  """
  monkeypatch.setattr(attention, "SPLASH_FUSED_BACKWARD_MAX_KEY_BLOCKS", 8 if fused else 1)
  length, shards = 256, 2
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.normal(size=(2, length, 4, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 8)), jnp.float32) for _ in range(2))
  ids = np.ones((2, length), np.int32)
  ids[:, 100:], ids[1, 200:] = 2, 0  # two documents, and padding in the second row
  ids = jnp.asarray(ids)
  mesh = create_mesh("data=2,context=2", devices=jax.devices()[:4])

  def loss(kernel, q, k, v):
    return jnp.sum(
      jnp.sin(attention.attend(q, k, v, context.to_balanced(ids, shards), kernel=kernel))
    )

  def split(kernel):
    def run(q, k, v):
      with rules.activation_rules(rules.FSDP_TP, mesh), context.order(shards):
        return loss(kernel, *(context.to_balanced(x, shards) for x in (q, k, v)))

    return jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2)))

  with attention.recorded_choices() as choices:
    splash, xla = split("splash")(q, k, v), split("xla")(q, k, v)
  assert [c.kernel for c in choices] == ["splash", "xla"], choices
  assert choices[0].interpret and choices[0].block == 128
  np.testing.assert_allclose(splash[0], xla[0], rtol=1e-5)
  for a, b in zip(splash[1], xla[1]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def _llama_config(ici: str, num_layers: int = 1):
  """The tiny Llama on `ici`. One layer by default: every layer splits its attention over
  `context` alike, so a second one adds compile time and no other case."""
  config = llama_tiny.get_config()
  config.mesh.ici, config.mesh.rules = ici, "fsdp_tp"
  config.model.update(
    seq_len=SEQ,
    num_layers=num_layers,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    vocab_size=512,
  )
  config.model.attention = "xla"
  config.train.precision = "float32"
  config.global_batch = ROWS
  return config


LR = 1e4  # the update is -LR x the gradient: recovered to float32 rounding of the gradient


def _loss_and_grads(task, config, devices):
  """One train step (`make_train_step`: the balanced order at its entry) by SGD: loss, gradients.

  The batch is placed as the run places it (`batch_shardings`: the sequence
  features split along `context`), and the gradients are read back from
  the update, so the test runs the step the trainer runs.
  """
  config.train.update(
    optimizer="sgd", momentum=0.0, learning_rate=LR, schedule="constant", warmup_steps=0
  )
  config.train.update(grad_clip_norm=0.0, weight_decay=0.0)
  mesh, axes = build_mesh(config, devices)
  setup = make_state(task.model, config, mesh, axes)
  state = setup.init()
  before = jax.device_get(state["params"])
  placement = batch_shardings(task, setup.rules, mesh, axes)
  batch = {k: jax.device_put(v, placement[k]) for k, v in _batch_for(task).items()}
  state, metrics = make_train_step(setup, task, config, mesh, axes)(state, batch)
  grads = jax.tree.map(lambda b, a: (b - a) / LR, before, jax.device_get(state["params"]))
  return float(metrics["loss"]), grads


def _batch_for(task):
  """`_packed()`'s features the task's examples have (an unpacked task: no segments)."""
  return {k: v for k, v in _packed().items() if k in task.example_shapes()}


def _assert_same(runs):
  """The loss to rtol 1e-5; each gradient to rtol 1e-5 of its own largest entry.

  A weight's gradient is a sum over the tokens, added in another order when
  they sit on other devices: an entry that is a small difference of large
  terms differs by float32 rounding of those terms (about 1e-6 of the
  array's scale), so the tolerance is relative to each array's scale.
  """
  ref_loss, ref_grads = next(iter(runs.values()))
  for name, (value, grads) in list(runs.items())[1:]:
    np.testing.assert_allclose(value, ref_loss, rtol=1e-5, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
      scale = float(np.max(np.abs(b)))
      np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{name} {jax.tree_util.keystr(path)}"
      )


def test_llama_loss_and_gradients_split_over_context_equal_the_whole_sequence():
  devices = jax.devices()[:4]
  runs = {}
  for ici in ("data=4", "context=4", "data=2,context=2"):
    config = _llama_config(ici)
    runs[ici] = _loss_and_grads(make_task(config), config, devices)
  _assert_same(runs)


def _bf16_losses(ici: str, steps: int) -> list[float]:
  """`steps` Adam steps of the tiny Llama under the bfloat16 policy, over 4 packed batches in turn."""
  config = _llama_config(ici, num_layers=2)  # the layers the measured drift below is of
  config.train.update(precision="bfloat16", learning_rate=1e-3, warmup_steps=5)
  task = make_task(config)
  mesh, axes = build_mesh(config, jax.devices()[:4])
  setup = make_state(task.model, config, mesh, axes)
  state = setup.init()
  placement = batch_shardings(task, setup.rules, mesh, axes)
  step = make_train_step(setup, task, config, mesh, axes)
  losses = []
  for i in range(steps):
    batch = _packed(seed=i % 4)
    state, metrics = step(state, {k: jax.device_put(batch[k], placement[k]) for k in batch})
    losses.append(float(metrics["loss"]))
  return losses


def test_under_bfloat16_twenty_steps_split_over_context_stay_within_1e_2_of_whole():
  """The issue's bf16 bound: the losses of 20 steps with the sequence split 4 ways or whole.

  The first step's losses agree to float32 rounding; after it, bfloat16
  rounds sums taken in another order (the balanced order's keys, other
  devices' tokens) another way, and Adam turns a flipped sign of a
  near-zero gradient into a full step, so the runs drift apart. Measured:
  at most 0.002 here (0.006 for data=2,context=2; 0.008 at 3x the
  learning rate), a fifth of the bound. Its own in-process steps, not a shared
  run: the bound is between two layouts of one bf16 schedule, which no shared
  run trains.
  """
  whole, split = _bf16_losses("data=4", 20), _bf16_losses("context=4", 20)
  assert whole[-1] < whole[0] - 1.0, whole  # both learn: the bound is between runs that train
  assert split[0] == pytest.approx(whole[0], rel=1e-5)
  np.testing.assert_allclose(split, whole, rtol=0, atol=1e-2)


def test_the_transformer_unpacked_with_learned_positions_is_exact_over_context():
  """Its learned positions at each token's place (`spmd.context.token_index`): no batch positions."""
  from configs import lm_tiny_bytes

  runs = {}
  for ici in ("data=4", "data=2,context=2"):
    config = lm_tiny_bytes.get_config()
    config.mesh.ici, config.mesh.rules = ici, "fsdp_tp"
    config.model.update(seq_len=SEQ, num_layers=1, d_model=32, num_heads=4, d_ff=64)
    config.model.attention = "xla"
    config.global_batch = ROWS
    runs[ici] = _loss_and_grads(make_task(config), config, jax.devices()[:4])
  _assert_same(runs)


class OwnModel(nnx.Module):
  """A user's model: its own layers, its activations named by logical axes (length among them)."""

  def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.pos = nnx.Embed(SEQ, width, rngs=rngs)
    self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
    self.out = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens):
    # Learned positions at each token's place in its row, whatever the step's order.
    places = jnp.asarray(context.token_index(tokens.shape[1]))
    x = rules.constrain(self.embed(tokens) + self.pos(places), ("batch", "length", "embed"))
    q, k, v = jnp.split(self.qkv(x).reshape(*tokens.shape, 3 * 2, -1), 3, axis=2)
    y = attention.attend(q, k, v, kernel="xla").reshape(x.shape)
    return rules.constrain(self.out(x + y), ("batch", "length", "vocab"))


def _own_task():
  def loss(model, batch, rngs, train):
    del rngs, train
    return cross_entropy_sums(model(batch["inputs"]), batch["targets"], batch["mask"])

  return Task(
    model=lambda rngs: OwnModel(128, 16, rngs),
    loss=loss,
    prepare_data=lambda data_dir: "unused",
    record_template={"tokens": np.zeros(SEQ + 1, np.int32)},
    to_example=lambda r: {
      "inputs": r["tokens"][:-1],
      "targets": r["tokens"][1:],
      "mask": np.ones(SEQ, np.float32),
    },
    sequence_features=("inputs", "targets", "mask"),
  )


def test_a_users_own_model_that_names_its_length_axis_is_exact_over_context():
  devices = jax.devices()[:4]
  runs = {}
  for ici in ("data=4", "context=4"):
    config = _llama_config(ici)
    config.mesh.rules = "fsdp"
    runs[ici] = _loss_and_grads(_own_task(), config, devices)
  _assert_same(runs)


def test_the_chunked_loss_splits_along_context_and_gathers_no_logits():
  """Chunks of each device's own slice: equal sums and gradients, no [rows, length, vocab] gather."""
  rng = np.random.default_rng(2)
  hidden = jnp.asarray(rng.normal(size=(4, SEQ, 16)), jnp.float32)
  unembed = jnp.asarray(rng.normal(size=(16, 96)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 96, (4, SEQ)), jnp.int32)
  mask = jnp.asarray(rng.random((4, SEQ)) < 0.8, jnp.float32)

  def sums(h, u):
    loss_sum, _, metrics = chunked_cross_entropy_sums(h, u, labels, mask, chunk=2)
    return loss_sum, metrics["accuracy"]

  expected = jax.value_and_grad(lambda h, u: sums(h, u)[0], argnums=(0, 1))(hidden, unembed)
  mesh = create_mesh("data=2,context=4", devices=jax.devices()[:8])

  def split(h, u):
    with rules.activation_rules(rules.FSDP_TP, mesh):
      h = rules.constrain(h, ("batch", "length", "embed"))
      return sums(h, u)[0]

  step = jax.jit(jax.value_and_grad(split, argnums=(0, 1)))
  text = step.lower(hidden, unembed).compile().as_text()
  gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
  assert not [g for g in gathered if g.startswith("f32[4,32,96]") or ",96]" in g], gathered
  got = step(hidden, unembed)
  np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
  for a, b in zip(got[1], expected[1]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_decoding_on_a_context_mesh_gathers_the_sequence_and_makes_the_same_tokens():
  from trainers.models import decode, llama

  config = llama.LlamaConfig(
    vocab_size=64, seq_len=16, num_layers=1, d_model=16, num_heads=4, num_kv_heads=2, d_ff=32
  )
  model = llama.Llama(config, rngs=nnx.Rngs(0))
  prompt = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 5)), jnp.int32)
  mesh = create_mesh("data=2,context=4", devices=jax.devices()[:8])
  alone = decode.generate(model, prompt, 6)
  on_mesh = decode.generate(model, prompt, 6, rules=rules.FSDP_TP, mesh=mesh)
  assert np.asarray(on_mesh).tolist() == np.asarray(alone).tolist()


def test_each_device_is_fed_only_its_slice_of_the_sequence_features():
  from trainers.data.read import lm_examples, pipeline

  task = make_task(_llama_config("data=2,context=2"))
  mesh = create_mesh("data=2,context=2", devices=jax.devices()[:4])
  records = [{"tokens": np.arange(SEQ + 1, dtype=np.int32) + i} for i in range(16)]
  batches = pipeline.GlobalBatches(
    records, lm_examples.lm_example(SEQ), ROWS, mesh, batch_axes=("data",)
  )
  batches.place_features(batch_shardings(task, rules.FSDP_TP, mesh, ("data",)))
  batch = batches.global_batch_arrays(0)
  for name in ("inputs", "targets", "mask"):
    shards = batch[name].addressable_shards
    assert {s.data.shape for s in shards} == {(ROWS // 2, SEQ // 2)}, name
  whole = np.asarray(batch["inputs"])
  assert whole.shape == (ROWS, SEQ) and (np.diff(whole, axis=1) == 1).all()


def test_the_evals_scorer_on_a_context_mesh_scores_as_the_model_alone(monkeypatch):
  """Log-likelihoods in chunks of each device's slice (4 of its 16 tokens) equal the model's alone."""
  from trainers.evals import loglikelihood
  from trainers.step.state import build_model
  from trainers.tasks import losses

  monkeypatch.setattr(losses, "CHUNK_LOGITS", 2 * 5 * 512)  # 2 rows a device, vocab 512

  config = _llama_config("data=2,context=2")
  task = make_task(config)
  mesh, axes = build_mesh(config, jax.devices()[:4])
  setup = make_state(task.model, config, mesh, axes)
  state = setup.init()
  batch = {k: v for k, v in _packed().items() if k in loglikelihood.FEATURES}
  inputs = {"params": state["params"]}  # `eval_inputs(state)`
  scored = jax.device_get(loglikelihood.mesh_scorer(setup, task, axes, ROWS)(inputs, batch))
  model = build_model(setup, jax.device_get(state["params"]), None, merged=True)
  alone = loglikelihood.model_logprobs(model, batch)
  np.testing.assert_allclose(scored, alone, rtol=1e-5, atol=1e-5)


def test_a_context_mesh_for_a_task_without_sequences_is_said_once():
  """A task that names no sequence features on data=2,context=2: the run says what it gets.

  Tried as a user would, a CNN on that mesh trains with each context device
  on whole rows, computing what its twin computes; the warning says so.
  """
  import dataclasses
  import types

  from trainers.run import startup

  llama = make_task(llama_tiny.get_config())
  unnamed = dataclasses.replace(llama, sequence_features=())
  split = types.SimpleNamespace(
    rules=rules.FSDP, mesh=create_mesh("data=2,context=2", devices=jax.devices()[:4])
  )
  whole = types.SimpleNamespace(
    rules=rules.FSDP, mesh=create_mesh("data=4", devices=jax.devices()[:4])
  )
  note = startup.context_without_sequences(unnamed, split)
  assert note and "over 2 context devices" in note and "no sequence_features" in note, note
  assert startup.context_without_sequences(llama, split) is None  # it names its sequences
  assert startup.context_without_sequences(unnamed, whole) is None  # nothing split
