"""LoRA (`config.lora`): adapters on a user's own NNX model and on the built-in Llama.

Only the adapters train: the optimizer's state is theirs alone, the frozen
weights come out of the steps bit for bit (in the compute dtype), step 0's
loss is the base model's (B starts at zero), and both A and B get gradients.
With the rest of a run: `config.evals` score and decode the adapted model,
and micro-batches under the bfloat16 policy train the adapters as one batch.
"""

import json
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from etils import epath
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import default, llama_tiny
from spmd import hlo_matmuls
from spmd.layout import batch_sharding
from spmd.mesh import create_mesh
from trainers.checkpoints import saved_run
from trainers.checkpoints.damage import CheckpointError
from trainers.config.checks import check_values, resolve
from trainers.evals import encoding
from trainers.evals.runner import EvalRunner
from trainers.models import lora
from trainers.planning import plan as plan_lib
from trainers.planning import report, targets
from trainers.step import trainable
from trainers.step.loss import abstract_batch, loss_fn, model_weights, step_key
from trainers.step.precision import Precision
from trainers.step.state import build_model, make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import Task, make_task


class ConvNet(nnx.Module):
  """A user's model: a convolution, then a dense layer (nothing of the built-in models)."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
    self.dense = nnx.Linear(8 * 4 * 4, 5, rngs=rngs)

  def __call__(self, x):
    y = nnx.relu(self.conv(x))
    return self.dense(y.reshape(y.shape[0], -1))


def _loss(model, batch, rngs, train):
  logits = model(batch["x"]).astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return (losses * batch["mask"]).sum(), batch["mask"].sum(), {}


def _task() -> Task:
  return Task(
    model=ConvNet,
    loss=_loss,
    prepare_data=lambda data_dir: "none",
    record_template={"x": np.zeros((4, 4, 3), np.float32), "y": np.int32(0)},
    to_example=lambda record: dict(record, mask=np.float32(1)),
  )


def _conv_config(precision="float32", targets="conv/kernel,dense/kernel"):
  config = default.get_config()
  config.global_batch = 8
  config.train.precision = precision
  config.train.warmup_steps = 0
  config.train.learning_rate = 1e-2
  config.lora.targets = targets
  config.lora.rank = 2
  config.lora.alpha = 6.0
  return config


def _conv_batch(mesh):
  rng = np.random.default_rng(0)
  spec = batch_sharding(mesh, ("data",))
  return {
    "x": jax.device_put(rng.normal(size=(8, 4, 4, 3)).astype(np.float32), spec),
    "y": jax.device_put(rng.integers(0, 5, 8).astype(np.int32), spec),
    "mask": jax.device_put(np.ones(8, np.float32), spec),
  }


def _base_loss(setup, state, task, batch):
  """The loss of the model without adapters (its base weights as stored)."""
  graphdef = nnx.split(nnx.eval_shape(lambda: task.model(nnx.Rngs(0))))[0]

  @jax.jit  # one program, not one per operation
  def loss(params, batch):
    model = nnx.merge(graphdef, nnx.State(lora.base_weights(params, setup.adapters)))
    loss_sum, weight, _ = task.loss(model, batch, None, True)
    return loss_sum / weight

  return float(loss(jax.device_get(state["params"]), jax.device_get(batch)))


def _leaves(tree):
  return {
    jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
  }


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_only_adapters_train_on_a_users_conv_net(precision):
  """Two steps of a user's conv net, which takes its adapters merged (`W + s A B`).

  Its own steps, not a shared run's: the only model here on the merged
  path, and each precision is another step program.
  """
  config, task = _conv_config(precision), _task()
  mesh = create_mesh("data=-1")
  setup = make_state(task.model, config, mesh)
  state = setup.init()
  train, frozen = trainable.split(state["params"], setup.trainable_paths)
  assert sorted(_leaves(train)) == [
    "['conv']['kernel_lora_a']",
    "['conv']['kernel_lora_b']",
    "['dense']['kernel_lora_a']",
    "['dense']['kernel_lora_b']",
  ]
  # A conv kernel [3, 3, 3, 8]: A [3, 3, 3, r], B [r, 8]; B starts at zero.
  assert train["conv"]["kernel_lora_a"].shape == (3, 3, 3, 2)
  assert train["conv"]["kernel_lora_b"].shape == (2, 8)
  assert not np.asarray(train["conv"]["kernel_lora_b"]).any()
  compute = jnp.dtype(precision)
  assert {x.dtype for x in jax.tree.leaves(frozen)} == {compute}
  assert {x.dtype for x in jax.tree.leaves(train)} == {jnp.dtype(jnp.float32)}
  # The optimizer's state holds the adapters' moments and nothing of the frozen weights.
  adapter_size = sum(x.size for x in jax.tree.leaves(train))
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
  assert sum(x.size for x in moments) == 2 * adapter_size  # adamw: mu and nu

  batch = _conv_batch(mesh)
  base = _base_loss(setup, state, task, batch)
  frozen_before, train_before = _leaves(frozen), _leaves(train)  # the step donates the state
  step = make_train_step(setup, task, config, mesh, ("data",))
  state, metrics = step(state, batch)
  assert float(metrics["loss"]) == pytest.approx(base, rel=1e-2 if precision != "float32" else 1e-6)
  state, metrics = step(state, batch)
  after, frozen_after = trainable.split(state["params"], setup.trainable_paths)
  for name, value in frozen_before.items():
    np.testing.assert_array_equal(_leaves(frozen_after)[name], value, err_msg=name)
  # Both A and B moved: B from its zeros after the first step, A after the second.
  for name, value in train_before.items():
    assert not np.array_equal(_leaves(after)[name], value), name
  assert float(metrics["loss"]) < base


def test_llama_targets_by_short_name():
  config = llama_tiny.get_config()
  config.model.update(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, seq_len=8)
  config.model.scan_layers = True  # stacked: A and B take the "layers" dim too
  config.lora.targets = "q,k,v,o,gate,up,down"
  config.lora.rank = 4
  mesh = create_mesh("data=2,fsdp=4")
  setup = make_state(make_task(config).model, config, mesh)
  shapes = {"/".join(p): (a.a_shape, a.b_shape) for a in setup.adapters for p in [a.path]}
  assert shapes["blocks/attn/query"] == ((2, 32, 4), (2, 4, 4, 8))
  assert shapes["blocks/attn/out"] == ((2, 4, 8, 4), (2, 4, 32))
  assert shapes["blocks/mlp/down"] == ((2, 64, 4), (2, 4, 32))
  assert len(shapes) == 7
  # Sharded by the weight's own logical names: A's input dims, B's output dims.
  params = setup.shardings["params"]["blocks"]
  spec = lambda sharding: tuple(sharding.spec) + (None,) * 4  # noqa: E731
  assert spec(params["attn"]["query_lora_a"])[:3] == (*spec(params["attn"]["query"])[:2], None)
  assert spec(params["mlp"]["down_lora_b"])[2] == spec(params["mlp"]["down"])[2]
  assert spec(params["attn"]["query"])[1] == "fsdp"  # so the check above checks something


@pytest.mark.parametrize(
  "settings, message",
  [
    (dict(rank=0), "lora.rank=0 must be a positive integer"),
    (dict(alpha=-1.0), "lora.alpha=-1.0 must be a number > 0"),
    (dict(dropout=1.0), "lora.dropout=1.0 must be a number in [0, 1)"),
    (dict(dropout=-0.1), "lora.dropout=-0.1 must be a number in [0, 1)"),
    (dict(targets="q,(v"), "lora.targets: '(v' is not a regex"),
  ],
)
def test_bad_settings_are_named(settings, message):
  config = _conv_config()
  config.lora.update(settings)
  with pytest.raises(ValueError, match=re.escape(message)):
    check_values(config)


def test_a_target_that_matches_nothing_is_named():
  config = llama_tiny.get_config()
  config.lora.targets = "q,qkv_proj"
  with pytest.raises(
    ValueError, match="lora.targets: 'qkv_proj' matches no parameter of the model"
  ):
    resolve(config)  # which calls check_lora_targets


def test_spmd_plan_shows_the_saving():
  """Llama, rank 4 on all seven projections, bf16, FSDP over 8 H100 stand-ins: state only."""
  config = llama_tiny.get_config()
  config.model.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, seq_len=16)
  config.model.scan_layers = True
  config.mesh.ici = "data=1,fsdp=-1,tensor=1"
  config.train.precision = "bfloat16"
  config.lora.targets = "q,k,v,o,gate,up,down"
  config.lora.rank = 4
  plan = plan_lib.make_plan(config, targets.gpu_target("h100", 8), compile_step=False)
  d, f, layers, r = 64, 128, 2, 4
  # Per layer: q [d, 4, 16] and o [4, 16, d] have A or B of d x r and 64 x r; k, v
  # [d, 2, 16]: d x r + r x 32; gate, up [d, f] and down [f, d]: (d + f) x r each.
  adapters = layers * r * (2 * (d + 64) + 2 * (d + 32) + 3 * (d + f))
  assert plan.lora.trainable_params == adapters and plan.lora.targets == 7
  # The same state on the 8 CPU devices, split into the adapters and the frozen weights.
  setup = make_state(make_task(config).model, config, create_mesh(config.mesh.ici))
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  train, frozen = trainable.split(state["params"], setup.trainable_paths)
  assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
  counters = 5 * 4  # adam's count, the schedule's, step, updates, bad_steps (int32)
  # adamw's two float32 moments, of the adapters alone.
  assert plan.memory.optimizer_bytes == 2 * plan_lib.per_device_bytes(train) + counters
  # Full fine-tuning: every weight in float32 with its two moments.
  full_params = 2 * plan_lib.per_device_bytes(frozen)
  assert plan.lora.full_params_bytes == full_params
  assert plan.lora.full_optimizer_bytes == 2 * full_params + counters
  text = report.format_plan(plan)
  assert re.search(r"lora +rank 4 on 7 weights: [\d.]+M parameters train \([\d.]+%\)", text), text
  assert "full fine-tuning: " in text


def test_readers_of_whole_weights_refuse_a_lora_checkpoint(tmp_path):
  """spmd-export, spmd-sample and --mode=eval read a checkpoint's weights through one function."""
  (tmp_path / "4" / "data").mkdir(parents=True)
  record = {"next_step": 4, "lora_base": {"source": "models/llama3", "hash": "0123456789abcdef"}}
  (tmp_path / "4" / "data" / "metadata").write_text(json.dumps(record))
  with pytest.raises(CheckpointError, match=r"holds LoRA adapters, not a whole model \(its base "):
    saved_run.restore_weights(saved_run.CheckpointRef(epath.Path(tmp_path), 4))


