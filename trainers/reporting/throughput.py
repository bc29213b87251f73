"""The run's throughput: real units per second and the share of peak FLOP/s.

The share is MFU when the task counts its model FLOPs per step
(`Task.flops_per_step`), else HFU from the matmul FLOPs of the compiled
train step. Only process 0 measures the peak and reports the share.

Example:
  >>> from trainers.reporting.peaks import PeakInfo
  >>> rate = Throughput("tokens_per_s", "mfu", 4e12, PeakInfo(1e12, "table"), peak_total=8e12)
  >>> row = {"units": 512.0, "step_time_s": 0.5}
  >>> rate.annotate(row)
  >>> row["tokens_per_s"], row["mfu"]
  (1024.0, 1.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import ml_collections

from spmd import hlo, multihost
from spmd.layout import batch_sharding
from trainers.reporting import peaks
from trainers.step.loss import abstract_batch
from trainers.step.state import StateSetup
from trainers.tasks import Task


@dataclasses.dataclass(frozen=True)
class Throughput:
  """What each fetched metrics row gains: `rate` and, with a peak, `flops_metric`."""

  rate: str  # "<unit>_per_s"
  flops_metric: str  # "mfu" or "hfu"
  flops_per_step: float | None
  peak: peaks.PeakInfo  # one device's
  peak_total: float  # over all devices

  def annotate(self, row: dict) -> None:
    """Adds the row's units per second and, when both are known, its FLOP/s share of peak."""
    row[self.rate] = row.get("units", 0.0) / row["step_time_s"]  # real units, padding excluded
    if self.flops_per_step and self.peak_total:
      row[self.flops_metric] = self.flops_per_step / row["step_time_s"] / self.peak_total


def measure_throughput(
  train_step: Callable,
  setup: StateSetup,
  task: Task,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  batch_axes: tuple[str, ...],
  cache_dir: str,
) -> Throughput:
  """The peak (process 0 only) and the FLOPs per step, from the task or the compiled step."""
  chief = jax.process_index() == 0
  # Only process 0 reports MFU; the others skip the (measured, on CPU) peak.
  peak = (
    peaks.peak_flops(jax.local_devices()[0], setup.precision, cache_dir=cache_dir)
    if chief
    else peaks.PeakInfo(0.0, "not measured on this process")
  )
  # The others wait: a CPU peak measured while a peer compiles beside it on
  # the same cores would come out low (once; it is cached after).
  multihost.barrier("peak_measured", timeout_s=600)
  flops_metric, flops_per_step = "mfu", task.flops_per_step
  if flops_per_step is None:
    # Every process lowers the same signature: a lowering checks that hosts agree.
    flops_metric = "hfu"
    flops_per_step = compiled_flops(train_step, setup, task, config, mesh, batch_axes)
  return Throughput(
    rate=f"{task.unit}_per_s",
    flops_metric=flops_metric,
    flops_per_step=flops_per_step,
    peak=peak,
    peak_total=peak.flops_per_s * jax.device_count(),
  )


def compiled_flops(
  train_step: Callable,
  setup: StateSetup,
  task: Task,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  batch_axes: tuple[str, ...],
) -> float:
  """The compiled train step's matmul FLOPs over all devices (hardware FLOPs)."""
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  batch = abstract_batch(task, config.global_batch, batch_sharding(mesh, batch_axes))
  text = train_step.lower(state, batch).compile().as_text()
  return float(hlo.matmul_flops(text)) * mesh.devices.size
