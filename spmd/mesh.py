"""The one global device order, and the meshes `sharded_jit` runs on.

Every process must list the devices in the same order, or two hosts disagree
about which shard lives where and compute garbage without an error. The order
is defined here once: grouped by process (in process index order), then by
device id inside a process. CPU device ids are not dense across processes
(process 1's start at 2048 or more), so the order never relies on ids alone.

A computation over `n` partitions runs on a mesh whose axes are the prime
factors of the process count followed by those of the per-process device
count. Any count spec whose product is `n` can be laid out on it, every
process's devices form a sub-block of it (so each process owns one contiguous
piece of every array), and all shardings of one computation share one mesh
(which JAX's autodiff requires).

Example:
  >>> import jax
  >>> mesh = partition_mesh(jax.devices()[:1])
  >>> dict(mesh.shape)
  {'local0': 1}
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

from spmd.partition import prime_factors

HOST_AXIS_PREFIX = "host"
LOCAL_AXIS_PREFIX = "local"


def device_order(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """All devices (or `devices`) in the one global order: process, then id.

  Example:
    >>> import jax
    >>> device_order() == sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    True
  """
  devices = jax.devices() if devices is None else devices
  return sorted(devices, key=lambda d: (d.process_index, d.id))


def devices_for_partitions(num_partitions: int) -> list[jax.Device]:
  """The devices a computation over `num_partitions` partitions runs on.

  Up to the local device count: this process's first devices, and the
  computation is private to this process. Exactly the global device count:
  every device of every process, in `device_order()`. Anything between has no
  single right answer (which processes would sit out?) and is an error.
  """
  total, local = jax.device_count(), jax.local_device_count()
  if num_partitions < 1:
    raise ValueError(f"{num_partitions=} must be at least 1")
  if num_partitions > total:
    raise ValueError(
      f"sharded_jit computation requires {num_partitions} devices, "
      f"but only {total} devices are available."
    )
  if num_partitions <= local:
    return device_order(jax.local_devices())[:num_partitions]
  if num_partitions < total:
    raise ValueError(
      "sharded_jit across multiple processes must use all available devices. "
      f"Got {num_partitions} out of {total} requested devices "
      f"(local device count: {local})"
    )
  return device_order()


@functools.cache
def _partition_mesh(devices: tuple[jax.Device, ...]) -> jax.sharding.Mesh:
  processes = sorted({d.process_index for d in devices})
  per_process = len(devices) // len(processes)
  counts = {p: sum(d.process_index == p for d in devices) for p in processes}
  if any(c != per_process for c in counts.values()):
    raise ValueError(f"processes hold unequal numbers of devices: {counts=}")
  host_sizes = prime_factors(len(processes)) if len(processes) > 1 else []
  local_sizes = prime_factors(per_process) or [1]
  names = [f"{HOST_AXIS_PREFIX}{i}" for i in range(len(host_sizes))] + [
    f"{LOCAL_AXIS_PREFIX}{i}" for i in range(len(local_sizes))
  ]
  shape = host_sizes + local_sizes
  grid = np.empty(len(devices), dtype=object)
  grid[:] = list(devices)
  return jax.sharding.Mesh(
    grid.reshape(shape), tuple(names), axis_types=(jax.sharding.AxisType.Auto,) * len(names)
  )


def partition_mesh(devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
  """The mesh (prime-factor axes, host axes first) over `devices`, cached."""
  return _partition_mesh(tuple(device_order(devices)))


def split_axes(mesh: jax.sharding.Mesh) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
  """The mesh's axes as (across processes, within a process) lists.

  An axis counts as "within a process" when walking along it never changes
  process; an axis that does (even partly) counts as across processes.
  """
  host, local = [], []
  for axis, (name, size) in enumerate(mesh.shape.items()):
    moved = np.moveaxis(mesh.devices, axis, -1).reshape(-1, size)
    same_process = all(len({d.process_index for d in row}) == 1 for row in moved)
    (local if same_process else host).append((name, size))
  return host, local
