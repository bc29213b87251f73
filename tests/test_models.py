"""The models: shapes, causality, annotations, and sharded init and training on 8 CPU devices."""

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import lm_tiny_bytes
from spmd import rules
from spmd.mesh import create_mesh
from tests.session_settings import DEFAULT_EMITTERS
from trainers.models import decode, logical_axes, param
from trainers.models.mlp import MLPClassifier, MLPConfig
from trainers.models.transformer import (
  TransformerConfig,
  TransformerLM,
  flops_per_token,
  param_count,
)
from trainers.step.state import make_state

P = jax.sharding.PartitionSpec
# Every size divides a fsdp=2 x tensor=2 mesh.
# One layer: every extra layer adds compile time, not coverage (param_count checks three).
SMALL = TransformerConfig(
  vocab_size=256, seq_len=32, num_layers=1, d_model=64, num_heads=4, d_ff=128
)
# Two layers: the smallest stack where the order of the layers matters.
TWO_LAYERS = TransformerConfig(
  vocab_size=64, seq_len=16, num_layers=2, d_model=32, num_heads=2, d_ff=64
)
# Enough for the loss on a fixed batch of repetitive text to halve (it does by ~10).
STEPS = 20
TEXT = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 8, np.uint8)


def _is_var(x):
  return isinstance(x, nnx.Variable)


@dataclasses.dataclass
class Init:
  """A compiled parameter init: `init(seed)` is the state, placed by `shardings`."""

  graphdef: nnx.GraphDef
  shardings: Any  # None, or the state's NamedShardings
  init: Callable[[int], Any]


def _compile_init(config, mesh=None, rule_set=rules.FSDP_TP) -> Init:
  """One jitted init, as a trainer does it: the parameters are born sharded.

  One compiled init is much faster than eager op-by-op init, and the key is
  an argument, so another seed reuses the compiled program.
  """
  make = lambda key: TransformerLM(config, rngs=nnx.Rngs(key))  # noqa: E731
  graphdef, abstract = nnx.split(nnx.eval_shape(make, jax.random.key(0)))
  shardings = None
  if mesh is not None:
    shardings = rules.logical_to_sharding(logical_axes(abstract), mesh, rule_set, shapes=abstract)
  init = jax.jit(lambda key: nnx.split(make(key))[1], out_shardings=shardings)
  return Init(graphdef, shardings, lambda seed: init(jax.random.key(seed)))


# Compiling is most of these tests' time (a CI machine may have 2 cores), so
# the meshes, inits and forward pass are built once per module and shared.
@pytest.fixture(scope="module")
def mesh():
  return create_mesh("data=-1,fsdp=2,tensor=2")


@pytest.fixture(scope="module")
def sharded_init(mesh):
  return _compile_init(SMALL, mesh=mesh)


@pytest.fixture(scope="module")
def small(sharded_init):
  """The small model's (graphdef, params), params sharded as the trainer would."""
  return sharded_init.graphdef, sharded_init.init(0)


@pytest.fixture(scope="module")
def forward():
  return jax.jit(
    lambda graphdef, state, tokens: nnx.merge(graphdef, state)(tokens), static_argnums=0
  )


def _windows(batch, length):
  """Overlapping windows of a repetitive text: learnable next-token targets."""
  return jnp.asarray(np.stack([TEXT[i * 3 : i * 3 + length] for i in range(batch)]), jnp.int32)


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(d_model=64, num_heads=3), "d_model=64 is not divisible by num_heads=3"),
    (dict(num_layers=0), "num_layers=0 must be a positive integer"),
    (dict(vocab_size=-1), "vocab_size=-1 must be a positive integer"),
    (dict(dtype="int32"), "dtype='int32' is not a floating point dtype"),
    (dict(param_dtype="floaty"), "param_dtype='floaty' is not a dtype"),
    (dict(scan_unroll=0), "scan_unroll=0 must be a positive integer"),
    (dict(scan_unroll=True), "scan_unroll=True must be a positive integer"),
    (dict(remat_policy="full"), r"remat_policy='full' is not one of \('minimal', 'none'\)"),
  ],
)
def test_config_errors_name_the_values(kwargs, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig(**kwargs)


def test_logits_shape_and_dtype(small, forward):
  graphdef, state = small
  logits = forward(graphdef, state, _windows(4, SMALL.seq_len))
  assert logits.shape == (4, SMALL.seq_len, SMALL.vocab_size)
  assert logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()
  assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype("float32")}
  assert forward(graphdef, state, _windows(2, 5)).shape == (2, 5, SMALL.vocab_size)
  with pytest.raises(ValueError, match="longer than seq_len=32"):
    forward(graphdef, state, _windows(1, SMALL.seq_len + 1))


