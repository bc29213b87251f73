"""What a plan is for: a TPU slice from its name, or a number of GPUs of a kind.

Example:
  >>> sorted(GPU_KINDS)[:2]
  ['a100-40gb', 'a100-80gb']
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import jax

from spmd import topology
from spmd.topology import topology_devices

# `--gpu` names -> the device_kind JAX reports for that GPU (peaks and memory tables).
GPU_KINDS = {
  "h100": "NVIDIA H100 80GB HBM3",
  "h100-pcie": "NVIDIA H100 PCIe",
  "h200": "NVIDIA H200",
  "a100-40gb": "NVIDIA A100-SXM4-40GB",
  "a100-80gb": "NVIDIA A100-SXM4-80GB",
}


@dataclasses.dataclass(frozen=True)
class Target:
  """What to plan for: devices to compile against and what they stand for."""

  name: str  # e.g. "v5p-256", "2 x v5e-256", "16 x h100"
  devices: tuple[Any, ...]
  device_kind: str  # for the peak FLOP/s and memory tables
  num_slices: int
  hosts: int
  devices_per_host: int
  estimated: bool  # compiled for stand-in CPU devices: temporaries and FLOPs are estimates


def tpu_target(topology: str, num_slices: int = 1) -> Target:
  """A TPU slice (or several) from its name, e.g. `v5p-256`; needs libtpu."""
  devices = topology_devices(topology, num_slices)
  hosts = len({(getattr(d, "slice_index", 0) or 0, d.process_index) for d in devices})
  name = topology if num_slices == 1 else f"{num_slices} x {topology}"
  return Target(
    name, devices, devices[0].device_kind, num_slices, hosts, len(devices) // hosts, False
  )


def gpu_target(gpu: str, num_gpus: int, gpus_per_host: int = 8) -> Target:
  """`num_gpus` GPUs of type `gpu` (see `GPU_KINDS`), `gpus_per_host` to a node.

  Compiles for this process's CPU devices, so it needs `jax_num_cpu_devices`
  (or `SPMD_CPU_DEVICES`) of at least `num_gpus` set before JAX starts.
  """
  if gpu not in GPU_KINDS:
    raise ValueError(f"{gpu=} is not known; choose one of {sorted(GPU_KINDS)}")
  if num_gpus < 1 or gpus_per_host < 1 or num_gpus % min(gpus_per_host, num_gpus):
    raise ValueError(f"{num_gpus=} is not a whole number of hosts of {gpus_per_host=}")
  cpus = jax.devices("cpu")
  if len(cpus) < num_gpus:
    raise ValueError(
      f"planning for {num_gpus=} needs as many CPU devices, this process has {len(cpus)}: "
      f"set jax_num_cpu_devices={num_gpus} before JAX starts (spmd-plan does)"
    )
  per_host = min(gpus_per_host, num_gpus)
  return Target(
    f"{num_gpus} x {gpu}",
    tuple(cpus[:num_gpus]),
    GPU_KINDS[gpu],
    1,
    num_gpus // per_host,
    per_host,
    True,
  )


@contextlib.contextmanager
def own_libtpu_log_folder() -> Iterator[str | None]:
  """Points libtpu's log at a fresh folder for the block, then removes the folder.

  libtpu writes the compiler's warnings (the SPMD partitioner's fallbacks
  among them) to its log folder, not to stderr, and shares `/tmp/tpu_logs`
  with every other process on the machine unless told otherwise; the plan
  reads them from a folder of its own (`spmd.compiler_log`). A folder the
  user chose (`TPU_LOG_DIR`, or `--log_dir` in `LIBTPU_INIT_ARGS`) is kept
  and read instead; so is the one of a libtpu this process already loaded.
  Yields the folder libtpu will log to, None when it is the user's or fixed.
  """
  chosen = os.environ.get("TPU_LOG_DIR") or "--log_dir=" in os.environ.get("LIBTPU_INIT_ARGS", "")
  if chosen or topology.libtpu_log_dir() is not None:
    yield None
    return
  folder = tempfile.mkdtemp(prefix="spmd-plan-libtpu-logs-")
  topology.point_libtpu_logs(folder)
  try:
    yield folder
  finally:
    shutil.rmtree(folder, ignore_errors=True)