def _tiny_llama_config(targets="q,k,v,o,gate,up,down", scan_layers=True):
  config = llama_tiny.get_config()
  config.model.update(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, seq_len=8)
  config.model.scan_layers = scan_layers
  config.global_batch = 8
  config.lora.targets = targets
  config.lora.rank = 4
  config.lora.alpha = 12.0
  return config


@pytest.mark.parametrize("scan_layers", [True, False])
def test_the_llama_adds_the_low_rank_products_as_the_merged_weights_would(scan_layers):
  """The built-in Llama applies its adapters itself: equal, in float32, to `W + s A B`."""
  config = _tiny_llama_config(scan_layers=scan_layers)
  task = make_task(config)
  setup = make_state(task.model, config, create_mesh("data=-1"))
  assert setup.applies_lora and not setup.merges_adapters
  params = jax.device_get(setup.init()["params"])
  rng = np.random.default_rng(0)
  for adapter in setup.adapters:  # B at zero would show nothing
    params = lora._set(params, adapter.b_path, rng.normal(size=adapter.b_shape).astype(np.float32))
  tokens = jnp.asarray(rng.integers(0, config.model.vocab_size, (2, 8)), jnp.int32)
  plain = nnx.split(nnx.eval_shape(lambda: task.model(nnx.Rngs(0))))[0]

  @jax.jit  # one program for the three forward passes, not one per operation
  def logits(params):
    applied = build_model(setup, params)(tokens)
    weights = lora.base_weights(lora.merged(params, setup.adapters), setup.adapters)
    merged = nnx.merge(plain, nnx.State(weights))(tokens)
    base = nnx.merge(plain, nnx.State(lora.base_weights(params, setup.adapters)))(tokens)
    return applied, merged, base

  applied, merged, base = logits(params)
  np.testing.assert_allclose(applied, merged, rtol=2e-5, atol=2e-5)
  assert not np.allclose(applied, base, atol=1e-3)


