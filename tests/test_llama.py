"""The Llama model: its parts, its packed-data attention, its sharding on a TPU topology
and on a CPU mesh, and a run of the real entry point on llama_tiny."""

import collections
import math
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import llama3_8b, llama_tiny
from spmd import hlo, rules
from spmd.layout import batch_sharding
from spmd.mesh import create_mesh
from spmd.topology import libtpu_available
from tests import shared_runs
from trainers.models import llama, logical_axes
from trainers.planning import plan as plan_lib
from trainers.planning import targets
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import make_task
from trainers.tasks.llama import llama_config

SMALL = dict(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48)


def _model(**overrides) -> llama.Llama:
  return llama.Llama(llama.LlamaConfig(**{**SMALL, **overrides}), rngs=nnx.Rngs(0))


def _tokens(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 64, shape), jnp.int32)


# ---------------------------------------------------------------------------
# The model's parts.


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_shapes_and_every_parameter_names_logical_axes(scan):
  model = _model(scan_layers=scan)
  logits = model(_tokens((3, 7)))
  assert logits.shape == (3, 7, 64) and logits.dtype == jnp.float32
  names = jax.tree.leaves(logical_axes(model), is_leaf=lambda x: isinstance(x, tuple))
  assert all(set(n) <= set(rules.LOGICAL_AXES) for n in names), names
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(model))
  ]
  assert not any("bias" in p for p in paths), paths


@pytest.mark.slow
def test_scanned_and_unrolled_layers_give_the_same_model():
  tokens = _tokens((2, 9))
  scanned = _model(scan_layers=True, remat_policy="full")(tokens)
  unrolled = _model(scan_layers=False)(tokens)
  np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_recomputing_the_query_key_value_projections_changes_no_bit_of_loss_or_gradient():
  """ "minimal_no_qkv" recomputes what "minimal" keeps: the same products, so the same bits.

  Under the bfloat16 policy (bf16 compute, float32 weights whose gradients
  are summed in float32), where a recomputation in another order would show.
  """
  tokens = _tokens((2, 9))

  def loss_and_grads(policy):
    model = _model(remat_policy=policy, dtype="bfloat16")
    graphdef, params = nnx.split(model)

    def loss(params):
      return nnx.merge(graphdef, params)(tokens).astype(jnp.float32).sum()

    return jax.jit(jax.value_and_grad(loss))(params)

  minimal, no_qkv = loss_and_grads("minimal"), loss_and_grads("minimal_no_qkv")
  assert jax.tree.structure(minimal) == jax.tree.structure(no_qkv)
  for a, b in zip(jax.tree.leaves(minimal), jax.tree.leaves(no_qkv), strict=True):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_gqa_is_multi_head_attention_with_each_kv_head_repeated():
  """Query head i reads key/value head i // (num_heads // num_kv_heads)."""
  gqa = _model(num_kv_heads=2, scan_layers=False)
  mha = _model(num_kv_heads=4, scan_layers=False)
  for g, m in zip(gqa.blocks, mha.blocks):
    for name in ("query", "out"):
      getattr(m.attn, name).set_value(getattr(g.attn, name).get_value())
    for name in ("key", "value"):
      getattr(m.attn, name).set_value(jnp.repeat(getattr(g.attn, name).get_value(), 2, axis=1))
    for sub in ("attn_norm", "mlp_norm"):
      getattr(m, sub).scale.set_value(getattr(g, sub).scale.get_value())
    for name in ("gate", "up", "down"):
      getattr(m.mlp, name).set_value(getattr(g.mlp, name).get_value())
  mha.token_embed.set_value(gqa.token_embed.get_value())
  mha.unembed.set_value(gqa.unembed.get_value())
  tokens = _tokens((2, 8))
  np.testing.assert_allclose(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)
  # Repeating is what makes them equal: other key heads give other outputs.
  mha.blocks[0].attn.key.set_value(jnp.tile(gqa.blocks[0].attn.key.get_value(), (1, 2, 1)))
  assert not np.allclose(gqa(tokens), mha(tokens), atol=1e-4)