def test_logits_at_t_do_not_depend_on_later_tokens(small, forward):
  graphdef, state = small
  a = _windows(2, SMALL.seq_len)
  t = 10
  b = a.at[:, t + 1 :].set((a[:, t + 1 :] + 7) % SMALL.vocab_size)
  la, lb = forward(graphdef, state, a), forward(graphdef, state, b)
  # Masked scores get probability exactly 0, so earlier positions match bit for bit.
  np.testing.assert_array_equal(la[:, : t + 1], lb[:, : t + 1])
  assert not np.allclose(la[:, t + 1 :], lb[:, t + 1 :])  # the test can see a change


@pytest.mark.parametrize(
  "config",
  [
    SMALL,
    TransformerConfig(vocab_size=100, seq_len=7, num_layers=3, d_model=24, num_heads=3, d_ff=40),
  ],
)
@pytest.mark.parametrize("scan_layers", [True, False])
def test_param_count_matches_the_model(config, scan_layers):
  config = dataclasses.replace(config, scan_layers=scan_layers)
  abstract = nnx.state(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))), nnx.Param)
  assert param_count(config) == sum(x.size for x in jax.tree.leaves(abstract))


def test_flops_per_token_is_palm_accounting():
  d, f, v, s, n = 64, 128, 256, 32, 1
  non_embedding = n * (4 * d * d + 2 * d * f + 4 * d) + 2 * d + d * v
  assert flops_per_token(SMALL) == 6 * non_embedding + 12 * n * d * s


def _names_and_shapes(state):
  axes = jax.tree.leaves(logical_axes(state), is_leaf=_is_var)
  return [(a.get_value(), x.shape) for a, x in zip(axes, jax.tree.leaves(state), strict=True)]


@pytest.mark.parametrize("model", ["transformer", "mlp"])
def test_logical_axes_line_up_with_param_leaves(model):
  if model == "transformer":
    make = lambda: TransformerLM(SMALL, rngs=nnx.Rngs(0))  # noqa: E731
  else:
    config = MLPConfig(input_dim=12, hidden_sizes=(16, 8, 4), num_classes=5)
    make = lambda: MLPClassifier(config, rngs=nnx.Rngs(0))  # noqa: E731
  abstract_model = nnx.eval_shape(make)
  state = nnx.state(abstract_model, nnx.Param)
  axes = logical_axes(state)
  # A module gives the same answer as its state.
  assert jax.tree.structure(logical_axes(abstract_model)) == jax.tree.structure(axes)
  tuples = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  assert len(tuples) == len(jax.tree.leaves(state))
  for names, shape in _names_and_shapes(state):
    assert len(names) == len(shape)
    assert set(names) <= set(rules.LOGICAL_AXES), names
  # With variables as leaves both trees have one structure: the shardings can be jit's.
  assert jax.tree.structure(axes, is_leaf=_is_var) == jax.tree.structure(state, is_leaf=_is_var)


def test_logical_axes_names_a_parameter_without_annotations():
  class Mixed(nnx.Module):
    def __init__(self, rngs):
      self.good = param(rngs, nnx.initializers.zeros, (2,), ("embed",))
      self.plain = nnx.Linear(2, 3, rngs=rngs)

  with pytest.raises(ValueError, match=r"\['plain'\]\['bias'\].*no logical axes"):
    logical_axes(Mixed(nnx.Rngs(0)))
  with pytest.raises(ValueError, match="not in LOGICAL_AXES"):
    param(nnx.Rngs(0), nnx.initializers.zeros, (2,), ("hidden",))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_fsdp_tp_puts_model_dims_on_tensor_and_embed_on_fsdp(mesh, scan_layers):
  config = dataclasses.replace(SMALL, scan_layers=scan_layers)
  state = nnx.state(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))), nnx.Param)
  shardings = rules.logical_to_sharding(logical_axes(state), mesh, rules.FSDP_TP, shapes=state)
  assert jax.tree.structure(shardings) == jax.tree.structure(state)
  # "layers" is missing on purpose: the stacked axis is never split.
  expected_axis = {"mlp": "tensor", "heads": "tensor", "vocab": "tensor", "embed": "fsdp"}
  specs = [s.spec for s in jax.tree.leaves(shardings)]
  for (names, shape), spec in zip(_names_and_shapes(state), specs, strict=True):
    padded = (*spec, *[None] * (len(shape) - len(spec)))
    assert padded == tuple(expected_axis.get(n) for n in names), (names, spec)
  assert shardings["token_embed"].get_value().spec == P("tensor", "fsdp")
  if scan_layers:
    block, layer = shardings["blocks"], (None,)
  else:
    block, layer = shardings["blocks"][0], ()
  assert block["attn"]["out"].get_value().spec == P(*layer, "tensor", None, "fsdp")
  assert block["mlp"]["wo"].get_value().spec == P(*layer, "tensor", "fsdp")
  assert shardings["final_norm"]["scale"].get_value().spec == P()