def _matmul_flops(config):
  task = make_task(config)
  mesh = create_mesh("data=-1")
  setup = make_state(task.model, config, mesh)
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  batch = abstract_batch(task, config.global_batch, batch_sharding(mesh, ("data",)))
  step = make_train_step(setup, task, config, mesh, ("data",))
  return hlo_matmuls.matmul_flops(step.lower(state, batch).compile().as_text())


def test_the_llama_computes_no_gradient_of_its_frozen_weights():
  """A LoRA step's matmuls: forward and input gradients, no weight gradients (the issue's L3, in FLOPs)."""
  config = _tiny_llama_config(targets="q,k,v,o,gate,up,down")
  config.model.update(d_model=64, d_ff=128)
  config.lora.rank = 1
  config.lora.dropout = 0.1  # dropped inputs multiply A alone: no frozen weight's gradient
  lora_flops = _matmul_flops(config)
  lora_model_flops = make_task(config).flops_per_step  # the MFU a LoRA run reports counts these
  config.lora.targets, config.lora.dropout = "", 0.0
  full_flops = _matmul_flops(config)
  assert lora_flops < 0.75 * full_flops, (lora_flops, full_flops)
  model_ratio = lora_model_flops / make_task(config).flops_per_step
  assert model_ratio == pytest.approx(lora_flops / full_flops, abs=0.1), model_ratio