def _packed():
  """One row of three documents (5, 4 and 3 tokens) and 4 padding tokens."""
  segment_ids = jnp.asarray([[1] * 5 + [2] * 4 + [3] * 3 + [0] * 4], jnp.int32)
  positions = jnp.asarray([list(range(5)) + list(range(4)) + list(range(3)) + [0] * 4], jnp.int32)
  return _tokens((1, 16), seed=1), segment_ids, positions


def test_segments_do_not_attend_to_each_other():
  model = _model()
  tokens, segment_ids, positions = _packed()
  out = model(tokens, segment_ids, positions)
  # New tokens in document 1 change document 1, never documents 2 and 3 (which
  # plain causal attention would let read them).
  changed = tokens.at[0, :5].set((tokens[0, :5] + 7) % 64)
  other = model(changed, segment_ids, positions)
  np.testing.assert_allclose(out[0, 5:12], other[0, 5:12], rtol=1e-6, atol=1e-6)
  assert not np.allclose(out[0, :5], other[0, :5], atol=1e-4)
  plain = model(changed)
  assert not np.allclose(out[0, 5:12], plain[0, 5:12], atol=1e-4)


@pytest.mark.slow
def test_rope_counts_positions_within_each_segment():
  """A packed document gives the logits it gives alone at the start of a row."""
  model = _model()
  tokens, segment_ids, positions = _packed()
  packed = model(tokens, segment_ids, positions)
  # The three documents alone, each at the start of its own row of one batch (one shape of
  # every op, run op by op), padded at its end: later tokens never change a causal logit.
  spans = ((0, 5), (5, 9), (9, 12))
  alone = model(jnp.stack([jnp.pad(tokens[0, a:b], (0, 5 - (b - a))) for a, b in spans]))
  for row, (start, stop) in enumerate(spans):
    np.testing.assert_allclose(
      packed[0, start:stop], alone[row, : stop - start], rtol=1e-5, atol=1e-5
    )
  # RoPE sees only relative positions: counting from the row's start shifts a
  # document's positions by a constant and changes nothing, but positions
  # that are not a shift (a gap inside document 2) do change its logits.
  np.testing.assert_allclose(model(tokens, segment_ids)[:, 5:9], packed[:, 5:9], atol=1e-5)
  gap = positions.at[0, 7:9].add(3)
  assert not np.allclose(model(tokens, segment_ids, gap)[:, 7:9], packed[:, 7:9], atol=1e-4)
  np.testing.assert_allclose(model(tokens, segment_ids, gap)[:, :7], packed[:, :7], atol=1e-5)


def test_tied_embeddings_save_the_output_projection():
  tied = llama.LlamaConfig(**SMALL, tie_embeddings=True)
  untied = llama.LlamaConfig(**SMALL)
  for config in (tied, untied):
    model = llama.Llama(config, rngs=nnx.Rngs(0))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == llama.param_count(config)
  assert llama.param_count(untied) - llama.param_count(tied) == 64 * 32
  # The tied table is still multiplied: the same model FLOPs.
  assert llama.flops_per_token(tied) == llama.flops_per_token(untied)
  assert _model(tie_embeddings=True)(_tokens((1, 4))).shape == (1, 4, 64)


def test_llama3_8b_has_8_03b_parameters():
  config = llama_config(llama3_8b.get_config())
  # Meta's Llama-3-8B: 8,030,261,248 parameters.
  assert llama.param_count(config) == 8_030_261_248
  abstract = nnx.eval_shape(lambda: llama.Llama(config, rngs=nnx.Rngs(0)))
  assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))) == 8_030_261_248


def test_constraints_do_nothing_without_rules_and_pin_with_them():
  x = jnp.ones((8, 4, 6))
  assert rules.constrain(x, ("batch", "length", "mlp")) is x
  mesh = create_mesh("data=2,fsdp=2,tensor=2")
  with rules.activation_rules(rules.FSDP_TP, mesh):
    y = jax.jit(lambda a: rules.constrain(a * 2, ("batch", "length", "mlp")))(x)
    with pytest.raises(ValueError, match="not divisible"):
      rules.constrain(jnp.ones((3, 4, 6)), ("batch", "length", "mlp"))
  assert y.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor")