def test_every_preset_leaves_the_layers_axis_whole():
  assert "layers" in rules.LOGICAL_AXES
  for name, rule_set in rules.PRESETS.items():
    assert dict(rule_set)["layers"] is None, name


@pytest.mark.parametrize("rules_name", ["fsdp", "fsdp_tp"])
def test_make_state_shards_stacked_params_like_their_layers(mesh, rules_name):
  """The trainer's shardings: each stacked weight is split like one layer's, whole along layers."""
  config = lm_tiny_bytes.get_config()
  config.mesh.rules = rules_name

  def setup(scan_layers):
    model_config = dataclasses.replace(TWO_LAYERS, scan_layers=scan_layers)
    return make_state(lambda rngs: TransformerLM(model_config, rngs=rngs), config, mesh)

  scanned, unrolled = setup(True), setup(False)
  stacked, per_layer = scanned.shardings["params"]["blocks"], unrolled.shardings["params"]["blocks"]
  shapes = scanned.abstract["params"]["blocks"]
  for i in range(TWO_LAYERS.num_layers):
    layer_specs = jax.tree.map(lambda s: s.spec, per_layer[i])
    assert jax.tree.map(lambda s: s.spec, stacked) == jax.tree.map(
      lambda spec: P(None, *spec) if spec else P(), layer_specs
    )
  for x in jax.tree.leaves(shapes):
    assert x.shape[0] == TWO_LAYERS.num_layers
  tp = ("tensor",) if rules_name == "fsdp_tp" else ()  # PartitionSpecs drop trailing Nones
  assert stacked["attn"]["query"].spec == P(None, "fsdp", *tp)
  assert stacked["mlp"]["wi"].spec == P(None, "fsdp", *tp)
  assert stacked["mlp_norm"]["scale"].spec == P()
  assert scanned.shardings["params"]["unembed"].spec == P("fsdp", *tp)
  # Adam's moments follow the stacked parameters.
  mu = scanned.shardings["opt_state"][1][0].mu  # chain(clip, adamw(scale_by_adam, ...))
  assert mu["blocks"]["attn"]["out"] == stacked["attn"]["out"]