EVALS = "examples/evals"


def _with_random_b(setup, params, seed=0):
  """`params` with every adapter's B random (at zero the adapters would change nothing)."""
  rng = np.random.default_rng(seed)
  for adapter in setup.adapters:
    b = 0.05 * rng.normal(size=adapter.b_shape).astype(np.float32)
    params = lora._set(params, adapter.b_path, b)
  return params


def _eval_runner(config):
  """`params, workdir -> (metrics, completions)`: `config.evals` through the run's own
  `EvalRunner` (8 CPU devices), built once, so parameters of one model share its programs."""
  task = make_task(config)
  setup = make_state(task.model, config, create_mesh("data=-1"))
  runner = EvalRunner.build(config, setup, task, ("data",))
  runner.prepare(encoding.byte_encoder(config.model.vocab_size))

  def run(params, workdir):
    params = jax.device_put(params, setup.shardings["params"])
    metrics = runner({"params": params}, step=1, workdir=str(workdir))
    completions = (workdir / "evals" / "complete" / "step_1.jsonl").read_text()
    return {
      k: v for k, v in metrics.items() if not k.endswith(("seconds", "tokens_per_s"))
    }, completions

  return run


def test_evals_of_a_lora_run_see_its_adapters(tmp_path):
  """`config.evals` (multiple choice and generation) on a LoRA state: the merged model's scores.

  The evals build the model from the state's parameters; with adapters they
  must score and decode the adapted model (the Llama adds `s (x A) B`, the
  KV-cache decoder too), not the frozen base. Float32, so the two agree to
  rounding; the base's scores differ.
  """
  config = _tiny_llama_config()
  config.model.seq_len = 64  # the eval rows' window
  config.train.precision = "float32"
  config.evals.code = ml_collections.ConfigDict(
    dict(kind="multiple_choice", path=f"{EVALS}/choices.jsonl", layout="plain", delimiter=" ")
  )
  config.evals.complete = ml_collections.ConfigDict(
    dict(kind="generation", path=f"{EVALS}/prompts.jsonl", max_new_tokens=6, stop=["\n"])
  )
  setup = make_state(make_task(config).model, config, create_mesh("data=-1"))
  params = _with_random_b(setup, jax.device_get(setup.init()["params"]))
  adapted, adapted_text = _eval_runner(config)(params, tmp_path / "lora")
  plain = config.copy_and_resolve_references()
  plain.lora.targets = ""
  plain_evals = _eval_runner(plain)  # the merged model's and the base's: one model, two weights
  merged = lora.base_weights(lora.merged(params, setup.adapters), setup.adapters)
  same, same_text = plain_evals(merged, tmp_path / "merged")
  base, _ = plain_evals(lora.base_weights(params, setup.adapters), tmp_path / "base")
  assert adapted.keys() == same.keys() and "evals/complete/exact_match" in adapted
  for key, value in same.items():
    assert adapted[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
  assert adapted_text == same_text
  key = "evals/code/answer_loglikelihood"
  assert abs(adapted[key] - base[key]) > 1e-3, (adapted[key], base[key])


def test_micro_batches_under_bfloat16_train_the_adapters_as_one_batch():
  """`train.micro_batches` with LoRA under the bfloat16 policy: one batch's step, the base untouched.

  The accumulated gradients are the adapters' alone (the frozen weights are
  neither differentiated nor carried through the scan), the frozen weights
  stay bfloat16 and bit for bit, and the adapters float32, as with one batch.
  Its own steps, not a shared run's: one step of each of two programs from
  the same weights is the comparison.
  """
  config = _tiny_llama_config()
  config.train.precision = "bfloat16"
  config.global_batch = 16
  config.train.optimizer, config.train.momentum = "sgd", 0.0  # the update is the gradient
  config.train.warmup_steps, config.train.learning_rate = 0, 1.0
  config.train.weight_decay = 0.0
  task, mesh = make_task(config), create_mesh("data=-1")
  setup = make_state(task.model, config, mesh)  # micro_batches changes the step alone
  before = _with_random_b(setup, jax.device_get(setup.init()["params"]))
  batch = jax.device_put(_token_rows(config, 16), batch_sharding(mesh, ("data",)))
  results = {}
  for micro in (1, 2):
    config.train.micro_batches = micro
    state = setup.init()
    state["params"] = jax.device_put(before, setup.shardings["params"])
    state, metrics = make_train_step(setup, task, config, mesh, ("data",))(state, batch)
    train, frozen = trainable.split(jax.device_get(state["params"]), setup.trainable_paths)
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(train)} == {jnp.dtype(jnp.float32)}
    for name, value in _leaves(trainable.split(before, setup.trainable_paths)[1]).items():
      np.testing.assert_array_equal(_leaves(frozen)[name], value, err_msg=name)
    moved = jax.tree.map(jnp.subtract, train, trainable.split(before, setup.trainable_paths)[0])
    results[micro] = (jax.device_get(metrics), moved)
  (one, one_moved), (two, two_moved) = results[1], results[2]
  for key in ("loss", "grad_norm", "weight"):
    assert float(two[key]) == pytest.approx(float(one[key]), rel=2e-3), key
  for name, value in _leaves(one_moved).items():
    assert np.abs(value).max() > 0, name
    np.testing.assert_allclose(
      _leaves(two_moved)[name], value, rtol=2e-2, atol=2e-3 * np.abs(value).max(), err_msg=name
    )


