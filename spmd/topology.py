"""Real TPU device descriptions on a machine without TPUs, from a slice's name.

With libtpu installed (the `tpu` extra), `jax.experimental.topologies` returns
the devices of any TPU slice — coordinates, process (host) and slice indices —
and programs compile against them ahead of time. That is how we test device
assignment and plan memory at pod scale from a laptop or CI.

Slice names follow Cloud TPU: v4 and v5p count TensorCores (two per chip),
v5e and v6e count chips. `v5p-64` is 32 chips in a 2x4x4 torus.

Example:
  >>> topology_name("v5p-64"), topology_name("v5e-16"), topology_name("v4:2x2x4")
  ('v5p:2x4x4', 'v5e:4x4', 'v4:2x2x4')
"""

from __future__ import annotations

import contextlib
import functools
import glob
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # JAX is imported where devices are made: `spmd-launch` reads names only.
  import jax

_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_DIMS = {"v4": 3, "v5p": 3, "v5e": 2, "v6e": 2}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}


def chip_grid(generation: str, chips: int) -> tuple[int, ...]:
  """The standard slice shape for a chip count: double the smallest side.

  Example:
    >>> chip_grid("v5p", 32), chip_grid("v5e", 256)
    ((2, 4, 4), (16, 16))
  """
  dims = _DIMS[generation]
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f"{chips=} for {generation} is not a power of two")
  shape = [1] * dims
  if dims == 3 and chips >= 4:
    shape = [2, 2, 1]
  while math.prod(shape) < chips:
    smallest = min(shape)
    i = max(j for j, s in enumerate(shape) if s == smallest)
    shape[i] *= 2
  if math.prod(shape) != chips:
    raise ValueError(f"no standard {generation} slice has {chips=}")
  return tuple(shape)