@pytest.mark.slow
def test_scanned_and_unrolled_models_are_the_same_model():
  """Same seed, same weights (the stack's row i is block i), same logits and gradients."""
  tokens = _windows(4, TWO_LAYERS.seq_len + 1) % TWO_LAYERS.vocab_size

  models = {}  # scan_layers: (graphdef, params), the model each layout initialises

  def init_and_grads(scan_layers):
    config = dataclasses.replace(TWO_LAYERS, scan_layers=scan_layers)

    def run(tokens):
      graphdef, params = nnx.split(TransformerLM(config, rngs=nnx.Rngs(0)), nnx.Param)

      def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return ce.mean(), logits

      (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
      return params, logits, nnx.to_pure_dict(grads)

    # XLA's default emitters: the classic ones the suite compiles with differ in the
    # last bit between the layouts (tests/session_settings.py).
    params, logits, grads = jax.jit(run, compiler_options=DEFAULT_EMITTERS)(tokens)
    graphdef = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))[0]
    models[scan_layers] = graphdef, params
    return nnx.to_pure_dict(params), logits, grads

  scanned, unrolled = init_and_grads(True), init_and_grads(False)

  def forward_jaxpr(scan_layers):
    graphdef, params = models[scan_layers]
    return str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens[:, :-1]))(params))

  # The scanned layer is rematerialised (jax.checkpoint, printed "remat2" or "checkpoint"
  # depending on the JAX version, inside the scan); the unrolled one is not.
  for scan_layers in (True, False):
    jaxpr = forward_jaxpr(scan_layers)
    assert bool(re.search(r"\b(remat\w*|checkpoint)\[", jaxpr)) == scan_layers
    assert ("scan[" in jaxpr) == scan_layers
  # Stack the unrolled blocks the way the scanned model stores them.
  layers = [unrolled[0]["blocks"][i] for i in range(TWO_LAYERS.num_layers)]
  stacked = dict(unrolled[0], blocks=jax.tree.map(lambda *xs: jnp.stack(xs), *layers))
  for a, b in zip(jax.tree.leaves(scanned[0]), jax.tree.leaves(stacked), strict=True):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(layers[0]["mlp"]["wi"], layers[1]["mlp"]["wi"])
  np.testing.assert_allclose(scanned[1], unrolled[1], rtol=1e-5, atol=1e-5)
  grad_layers = [unrolled[2]["blocks"][i] for i in range(TWO_LAYERS.num_layers)]
  stacked_grads = dict(unrolled[2], blocks=jax.tree.map(lambda *xs: jnp.stack(xs), *grad_layers))
  for a, b in zip(jax.tree.leaves(scanned[2]), jax.tree.leaves(stacked_grads), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # Greedy decoding reads the model only through its forward pass, in either layout
  # (the models initialised above: an eager init compiles each of its ops on its own).
  samples = [
    decode.generate(nnx.merge(*models[scan]), tokens[:, :3], num_tokens=5) for scan in (True, False)
  ]
  np.testing.assert_array_equal(*samples)


@pytest.mark.slow
def test_unrolling_the_scan_or_dropping_the_remat_is_the_same_model():
  """scan_unroll and remat_policy change how the layers run, not what they compute."""
  tokens = _windows(4, TWO_LAYERS.seq_len + 1) % TWO_LAYERS.vocab_size

  # One set of weights for every variant (they differ in how they run, not in their
  # parameters), from one compiled init: an eager init compiles each of its ops on its own.
  params = _compile_init(TWO_LAYERS).init(0)

  def logits_and_grads(unroll, remat_policy="minimal"):
    config = dataclasses.replace(TWO_LAYERS, scan_unroll=unroll, remat_policy=remat_policy)
    graphdef = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))[0]

    def loss(params):
      logits = nnx.merge(graphdef, params)(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits

    # Compiled once: the program that runs is the one whose text is read. XLA's default
    # emitters, which keep the while loop (tests/session_settings.py).
    grads_of = jax.jit(jax.value_and_grad(loss, has_aux=True), compiler_options=DEFAULT_EMITTERS)
    compiled = grads_of.lower(params).compile()
    (_, logits), grads = compiled(params)
    return logits, nnx.to_pure_dict(grads), compiled.as_text()

  looped, unrolled = logits_and_grads(1), logits_and_grads(2)
  for other in (unrolled, logits_and_grads(2, "none"), logits_and_grads(1, "none")):
    np.testing.assert_allclose(looped[0], other[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(looped[1]), jax.tree.leaves(other[1]), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert " while(" in looped[2] and " while(" not in unrolled[2]
  # That the unrolled layers are still rematerialised is checked by counting
  # the compiled matmul FLOPs (tests/test_plan.py, unrolled layers).


def _optimizer_shardings(opt_state, mesh, rule_set=rules.FSDP_TP):
  """Moments placed like their parameters; anything else (the step count) replicated.

  optax builds its moments with tree maps over the parameter state, so they
  are the same `nnx.Param`s with the same `out_sharding` metadata and
  `logical_axes` reads them too.
  """
  replicated = jax.sharding.NamedSharding(mesh, P())

  def place(x):
    if _is_var(x):
      return rules.logical_to_sharding(logical_axes(x), mesh, rule_set)
    return replicated

  return jax.tree.map(place, opt_state, is_leaf=_is_var)


@pytest.mark.slow
def test_sharded_train_step_lowers_the_loss(mesh, sharded_init):
  graphdef, shardings = sharded_init.graphdef, sharded_init.shardings
  params = sharded_init.init(0)
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  batch_sharding = jax.sharding.NamedSharding(
    mesh, rules.logical_to_spec(("batch", "length"), rules.FSDP_TP, mesh)
  )
  tokens = jax.device_put(_windows(8, SMALL.seq_len + 1), batch_sharding)
  tx = optax.adamw(3e-3)
  opt_shardings = _optimizer_shardings(jax.eval_shape(tx.init, params), mesh)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
  adam = opt_state[0]  # adamw = chain(scale_by_adam, add_decayed_weights, scale_by_lr)
  assert adam.mu["unembed"].get_value().sharding.spec == P("fsdp", "tensor")

  # Outputs pinned to the input shardings: otherwise XLA may return another
  # layout and the second call compiles the step again.
  @functools.partial(
    jax.jit,
    out_shardings=(shardings, opt_shardings, jax.sharding.NamedSharding(mesh, P())),
    donate_argnums=(0, 1),
  )
  def step(params, opt_state, tokens):
    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  # Nothing crosses a device or host boundary in the loop (a stray float(loss) would raise).
  with jax.transfer_guard("disallow"):
    for _ in range(STEPS):
      params, opt_state, loss = step(params, opt_state, tokens)
      losses.append(loss)
  assert step._cache_size() == 1  # one compile: the shardings are stable
  losses = np.asarray(jnp.stack(losses))
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0], losses
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
    assert x.sharding.is_equivalent_to(s, x.ndim)


def test_bfloat16_compute_keeps_float32_params_and_logits(small, forward):
  graphdef, state = small
  bf16 = dataclasses.replace(SMALL, dtype="bfloat16")
  bf16_graphdef = nnx.split(nnx.eval_shape(lambda: TransformerLM(bf16, rngs=nnx.Rngs(0))))[0]
  tokens = _windows(2, SMALL.seq_len)
  logits = forward(bf16_graphdef, state, tokens)
  assert logits.dtype == jnp.float32
  np.testing.assert_allclose(logits, forward(graphdef, state, tokens), atol=0.1)
  jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(bf16_graphdef, s)(tokens))(state))
  dots = [line.split("=")[0] for line in jaxpr.splitlines() if "dot_general" in line]
  assert sum("bf16[" in out for out in dots) >= 6, dots  # q, k, v, probs @ v, out, MLP...
  # Gradients come back in the parameters' float32 (shapes only: no compile needed).
  grads = jax.eval_shape(jax.grad(lambda s: nnx.merge(bf16_graphdef, s)(tokens).mean()), state)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype("float32")}


