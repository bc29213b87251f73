"""LoRA adapters for any NNX model: low-rank `A`, `B` beside chosen weights (`config.lora`).

A weight `W` that a pattern of `config.lora.targets` matches (searched in its
parameter path, "blocks/attn/query", "encoder/conv/kernel") gets two
`nnx.LoRAParam`s on the module that holds it, named after it:

  W            [*stack, *in, *out]   frozen: no gradient, no optimizer state
  W_lora_a     [*stack, *in, rank]   float32, uniform(+-1/sqrt(in)) as peft's
                                     kaiming_uniform(a=sqrt(5)) draws it
  W_lora_b     [*stack, rank, *out]  float32, zeros: step 0 is the base model

and the model computes with `W + (alpha / rank) * A @ B` (peft's scale,
without rslora). `stack` is the leading dims named "layers" (stacked
layers); `in` the dims the product contracts: all dims but the last unless
the model says otherwise (`lora_input_dims`). So a `nnx.Linear` kernel
[in, out], a `nnx.Conv` kernel [kh, kw, c_in, c_out] (peft's conv LoRA: A a
convolution with W's window, B a 1x1 one) and the built-in Llama's query
[layers, embed, heads, kv] all take the same form. A and B are annotated
with W's logical names (the rank axis unnamed), so the mesh rules shard
them as they shard W's input and output.

Two ways to apply them:

- the weight (any model): the step hands the model `W + s A B` in W's
  place (`merged`). It works on any parameter of any NNX model, a user's
  `nnx.Linear`, `nnx.Einsum`, `nnx.Conv` or a bare `nnx.Param` read by its
  own code, with no change to the model's code or its parameter paths (an
  HF import, the mesh rules and a warm start see the same names). Its cost:
  each step forms `W + s A B` (`in * out * rank` multiply-adds per weight)
  and the gradient of that sum, a weight-shaped array, from which A's and
  B's come; under bfloat16 the sum is rounded as W is.
- the activations (a model with `applies_lora = True`, the built-in
  Llama): its products add `s (x A) B` to `x W` themselves (`low_rank`), as
  peft does. No weight-shaped array is formed and no gradient of a frozen
  weight is computed.

`lora.dropout` (peft's `lora_dropout`) drops the adapters' input in
training, `x W + s dropout(x) A B`, never the frozen path's: on the second
way only, as a mask on `x` (one per token and feature) is no edit of a
weight every token shares; a model handed merged weights refuses it
(`check_dropout`). Each adapted weight holds an `nnx.RngKey` (one per layer
of a stack) that the step reseeds from the seed, the step and the
micro-batch (`trainers.step.state.build_model`), so a resume draws the same
masks, and JAX's partitionable threefry makes them the same bits on any
mesh. The module is built in eval mode (`deterministic`): only the train
step's `model.train()` drops anything; evals, sampling and exports never do.

PEFT's names map one to one: layer N of `blocks/attn/query_lora_a`
[layers, d_model, rank] is `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`,
reshaped to [d_model, rank] and transposed (torch stores [rank, in]); `B` is
`lora_B.weight`, [out, rank].

Models may name their targets and input dims (class attributes):
`lora_targets` maps short names to patterns ("q" -> "attn/query$"), and
`lora_input_dims` maps a pattern to the number of input dims of the
weights it matches.

Example:
  >>> from flax import nnx
  >>> model = nnx.eval_shape(lambda: nnx.Linear(6, 4, rngs=nnx.Rngs(0)))
  >>> settings = LoRASettings(rank=2, alpha=4.0, targets=("kernel",))
  >>> [(a.path, a.stack, a.inputs, a.scale) for a in find_adapters(model, settings)]
  [(('kernel',), 0, 1, 2.0)]
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from trainers.models.layers import dense

A_SUFFIX, B_SUFFIX, SCALE_SUFFIX = "_lora_a", "_lora_b", "_lora_scale"
# With `lora.dropout` > 0 (the adapters' input dropout, `low_rank`): the rate,
# static, and an `nnx.RngKey` that the step reseeds from (seed, step, micro-batch).
DROPOUT_SUFFIX, KEY_SUFFIX = "_lora_dropout", "_lora_key"


@dataclasses.dataclass(frozen=True)
class LoRASettings:
  """`config.lora`, checked: rank, alpha, dropout and the target patterns.

  Example:
    >>> LoRASettings(rank=0, targets=("kernel",))
    Traceback (most recent call last):
    ...
    ValueError: lora.rank=0 must be a positive integer
  """

  rank: int = 16
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = ()

  def __post_init__(self):
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f"lora.rank={self.rank!r} must be a positive integer")
    if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or self.alpha <= 0:
      raise ValueError(f"lora.alpha={self.alpha!r} must be a number > 0")
    if (
      isinstance(self.dropout, bool)
      or not isinstance(self.dropout, int | float)
      or not 0 <= self.dropout < 1
    ):
      raise ValueError(f"lora.dropout={self.dropout!r} must be a number in [0, 1)")
    for pattern in self.targets:
      try:
        re.compile(pattern)
      except (re.error, TypeError) as e:
        raise ValueError(f"lora.targets: {pattern!r} is not a regex: {e}") from None

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank


def settings_from_config(lora: ml_collections.ConfigDict | None) -> LoRASettings | None:
  """`config.lora` as `LoRASettings`, or None when LoRA is off (no targets).

  `lora.targets` is a tuple of patterns or one comma-separated string.

  Example:
    >>> config = ml_collections.ConfigDict(dict(rank=8, alpha=16.0, dropout=0.0, targets="q,v"))
    >>> settings_from_config(config).targets, settings_from_config(config).scale
    (('q', 'v'), 2.0)
  """
  if lora is None:
    return None
  targets = lora.targets
  if isinstance(targets, str):
    targets = tuple(t.strip() for t in targets.split(",") if t.strip())
  if not targets:
    return None
  return LoRASettings(
    rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(targets)
  )


@dataclasses.dataclass(frozen=True)
class Adapter:
  """One weight's adapter: where the weight is and how its dims split."""

  path: tuple[str, ...]  # the weight's path in the parameter state
  shape: tuple[int, ...]
  names: tuple | None  # the weight's logical names (None: unannotated)
  stack: int  # leading dims named "layers"
  inputs: int  # the dims after them that the product contracts
  rank: int
  scale: float
  dropout: float = 0.0  # of the adapter's input, in training (`low_rank`)

  @property
  def a_path(self) -> tuple[str, ...]:
    return (*self.path[:-1], self.path[-1] + A_SUFFIX)

  @property
  def b_path(self) -> tuple[str, ...]:
    return (*self.path[:-1], self.path[-1] + B_SUFFIX)

  def _split(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    s, i = self.stack, self.stack + self.inputs
    return self.shape[:s], self.shape[s:i], self.shape[i:]

  @property
  def a_shape(self) -> tuple[int, ...]:
    stack, inputs, _ = self._split()
    return (*stack, *inputs, self.rank)

  @property
  def b_shape(self) -> tuple[int, ...]:
    stack, _, outputs = self._split()
    return (*stack, self.rank, *outputs)

  def a_names(self) -> tuple | None:
    if self.names is None:
      return None
    return (*self.names[: self.stack + self.inputs], None)

  def b_names(self) -> tuple | None:
    if self.names is None:
      return None
    s, i = self.stack, self.stack + self.inputs
    return (*self.names[:s], None, *self.names[i:])

  def delta(self, a: jax.Array, b: jax.Array) -> jax.Array:
    """`scale * A @ B` in W's shape, float32."""
    stack, inputs, outputs = self._split()
    a = a.astype(jnp.float32).reshape(*stack, math.prod(inputs), self.rank)
    b = b.astype(jnp.float32).reshape(*stack, self.rank, math.prod(outputs))
    return (self.scale * jnp.matmul(a, b)).reshape(self.shape)

  def dropout_key(self, seed: int) -> jax.Array:
    """A key for the input dropout, one per layer of a stack ([*stack] keys)."""
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32("/".join(self.path).encode()))
    stack = self.shape[: self.stack]
    return jax.random.split(key, stack) if stack else key

  def initial(self, seed: int) -> tuple[jax.Array, jax.Array]:
    """(A, B) at the start: A uniform(+-1/sqrt(fan_in)) from the seed and W's path, B zeros."""
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32("/".join(self.path).encode()))
    bound = 1.0 / math.sqrt(math.prod(self._split()[1]))
    a = jax.random.uniform(key, self.a_shape, jnp.float32, -bound, bound)
    return a, jnp.zeros(self.b_shape, jnp.float32)


