"""The run's mesh from its config, and the mesh axes that split the batch.

`spmd-train`, `--mode=eval` and `spmd-plan` build it the same way, so a plan
compiles the mesh a run will have.

Example:
  >>> from configs import mlp
  >>> mesh, batch_axes = build_mesh(mlp.get_config())  # 8 CPU devices: data=-1
  >>> dict(mesh.shape), batch_axes
  ({'data': 8, 'fsdp': 1, 'tensor': 1}, ('data', 'fsdp'))
"""

from __future__ import annotations

import jax
import ml_collections

from spmd.layout import check_batch_divides
from spmd.mesh import create_mesh


def build_mesh(
  config: ml_collections.ConfigDict, devices=None
) -> tuple[jax.sharding.Mesh, tuple[str, ...]]:
  """The run's mesh and the mesh axes that split the batch (also `spmd-plan`'s)."""
  mesh = create_mesh(config.mesh.ici, config.mesh.dcn or None, devices=devices)
  axes = tuple(a for a in config.mesh.batch_axes if a in mesh.shape)
  # Before anything traces a batch: an uneven one would fail deep in a
  # layout instead, naming an activation rather than global_batch.
  check_batch_divides(mesh, config.global_batch, axes)
  return mesh, axes
