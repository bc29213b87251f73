"""Which rows of each global batch every host feeds: the per-host data layout.

The batch dimension is split over the mesh's batch axes (e.g. `data` and
`fsdp`). A host feeds exactly the rows that land on its own devices. Hosts
whose devices hold the same rows (a model axis spans hosts, so they are
replicas of one data-parallel shard) feed the same rows. The layout comes
from JAX's own index math (`NamedSharding.devices_indices_map`), so it agrees
with where `jax.make_array_from_process_local_data` puts the rows. This is
the only place that computes it: the input pipeline and the trainer ask here.

Example:
  >>> import jax
  >>> from spmd.mesh import create_mesh
  >>> layout = data_layout(create_mesh("data=-1"), global_batch=16)
  >>> layout.num_shards, layout.host(0).rows, layout.host(0).shard
  (1, range(0, 16), 0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax

from spmd.mesh import DEFAULT_DATA_AXES
from spmd.partition import NamedSpec


@dataclasses.dataclass(frozen=True)
class HostLayout:
  """What one host feeds."""

  process_index: int
  rows: range  # the global batch rows this host feeds, contiguous
  shard: int  # which distinct block of rows (0..num_shards-1)
  device_rows: tuple[tuple[int, range], ...]  # (device id, global rows) per device

  @property
  def batch_size(self) -> int:
    return len(self.rows)


@dataclasses.dataclass(frozen=True)
class DataLayout:
  """The whole job's layout for one global batch size."""

  global_batch: int
  batch_axes: tuple[str, ...]
  data_parallel: int  # product of the batch axes' sizes
  num_shards: int  # distinct row blocks across hosts
  hosts: tuple[HostLayout, ...]  # by process index
  sharding: jax.sharding.NamedSharding  # of the batch dimension

  def host(self, process_index: int | None = None) -> HostLayout:
    """This process's layout (or another's)."""
    p = jax.process_index() if process_index is None else process_index
    return self.hosts[p]

  @property
  def per_host_batch(self) -> int:
    return self.global_batch // self.num_shards


def batch_axes_of(
  mesh: jax.sharding.Mesh, batch_axes: Sequence[str] | None = None
) -> tuple[str, ...]:
  """The mesh axes that split the batch: given, or the default data axes present."""
  if batch_axes is None:
    return tuple(a for a in DEFAULT_DATA_AXES if a in mesh.shape)
  missing = [a for a in batch_axes if a not in mesh.shape]
  if missing:
    raise ValueError(f"batch axes {missing} are not mesh axes {tuple(mesh.axis_names)}")
  return tuple(batch_axes)


def batch_sharding(
  mesh: jax.sharding.Mesh,
  batch_axes: Sequence[str] | None = None,
) -> jax.sharding.NamedSharding:
  """Sharding for arrays whose first dimension is the batch."""
  axes = batch_axes_of(mesh, batch_axes)
  return jax.sharding.NamedSharding(mesh, NamedSpec(axes if axes else None))


def check_batch_divides(
  mesh: jax.sharding.Mesh, global_batch: int, batch_axes: Sequence[str] | None = None
) -> None:
  """Raises `ValueError` unless `global_batch` rows split evenly over the batch axes.

  Example:
    >>> import jax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> check_batch_divides(mesh, 0)
    Traceback (most recent call last):
    ...
    ValueError: global_batch=0 must be a positive number of rows
  """
  axes = batch_axes_of(mesh, batch_axes)
  data_parallel = math.prod(mesh.shape[a] for a in axes)
  if global_batch < 1:
    raise ValueError(f"{global_batch=} must be a positive number of rows")
  if global_batch % data_parallel:
    raise ValueError(
      f"{global_batch=} is not divisible by the data-parallel size {data_parallel} "
      f"(batch axes {dict((a, mesh.shape[a]) for a in axes)})"
    )


def data_layout(
  mesh: jax.sharding.Mesh, global_batch: int, batch_axes: Sequence[str] | None = None
) -> DataLayout:
  """Which rows of a `global_batch` every host feeds, for this mesh.

  Raises:
    ValueError: the batch does not divide over the data-parallel size, or a
      host's devices hold rows that are not one contiguous block (put the data
      axes first in the mesh, or build it with `spmd.mesh.create_mesh`).
  """
  axes = batch_axes_of(mesh, batch_axes)
  check_batch_divides(mesh, global_batch, axes)
  data_parallel = math.prod(mesh.shape[a] for a in axes)
  sharding = batch_sharding(mesh, axes)
  per_device = sharding.devices_indices_map((global_batch,))
  by_process: dict[int, list[tuple[jax.Device, range]]] = {}
  for device in mesh.devices.flat:
    start, stop, _ = per_device[device][0].indices(global_batch)
    by_process.setdefault(device.process_index, []).append((device, range(start, stop)))
  blocks: dict[int, int] = {}  # start row -> block size
  hosts = []
  for p in sorted(by_process):
    entries = by_process[p]
    starts = sorted({r.start for _, r in entries})
    size = global_batch // data_parallel
    if starts != list(range(starts[0], starts[0] + size * len(starts), size)):
      raise ValueError(
        f"process {p}'s devices hold rows starting at {starts}, not one contiguous block "
        f"of the global batch; order the mesh so the batch axes {axes} come first "
        "(spmd.mesh.create_mesh does this)"
      )
    rows = range(starts[0], starts[-1] + size)
    blocks[rows.start] = len(rows)
    hosts.append(
      HostLayout(
        p,
        rows,
        rows.start // len(rows),
        tuple((d.id, r) for d, r in sorted(entries, key=lambda e: e[0].id)),
      )
    )
  sizes = {len(h.rows) for h in hosts}
  tiles = sorted(blocks.items())
  if len(sizes) > 1 or [start for start, _ in tiles] != list(range(0, global_batch, tiles[0][1])):
    raise ValueError(
      "hosts' row blocks do not tile the global batch evenly: "
      f"{ {h.process_index: (h.rows.start, h.rows.stop) for h in hosts} }"
    )
  return DataLayout(global_batch, axes, data_parallel, len(blocks), tuple(hosts), sharding)
