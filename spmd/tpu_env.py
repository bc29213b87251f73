"""What a Cloud TPU VM's environment says about its slice: how many hosts, and which one this is.

JAX's own detection of a TPU VM (`jax._src.clusters`) asks the GCE metadata
server for the slice's workers and the multislice coordinator, even where
the environment already says that the slice is one host; on a machine whose
metadata server is absent or blocked that query ends the job with a
`requests.ConnectionError`. `spmd.initialize` reads the environment here
first: one host needs no server at all, and a slice of several hosts whose
variables name every worker needs none either.

Variables read (Cloud TPU VMs, GKE and `spmd-launch tpu` set them):

| variable | says |
|---|---|
| `TPU_WORKER_HOSTNAMES` (or `TPU_PROCESS_ADDRESSES`) | the slice's hosts, comma separated |
| `TPU_WORKER_ID` | this host's index among them |
| `TPU_HOST_BOUNDS` | the hosts as a grid, e.g. `2,2,1` |
| `TPU_ACCELERATOR_TYPE`, `TPU_CHIPS_PER_HOST_BOUNDS` | chips of the slice, and of one host |
| `MEGASCALE_NUM_SLICES`, `MEGASCALE_SLICE_ID` | slices joined over DCN |

Example:
  >>> one = {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
  ...        "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}
  >>> read_slice(one).processes, read_slice(one).evidence
  (1, 'TPU_WORKER_HOSTNAMES=localhost')
  >>> read_slice({"TPU_HOST_BOUNDS": "2,1,1"}).processes
  2
  >>> read_slice({}).processes is None  # the environment says nothing
  True
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from spmd import topology

WORKERS = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES")
WORKER_ID = "TPU_WORKER_ID"
HOST_BOUNDS = "TPU_HOST_BOUNDS"
ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"
CHIPS_PER_HOST = "TPU_CHIPS_PER_HOST_BOUNDS"
NUM_SLICES = "MEGASCALE_NUM_SLICES"


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """A TPU slice as its environment describes it; None where the environment is silent."""

  hosts: int | None  # hosts per slice
  slices: int  # slices joined over DCN (MEGASCALE_NUM_SLICES, default 1)
  workers: tuple[str, ...] | None  # the hosts' names or addresses, in worker-id order
  worker_id: int | None  # this host's index among `workers`
  evidence: str  # the variables that gave `hosts`, for messages ("" when none did)

  @property
  def processes(self) -> int | None:
    """One process per host: hosts x slices, or None when the hosts are unknown."""
    return None if self.hosts is None else self.hosts * self.slices

  @property
  def names_every_worker(self) -> bool:
    """The environment alone sets up a one-slice job: every worker and this one's index."""
    return (
      self.slices == 1
      and self.workers is not None
      and self.worker_id is not None
      and 0 <= self.worker_id < len(self.workers)
    )


def _get(environ: Mapping[str, str], name: str) -> str | None:
  value = environ.get(name)
  return value.strip() if value and value.strip() else None


def _int(environ: Mapping[str, str], name: str) -> int | None:
  raw = _get(environ, name)
  if raw is None:
    return None
  try:
    return int(raw)
  except ValueError:
    raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _bounds(environ: Mapping[str, str], name: str) -> int | None:
  """The product of a bounds variable (`2,2,1` -> 4)."""
  raw = _get(environ, name)
  if raw is None:
    return None
  try:
    sizes = [int(x) for x in raw.replace("x", ",").split(",") if x.strip()]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    raise ValueError(f"environment variable {name}={raw!r} is not a list of sizes like 2,2,1")
  return math.prod(sizes)


def _slice_chips(accelerator_type: str) -> int | None:
  """Chips of a slice from its Cloud TPU name (`v5litepod-16` -> 16, `v5p-8` -> 4); None if unknown."""
  try:
    name = topology.topology_name(accelerator_type)
  except ValueError:
    return None
  return math.prod(int(x) for x in name.split(":", 1)[1].split("x"))


def read_slice(environ: Mapping[str, str] | None = None) -> TpuSlice:
  """The slice `environ` (default: this process's environment) describes.

  The hosts come from the first variable that gives them: the worker list,
  then `TPU_HOST_BOUNDS`, then the accelerator type's chips over the chips
  per host.

  Raises:
    ValueError: a variable is malformed; the message names it and its value.
  """
  environ = os.environ if environ is None else environ
  slices = _int(environ, NUM_SLICES) or 1
  workers = None
  for name in WORKERS:
    raw = _get(environ, name)
    if raw is not None:
      workers = tuple(w.strip() for w in raw.split(",") if w.strip())
      evidence = f"{name}={raw}"
      break
  worker_id = _int(environ, WORKER_ID)
  if workers:
    return TpuSlice(len(workers), slices, workers, worker_id, evidence)
  hosts = _bounds(environ, HOST_BOUNDS)
  if hosts is not None:
    return TpuSlice(hosts, slices, None, worker_id, f"{HOST_BOUNDS}={environ[HOST_BOUNDS]}")
  accelerator, per_host = _get(environ, ACCELERATOR_TYPE), _bounds(environ, CHIPS_PER_HOST)
  chips = None if accelerator is None else _slice_chips(accelerator)
  if chips is not None and per_host is not None:
    evidence = f"{ACCELERATOR_TYPE}={accelerator}, {CHIPS_PER_HOST}={environ[CHIPS_PER_HOST]}"
    return TpuSlice(max(1, chips // per_host), slices, None, worker_id, evidence)
  return TpuSlice(None, slices, None, worker_id, "")
