"""The run's throughput: real units per second and the share of peak FLOP/s.

The share is MFU when the task counts its model FLOPs per step
(`Task.flops_per_step`), else HFU from the matmul FLOPs of the compiled
train step. Only process 0 measures the peak and reports the share. The
peak is that of the dtype the compiled step multiplies in
(`step_compute_dtype`): under `train.precision=bfloat16` a step whose
bfloat16 dots and convolutions are under half its matmul FLOPs (a model
that widens them, a compiler that does) is said so, once, and measured
against the float32 peak.

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
import logging
from collections.abc import Callable

import jax
import ml_collections

from spmd import hlo, multihost
from spmd import rules as rules_lib
from trainers.reporting import peaks
from trainers.step.loss import abstract_batch, batch_shardings
from trainers.step.state import StateSetup
from trainers.tasks import Task

log = logging.getLogger(__name__)


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
  flops_metric, flops_per_step = "mfu", task.flops_per_step
  computes_in = setup.precision
  if flops_per_step is None or setup.precision != "float32":
    # Every process lowers the same signature: a lowering checks that hosts
    # agree. The compilation cache keeps the program for the first step.
    text = compiled_text(train_step, setup, task, config, mesh, batch_axes)
    computes_in = step_compute_dtype(setup.precision, text)
    if flops_per_step is None:
      flops_metric = "hfu"
      flops_per_step = float(hlo.matmul_flops(text)) * mesh.devices.size
  # Only process 0 reports MFU; the others skip the (measured, on CPU) peak.
  peak = (
    peaks.peak_flops(jax.local_devices()[0], computes_in, cache_dir=cache_dir)
    if chief
    else peaks.PeakInfo(0.0, "not measured on this process")
  )
  # The others wait: a CPU peak measured while a peer compiles beside it on
  # the same cores would come out low (once; it is cached after).
  multihost.barrier("peak_measured", timeout_s=600)
  return Throughput(
    rate=f"{task.unit}_per_s",
    flops_metric=flops_metric,
    flops_per_step=flops_per_step,
    peak=peak,
    peak_total=peak.flops_per_s * jax.device_count(),
  )


def compiled_text(
  train_step: Callable,
  setup: StateSetup,
  task: Task,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  batch_axes: tuple[str, ...],
) -> str:
  """The compiled train step's optimised HLO."""
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  placement = batch_shardings(task, rules_lib.preset(config.mesh.rules), mesh, batch_axes)
  batch = abstract_batch(task, config.global_batch, placement)
  return train_step.lower(state, batch).compile().as_text()


_said: set[tuple[str, float]] = set()


def step_compute_dtype(precision: str, hlo_text: str) -> str:
  """The dtype a step of `train.precision=precision` multiplies in, read from its HLO.

  `precision` when dots and convolutions whose operands are both of it
  hold at least half the step's matmul FLOPs; else float32, and the log
  says so once per process: the policy cast the step, yet its matmuls were
  widened (by the model, or by a compiler such as XLA:CPU's), and a
  bfloat16 peak would flatter its MFU.

  Example:
    >>> text = '''ENTRY %main (a: f32[8,32], b: f32[32,16]) -> f32[8,16] {
    ...   %a = f32[8,32]{1,0} parameter(0)
    ...   %b = f32[32,16]{1,0} parameter(1)
    ...   ROOT %d = f32[8,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }'''
    >>> step_compute_dtype("float32", text), step_compute_dtype("bfloat16", text)
    ('float32', 'float32')
  """
  by_dtype = hlo.matmul_flops_by_dtype(hlo_text)
  total = sum(by_dtype.values())
  if precision == "float32" or not total:
    return precision
  share = by_dtype.get((precision, precision), 0.0) / total
  if share >= 0.5:
    return precision
  key = (precision, round(share, 2))
  if key not in _said and jax.process_index() == 0:
    log.warning(
      "train.precision=%s, but %s x %s dots and convolutions are %.0f%% of the compiled "
      "step's matmul FLOPs (the model or the compiler widens the rest): MFU is against "
      "the float32 peak",
      precision,
      precision,
      precision,
      100 * share,
    )
  _said.add(key)
  return "float32"