def _path_name(path: Sequence[Any]) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _patterns(model: Any, targets: Sequence[str]) -> list[tuple[str, str]]:
  """(as given, regex) for each target: a model's short name expands to its pattern."""
  aliases: Mapping[str, str] = getattr(model, "lora_targets", {}) or {}
  return [(t, aliases.get(t, t)) for t in targets]


def _input_dims(model: Any, name: str, free: int) -> int:
  for pattern, inputs in (getattr(model, "lora_input_dims", {}) or {}).items():
    if re.search(pattern, name):
      return inputs
  return free - 1


def find_adapters(model: nnx.Module, settings: LoRASettings) -> list[Adapter]:
  """The adapters `settings` put on `model`'s parameters (a model or its `nnx.eval_shape`).

  Raises:
    ValueError: a target that matches no parameter (naming the parameters
      there are), or a matched weight with fewer than 2 dims besides its stack.
  """
  patterns = _patterns(model, settings.targets)
  found: dict[str, Adapter] = {}
  matched = {given: 0 for given, _ in patterns}
  flat = jax.tree_util.tree_flatten_with_path(
    nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]
  names_seen = []
  for path, var in flat:
    if isinstance(var, nnx.LoRAParam):
      continue
    name = _path_name(path)
    names_seen.append(name)
    hits = [given for given, regex in patterns if re.search(regex, name)]
    if not hits:
      continue
    for given in hits:
      matched[given] += 1
    shape = tuple(var.get_value().shape)
    names = var.get_metadata("out_sharding", None)
    names = None if names is None else tuple(names)
    stack = 0
    while names is not None and stack < len(names) and names[stack] == "layers":
      stack += 1
    free = len(shape) - stack
    if free < 2:
      raise ValueError(
        f"lora.targets: {hits[0]!r} matches {name} of shape {shape}, which is not a matrix "
        "(a LoRA target needs an input and an output dim)"
      )
    inputs = _input_dims(model, name, free)
    if not 1 <= inputs < free:
      raise ValueError(f"lora: {name} of shape {shape}: {inputs} input dims of {free}")
    found[name] = Adapter(
      path=tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path),
      shape=shape,
      names=names,
      stack=stack,
      inputs=inputs,
      rank=settings.rank,
      scale=settings.scale,
      dropout=float(settings.dropout),
    )
  for given, regex in patterns:
    if not matched[given]:
      shown = given if given == regex else f"{given} ({regex})"
      raise ValueError(
        f"lora.targets: {shown!r} matches no parameter of the model; its parameters: "
        + ", ".join(names_seen)
      )
  return list(found.values())


def _module_at(model: nnx.Module, path: Sequence[str]) -> Any:
  node = model
  for key in path:
    node = node[int(key)] if key.isdigit() and not hasattr(node, key) else getattr(node, key)
  return node


def add_adapters(model: nnx.Module, adapters: Sequence[Adapter], seed: int) -> nnx.Module:
  """`model` with each adapter's A and B set on the module holding its weight (in place).

  Example:
    >>> model = add_adapters(nnx.Linear(6, 4, rngs=nnx.Rngs(0)),
    ...                      find_adapters(nnx.Linear(6, 4, rngs=nnx.Rngs(0)),
    ...                                    LoRASettings(rank=2, targets=("kernel",))), seed=0)
    >>> model.kernel_lora_a.shape, model.kernel_lora_b.shape, float(model.kernel_lora_b[...].sum())
    ((6, 2), (2, 4), 0.0)
  """
  for adapter in adapters:
    module = _module_at(model, adapter.path[:-1])
    a, b = adapter.initial(seed)
    for name, value, names in (
      (adapter.a_path[-1], a, adapter.a_names()),
      (adapter.b_path[-1], b, adapter.b_names()),
    ):
      metadata = {} if names is None else {"out_sharding": names, "eager_sharding": False}
      setattr(module, name, nnx.LoRAParam(value, **metadata))
    # Static (no array): for a model that applies its adapters itself (`low_rank`).
    setattr(module, adapter.path[-1] + SCALE_SUFFIX, adapter.scale)
    if adapter.dropout:
      setattr(module, adapter.path[-1] + DROPOUT_SUFFIX, adapter.dropout)
      # A key per layer of a stack; the step replaces it (`state.build_model`).
      setattr(module, adapter.path[-1] + KEY_SUFFIX, nnx.RngKey(adapter.dropout_key(seed)))
      if not hasattr(module, "deterministic"):
        # NNX's switch, flipped by `model.train()` and `model.eval()`: built
        # in eval mode, so only the train step's model drops anything.
        module.deterministic = True
  return model


