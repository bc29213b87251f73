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
from collections.abc import Callable
from typing import Any

import numpy as np
from etils import epath

from trainers.reporting import metrics
from trainers.reporting.throughput import Throughput
from trainers.run.loop import LoopState
from trainers.step import task_metrics
from trainers.step.state import StateSetup, build_model
from trainers.tasks import Task

log = logging.getLogger(__name__)


def real_unit_share(task: Task, history: list[dict]) -> dict[str, float]:
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
  loop: LoopState,
  final_eval: dict,
  throughput: Throughput,
  *,
  task: Task,
  workdir: epath.Path,
  resumed_from: str,
  started: float,
  first_step: dict[str, float],
  extra: Callable[[], dict] = dict,
) -> dict[str, Any]:
  """The run's summary: losses, throughput, timings, where its files are; `extra()` last.

  Of the final eval it takes the loss and every metric of the task's loss,
  `eval_<name>` by the task's own names (none, if the loss returns none).
  """
  rate, flops_metric = throughput.rate, throughput.flops_metric
  last = loop.history[-1] if loop.history else {}
  rates = [h[rate] for h in loop.history[1:]] or [last.get(rate, 0.0)]
  return {
    "steps": loop.step,
    "train_loss": last.get("loss"),
    "eval_loss": final_eval["eval_loss"],
    **task_metrics.eval_metrics_of_task(final_eval),  # the task's own, by their names
    rate: float(np.median(rates)) if rates else None,
    flops_metric: (
      float(np.median([h.get(flops_metric, 0.0) for h in loop.history])) if loop.history else None
    ),
    "peak_source": throughput.peak.source,
    "wall_time_s": time.perf_counter() - started,
    "first_step_s": first_step.get("s"),  # from the start of training (imports excluded)
    "first_step_at": first_step.get("at"),  # Unix time, for timing from outside
    "workdir": str(workdir),
    "checkpoints": str(workdir / "checkpoints"),
    "metrics": str(workdir / "metrics.jsonl"),
    "resumed_from": resumed_from,
    "loss_history": [(h["step"], h["loss"]) for h in loop.history],
    **real_unit_share(task, loop.history),
    **extra(),
  }


def publish(
  summary: dict[str, Any], workdir: epath.Path, chief: bool, report: Callable[[], str]
) -> dict[str, Any]:
  """Process 0 writes the loss curve and `summary.json`; then the report joins the summary.

  `report()` runs on every process, after the files are written; process 0
  prints the summary and the report. Returns `summary` with `report` added.
  """
  if chief:
    summary["loss_curve"] = str(
      metrics.plot_loss_curve(workdir / "metrics.jsonl", workdir / "loss.png")
    )
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
  summary["report"] = text = report()
  if chief:
    print(metrics.format_summary(summary), flush=True)
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
