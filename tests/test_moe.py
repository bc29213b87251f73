"""The routed MLP (`trainers.models.moe`) and the Llama's routed layers (issue 63, item 1).

The routed MLP against a dense reference that runs every expert on every
token and weights them by gates chosen with a threshold mask (no sort, no
top_k, no grouped matmul); the auxiliary losses against values worked by
hand; a tiny routed Llama through the trainer's own step on four CPU
devices; its FLOPs on active parameters; the config's refusals.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import llama_tiny
from spmd import rules
from spmd.mesh import create_mesh
from trainers.models import llama, moe
from trainers.step.loss import batch_shardings
from trainers.step.mesh import build_mesh
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import make_task

D, E, K, F = 8, 4, 2, 16


def _reference(layer: moe.MoE, x: jax.Array) -> jax.Array:
  """Every expert on every token, weighted by the k largest scores' gates (a mask, no sort)."""
  config = layer.config
  tokens = x.reshape(-1, D)
  logits = tokens @ layer.router[...]
  scores = jax.nn.softmax(logits) if config.gate == "softmax" else jax.nn.sigmoid(logits)
  kth = jnp.sort(scores, axis=-1)[:, -config.top_k][:, None]
  gates = jnp.where(scores >= kth, scores, 0.0)
  if config.norm_topk:
    gates = gates / gates.sum(-1, keepdims=True)
  hidden = jax.nn.silu(jnp.einsum("td,edf->tef", tokens, layer.expert_gate[...]))
  hidden = hidden * jnp.einsum("td,edf->tef", tokens, layer.expert_up[...])
  outs = jnp.einsum("tef,efd->ted", hidden, layer.expert_down[...])
  y = jnp.einsum("ted,te->td", outs, gates)
  if config.shared_d_ff:
    shared = layer.shared
    h = jax.nn.silu(tokens @ shared.gate[...]) * (tokens @ shared.up[...])
    s = h @ shared.down[...]
    if config.shared_gate:
      s = s * jax.nn.sigmoid(tokens @ layer.shared_gate[...])[:, None]
    y = y + s
  return y.reshape(x.shape)


CASES = {
  "softmax": dict(gate="softmax"),
  "softmax_unnormalised": dict(gate="softmax", norm_topk=False),
  "sigmoid_shared_ungated": dict(gate="sigmoid", shared_d_ff=6, shared_gate=False),
  "softmax_shared_gated": dict(gate="softmax", shared_d_ff=6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_routed_mlp_and_its_gradients_equal_every_expert_weighted_by_its_gate(case):
  layer = moe.MoE(
    moe.MoEConfig(d_model=D, num_experts=E, top_k=K, d_ff=F, **CASES[case]), rngs=nnx.Rngs(0)
  )
  x = jax.random.normal(jax.random.key(1), (3, 5, D))
  cotangent = jax.random.normal(jax.random.key(2), (3, 5, D))
  graphdef, params = nnx.split(layer)

  def loss(params, x, fn):
    return jnp.sum(fn(nnx.merge(graphdef, params), x) * cotangent)

  np.testing.assert_allclose(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-6)
  got = jax.grad(loss, argnums=(0, 1))(params, x, moe.MoE.__call__)
  want = jax.grad(loss, argnums=(0, 1))(params, x, _reference)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  # The reference routes some pairs to every expert: each group of the sort is used.
  _, stats = layer.routed(x)
  assert float(stats.dropped) == 0.0 and np.isclose(float(stats.expert_share.sum()), 1.0)


@pytest.mark.slow  # compiles the routing on four devices: seconds
def test_each_device_routes_its_own_rows_and_gets_the_single_device_result():
  """Under the rules on data=4, the compiled routing has no all-gather (routed over the
  whole batch, every token went to every device), and its loss and gradients are one
  device's."""
  layer = moe.MoE(moe.MoEConfig(d_model=D, num_experts=E, top_k=K, d_ff=F), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(layer)
  mesh = create_mesh("data=4", devices=jax.devices()[:4])
  x = jax.random.normal(jax.random.key(1), (8, 32, D))

  def loss(params, x):
    y, stats = nnx.merge(graphdef, params).routed(x)
    return jnp.sum(y**2) + stats.load_balancing_loss + stats.z_loss

  def split_loss(params, x):
    with rules.activation_rules(rules.FSDP, mesh):
      return loss(params, x)

  placed = jax.device_put(x, NamedSharding(mesh, P("data")))
  compiled = jax.jit(jax.value_and_grad(split_loss)).lower(params, placed).compile()
  assert "all-gather" not in compiled.as_text()
  got, want = compiled(params, placed), jax.value_and_grad(loss)(params, x)
  # Sums over the tokens added in another order: float32 rounding of each array's scale.
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))))


def test_a_float32_experts_gradient_under_bfloat16_is_summed_in_float32():
  """Each group's weight gradient equals the float32 sum of the bfloat16 products,
  unrounded (a bfloat16 result would be off by ~1e-3 of its size); the input's is JAX's own."""
  x = jax.random.normal(jax.random.key(0), (64, D), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (E, D, F), jnp.float32)
  g = jax.random.normal(jax.random.key(2), (64, F), jnp.bfloat16)
  sizes = jnp.array([10, 30, 0, 24], jnp.int32)
  y, vjp = jax.vjp(moe.grouped_matmul, x, w, sizes)
  dx, dw, _ = vjp(g)
  assert y.dtype == dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  bounds = np.cumsum([0, *sizes.tolist()])
  x32, g32 = np.asarray(x, np.float32), np.asarray(g, np.float32)
  for e in range(E):
    rows = slice(bounds[e], bounds[e + 1])
    np.testing.assert_allclose(dw[e], x32[rows].T @ g32[rows], rtol=1e-5, atol=1e-5)
  plain_dx = jax.vjp(lambda x: jax.lax.ragged_dot(x, w.astype(jnp.bfloat16), sizes), x)[1](g)[0]
  np.testing.assert_array_equal(dx, plain_dx)


def test_megablox_kernels_multiply_each_group_as_xla_does():
  """The TPU's kernels (megablox's, interpreted here) on groups of uneven sizes, one
  empty and one across a tile's edge. tgmm: each group's weight gradient is the float32
  sum of its own rows' bfloat16 products, as XLA's ragged dot gives, the rows' gradient
  unchanged. gmm (for the rows, forward and backward): each row times its own group's
  weight, as XLA's, to bfloat16's rounding."""
  x = jax.random.normal(jax.random.key(0), (512, 128), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (E, 128, 256), jnp.float32)
  g = jax.random.normal(jax.random.key(2), (512, 256), jnp.bfloat16)
  sizes = jnp.array([10, 260, 0, 242], jnp.int32)
  got = {}
  for kernel, rows, pallas_calls in (("xla", "xla", 0), ("tgmm", "xla", 1), ("tgmm", "gmm", 3)):
    with moe._kernel(kernel, rows=rows):
      assert (moe.weight_gradient_tiling(512, 128, 256, E) is None) == (kernel == "xla")
      assert (moe.row_tilings(512, 128, 256, E) is None) == (rows == "xla")
      step = jax.value_and_grad(lambda x, w: jnp.vdot(moe.grouped_matmul(x, w, sizes), g), (0, 1))
      assert str(jax.make_jaxpr(step)(x, w)).count("pallas_call") == pallas_calls, (kernel, rows)
      y, vjp = jax.vjp(moe.grouped_matmul, x, w, sizes)
      got[kernel, rows] = (y, *vjp(g)[:2])
  xla_y, xla_dx, xla_dw = got["xla", "xla"]
  for key, (y, dx, dw) in got.items():
    if key[1] == "xla":
      np.testing.assert_array_equal(y, xla_y)
      np.testing.assert_array_equal(dx, xla_dx)
    for a, b in ((y, xla_y), (dx, xla_dx)):  # products of 128 or 256 terms, in bfloat16
      np.testing.assert_allclose(
        np.float32(a), np.float32(b), rtol=2**-7, atol=2**-6 * float(np.max(np.abs(b)))
      )
    np.testing.assert_allclose(dw, xla_dw, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(xla_dw))))
    assert dw.dtype == jnp.float32 and not np.any(dw[2])  # the empty group's gradient is 0
  # gmm's rows of the empty group's neighbours are each their own group's products.
  y = np.float32(got["tgmm", "gmm"][0])
  want = np.float32(x[10:270]) @ np.float32(w[1]).astype(jnp.bfloat16).astype(np.float32)
  np.testing.assert_allclose(y[10:270], want, rtol=2**-7, atol=2**-6 * float(np.max(np.abs(want))))