# ---------------------------------------------------------------------------
# Sharding: the compiled program on a TPU topology, and losses on a CPU mesh.


def _small_config(ici: str, rules_name: str, **model):
  config = llama_tiny.get_config()
  config.mesh.ici, config.mesh.rules = ici, rules_name
  config.model.update(dict(d_model=64, d_ff=128, seq_len=32, **model))
  config.global_batch = 8
  return config


def _axes(group: list[int], mesh_shape: dict[str, int]) -> tuple[str, ...]:
  """The mesh axes a group of partition ids (flat mesh positions) spans."""
  coords = np.array(np.unravel_index(group, tuple(mesh_shape.values())))
  return tuple(name for name, row in zip(mesh_shape, coords) if len(set(row)) > 1)


def _per_layer(layers: int) -> tuple[collections.Counter, int]:
  """Collectives in the layers' loop bodies of a compiled train step on v5e-8.

  Returns the (kind, mesh axes) of the instructions that run once per layer
  and their executions in all.
  """
  config = _small_config("data=2,fsdp=2,tensor=2", "fsdp_tp", num_layers=layers, scan_layers=True)
  kept = []
  plan = plan_lib.make_plan(config, targets.tpu_target("v5e-8"), keep_compiled=kept)
  found, executions = collections.Counter(), 0
  for op in hlo.collective_ops(kept[0].as_text()):
    if op.executions != layers or not op.groups:
      continue
    # TPU writes a reduce-scatter as an all-reduce fused with its slice.
    kind = "reduce-scatter" if op.computation.startswith("all-reduce-scatter") else op.kind
    axes = _axes(op.groups[0], plan.mesh)
    found[(kind, axes)] += 1
    executions += op.executions
  return found, executions


@pytest.mark.slow
@pytest.mark.skipif(not libtpu_available(), reason="needs libtpu: pip install -e '.[tpu]'")
def test_fsdp_tp_layer_collectives_on_a_tpu_topology():
  """The real train step compiled for v5e-8 on data=2,fsdp=2,tensor=2 with rules fsdp_tp.

  Per layer (inside the scanned layers' loops): weights all-gathered over fsdp,
  gradients reduce-scattered over fsdp, and the tensor-parallel all-reduce of
  activations. Twice the layers, twice the executions of the same loop bodies.
  """
  two, runs_two = _per_layer(2)
  four, runs_four = _per_layer(4)
  for expected in (
    ("all-gather", ("fsdp",)),
    ("reduce-scatter", ("fsdp",)),
    ("all-reduce", ("tensor",)),
  ):
    assert expected in two and expected in four, (expected, two, four)
  assert set(two) == set(four), (two, four)
  # The same tensor-parallel and gradient collectives in each layer's body.
  for kind in (("all-reduce", ("tensor",)), ("reduce-scatter", ("fsdp",))):
    assert two[kind] == four[kind], (kind, two, four)
  # XLA may schedule a few more or fewer instructions into the bigger loop
  # body, so "twice" is "well over one and a half times".
  assert runs_four > runs_two * 1.5, (runs_two, runs_four)


def _packed_batch(mesh, rows=8, length=32):
  spec = batch_sharding(mesh, ("data", "fsdp"))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, (rows, length + 1), dtype=np.int32)
  cut = rng.integers(4, length - 4, rows)
  index = np.arange(length)
  segment_ids = np.where(index < cut[:, None], 1, 2).astype(np.int32)
  positions = np.where(index < cut[:, None], index, index - cut[:, None]).astype(np.int32)
  batch = {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "mask": np.ones((rows, length), np.float32),
    "segment_ids": segment_ids,
    "positions": positions,
  }
  return {k: jax.device_put(v, spec) for k, v in batch.items()}


def _losses(config, steps=3):
  mesh = create_mesh(config.mesh.ici)
  axes = tuple(config.mesh.batch_axes)
  task = make_task(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  step = make_train_step(setup, task, config, mesh, axes)
  state, batch, out = setup.init(), _packed_batch(mesh), []
  for _ in range(steps):
    state, metrics = step(state, batch)
    out.append(float(jax.device_get(metrics["loss"])))
  return out


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_fsdp_tp_losses_match_data_parallel(scan):
  # One layer, scanned or not: each layer is split alike; another only adds compile time.
  model = dict(num_layers=1, scan_layers=scan)
  dp = _losses(_small_config("data=-1,fsdp=1,tensor=1", "dp", **model))
  tp = _losses(_small_config("data=2,fsdp=2,tensor=2", "fsdp_tp", **model))
  np.testing.assert_allclose(tp, dp, rtol=1e-5)
  assert dp[-1] < dp[0]


# ---------------------------------------------------------------------------
# The real entry point.


@pytest.mark.slow
@pytest.mark.multiprocess
def test_spmd_train_llama_tiny_on_packed_tokens_learns_and_resumes_bit_identically(tmp_path):
  folder, facts = shared_runs.llama_tiny_run()
  straight = {int(step): loss for step, loss in facts["losses"].items()}
  out = facts["output"]
  curve = [straight[s] for s in range(1, 41)]
  assert np.mean(curve[-3:]) < 0.7 * np.mean(curve[:3]), curve
  assert all(math.isfinite(x) for x in curve)
  # Only the split's last window has padding; this small corpus feeds it every few steps.
  share = float(re.search(r"real tokens per batch : ([\d.]+)%", out).group(1))
  assert "MFU" in out and 99 < share <= 100, out[-2500:]
  assert "sample (greedy" in out and "text through the tokenizer" in out

  # A copy of the straight run as it was at step 20 (its checkpoint there), resumed:
  # the same losses to the last bit.
  resumed_dir = shared_runs.copy_of(folder / "run", tmp_path / "resumed")
  shutil.rmtree(resumed_dir / "checkpoints" / "40")
  resumed, out = shared_runs.train_llama_tiny(facts["data"], resumed_dir)
  assert re.search(r"state from\s+: checkpoint step 20\n", out), out
  assert [resumed[s] for s in range(21, 41)] == curve[20:]


def test_activation_layouts_under_fsdp_tp_are_what_the_rules_say():
  """The constraints in the traced forward pass: Megatron's layout, batch over data x fsdp."""
  model = _model(scan_layers=False, num_heads=4, num_kv_heads=2)
  mesh = create_mesh("data=2,fsdp=2,tensor=2")
  tokens, segment_ids, positions = (jnp.tile(x, (4, 1)) for x in _packed())
  with rules.activation_rules(rules.FSDP_TP, mesh):
    jaxpr = jax.make_jaxpr(lambda t, s, p: model(t, s, p))(tokens, segment_ids, positions)
  specs = collections.Counter(
    tuple(e.params["sharding"].spec)
    for e in jaxpr.jaxpr.eqns
    if e.primitive.name == "sharding_constraint"
  )
  batch = ("data", "fsdp")
  # Specs drop trailing unsplit dimensions: (batch, length, heads, kv) is
  # (batch, None, "tensor") like (batch, length, mlp) and (batch, length, vocab).
  assert specs == {
    (batch,): 1 + 2 * 2,  # the embeddings, then after attention and MLP in each layer
    # per layer q, k, v and the attention output; then the logits
    (batch, None, "tensor"): 4 * 2 + 1,
    # per layer the MLP's gate and up, on the tokens flattened into one axis:
    # the same layout as (batch, length, mlp)
    (batch, "tensor"): 2 * 2,
  }, specs
  # Without rules the same model has no constraints at all.
  plain = jax.make_jaxpr(lambda t: model(t))(tokens)
  assert not any(e.primitive.name == "sharding_constraint" for e in plain.jaxpr.eqns)