def test_cached_generate_is_greedy_and_deterministic(small, forward):
  graphdef, state = small
  model = nnx.merge(graphdef, state)
  prompt = _windows(2, 4)
  out = decode.generate(model, prompt, num_tokens=SMALL.seq_len - 4)
  assert out.shape == (2, SMALL.seq_len) and out.dtype == jnp.int32
  np.testing.assert_array_equal(out[:, :4], prompt)
  np.testing.assert_array_equal(out, decode.generate(model, prompt, num_tokens=SMALL.seq_len - 4))
  # Every added token is the argmax after the tokens before it (a host round
  # trip makes the input look like the other tests', so the forward is cached).
  logits = forward(graphdef, state, jnp.asarray(np.asarray(out)))
  np.testing.assert_array_equal(jnp.argmax(logits[:, 3:-1], axis=-1), out[:, 4:])
  with pytest.raises(ValueError, match=r"num_tokens=32 must be at most max_len=32"):
    decode.generate(model, prompt, num_tokens=SMALL.seq_len)


def test_same_seed_gives_identical_params_on_any_mesh(small, sharded_init):
  # Partitionable threefry makes each random bit depend on its index only,
  # not on which device computes it (JAX's default since 0.5).
  assert jax.config.jax_threefry_partitionable
  _, sharded = small
  one_device = _compile_init(SMALL, mesh=create_mesh("data=1", devices=jax.devices()[:1]))
  unsharded = one_device.init(0)
  assert sharded["token_embed"].get_value().sharding.spec == P("tensor", "fsdp")
  assert len(unsharded["token_embed"].get_value().sharding.device_set) == 1
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded), strict=True):
    np.testing.assert_array_equal(a, b)
  other_seed = sharded_init.init(1)
  assert not np.array_equal(sharded["unembed"].get_value(), other_seed["unembed"].get_value())


def test_mlp_classifier_shapes_and_shardings(mesh):
  config = MLPConfig(input_dim=16, hidden_sizes=(32, 32), num_classes=10, dtype="bfloat16")
  model = nnx.eval_shape(lambda: MLPClassifier(config, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  shardings = rules.logical_to_sharding(logical_axes(state), mesh, rules.FSDP_TP, shapes=state)
  assert shardings["hidden"][0]["kernel"].get_value().spec == P("fsdp", "tensor")
  assert shardings["hidden"][1]["kernel"].get_value().spec == P("tensor", "fsdp")
  assert shardings["head"]["kernel"].get_value().spec == P("fsdp")
  # Shapes only (the doctests run the MLP for real).
  logits = nnx.eval_shape(lambda m, x: m(x), model, jax.ShapeDtypeStruct((8, 16), jnp.float32))
  assert logits.shape == (8, 10) and logits.dtype == jnp.float32
  with pytest.raises(ValueError, match=r"hidden_sizes\[1\]=0 must be a positive integer"):
    MLPConfig(input_dim=4, hidden_sizes=(8, 0))
