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
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from spmd.partition import prime_factors

HOST_AXIS_PREFIX = "host"
LOCAL_AXIS_PREFIX = "local"


def device_order(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """All devices (or `devices`) in the one global order.

  Grouped by process in process order; inside a process by position on the
  chip grid (a snake, so consecutive chips are linked) and core, or by id
  where devices have no coordinates (CPU, GPU).

  Example:
    >>> import jax
    >>> device_order() == sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    True
  """
  devices = jax.devices() if devices is None else devices
  return sorted(devices, key=lambda d: (d.process_index, *_physical_key(d)))


def _physical_key(d: jax.Device) -> tuple:
  coords = getattr(d, "coords", None)
  if coords is None:
    return (d.id,)
  x, y, z = [*coords, 0, 0, 0][:3]
  return (z, y, x if y % 2 == 0 else -x, getattr(d, "core_on_chip", 0), d.id)


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


# ---------------------------------------------------------------------------
# Named meshes from config: `data=-1, fsdp=1, tensor=1`, split into ICI and DCN.

AxisSizes = Sequence[tuple[str, int]]
EXPERT_AXIS = "expert"
"""Splits a routed layer's experts, and the batch everywhere else (expert parallelism):
a data axis, so it may cross DCN and each host feeds the rows of its devices."""
DEFAULT_DATA_AXES = ("data", "fsdp", EXPERT_AXIS)
CONTEXT_AXIS = "context"
"""Splits every sequence; like a data axis it may cross DCN (each host feeds its slices)."""


def parse_axes(spec: str | Mapping[str, int] | AxisSizes | None) -> list[tuple[str, int]]:
  """Axis names and sizes from `"data=-1,tensor=2"`, a dict, or pairs.

  Example:
    >>> parse_axes("data=-1, fsdp=1,tensor=2")
    [('data', -1), ('fsdp', 1), ('tensor', 2)]
  """
  if spec is None:
    return []
  if isinstance(spec, str):
    pairs = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
      name, sep, size = part.partition("=")
      if not sep or not name.strip():
        raise ValueError(f"mesh axis {part!r} in {spec=} is not of the form name=size")
      try:
        pairs.append((name.strip(), int(size)))
      except ValueError:
        raise ValueError(f"mesh axis size {size!r} in {spec=} is not an integer") from None
    return pairs
  items = list(spec.items()) if isinstance(spec, Mapping) else list(spec)
  pairs = [(str(name), int(size)) for name, size in items]
  names = [n for n, _ in pairs]
  if len(set(names)) != len(names):
    raise ValueError(f"mesh axis names repeat: {names=}")
  return pairs


def resolve_sizes(
  axes: AxisSizes, total: int, what: str = "mesh", unit: str = "devices"
) -> list[tuple[str, int]]:
  """Fills the one `-1` so that the sizes multiply to `total`.

  Example:
    >>> resolve_sizes([("data", -1), ("tensor", 2)], 8)
    [('data', 4), ('tensor', 2)]
  """
  sizes = dict(axes)
  fill = [n for n, s in axes if s == -1]
  bad = {n: s for n, s in axes if s == 0 or s < -1}
  if bad:
    raise ValueError(f"{what} axis sizes must be positive or -1, got {bad}")
  if len(fill) > 1:
    raise ValueError(
      f"{what} axes {fill} are all -1; at most one axis may fill the rest ({dict(axes)})"
    )
  known = math.prod(s for s in sizes.values() if s != -1)
  if fill:
    if total % known:
      raise ValueError(
        f"{what} axes {dict(axes)}: the fixed sizes multiply to {known}, which does not "
        f"divide the {total} {unit}, so -1 for {fill[0]!r} has no whole size"
      )
    sizes[fill[0]] = total // known
  elif known != total:
    raise ValueError(
      f"{what} axes {dict(axes)} multiply to {known}, but there are {total} "
      f"{unit}; make one size -1 to fill the rest"
    )
  return [(n, sizes[n]) for n, _ in axes]


def granules(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
  """The devices of each DCN unit: TPU slices when there are several, else processes."""
  slices = {getattr(d, "slice_index", 0) or 0 for d in devices}
  key = (
    (lambda d: getattr(d, "slice_index", 0) or 0)
    if len(slices) > 1
    else (lambda d: d.process_index)
  )
  groups: dict[int, list[jax.Device]] = {}
  for d in devices:
    groups.setdefault(key(d), []).append(d)
  sizes = {k: len(v) for k, v in groups.items()}
  if len(set(sizes.values())) > 1:
    raise ValueError(f"DCN units hold unequal numbers of devices: {sizes}")
  return [groups[k] for k in sorted(groups)]


def _granule_array(
  devices: Sequence[jax.Device], axes: list[tuple[str, int]], data_axes: Sequence[str]
) -> np.ndarray:
  """One granule's devices as an array over `axes`, host-local where it can be.

  Data axes first, model axes last, filled in host-major order: the model
  axes then vary fastest, so a model group stays inside one host when it fits
  (or spans whole consecutive hosts when it does not), and each host owns a
  contiguous block of the data axes. Then transposed to the user's order.
  """
  data = [i for i, (n, _) in enumerate(axes) if n in data_axes]
  model = [i for i in range(len(axes)) if i not in data]
  order = data + model
  grid = np.empty(len(devices), dtype=object)
  grid[:] = device_order(devices)
  grid = grid.reshape([axes[i][1] for i in order])
  return np.transpose(grid, np.argsort(order))


def _topology_aware_array(devices, axes, data_axes) -> np.ndarray | None:
  """`mesh_utils.create_device_mesh` for TPUs, if it keeps hosts' blocks whole."""
  if getattr(devices[0], "platform", "") != "tpu":
    return None
  from jax.experimental import mesh_utils

  try:
    grid = mesh_utils.create_device_mesh(
      [s for _, s in axes], devices, allow_split_physical_axes=True
    )
  except (ValueError, NotImplementedError, AssertionError):
    return None
  return grid if _hosts_keep_blocks(grid, axes, data_axes) else None


def _hosts_keep_blocks(grid: np.ndarray, axes, data_axes) -> bool:
  """True when model groups stay in a host (when they fit) and hosts' data blocks are whole."""
  model = [i for i, (n, _) in enumerate(axes) if n not in data_axes]
  per_host = len(grid.flat) // len({d.process_index for d in grid.flat})
  procs = np.vectorize(lambda d: d.process_index)(grid)
  model_size = math.prod(grid.shape[i] for i in model)
  if model_size <= per_host:
    flat = np.moveaxis(procs, model, list(range(grid.ndim - len(model), grid.ndim)))
    if any(len(set(row)) > 1 for row in flat.reshape(-1, model_size)):
      return False
  data = [i for i in range(grid.ndim) if i not in model]
  blocks = np.moveaxis(procs, data, list(range(len(data))))
  blocks = blocks.reshape(math.prod(grid.shape[i] for i in data), -1)
  owners = [tuple(sorted(set(row))) for row in blocks]
  # Every host's data positions must be one contiguous run.
  for p in {d.process_index for d in grid.flat}:
    where = [i for i, o in enumerate(owners) if p in o]
    if where != list(range(where[0], where[-1] + 1)):
      return False
  return True


def create_mesh(
  ici: str | Mapping[str, int] | AxisSizes,
  dcn: str | Mapping[str, int] | AxisSizes | None = None,
  devices: Sequence[jax.Device] | None = None,
  data_axes: Sequence[str] = DEFAULT_DATA_AXES,
) -> jax.sharding.Mesh:
  """The global mesh for named axes, the one device assignment everything uses.

  Args:
    ici: axes and sizes inside a granule (TPU slice, or the whole job when
      there is no DCN), e.g. `"data=-1,fsdp=1,tensor=1"`; one `-1` fills the rest.
    dcn: sizes across granules (TPU slices; processes on GPU/CPU), e.g.
      `"data=2"`. Axes not named are 1. Default: none, except on multi-slice
      TPU, where the slices go on the first data axis.
    devices: default `jax.devices()`; or a TPU topology's devices for planning.
    data_axes: the axes that split the batch (`data`, `fsdp` and `expert`);
      they go across hosts and DCN, the others (model axes) stay inside
      hosts when they fit. `context` (which splits every sequence) may cross
      DCN too.

  Returns:
    A `jax.sharding.Mesh` with `AxisType.Auto` axes, each axis's size ICI x DCN.

  Example:
    >>> import jax
    >>> mesh = create_mesh("data=-1,tensor=2")
    >>> mesh.axis_names, mesh.devices.size == jax.device_count()
    (('data', 'tensor'), True)
  """
  devices = list(jax.devices() if devices is None else devices)
  ici_axes = parse_axes(ici)
  names = [n for n, _ in ici_axes]
  if not names:
    raise ValueError(f"{ici=} names no mesh axes")
  dcn_axes = parse_axes(dcn)
  unknown = [n for n, _ in dcn_axes if n not in names]
  if unknown:
    raise ValueError(f"DCN axes {unknown} are not among the mesh axes {names}")
  units = granules(devices)
  multislice = len({getattr(d, "slice_index", 0) or 0 for d in devices}) > 1
  if not dcn_axes and multislice:
    first_data = next((n for n in names if n in data_axes), names[0])
    dcn_axes = [(first_data, -1)]
  if not dcn_axes or all(s == 1 for _, s in dcn_axes):
    units, dcn_sizes = [devices], [1] * len(names)
  else:
    kind = "slices" if multislice else "processes"
    dcn_named = dict(resolve_sizes(dcn_axes, len(units), "DCN", kind))
    crossing = (*data_axes, CONTEXT_AXIS)
    model_dcn = {n: s for n, s in dcn_named.items() if s > 1 and n not in crossing}
    if model_dcn:
      raise ValueError(f"only the axes {crossing} may cross DCN, got {model_dcn}")
    dcn_sizes = [dcn_named.get(n, 1) for n in names]
  per_unit = len(units[0])
  ici_sizes = [
    s
    for _, s in resolve_sizes(
      ici_axes, per_unit, "ICI", "devices" if len(units) == 1 else "devices per DCN unit"
    )
  ]
  resolved = list(zip(names, ici_sizes))
  arrays = []
  for unit in units:
    grid = _topology_aware_array(unit, resolved, data_axes)
    arrays.append(grid if grid is not None else _granule_array(unit, resolved, data_axes))
  # Combine granules: along each axis, the DCN index is the outer part.
  full = np.stack(arrays).reshape(dcn_sizes + ici_sizes)
  k = len(names)
  interleave = [j for i in range(k) for j in (i, k + i)]
  full = full.transpose(interleave).reshape([d * s for d, s in zip(dcn_sizes, ici_sizes)])
  return jax.sharding.Mesh(
    full, tuple(names), axis_types=(jax.sharding.AxisType.Auto,) * len(names)
  )