def _token_rows(config, rows, seed=1):
  tokens = np.random.default_rng(seed).integers(1, config.model.vocab_size, (rows, 9), np.int32)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segment_ids": np.ones((rows, 8), np.int32),
    "positions": np.tile(np.arange(8, dtype=np.int32), (rows, 1)),
    "mask": np.ones((rows, 8), np.float32),
  }


def test_dropout_drops_the_adapters_input_in_training_only():
  """`lora.dropout` on the Llama: the train loss moves, the eval loss does not, keys from the step.

  At the same weights (B random: at zero the adapters add nothing) and in
  float32: the train-mode loss with dropout differs from the loss without,
  the eval-mode losses are equal bit for bit (evals, sampling and export
  build the model in eval mode), the same (seed, step) key gives the same
  loss and another step another. Gradients are the adapters' alone. No
  run: the loss function alone, jitted, at fixed weights.
  """
  assert jax.config.jax_threefry_partitionable  # the masks' bits, whatever the mesh
  config = _tiny_llama_config()
  config.train.precision = "float32"
  task, mesh = make_task(config), create_mesh("data=-1")
  plain = make_state(task.model, config, mesh)
  config.lora.dropout = 0.5
  dropped = make_state(task.model, config, mesh)
  assert jax.tree.leaves(dropped.abstract_rng_state) and dropped.abstract == plain.abstract
  params = _with_random_b(plain, jax.device_get(plain.init()["params"]))
  batch = jax.device_put(_token_rows(config, 8), batch_sharding(mesh, ("data",)))

  def loss(setup, train):
    step = jax.jit(loss_fn(setup, task, train))

    def at(n):
      loss_sum, (weight, _, _) = step(params, None, batch, step_key(config.seed, jnp.int32(n)))
      return float(loss_sum / weight)

    return at

  without = loss(plain, True)(1)
  assert loss(dropped, False)(1) == without  # eval mode: no dropout, the same computation
  trained = loss(dropped, True)
  with_dropout = trained(1)
  assert abs(with_dropout - without) > 1e-3, (with_dropout, without)
  assert trained(1) == with_dropout
  assert trained(2) != with_dropout
  # Gradients of the adapters alone (the compiled step's matmuls:
  # `test_the_llama_computes_no_gradient_of_its_frozen_weights`, with dropout).
  value_and_grad = trainable.value_and_grad(loss_fn(dropped, task, True), dropped.trainable_paths)
  _, grads = jax.eval_shape(value_and_grad, params, None, batch, step_key(config.seed, 1))
  adapters = trainable.split(params, dropped.trainable_paths)[0]
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)


