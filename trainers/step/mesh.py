"""The run's mesh from its config, and the mesh axes that split the batch.

`spmd-train`, `--mode=eval` and `spmd-plan` build it the same way, so a plan
compiles the mesh a run will have. `config.mesh.ici` and `.dcn` name only
the axes the rule presets split along (`trainer_axes`): an axis no rule
uses would hold copies of the same work. A mesh that does not fit the
devices is a `UserError` naming the setting, its axes, their product and
the device count.

Example:
  >>> from configs import mlp
  >>> mesh, batch_axes = build_mesh(mlp.get_config())  # 8 CPU devices: data=-1
  >>> dict(mesh.shape), batch_axes
  ({'data': 8, 'fsdp': 1, 'tensor': 1}, ('data', 'fsdp'))
"""

from __future__ import annotations

import jax
import ml_collections

from spmd import rules
from spmd.errors import UserError, one_line
from spmd.layout import check_batch_divides
from spmd.mesh import create_mesh, parse_axes


def trainer_axes() -> tuple[str, ...]:
  """The mesh axes some rule preset (`spmd.rules.PRESETS`) splits along, in order of first use.

  >>> trainer_axes()
  ('data', 'fsdp', 'expert', 'context', 'tensor')
  """
  axes: dict[str, None] = {}
  for preset in rules.PRESETS.values():
    for _, mesh_axes in preset:
      for axis in (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes or ():
        axes[axis] = None
  return tuple(axes)


def check_axes(config: ml_collections.ConfigDict) -> None:
  """A `ValueError` naming `config.mesh.ici`, `.dcn` or `.batch_axes` when it names an unknown axis.

  `build_mesh` leaves out a batch axis the mesh was not given (a mesh of
  `data=-1` alone splits the batch along data only), so a misspelt one would
  leave the batch unsplit along the axis meant, without a word: it is
  refused here instead.

  >>> from configs import mlp
  >>> config = mlp.get_config()
  >>> config.mesh.ici = "data=-1,experts=2"
  >>> check_axes(config)
  Traceback (most recent call last):
  ...
  ValueError: config.mesh.ici='data=-1,experts=2': 'experts' is not a mesh axis of the trainer; its axes: data, fsdp, expert, context, tensor (the ones config.mesh.rules splits along)
  """
  known = trainer_axes()
  for name in ("ici", "dcn"):
    spec = config.mesh[name] or None
    try:
      axes = parse_axes(spec)
    except ValueError as e:
      raise ValueError(f"config.mesh.{name}={spec!r}: {one_line(e)}") from None
    for axis, _ in axes:
      if axis not in known:
        raise ValueError(
          f"config.mesh.{name}={spec!r}: {axis!r} is not a mesh axis of the trainer; its axes: "
          f"{', '.join(known)} (the ones config.mesh.rules splits along)"
        )
  batch_axes = tuple(config.mesh.batch_axes)
  if rules.CONTEXT_AXIS in batch_axes:
    raise ValueError(
      f"config.mesh.batch_axes={batch_axes!r}: {rules.CONTEXT_AXIS!r} splits every sequence, "
      "not the rows; leave it out of the batch axes"
    )
  for axis in batch_axes:
    if axis not in known:
      raise ValueError(
        f"config.mesh.batch_axes={batch_axes!r}: {axis!r} is not a mesh axis of the trainer; "
        f"its axes: {', '.join(known)}"
      )


def build_mesh(
  config: ml_collections.ConfigDict, devices=None
) -> tuple[jax.sharding.Mesh, tuple[str, ...]]:
  """The run's mesh and the mesh axes that split the batch (also `spmd-plan`'s).

  Raises:
    UserError: the mesh's sizes do not fit the devices (a `ValueError`, as
      `spmd.mesh.create_mesh` raises it, with the setting named).
  """
  try:
    mesh = create_mesh(config.mesh.ici, config.mesh.dcn or None, devices=devices)
  except ValueError as e:
    given = f"config.mesh.ici={config.mesh.ici!r}"
    if config.mesh.dcn:
      given += f", config.mesh.dcn={config.mesh.dcn!r}"
    raise UserError(f"{given}: {one_line(e)}") from e
  axes = tuple(a for a in config.mesh.batch_axes if a in mesh.shape)
  # Before anything traces a batch: an uneven one would fail deep in a
  # layout instead, naming an activation rather than global_batch.
  check_batch_divides(mesh, config.global_batch, axes)
  return mesh, axes
