"""Models in Flax NNX whose every parameter names its logical axes.

  transformer.py  `TransformerLM`: decoder-only byte-level language model,
                  `generate`, `param_count`, `flops_per_token`
  llama.py        `Llama`: RMSNorm, RoPE, SwiGLU, grouped-query attention,
                  packed-segment masking, activations constrained by
                  logical names (`spmd.rules.constrain`)
  mlp.py          `MLPClassifier`
  embedding.py    `lookup`: embedding rows laid out by the active rules, so
                  no mesh makes XLA copy whole activations
  lora.py         LoRA adapters beside the chosen weights of any NNX model
                  (`config.lora`)
  moe.py          `MoE`: the Llama's routed MLP (top-k routing, dropless
                  grouped matmuls, load-balancing and z-loss)

What the models share lives here: `param` creates an annotated parameter and
`logical_axes` reads the annotations back as a tree shaped like the model's
parameter state, ready for `spmd.rules.logical_to_sharding`.

Annotations use NNX's own sharding metadata, `out_sharding`, with names from
`spmd.rules.LOGICAL_AXES` (not mesh axes). Parameters are created with
`eager_sharding=False`: NNX's default (`flax_always_shard_variable`) would
otherwise shard each value on creation, which needs a mesh in context and
treats the names as mesh axes, so a bare `TransformerLM(...)` would fail
("An auto mesh context or metadata is required", or with a mesh "Resource
axis: embed ... is not found in mesh"). Placing parameters is the trainer's
job (`jax.jit(..., out_shardings=...)`).

Example:
  >>> import jax
  >>> from flax import nnx
  >>> from spmd import rules
  >>> from spmd.mesh import create_mesh
  >>> from trainers.models.mlp import MLPClassifier, MLPConfig
  >>> config = MLPConfig(input_dim=8, hidden_sizes=(16,), num_classes=4)
  >>> model = nnx.eval_shape(lambda: MLPClassifier(config, rngs=nnx.Rngs(0)))  # shapes only
  >>> state = nnx.state(model, nnx.Param)
  >>> logical_axes(state)["hidden"][0]["kernel"].get_value()
  ('embed', 'mlp')
  >>> shardings = rules.logical_to_sharding(
  ...   logical_axes(state), create_mesh("data=-1,tensor=2"), rules.FSDP_TP, shapes=state)
  >>> shardings["hidden"][0]["kernel"].get_value().spec
  P(None, 'tensor')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.rules import LOGICAL_AXES

Initializer = Callable[..., jax.Array]


def _draw_key(stream: nnx.RngStream) -> jax.Array:
  """The same key as `stream()`, in time linear in the model's size when traced.

  flax's `stream()` bumps its counter with an indexed write, whose equality
  check asks the traced counter for its `.sharding`; on a tracer that builds
  an error message by walking the whole trace, so building a model under
  `jit`/`eval_shape` took time quadratic in its layers (minutes for 96
  layers). Replacing the counter's value skips that check.
  """
  key = jax.random.fold_in(stream.key.get_value(), stream.count.get_value())
  stream.count.set_value(stream.count.get_value() + 1)
  return key


def param(
  rngs: nnx.Rngs,
  init: Initializer,
  shape: Sequence[int],
  axes: Sequence[str],
  dtype: Any = jnp.float32,
) -> nnx.Param:
  """A new `nnx.Param` of `shape` annotated with the logical names `axes`.

  Args:
    rngs: the key stream (`rngs.params()` is drawn once).
    init: a JAX initializer, `init(key, shape, dtype)`.
    shape: the parameter's shape.
    axes: one name from `spmd.rules.LOGICAL_AXES` per dimension.
    dtype: the parameter dtype.

  Example:
    >>> from flax import nnx
    >>> w = param(nnx.Rngs(0), nnx.initializers.zeros, (2, 3), ("embed", "mlp"))
    >>> w.shape, w.get_metadata("out_sharding")
    ((2, 3), ('embed', 'mlp'))
  """
  axes = tuple(axes)
  shape = tuple(shape)
  if len(axes) != len(shape):
    raise ValueError(f"{axes=} must name each dimension of {shape=}")
  unknown = [a for a in axes if a not in LOGICAL_AXES]
  if unknown:
    raise ValueError(f"{axes=} uses {unknown}, which are not in {LOGICAL_AXES=}")
  value = init(_draw_key(rngs.params), shape, dtype)
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def logical_axes(model_or_state: nnx.Module | Any) -> Any:
  """The logical axis names of every parameter, shaped like the parameter state.

  Args:
    model_or_state: a module (its `nnx.state(model, nnx.Param)` is used), or
      a state or other pytree of `nnx.Variable`s, concrete or abstract (from
      `nnx.eval_shape`), e.g. the state half of `nnx.split(model)`.

  Returns:
    The same tree with each variable's value replaced by its tuple of names.
    Its tree structure equals the state's (the variables keep their
    metadata), so `spmd.rules.logical_to_sharding` of it can be passed as
    `out_shardings`/`in_shardings` of a `jax.jit` over that state, or to
    `jax.device_put`. Its leaves, taken with tuples as leaves, line up 1:1
    with `jax.tree_util.tree_leaves(state)`.

  Raises:
    ValueError: naming the path of a variable without `out_sharding`
      metadata, or whose names do not match its number of dimensions.

  Example:
    >>> import jax
    >>> from flax import nnx
    >>> class Tiny(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.w = param(rngs, nnx.initializers.ones, (2, 3), ("embed", "mlp"))
    >>> axes = logical_axes(Tiny(nnx.Rngs(0)))
    >>> axes["w"].get_value()
    ('embed', 'mlp')
  """
  if isinstance(model_or_state, nnx.Module):
    state = nnx.state(model_or_state, nnx.Param)
  else:
    state = model_or_state

  def names(path, var):
    if not isinstance(var, nnx.Variable):
      raise ValueError(
        f"{jax.tree_util.keystr(path)}: expected an nnx.Variable, got {type(var).__name__}"
      )
    axes = var.get_metadata("out_sharding", None)
    shape = tuple(var.get_value().shape)
    if axes is None:
      raise ValueError(
        f"{jax.tree_util.keystr(path)}: {type(var).__name__} of {shape=} has no "
        "logical axes (no out_sharding metadata)"
      )
    if len(axes) != len(shape):
      raise ValueError(f"{jax.tree_util.keystr(path)}: logical {axes=} do not match {shape=}")
    # `replace` keeps the metadata, so the result has the state's treedef.
    return var.replace(tuple(axes))

  return jax.tree_util.tree_map_with_path(
    names, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )
