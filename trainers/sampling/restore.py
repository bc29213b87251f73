"""A run's model for sampling: its parameters restored onto this machine's devices, or one CPU.

`restore_model(config, ref)` restores as `spmd-train --mode=eval` does: the
run's mesh (`config.mesh`) is built over every device of the processes
taking part (`trainers.step.mesh.build_mesh`; one host, or every host under
a launcher), and orbax reads the parameters (and model state, no optimizer
state) straight into their shardings on it, whatever mesh saved them. The
floating parameters are then cast to the run's compute dtype
(`config.train.precision`, `trainers.step.precision`), so a decode step
reads them once in that dtype. `on_cpu=True` keeps the path of machines
without an accelerator: numpy on this host, one CPU device, as `spmd-export`
places them.

Example:
  >>> restored = restore_model(config, saved_run.find_checkpoint("W", "", None))  # doctest: +SKIP
  >>> restored.platform, restored.batch_multiple  # doctest: +SKIP
  ('tpu', 1)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import ml_collections
from flax import nnx

from spmd import rules as rules_lib
from spmd.errors import UserError, one_line
from trainers.checkpoints import export, saved_run
from trainers.step.mesh import build_mesh
from trainers.step.precision import Precision
from trainers.step.state import build_model, make_state
from trainers.tasks import make_task


@dataclasses.dataclass(frozen=True)
class Restored:
  """A restored model and where it lives.

  Attributes:
    model: the NNX model in eval mode, its parameters in the compute dtype.
    mesh, rules: the mesh its parameters are on and the rules that placed
      them (None and () on one CPU device).
    batch_multiple: a decode batch must be a multiple of this (the batch axes' size).
  """

  model: nnx.Module
  mesh: jax.sharding.Mesh | None
  rules: rules_lib.Rules
  batch_multiple: int

  @property
  def platform(self) -> str:
    """Where the parameters are: "cpu", "tpu", "gpu"."""
    leaf = jax.tree.leaves(nnx.state(self.model, nnx.Param))[0]
    return next(iter(leaf.devices())).platform


def _in_compute_dtype(model: nnx.Module, config: ml_collections.ConfigDict) -> nnx.Module:
  policy = Precision(config.train.get("precision", "float32"))
  params = nnx.state(model, nnx.Param)
  nnx.update(model, jax.jit(policy.cast_params)(params))
  return model


def restore_model(
  config: ml_collections.ConfigDict, ref: saved_run.CheckpointRef, on_cpu: bool = False
) -> Restored:
  """The run's model with `ref`'s weights, on the run's mesh (or one CPU device), in its compute dtype.

  Every process of a multi-process job calls it; each gets the same global model.

  Raises:
    UserError: the run's mesh does not fit this machine's devices (names the setting).
    CheckpointError: the step is unfinished, damaged or of another model.
  """
  if on_cpu:
    weights = saved_run.restore_weights(ref)  # numpy on this host: any saving mesh
    model = export.build_model(config, weights["params"], weights.get("model_state"))
    return Restored(_in_compute_dtype(model, config), None, (), 1)
  try:
    mesh, batch_axes = build_mesh(config)
  except UserError as e:
    raise UserError(
      f"{one_line(e)}; the run's mesh must fit this machine's devices, "
      "or --cpu decodes on one CPU device"
    ) from e
  setup = make_state(make_task(config).model, config, mesh, batch_axes)
  weights = saved_run.restore_run_weights(ref, setup, config)  # a LoRA run's with its base
  model = build_model(setup, weights["params"], weights.get("model_state"))
  model.eval()
  multiple = math.prod(mesh.shape[a] for a in batch_axes)
  return Restored(
    _in_compute_dtype(model, config), mesh, rules_lib.preset(config.mesh.rules), multiple
  )
