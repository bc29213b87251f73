"""The end of a run: the summary (returned, `summary.json`, printed), the loss curve, the report.

Every process builds the same summary; process 0 writes it, plots the loss
curve and prints both. The task's report (a greedy sample, say) runs last,
so the results are on disk whatever it does.

Example:
  >>> from types import SimpleNamespace
  >>> task = SimpleNamespace(unit="tokens", units_per_batch=1024)  # the two Task fields it reads
  >>> real_unit_share(task, [{"units": 512.0}, {"units": 1024.0}])
  {'real_token_share': 0.75}
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from trainers.reporting import console, loss_curve
from trainers.reporting.throughput import Throughput
from trainers.step import task_metrics
from trainers.step.state import StateSetup, build_model
from trainers.tasks import Task

log = logging.getLogger(__name__)


def real_unit_share(task: Task, history: Sequence[dict]) -> dict[str, float]:
  """`{"real_<unit>_share": mean units per step / Task.units_per_batch}`, when the task says.

  The units are the step's own sum (already fetched with the metrics), so
  this costs no transfer.
  """
  if not task.units_per_batch or not history:
    return {}
  unit = task.unit[:-1] if task.unit.endswith("s") else task.unit
  share = float(np.mean([h.get("units", 0.0) for h in history])) / task.units_per_batch
  return {f"real_{unit}_share": share}


def summarize(
  steps: int,
  history: Sequence[dict],
  final_eval: dict,
  throughput: Throughput,
  *,
  task: Task,
  workdir: epath.Path,
  resumed_from: str,
  started: float,
  first_step: dict[str, float],
  extra: Mapping[str, Any] | None = None,
  data_sources: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
  """The run's summary after `steps` steps: losses, throughput, timings, where its files are.

  `history` is every fetched metrics row, oldest first (the loop's).
  `extra`: entries the hooks returned (`Hook.end`), last; one whose name the
  summary already uses is left out, with a warning naming it.
  `data_sources`: what each source of a mixture fed over the run's steps
  (its weight, rows, epochs, units and their share:
  `MixtureBatches.sources_fed`), kept as the summary's `data_sources`.

  Of the final eval it takes the loss and every metric of the task's loss,
  `eval_<name>` by the task's own names (none, if the loss returns none).
  """
  rate, flops_metric = throughput.rate, throughput.flops_metric
  last = history[-1] if history else {}
  rates = [h[rate] for h in history[1:]] or [last.get(rate, 0.0)]
  summary = {
    "steps": steps,
    "train_loss": last.get("loss"),
    "eval_loss": final_eval["eval_loss"],
    **task_metrics.eval_metrics_of_task(final_eval),  # the task's own, by their names
    rate: float(np.median(rates)) if rates else None,
    flops_metric: (
      float(np.median([h.get(flops_metric, 0.0) for h in history])) if history else None
    ),
    "peak_source": throughput.peak.source,
    "wall_time_s": time.perf_counter() - started,
    "first_step_s": first_step.get("s"),  # from the start of training (imports excluded)
    "first_step_at": first_step.get("at"),  # Unix time, for timing from outside
    "workdir": str(workdir),
    "checkpoints": str(workdir / "checkpoints"),
    "metrics": str(workdir / "metrics.jsonl"),
    "resumed_from": resumed_from,
    "loss_history": [(h["step"], h["loss"]) for h in history],
    **real_unit_share(task, history),
  }
  if data_sources is not None:
    summary["data_sources"] = data_sources
  for name, value in (extra or {}).items():
    if name in summary:
      log.warning(
        "spmd-train: a hook's summary entry %r is the trainer's own; it is left out", name
      )
    else:
      summary[name] = value
  return summary


def publish(
  summary: dict[str, Any],
  workdir: epath.Path,
  chief: bool,
  report: Callable[[], str],
  own_entries: Sequence[str] = (),
  draw_loss_curve: bool = True,
) -> dict[str, Any]:
  """Process 0 writes the loss curve (if `draw_loss_curve`) and `summary.json`; then the report joins the summary.

  `report()` runs on every process, after the files are written; process 0
  prints the summary and the report. Returns `summary` with `report` added.
  `own_entries`: the hooks' entries of the summary, printed after the trainer's.
  """
  if chief:
    try:
      if draw_loss_curve:
        summary["loss_curve"] = str(
          loss_curve.plot_loss_curve(workdir / "metrics.jsonl", workdir / "loss.png")
        )
      (workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    except OSError as e:
      # A store's own error names a host and port, not the run: say what was being written.
      e.add_note(
        f"writing the loss curve and summary.json to {workdir} failed: is the store reachable?"
      )
      raise
  summary["report"] = text = report()
  if chief:
    print(console.format_summary(summary, own_entries), flush=True)
    if text:
      print(text, flush=True)
  return summary


def task_report(task: Task, setup: StateSetup, state: dict, step: int) -> str:
  """The task's end-of-run report; a failure is logged, never fatal (the run is done)."""
  if task.report is None:
    return ""
  try:
    model = build_model(setup, state["params"], state.get("model_state"))
    model.eval()
    return task.report(model, step)
  except Exception as e:  # the summary and loss curve are already written
    log.warning("spmd-train: the task's report failed: %s: %s", type(e).__name__, e)
    return ""
