"""A train step its devices cannot hold: one line with the rows, the bytes and what would fit.

The TPU compiler refuses a step whose buffers exceed HBM (RESOURCE_EXHAUSTED,
naming what it needs and what the device has), and a device can run out when
the step first allocates. Either is the config's batch, mesh or model, not a
bug: `spmd-train` says so in one line (`spmd.errors.UserError`, exit 2) with
`spmd-plan`'s advice (`trainers.planning.advice`) instead of a traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections

from spmd import rules as rules_lib
from spmd.errors import UserError
from spmd.layout import data_layout
from trainers.planning import advice
from trainers.planning.figures import Memory
from trainers.planning.plan import per_device_bytes
from trainers.reporting import chips
from trainers.step.loss import abstract_batch, batch_shardings
from trainers.step.state import StateSetup
from trainers.tasks import Task


def out_of_device_memory(error: BaseException) -> bool:
  """A JAX runtime error that says a device's memory is exhausted (at compile time or allocation).

  Example:
    >>> out_of_device_memory(jax.errors.JaxRuntimeError(
    ...   "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
    ...   "space hbm. Used 16.34G of 15.75G hbm. Exceeded hbm capacity by 603.59M."))
    True
    >>> out_of_device_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: quota exceeded"))
    False
  """
  text = str(error)
  return (
    isinstance(error, jax.errors.JaxRuntimeError)
    and "RESOURCE_EXHAUSTED" in text
    and "memory" in text.lower()
  )


@contextlib.contextmanager
def step_must_fit(
  config: ml_collections.ConfigDict,
  task: Task,
  setup: StateSetup,
  mesh: jax.sharding.Mesh,
  batch_axes: tuple[str, ...],
) -> Iterator[None]:
  """Inside, a device running out of memory is a `UserError` naming the step's needs.

  Around what compiles and first runs the train step; any other error passes.
  """
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if not out_of_device_memory(e):
      raise
    raise UserError(_message(e, config, task, setup, mesh, batch_axes)) from None


def _message(error, config, task: Task, setup: StateSetup, mesh, batch_axes) -> str:
  state = _shaped(setup)
  placement = batch_shardings(task, rules_lib.preset(config.mesh.rules), mesh, batch_axes)
  batch = abstract_batch(task, config.global_batch, placement)
  memory = Memory(
    params_bytes=per_device_bytes(state["params"]),
    optimizer_bytes=per_device_bytes({k: v for k, v in state.items() if k != "params"}),
    batch_bytes=per_device_bytes(batch),
    temp_bytes=None,
    code_bytes=None,
    total_bytes=None,
    device_bytes=chips.device_memory_bytes(jax.local_devices()[0].device_kind),
    margin=0.1,
  )
  layout = data_layout(mesh, config.global_batch, batch_axes)
  return advice.step_does_not_fit(
    error,
    memory,
    dict(mesh.shape),
    config.mesh.rules,
    mesh.devices.size,
    rows_per_device=max(1, config.global_batch // layout.data_parallel),
    micro_batches=config.train.micro_batches,
  )


def _shaped(setup: StateSetup) -> dict[str, Any]:
  """The state's shapes, each with its sharding."""
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
