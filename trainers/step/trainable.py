"""Which parameters train: all of them, or (LoRA) only the adapters, the rest frozen.

The state's `params` always hold the whole model's parameters, so everything
that builds the model from the state (evals, the summary, sampling) sees it
whole. With `config.lora` the train step takes gradients of the adapters
only (`value_and_grad`), the optimizer's state covers them only, and the
frozen weights pass through the step unchanged, in the compute dtype.

Parameters are nested dicts (`nnx.to_pure_dict`); a path is the tuple of
keys, as strings.

Example:
  >>> params = {"dense": {"kernel": 1.0, "kernel_lora_a": 2.0}, "bias": 3.0}
  >>> train, frozen = split(params, frozenset({("dense", "kernel_lora_a")}))
  >>> train, frozen
  ({'dense': {'kernel_lora_a': 2.0}}, {'dense': {'kernel': 1.0}, 'bias': 3.0})
  >>> join(train, frozen) == params
  True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def _split(tree: Any, paths: frozenset, prefix: tuple) -> tuple[Any, Any]:
  if not isinstance(tree, dict):
    return (tree, None) if prefix in paths else (None, tree)
  train, frozen = {}, {}
  for key, value in tree.items():
    t, f = _split(value, paths, (*prefix, str(key)))
    if t is not None:
      train[key] = t
    if f is not None:
      frozen[key] = f
  return train or None, frozen or None


def split(params: Any, paths: frozenset[tuple[str, ...]] | None) -> tuple[Any, Any]:
  """(the parameters at `paths`, the rest), as two nested dicts; None: (all, {})."""
  if paths is None:
    return params, {}
  train, frozen = _split(params, paths, ())
  return train or {}, frozen or {}


def join(train: Any, frozen: Any) -> Any:
  """The nested dicts `train` and `frozen` as one (their keys are disjoint)."""
  if not isinstance(frozen, dict) or not frozen:
    return train
  if not isinstance(train, dict):
    return train
  out = dict(frozen)
  for key, value in train.items():
    out[key] = join(value, frozen[key]) if key in frozen else value
  return out


def value_and_grad(loss: Callable, paths: frozenset[tuple[str, ...]] | None) -> Callable:
  """`jax.value_and_grad(loss, has_aux=True)` whose gradients are those of `paths` only.

  `(params, *args) -> ((value, aux), grads)`: `params` whole, `grads` shaped
  like `split(params, paths)[0]`; nothing is differentiated for the rest.
  """
  if paths is None:
    return jax.value_and_grad(loss, has_aux=True)

  def run(params, *args):
    train, frozen = split(params, paths)
    frozen = jax.lax.stop_gradient(frozen)
    return jax.value_and_grad(lambda t: loss(join(t, frozen), *args), has_aux=True)(train)

  return run
