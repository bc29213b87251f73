"""An MLP classifier in Flax NNX: features [B, input_dim] -> logits [B, num_classes].

Hidden layers alternate `(embed, mlp)` and `(mlp, embed)` kernels, the
Megatron pattern: under tensor parallelism a column-split layer feeds a
row-split one, so each pair needs one all-reduce instead of a gather after
every layer. The head is `(embed|mlp, classes)` following the last hidden
width's name. Parameters:

  hidden/i/kernel   [in, out]           (embed, mlp) for even i, (mlp, embed) for odd i
  hidden/i/bias     [out]               (mlp,) or (embed,)
  head/kernel       [last, num_classes] (<last hidden's name>, classes)
  head/bias         [num_classes]       (classes,)

`trainers.models.logical_axes` reads them, as for the transformer.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> model = MLPClassifier(MLPConfig(input_dim=4, hidden_sizes=(8, 8), num_classes=3),
  ...                       rngs=nnx.Rngs(0))
  >>> model(jnp.ones((2, 4))).shape
  (2, 3)
  >>> [v.get_value() for v in jax.tree.leaves(
  ...   logical_axes(model), is_leaf=lambda x: isinstance(x, nnx.Variable))]  # doctest: +NORMALIZE_WHITESPACE
  [('classes',), ('embed', 'classes'), ('mlp',), ('embed', 'mlp'), ('embed',), ('mlp', 'embed')]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from trainers.models import logical_axes as logical_axes
from trainers.models import param
from trainers.models.matmul import matmul


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  """Sizes and dtypes of an `MLPClassifier`.

  Example:
    >>> MLPConfig(input_dim=784, hidden_sizes=(512, 512), num_classes=10).hidden_sizes
    (512, 512)
  """

  input_dim: int
  hidden_sizes: tuple[int, ...] = (256,)
  num_classes: int = 10
  dtype: str = "float32"
  """Compute dtype, e.g. "float32" or "bfloat16"."""
  param_dtype: str = "float32"

  def __post_init__(self):
    # A list from a config file is accepted and frozen, so the config stays hashable.
    object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
    sizes = {"input_dim": self.input_dim, "num_classes": self.num_classes}
    sizes.update({f"hidden_sizes[{i}]": s for i, s in enumerate(self.hidden_sizes)})
    for name, value in sizes.items():
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    for name in ("dtype", "param_dtype"):
      value = getattr(self, name)
      try:
        floating = jnp.issubdtype(jnp.dtype(value), jnp.floating)
      except TypeError:
        floating = False
      if not floating:
        raise ValueError(f"{name}={value!r} is not a floating point dtype")


class _Dense(nnx.Module):
  def __init__(self, din: int, dout: int, axes: tuple[str, str], param_dtype, *, rngs: nnx.Rngs):
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal")
    self.kernel = param(rngs, init, (din, dout), axes, param_dtype)
    self.bias = param(rngs, nnx.initializers.zeros, (dout,), axes[1:], param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    # The kernel multiplied in x's dtype, its gradient in float32 (`matmul`);
    # the bias added in its own dtype and the sum rounded once, so that its
    # gradient, a sum over the batch, is float32 too.
    return (matmul(x, self.kernel[...]) + self.bias[...]).astype(x.dtype)


class MLPClassifier(nnx.Module):
  """ReLU MLP: float features [B, input_dim] -> float32 logits [B, num_classes].

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = MLPClassifier(MLPConfig(input_dim=4, num_classes=3, dtype="bfloat16"),
    ...                       rngs=nnx.Rngs(0))
    >>> model(jnp.ones((2, 4))).dtype
    dtype('float32')
  """

  # The precision policy hands it float32 parameters: it casts them itself.
  casts_own_weights = True

  def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
    self.config = config
    pdt = jnp.dtype(config.param_dtype)
    layers, din, name = [], config.input_dim, "embed"
    for dout in config.hidden_sizes:
      out_name = "mlp" if name == "embed" else "embed"
      layers.append(_Dense(din, dout, (name, out_name), pdt, rngs=rngs))
      din, name = dout, out_name
    self.hidden = nnx.List(layers)
    self.head = _Dense(din, config.num_classes, (name, "classes"), pdt, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    if x.ndim != 2 or x.shape[1] != self.config.input_dim:
      raise ValueError(f"expected [batch, {self.config.input_dim}] features, got {x.shape=}")
    x = x.astype(self.config.dtype)
    for layer in self.hidden:
      x = jax.nn.relu(layer(x))
    return self.head(x).astype(jnp.float32)