@pytest.mark.slow  # compiles the routing on four devices with tgmm interpreted: seconds
def test_a_split_routing_sums_its_weight_gradients_with_tgmm_as_one_device_with_xla():
  """Inside the routed shard_maps (each device its rows, d_ff split over tensor; and the
  experts split over expert, the batch over data), megablox's tgmm, interpreted, gives the
  loss and gradients of one device with XLA's ragged dot: each weight's gradient summed
  over the devices that share it exactly once. The split step must hold the kernel: a
  shard_map that checks what varies over its axes would keep XLA's ragged dot."""
  config = moe.MoEConfig(d_model=128, num_experts=E, top_k=K, d_ff=256)
  graphdef, params = nnx.split(moe.MoE(config, rngs=nnx.Rngs(0)))
  # 512 tokens: each device's groups are at least a tile of tgmm's rows (128).
  x = jax.random.normal(jax.random.key(1), (4, 128, 128))

  def loss(params, x):
    y, stats = nnx.merge(graphdef, params).routed(x)
    return jnp.sum(y**2) + stats.load_balancing_loss + stats.z_loss

  with moe._kernel("xla"):
    want = jax.jit(jax.value_and_grad(loss))(params, x)
  layouts = (
    ("data=2,tensor=2", rules.FSDP_TP, P("data")),
    ("data=2,expert=2", rules.FSDP, P(("data", "expert"))),
  )
  for ici, preset, rows in layouts:
    mesh = create_mesh(ici, devices=jax.devices()[:4])

    def split_loss(params, x, preset=preset, mesh=mesh):
      with rules.activation_rules(preset, mesh):
        return loss(params, x)

    placed = jax.device_put(x, NamedSharding(mesh, rows))
    with moe._kernel("tgmm"):
      step = jax.value_and_grad(split_loss)
      # Three weight gradients, each megablox's jitted tgmm around its Pallas kernel
      # (the printed jaxpr shows a repeated jit's body once).
      jaxpr = str(jax.make_jaxpr(step)(params, placed))
      assert jaxpr.count("name=tgmm") == 3 and "pallas_call" in jaxpr, ici
      got = jax.jit(step)(params, placed)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b))), err_msg=f"{ici} {path}"
      )