def test_dropout_masks_are_the_same_bits_on_any_mesh():
  """What a resume on another host count relies on: each mask element comes from the key and
  its index alone, however the input is split (JAX's partitionable threefry)."""
  assert jax.config.jax_threefry_partitionable
  x = jnp.ones((16, 8, 32), jnp.bfloat16)
  key = jax.random.key(3)
  whole = np.asarray(jax.jit(lambda x: lora.dropout(x, 0.25, key))(x))
  assert 0 < (whole == 0).mean() < 0.5
  for ici, spec in (("data=8", P("data")), ("data=2,fsdp=4", P("data", None, "fsdp"))):
    sharding = jax.sharding.NamedSharding(create_mesh(ici), spec)
    drop = jax.jit(lambda x: lora.dropout(x, 0.25, key), out_shardings=sharding)
    split = drop(jax.device_put(x, sharding))
    assert split.sharding.spec == spec
    np.testing.assert_array_equal(np.asarray(split), whole, err_msg=ici)


def test_dropout_needs_a_model_that_shows_the_adapters_input():
  """A model handed `W + s A B` (a user's conv net) never shows `x`: dropout is refused, named."""
  config, task = _conv_config(), _task()
  config.lora.dropout = 0.1
  with pytest.raises(ValueError, match=r"^lora.dropout=0.1 needs a model that applies its "):
    make_state(task.model, config, create_mesh("data=-1"))
  config = _tiny_llama_config()
  config.lora.dropout = 0.1
  settings = lora.settings_from_config(config.lora)
  model = nnx.eval_shape(lambda: make_task(config).model(nnx.Rngs(0)))
  lora.check_dropout(settings, model)  # the Llama applies its adapters itself
  jax.config.update("jax_threefry_partitionable", False)
  try:
    with pytest.raises(ValueError, match=r"needs jax_threefry_partitionable=True"):
      lora.check_dropout(settings, model)
  finally:
    jax.config.update("jax_threefry_partitionable", True)


def test_the_weights_a_merging_model_is_built_with_are_the_steps_under_bfloat16():
  """A model handed `W + s A B` (a user's): merged in float32, then cast as W is.

  The train step, the eval step and the evals' scorer build the model
  through `model_weights`; casting A and B first and merging after would
  hand the scorer float32 weights, computed otherwise than in training.
  """
  config, task = _conv_config("bfloat16"), _task()
  setup = make_state(task.model, config, create_mesh("data=-1"))
  assert setup.merges_adapters and not setup.casts_own_weights
  params = _with_random_b(setup, jax.device_get(setup.init()["params"]))
  weights = model_weights(setup, Precision("bfloat16"), params)
  expected = lora.merged(params, setup.adapters)["conv"]["kernel"].astype(jnp.bfloat16)
  assert weights["conv"]["kernel"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(weights["conv"]["kernel"], expected)