def topology_name(name: str) -> str:
  """`v5p-64` -> `v5p:2x4x4`; names already in `gen:AxBxC` form pass through."""
  if ":" in name:
    return name
  generation, sep, count = name.partition("-")
  generation = _ALIASES.get(generation, generation)
  if not sep or generation not in _CORES_PER_CHIP or not count.isdigit():
    raise ValueError(
      f"unknown TPU slice {name!r}; use e.g. v4-32, v5p-64, v5e-16, v6e-256 or v5p:2x4x4"
    )
  cores = int(count)
  if cores % _CORES_PER_CHIP[generation]:
    raise ValueError(
      f"{name!r}: {generation} slices count TensorCores, {_CORES_PER_CHIP[generation]} per chip"
    )
  grid = chip_grid(generation, cores // _CORES_PER_CHIP[generation])
  return f"{generation}:{'x'.join(map(str, grid))}"


# The largest slice of each generation that is one host (Cloud TPU VMs:
# v5litepod-8 and v6e-8 are one host of 8 chips; v4-8 and v5p-8 one of 4).
_ONE_HOST_CHIPS = {"v4": 4, "v5p": 4, "v5e": 8, "v6e": 8}
# The hosts of larger slices: 4 chips each, 2x2.
_POD_HOST = (2, 2, 1)


def chips_per_host(name: str) -> tuple[int, int, int]:
  """The chips of one host of a slice, as libtpu's `chips_per_host_bounds`.

  A slice up to `_ONE_HOST_CHIPS` is one host holding the whole grid;
  larger ones are hosts of 2x2 chips. libtpu's default, or a
  `TPU_CHIPS_PER_HOST_BOUNDS` set on the machine that plans (a TPU VM
  describes its own host there), would not describe one-host slices.

  Example:
    >>> chips_per_host("v5e-1"), chips_per_host("v5e-8"), chips_per_host("v6e-256")
    ((1, 1, 1), (2, 4, 1), (2, 2, 1))
    >>> chips_per_host("v5p-8"), chips_per_host("v5p-64")
    ((2, 2, 1), (2, 2, 1))
  """
  generation, grid = topology_name(name).split(":", 1)
  sizes = [int(x) for x in grid.split("x")]
  if math.prod(sizes) <= _ONE_HOST_CHIPS.get(generation, 4):
    return tuple([*sizes, 1, 1, 1][:3])
  return _POD_HOST


# Where libtpu logs when told nothing (its own default).
LIBTPU_DEFAULT_LOG_DIR = "/tmp/tpu_logs"
# The folder this process's libtpu logs to, fixed when `topology_devices` loads it.
_loaded_log_dir: list[str] = []


def _configured_log_dir() -> str:
  """Where libtpu would log if it loaded now.

  libtpu builds its own flags when it starts: `--log_dir` from `TPU_LOG_DIR`
  (`/tmp/tpu_logs` when unset), then whatever `LIBTPU_INIT_ARGS` holds, the
  last `--log_dir` winning. Later changes to either are not read.
  """
  folder = os.environ.get("TPU_LOG_DIR") or LIBTPU_DEFAULT_LOG_DIR
  for arg in os.environ.get("LIBTPU_INIT_ARGS", "").split():
    if arg.startswith("--log_dir="):
      folder = arg.split("=", 1)[1]
  return folder


def libtpu_log_dir() -> str | None:
  """The folder libtpu writes this process's log to; None before it is loaded.

  libtpu's compiler logs its warnings (the SPMD partitioner's among them)
  there, not to stderr; `spmd.compiler_log` reads them.
  """
  return _loaded_log_dir[0] if _loaded_log_dir else None


def point_libtpu_logs(folder: str) -> None:
  """Makes libtpu write its log to `folder` when this process loads it (`TPU_LOG_DIR`).

  A `--log_dir` in `LIBTPU_INIT_ARGS` still wins (libtpu reads it last).

  Raises:
    RuntimeError: libtpu is already loaded, so its folder can no longer change.
  """
  if _loaded_log_dir:
    raise RuntimeError(
      f"libtpu is already loaded and logs to {_loaded_log_dir[0]}; point it at {folder!r} "
      "before the first TPU topology is asked for"
    )
  os.environ["TPU_LOG_DIR"] = folder


def tpu_chips_present() -> bool:
  """True on a machine with TPU chips: a Cloud TPU VM exposes them as /dev/accel* (v2-v4) or VFIO groups (v5 on)."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def accelerator_type(name: str) -> str:
  """A slice's name as Cloud TPU spells it in `TPU_ACCELERATOR_TYPE`.

  Example:
    >>> accelerator_type("v5e-16"), accelerator_type("v5p:2x2x1"), accelerator_type("v6e-8")
    ('v5litepod-16', 'v5p-8', 'v6e-8')
  """
  generation, grid = topology_name(name).split(":", 1)
  chips = math.prod(int(x) for x in grid.split("x"))
  prefix = {"v5e": "v5litepod"}.get(generation, generation)
  return f"{prefix}-{chips * _CORES_PER_CHIP[generation]}"


# What libtpu asks the GCE metadata server for when it loads, unless the
# environment says it (`spmd.tpu_env` lists what a TPU VM sets).
_SLICE_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")


@contextlib.contextmanager
def _slice_named_for_libtpu(name: str) -> Iterator[None]:
  """Names a slice and this host to libtpu while it loads, off a TPU VM; then unsets them.

  Off a TPU VM the metadata server has no slice to give, and libtpu prints a
  block of alarms before anything else (`could not determine TPU accelerator
  type`, `INVALID_ARGUMENT: unexpected worker hostname`). A planner only
  describes slices, which reads neither variable, so naming the slice it
  describes and `localhost` changes no plan and silences them. Variables the
  user set are kept; the ones added here are removed once libtpu has read
  them, so processes this one starts do not take this machine for a TPU host.
  On a TPU VM nothing changes: its libtpu describes the host it runs on.
  """
  if tpu_chips_present():
    yield
    return
  values = dict(zip(_SLICE_VARIABLES, (accelerator_type(name), "localhost"), strict=True))
  added = [key for key in _SLICE_VARIABLES if key not in os.environ]
  os.environ.update({key: values[key] for key in added})
  try:
    yield
  finally:
    for key in added:
      os.environ.pop(key, None)


def libtpu_available() -> bool:
  """True when libtpu (the `tpu` extra) is installed."""
  try:
    import libtpu  # noqa: F401
  except ImportError:
    return False
  return True


@functools.cache
def topology_devices(name: str, num_slices: int = 1) -> tuple[jax.Device, ...]:
  """The devices of a TPU slice (or `num_slices` of them), without TPUs.

  Raises:
    RuntimeError: libtpu is not installed.
    ValueError: libtpu does not know the slice (the message is its one line).
  """
  if not libtpu_available():
    raise RuntimeError(
      "planning for a TPU topology needs libtpu: pip install -e '.[tpu]' "
      "(it compiles for TPUs without having one)"
    )
  # libtpu takes a machine-wide lock on first load, so a second planner (or a
  # test next to a running one) fails; compiling for a description never
  # touches a chip, so several may load it at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax
  from jax.experimental import topologies

  full = topology_name(name)
  # libtpu reads its environment once, when the first description loads it.
  loading = contextlib.nullcontext() if _loaded_log_dir else _slice_named_for_libtpu(full)
  if not _loaded_log_dir:
    _loaded_log_dir.append(_configured_log_dir())
  extra = {}
  if _CORES_PER_CHIP.get(full.split(":")[0]) == 2:
    extra["chip_config_name"] = "megacore"  # one JAX device per chip, as on real pods
  try:
    with loading:
      desc = topologies.get_topology_desc(
        platform="tpu",
        topology_name=full,
        num_slices=num_slices,
        chips_per_host_bounds=chips_per_host(full),
        **extra,
      )
  except jax.errors.JaxRuntimeError as e:
    # libtpu's refusal of a shape it does not know is about the input.
    raise ValueError(
      f"libtpu cannot describe TPU slice {name!r} ({full}, {num_slices=}): "
      f"{' '.join(str(e).split())[:300]}"
    ) from None
  return tuple(desc.devices)