def test_a_float32_weight_shared_by_devices_gets_its_gradient_summed_over_them_under_bfloat16():
  """Inside a shard_map each device's rows differ and the weight does not: the weight's
  gradient (the float32 custom VJP's) is the sum over devices, the whole batch's."""
  x = jax.random.normal(jax.random.key(0), (64, D), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (E, D, F), jnp.float32)
  sizes = jnp.array([4, 8, 0, 4], jnp.int32)  # each device's 16 rows
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))

  def loss(x, w):
    def local(x, w):
      y = moe.grouped_matmul(x, w, sizes).astype(jnp.float32)
      return jax.lax.psum(jnp.sum(y * y), "data")

    return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())(x, w)

  dw = jax.jit(jax.grad(loss, argnums=1))(x, w)
  bounds, want = np.cumsum([0, *sizes.tolist()]), np.zeros(w.shape, np.float32)
  narrow = np.asarray(w.astype(jnp.bfloat16), np.float32)
  for block in np.split(np.asarray(x, np.float32), 4):
    for e in range(E):
      rows = block[bounds[e] : bounds[e + 1]]
      y = np.asarray((rows @ narrow[e]).astype(jnp.bfloat16), np.float32)
      want[e] += rows.T @ np.asarray(jnp.asarray(2 * y, jnp.bfloat16), np.float32)
  np.testing.assert_allclose(dw, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_the_load_balancing_loss_and_z_loss_equal_the_hand_computed_values():
  """Four tokens, two experts, top-1: probabilities 3:1 or 1:3, logsumexp 1, 2, 0, -1.

  f = (3/4, 1/4) of the choices, P = mean probabilities = (0.625, 0.375):
  balance = 2 * (0.75 * 0.625 + 0.25 * 0.375) = 1.125; z = (1 + 4 + 0 + 1) / 4 = 1.5.
  """
  probs = np.array([[0.75, 0.25], [0.75, 0.25], [0.25, 0.75], [0.75, 0.25]])
  logits = jnp.asarray(np.log(probs) + np.array([[1.0], [2.0], [0.0], [-1.0]]), jnp.float32)
  experts, gates, p = moe.route(logits, 1, "softmax", norm_topk=True)
  assert experts[:, 0].tolist() == [0, 0, 1, 0] and np.allclose(gates, 1.0)
  stats = moe.router_stats(logits, experts, p, 2)
  np.testing.assert_allclose(stats.load_balancing_loss, 1.125, rtol=1e-6)
  np.testing.assert_allclose(stats.z_loss, 1.5, rtol=1e-6)
  np.testing.assert_allclose(stats.expert_share, [0.75, 0.25])


def test_a_sigmoid_routers_balance_uses_the_scores_normalised_over_experts():
  """Sigmoid scores (0.5, 0.75) for one token: P = (0.4, 0.6); top-1 picks expert 1: 2 * 0.6."""
  logits = jnp.array([[0.0, math.log(3.0)]], jnp.float32)
  experts, gates, p = moe.route(logits, 1, "sigmoid", norm_topk=False)
  np.testing.assert_allclose(gates, [[0.75]], rtol=1e-6)
  stats = moe.router_stats(logits, experts, p, 2)
  np.testing.assert_allclose(stats.load_balancing_loss, 1.2, rtol=1e-6)


def _moe_model_config(**overrides) -> llama.LlamaConfig:
  fields = dict(
    num_layers=2,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    seq_len=16,
    moe_experts=4,
    moe_top_k=2,
    moe_d_ff=16,
    moe_shared_d_ff=8,
    attention="xla",
  )
  return llama.LlamaConfig(**{**fields, **overrides})


@pytest.mark.slow  # compiles a Llama's step or forward pass: seconds
def test_scanned_and_unrolled_routed_layers_give_the_same_states_and_stats():
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
  runs = {}
  for scan in (True, False):
    model = llama.Llama(_moe_model_config(scan_layers=scan), rngs=nnx.Rngs(0))
    runs[scan] = nnx.jit(lambda m, t: m.hidden_states_and_stats(t))(model, tokens)
  for a, b in zip(jax.tree.leaves(runs[True]), jax.tree.leaves(runs[False])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  # Mixed, unrolled: layer 1 routed, layer 0 dense; a dense model has no stats. Which
  # layers route and whether there are stats is the models' structure: built and traced
  # abstractly, not initialised and run op by op.
  def abstract(**overrides):
    return nnx.eval_shape(lambda: llama.Llama(_moe_model_config(**overrides), rngs=nnx.Rngs(0)))

  def stats(model):
    return nnx.eval_shape(lambda m, t: m.hidden_states_and_stats(t)[1], model, tokens)

  mixed = abstract(scan_layers=False, moe_every=2)
  assert [b.routed for b in mixed.blocks] == [False, True]
  assert stats(mixed) is not None
  assert stats(abstract(moe_experts=0)) is None


@pytest.mark.slow  # compiles a Llama's gradient twice: seconds
def test_full_remat_routes_rows_in_chunks_with_the_gradients_of_all_at_once(monkeypatch):
  """Under full remat a routed layer's rows go through the experts in chunks, each
  rematerialised on its own, and its attention runs again after the routed MLP's backward
  pass: the loss and gradients of running every row at once, keeping everything."""
  monkeypatch.setattr(moe, "CHUNK_BYTES", 1)  # 8 x 256 tokens x 2 choices: 4 chunks of 1024
  tokens = jax.random.randint(jax.random.key(0), (8, 256), 0, 256)
  runs = {}
  for policy in ("full", "none"):
    config = _moe_model_config(seq_len=256, remat_policy=policy)
    graphdef, params = nnx.split(llama.Llama(config, rngs=nnx.Rngs(0)))

    def loss(params, graphdef=graphdef):
      hidden, stats = nnx.merge(graphdef, params).hidden_states_and_stats(tokens)
      return jnp.mean(hidden.astype(jnp.float32) ** 2) + stats.load_balancing_loss

    step = jax.value_and_grad(loss)
    jaxpr = str(jax.make_jaxpr(step)(params))
    assert ("length=4" in jaxpr) == (policy == "full"), policy
    runs[policy] = jax.jit(step)(params)
  for a, b in zip(jax.tree.leaves(runs["full"]), jax.tree.leaves(runs["none"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))))


def test_flops_per_token_count_the_active_parameters():
  """Per layer: attention 2*32*4*8 + 2*32*2*8 = 3072, norms 64, router 32*4 = 128,
  two experts of 3*32*16 = 3072, the shared expert 3*32*8 + its gate 32 = 800:
  7136 active (10208 in all, with four experts). N = 2 * 7136 + 32 + 32 * 256 = 22496;
  FLOPs = 6 N + 12 * 2 * 32 * 16 = 147264."""
  config = _moe_model_config()
  assert llama.flops_per_token(config) == 147264.0
  model = llama.Llama(config, rngs=nnx.Rngs(0))
  counted = sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert llama.param_count(config) == counted == 2 * 10208 + 32 + 2 * 32 * 256
  # Every other layer routed: layer 0's dense MLP is 3 * 32 * 64 = 6144.
  mixed = _moe_model_config(scan_layers=False, moe_every=2)
  assert llama.flops_per_token(mixed) == 6 * (3136 + 6144 + 7136 + 32 + 8192) + 12288


@pytest.mark.parametrize(
  ("field", "value", "message"),
  [
    ("moe_experts", -1, "moe_experts=-1 must be a non-negative integer"),
    ("moe_top_k", 5, "moe_top_k=5 must be at most moe_experts=4"),
    ("moe_top_k", 0, "moe_top_k=0 must be a positive integer"),
    ("moe_gate", "relu", "moe_gate='relu' must be one of"),
    ("moe_every", 2, "moe_every=2 needs scan_layers=False"),
    ("moe_d_ff", -3, "moe_d_ff=-3 must be a positive integer"),
    ("moe_shared_d_ff", -1, "moe_shared_d_ff=-1 must be a non-negative integer"),
    ("moe_norm_topk", "yes", "moe_norm_topk='yes' must be True or False"),
    ("moe_load_balancing_coef", -0.1, "moe_load_balancing_coef=-0.1 must be a number >= 0"),
    ("moe_z_loss_coef", float("nan"), "moe_z_loss_coef=nan must be a number >= 0"),
  ],
)
def test_bad_moe_fields_are_refused_naming_the_field(field, value, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    _moe_model_config(**{field: value})


def _train_config(**model):
  config = llama_tiny.get_config()
  config.mesh.ici, config.mesh.rules = "data=2,fsdp=2", "fsdp"
  config.model.update(
    seq_len=16,
    num_layers=2,
    d_model=32,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    vocab_size=512,
    moe_experts=4,
    moe_top_k=2,
    moe_d_ff=16,
    moe_shared_d_ff=8,
    scan_layers=True,
    attention="xla",
    **model,
  )
  config.train.precision = "float32"
  config.train.update(
    optimizer="adamw", weight_decay=0.0, learning_rate=1e-2, schedule="constant", warmup_steps=0
  )
  config.global_batch = 4
  return config


def _batch(task):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 512, (4, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((4, 16), np.float32)}
  batch["segment_ids"] = np.ones((4, 16), np.int32)
  batch["positions"] = np.broadcast_to(np.arange(16, dtype=np.int32), (4, 16)).copy()
  return {k: v for k, v in batch.items() if k in task.example_shapes()}


def _steps(config, steps: int) -> list[dict]:
  """`steps` of the trainer's own step on one batch, over 2 data x 2 fsdp CPU devices."""
  task = make_task(config)
  mesh, axes = build_mesh(config, jax.devices()[:4])
  setup = make_state(task.model, config, mesh, axes)
  state = setup.init()
  placement = batch_shardings(task, setup.rules, mesh, axes)
  batch = {k: jax.device_put(v, placement[k]) for k, v in _batch(task).items()}
  step = make_train_step(setup, task, config, mesh, axes)
  history = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    history.append(jax.device_get(metrics))
  return history


@pytest.mark.slow  # compiles a Llama's step or forward pass: seconds
def test_a_routed_llama_trains_with_its_router_stats_in_the_metrics():
  """Scanned routed layers through `make_train_step`: the loss falls, the stats are reported,
  and the auxiliary losses are in the training loss (a run with the coefficients at 0
  differs by exactly their weighted sum). Its own in-process steps, not a shared run: the
  shared runs (tests/shared_runs.py) are dense Llamas."""
  history = _steps(_train_config(), steps=6)
  losses = [float(m["loss"]) for m in history]
  assert losses[-1] < losses[0] - 0.5, losses
  first = history[0]
  shares = [float(first[f"moe_expert_{i}_share"]) for i in range(4)]
  assert np.isclose(sum(shares), 1.0, atol=1e-5) and min(shares) > 0, shares
  assert float(first["moe_dropped"]) == 0.0
  assert float(first["moe_load_balancing_loss"]) > 0 and float(first["moe_z_loss"]) > 0
  plain = _steps(_train_config(moe_load_balancing_coef=0.0, moe_z_loss_coef=0.0), steps=1)[0]
  aux = 0.01 * first["moe_load_balancing_loss"] + 0.001 * first["moe_z_loss"]
  np.testing.assert_allclose(first["loss"] - plain["loss"], aux, rtol=1e-4)


LR = 1e4  # the SGD update is -LR x the gradient: recovered to float32 rounding of it


def _loss_and_grads(ici: str, rules_name: str = "fsdp") -> tuple[float, dict]:
  """One SGD step of the trainer's own step on `ici` (4 CPU devices): the loss and gradients.

  The batch is placed as the run places it, and the gradients are read back
  from the update, so the test runs the step the trainer runs.
  """
  config = _train_config()
  config.mesh.ici, config.mesh.rules = ici, rules_name
  config.train.update(optimizer="sgd", momentum=0.0, learning_rate=LR, grad_clip_norm=0.0)
  task = make_task(config)
  mesh, axes = build_mesh(config, jax.devices()[:4])
  setup = make_state(task.model, config, mesh, axes)
  state = setup.init()
  before = jax.device_get(state["params"])
  placement = batch_shardings(task, setup.rules, mesh, axes)
  batch = {k: jax.device_put(v, placement[k]) for k, v in _batch(task).items()}
  state, metrics = make_train_step(setup, task, config, mesh, axes)(state, batch)
  grads = jax.tree.map(lambda b, a: (b - a) / LR, before, jax.device_get(state["params"]))
  return float(metrics["loss"]), grads


@pytest.mark.slow  # compiles a Llama's step per mesh: seconds apiece
def test_a_routed_llama_split_over_the_expert_axis_has_the_loss_and_gradients_of_data_4():
  """expert=4 (one expert a device) and expert=2 x tensor=2 (each expert's d_ff split too):
  the loss (its auxiliary losses over the global batch) to rtol 1e-5, each gradient to rtol
  1e-5 of its own largest entry (sums over tokens added in another order). The float32
  policy; the router is float32 under any. data=2 x expert=2 trains as data=4 in
  tests/test_expert_multiprocess.py (the resumed layout), so it is not compiled again here."""
  runs = {
    ici: _loss_and_grads(ici, rules_name)
    for ici, rules_name in (
      ("data=4", "fsdp"),
      ("expert=4", "fsdp"),
      ("expert=2,tensor=2", "fsdp_tp"),
    )
  }
  ref_loss, ref_grads = runs.pop("data=4")
  for name, (value, grads) in runs.items():
    np.testing.assert_allclose(value, ref_loss, rtol=1e-5, err_msg=name)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
      np.testing.assert_allclose(
        a,
        b,
        rtol=1e-5,
        atol=1e-5 * float(np.max(np.abs(b))),
        err_msg=f"{name} {jax.tree_util.keystr(path)}",
      )


# Four rows: one a device on data=2 x expert=2, as the KV cache is split there.
DECODE_PROMPT = jnp.array([[5, 17, 3, 42], [8, 8, 60, 1], [2, 9, 9, 4], [70, 1, 33, 6]], jnp.int32)


@pytest.mark.slow  # compiles a Llama's step or forward pass: seconds
def test_a_routed_llama_decodes_with_its_kv_cache_as_its_full_forward_pass():
  """Dropless routing: each token decoded alone takes the experts it takes in the whole row."""
  from trainers.models import decode

  model = llama.Llama(_moe_model_config(vocab_size=96), rngs=nnx.Rngs(1))
  prompt = DECODE_PROMPT
  cached = decode.generate(model, prompt, 4)
  np.testing.assert_array_equal(cached, decode.generate_uncached(model, prompt, 4))
  logits, _ = decode.prefill(model, prompt)
  # The full forward pass as one program: run op by op it would compile each of its ops.
  np.testing.assert_allclose(logits, nnx.jit(lambda m, p: m(p))(model, prompt), atol=1e-5)


@pytest.mark.slow  # compiles a Llama's forward pass and decoding steps: seconds
def test_a_routed_llama_decodes_on_an_expert_mesh_as_on_one_device(monkeypatch):
  """data=2 x expert=2, 4 rows (one a device, as the KV cache is split): the prompt and
  each decoding step dispatched to the experts' devices make the same tokens as alone."""
  from trainers.models import decode

  model = llama.Llama(_moe_model_config(vocab_size=96), rngs=nnx.Rngs(1))
  prompt = DECODE_PROMPT  # the decoding alone is the test above's program, compiled once
  mesh = create_mesh("data=2,expert=2", devices=jax.devices()[:4])
  alone = decode.generate(model, prompt, 4)
  dispatched = []
  placed = moe._expert_parallel
  monkeypatch.setattr(moe, "_expert_parallel", lambda *a: dispatched.append(1) or placed(*a))
  on_mesh = decode.generate(model, prompt, 4, rules=rules.FSDP_TP, mesh=mesh)
  np.testing.assert_array_equal(on_mesh, alone)
  assert dispatched  # traced through the expert-parallel dispatch


@pytest.mark.slow  # compiles a Llama's step or forward pass: seconds
def test_routed_layers_give_the_same_gradients_under_every_remat_policy():
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
  grads = {}
  for policy in ("none", "full", "minimal_no_qkv"):
    model = llama.Llama(_moe_model_config(remat_policy=policy), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss(params, graphdef=graphdef):
      hidden, stats = nnx.merge(graphdef, params).hidden_states_and_stats(tokens)
      return jnp.mean(hidden**2) + stats.load_balancing_loss + stats.z_loss

    grads[policy] = jax.jit(jax.grad(loss))(params)
  for policy in ("full", "minimal_no_qkv"):
    for a, b in zip(jax.tree.leaves(grads[policy]), jax.tree.leaves(grads["none"])):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=policy)


def test_hugging_face_import_and_export_refuse_what_no_family_describes(tmp_path):
  """A routed Llama into a dense folder, or one no config.json says: named up front."""
  from configs import hf
  from trainers.checkpoints import hf_export
  from trainers.tasks import llama as llama_task

  config = hf.get_config("tests/fixtures/hf/llama3")
  config.model.moe_experts = 4
  with pytest.raises(ValueError, match=r"disagrees with .*: moe_experts=4 but the folder's is 0"):
    llama_task.llama_config(config)
  config = llama_tiny.get_config()
  config.model.moe_experts = 4
  config.model.moe_gate = "sigmoid"  # DeepSeek's gates: neither Mixtral nor Qwen2-MoE has them
  (tmp_path / "config.json").write_text(config.to_json())
  with pytest.raises(ValueError, match="a mixtral config.json cannot describe moe_gate='sigmoid'"):
    hf_export.export(str(tmp_path))
