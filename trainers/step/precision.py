"""The precision policy (`config.train.precision`): what the step computes in, for any model.

Parameters and optimizer state stay in their stored dtype (float32 unless a
model asks otherwise), so updates are exact. Under "bfloat16" the step casts,
inside the differentiated loss:

- each float32 parameter to bfloat16, so the model's matmuls run in bfloat16
  whether or not the model knows about dtypes (a stock `nnx.Linear` does not);
  but a model with `casts_own_weights = True` (the built-in ones) gets its
  float32 parameters and casts them inside its products, whose weight
  gradients are computed, summed across devices and returned in float32
  (`trainers.models.matmul`, `trainers.models.embedding`);
- each floating batch feature to bfloat16, except the task's
  `Task.float32_features` (`mask` by default: weights and regression
  targets keep their precision). The inputs must be cast as well as the
  weights: a bfloat16 weight against a float32 input promotes the dot back
  to float32.

- the compute dtype onto every submodule that takes a `dtype` and has not
  chosen one (`nnx.Conv`, `nnx.Linear`, `nnx.BatchNorm`, ... leave it None):
  a model that casts its inputs to float32 itself, or a BatchNorm whose
  float32 statistics would promote its output, still hands its matmuls and
  convolutions bfloat16. BatchNorm computes its statistics in float32
  whatever its dtype, and keeps them so.

The gradients come back in the parameters' float32 (the cast is part of the
differentiated function), and the loss, its weight and the metric sums are
cast to float32 as the task returns them, so micro-batches and eval batches
add up in float32. The model's other state (batch statistics) goes back to
its stored dtype.

Example:
  >>> import jax.numpy as jnp
  >>> policy = Precision("bfloat16")
  >>> cast = policy.cast_batch({"x": jnp.ones(2), "mask": jnp.ones(2), "ids": jnp.ones(2, int)})
  >>> {k: str(v.dtype) for k, v in cast.items()}
  {'x': 'bfloat16', 'mask': 'float32', 'ids': 'int32'}
  >>> str(policy.cast_params({"w": jnp.ones(2)})["w"].dtype)
  'bfloat16'
  >>> str(policy.to_float32(jnp.ones(2, jnp.bfloat16)).dtype)
  'float32'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

PRECISIONS = ("float32", "bfloat16")
"""The values `config.train.precision` takes."""


def check_precision(value: Any) -> str:
  """`config.train.precision`, checked: a name of `PRECISIONS`.

  Example:
    >>> check_precision("bf16")
    Traceback (most recent call last):
    ...
    ValueError: config.train.precision='bf16' is not one of ('float32', 'bfloat16')
  """
  if value not in PRECISIONS:
    raise ValueError(f"config.train.precision={value!r} is not one of {PRECISIONS}")
  return value


def _is_float32(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.dtype(x.dtype) == jnp.float32


@dataclasses.dataclass(frozen=True)
class Precision:
  """The step's casts for one `config.train.precision`; "float32" casts nothing."""

  compute: str = "float32"
  float32_features: Sequence[str] = ("mask",)

  def __post_init__(self):
    check_precision(self.compute)

  @property
  def casts(self) -> bool:
    return self.compute != "float32"

  def _down(self, tree: Any) -> Any:
    dtype = jnp.dtype(self.compute)
    return jax.tree.map(lambda x: x.astype(dtype) if _is_float32(x) else x, tree)

  def cast_params(self, params: Any) -> Any:
    """The float32 parameters in the compute dtype (others as stored)."""
    return self._down(params) if self.casts else params

  def reach_modules(self, model: Any) -> int:
    """Sets the compute dtype on `model`'s submodules whose `dtype` is None; returns how many.

    A submodule that names its own dtype keeps it (a head kept in float32).

    Example:
      >>> from flax import nnx
      >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
      >>> Precision("bfloat16").reach_modules(model), model.layers[1].dtype
      (2, dtype(bfloat16))
    """
    if not self.casts:
      return 0
    reached = 0
    for _, module in nnx.iter_modules(model):
      if "dtype" in vars(module) and module.dtype is None:
        module.dtype = jnp.dtype(self.compute)
        reached += 1
    return reached

  def cast_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's float32 features in the compute dtype, but `float32_features`."""
    if not self.casts:
      return batch
    keep = set(self.float32_features)
    return {k: v if k in keep else self._down(v) for k, v in batch.items()}

  @staticmethod
  def to_float32(tree: Any) -> Any:
    """Every floating leaf of lower precision in float32 (the sums the step adds up)."""

    def up(x):
      floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
      return jnp.asarray(x, jnp.float32) if floating and jnp.finfo(x.dtype).bits < 32 else x

    return jax.tree.map(up, tree)

  @staticmethod
  def like(tree: Any, reference: Any) -> Any:
    """`tree`'s leaves in `reference`'s dtypes (the model state, back as stored)."""
    return jax.tree.map(
      lambda x, r: x.astype(r.dtype) if hasattr(x, "astype") else x, tree, reference
    )