def low_rank(module: nnx.Module, name: str, x: jax.Array, contract: int = 1) -> jax.Array | None:
  """`scale * (x A) B` for the weight `name` of `module` when it has adapters, else None.

  For a model that applies its adapters itself (class attribute
  `applies_lora = True`, the built-in Llama): the weight's product `x W`
  plus this is the adapted product, with no weight-shaped array formed and
  no gradient of the frozen W. `x`'s last `contract` dims are W's inputs;
  A and B are multiplied in `x`'s dtype, their gradients summed in float32
  (`trainers.models.layers.dense`), as peft computes them under autocast.
  With `lora.dropout` and the module in train mode (`model.train()`, the
  train step only), A multiplies `dropout(x)`, as peft's `lora_dropout`
  does; `x W` always takes `x` whole.

  Example:
    >>> model = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
    >>> model = add_adapters(model, find_adapters(model, LoRASettings(rank=2, targets=("kernel",))), 0)
    >>> model.kernel_lora_b[...] = jnp.ones((2, 4))
    >>> x = jnp.ones((3, 6))
    >>> merged_kernel = _get(merged(nnx.to_pure_dict(nnx.state(model)), find_adapters(
    ...   model, LoRASettings(rank=2, targets=("kernel",)))), ("kernel",))
    >>> bool(jnp.allclose(x @ model.kernel[...] + low_rank(model, "kernel", x), x @ merged_kernel))
    True
  """
  a = getattr(module, name + A_SUFFIX, None)
  if a is None:
    return None
  rate = getattr(module, name + DROPOUT_SUFFIX, 0.0)
  # Only when switched to training: a user's module may hold `deterministic=None`.
  if rate and getattr(module, "deterministic", True) is False:
    x = dropout(x, rate, getattr(module, name + KEY_SUFFIX)[...])
  h = dense(x, a[...], contract=contract)
  return dense(h, getattr(module, name + B_SUFFIX)[...]) * getattr(module, name + SCALE_SUFFIX)


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
  """`x` with each element zeroed with probability `rate`, the rest divided by `1 - rate`.

  torch's (and peft's) inverted dropout, in `x`'s dtype. The mask is a
  function of the key and the element's index alone, whatever the mesh:
  JAX's partitionable threefry (`check_dropout` insists on it).

  Example:
    >>> y = dropout(jnp.ones((4, 1000)), 0.25, jax.random.key(0))
    >>> sorted({float(v) for v in jnp.unique(y)}), round(float(y.mean()), 1)
    ([0.0, 1.3333333730697632], 1.0)
  """
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def check_dropout(settings: LoRASettings, model: Any) -> None:
  """Raises `ValueError` when `lora.dropout` > 0 cannot be applied to `model` as peft does.

  peft drops the adapters' input, `x W + s dropout(x) A B`. A model that
  takes its adapters merged into its weights (`W + s A B`, any model
  without `applies_lora`) never shows us `x`, and a mask on `x` (one per
  token and feature) is no edit of a weight that every token shares. The
  masks must also be the same bits on any mesh, so a resume on another
  host count is bit-identical: JAX's partitionable threefry.

  Example:
    >>> check_dropout(LoRASettings(dropout=0.1, targets=("kernel",)),
    ...               nnx.eval_shape(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0))))
    Traceback (most recent call last):
    ...
    ValueError: lora.dropout=0.1 needs a model that applies its adapters itself (applies_lora, as the built-in Llama); Linear takes them merged into its weights (W + s A B), where the adapters' input is not seen: set lora.dropout=0.0
  """
  if not settings.dropout:
    return
  if not getattr(model, "applies_lora", False):
    raise ValueError(
      f"lora.dropout={settings.dropout!r} needs a model that applies its adapters itself "
      f"(applies_lora, as the built-in Llama); {type(model).__name__} takes them merged into "
      "its weights (W + s A B), where the adapters' input is not seen: set lora.dropout=0.0"
    )
  if not jax.config.jax_threefry_partitionable:
    raise ValueError(
      f"lora.dropout={settings.dropout!r} needs jax_threefry_partitionable=True (JAX's default "
      "since 0.5), so that the masks are the same bits on any mesh and host count"
    )


def _get(tree: Mapping, path: Sequence[str], default: Any = KeyError) -> Any:
  for key in path:
    if key not in tree and key.isdigit() and int(key) in tree:
      key = int(key)
    if key not in tree and default is not KeyError:
      return default
    tree = tree[key]
  return tree


def _set(tree: Any, path: Sequence[str], value: Any) -> Any:
  """A copy of the nested dict `tree` with `path` set (the dicts on the way copied)."""
  key = path[0]
  if key not in tree and key.isdigit() and int(key) in tree:
    key = int(key)
  out = dict(tree)
  out[key] = value if len(path) == 1 else _set(tree[key], path[1:], value)
  return out


def merged(params: Any, adapters: Sequence[Adapter]) -> Any:
  """The parameters (a pure dict) with each target weight `W + scale * A @ B`, float32.

  A and B stay in the tree (the model holds them); only the weight changes.
  """
  for adapter in adapters:
    w = _get(params, adapter.path)
    delta = adapter.delta(_get(params, adapter.a_path), _get(params, adapter.b_path))
    params = _set(params, adapter.path, w.astype(jnp.float32) + delta)
  return params


def with_adapters(params: Any, adapters: Sequence[Adapter], seed: int) -> Any:
  """`params` with each adapter's initial A and B where it has none (weights from elsewhere)."""
  for adapter in adapters:
    if _get(params, adapter.a_path, None) is None:
      a, b = adapter.initial(seed)
      params = _set(_set(params, adapter.a_path, a), adapter.b_path, b)
  return params


def base_weights(params: Any, adapters: Sequence[Adapter]) -> Any:
  """`params` without the adapters' A and B: the base model's parameters."""
  drop = adapter_paths(adapters)

  def keep(tree, prefix):
    if not isinstance(tree, Mapping):
      return tree
    return {k: keep(v, (*prefix, str(k))) for k, v in tree.items() if (*prefix, str(k)) not in drop}

  return keep(params, ())


def adapter_paths(adapters: Sequence[Adapter]) -> frozenset[tuple[str, ...]]:
  """The paths of every A and B (the trainable parameters)."""
  return frozenset(p for a in adapters for p in (a.a_path, a.b_path))
