"""Experiment tracking in Weights & Biases: the metrics file's records and the summary, on process 0.

Off unless `config.wandb.project` is set; `wandb` (the `wandb` extra:
`pip install spmd-harness[wandb]`) is imported only then. Each record
`MetricsWriter` writes to `metrics.jsonl` becomes one W&B history row with
the same keys and values: its `step` is a logged value and the x-axis of
every chart (`define_metric`), not W&B's own row counter, so rows may come
again or out of order as they do in the file (an eval between two metrics
writes, the steps a resumed run repeats after its last checkpoint). The
run's summary joins the W&B run's summary at the end.

The W&B run's id is kept in `workdir/wandb_run_id`, so a restarted run
resumes the same W&B run (`resume="allow"`) and its steps continue there.

Example (off: nothing is imported or written):
  >>> import ml_collections, tempfile
  >>> settings = ml_collections.ConfigDict({"project": "", "entity": "", "name": "", "mode": ""})
  >>> with open_tracker(settings, tempfile.mkdtemp(), run_config={}, enabled=True) as tracker:
  ...   tracker.log(1, {"loss": 2.5})
  >>> tracker.enabled
  False
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import ml_collections
from etils import epath

from trainers import paths

log = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"  # in the workdir: the W&B run a restart resumes
MODES = ("", "online", "offline", "disabled")  # "": W&B's own choice (WANDB_MODE, else online)
MISSING = "config.wandb.project is set but wandb is not installed: pip install spmd-harness[wandb]"


def check_settings(settings: ml_collections.ConfigDict) -> None:
  """Raises `ValueError` for a mode W&B does not take, or a project without `wandb` installed.

  Every process checks, before any data is prepared, so a missing package
  stops the whole job at once rather than process 0 alone.

  Example:
    >>> check_settings(ml_collections.ConfigDict({"project": "", "mode": "local"}))
    Traceback (most recent call last):
    ...
    ValueError: wandb.mode='local' must be one of ('', 'online', 'offline', 'disabled')
  """
  if settings.mode not in MODES:
    raise ValueError(f"wandb.mode={settings.mode!r} must be one of {MODES}")
  if settings.project and importlib.util.find_spec("wandb") is None:
    raise ValueError(MISSING)


class Tracker:
  """One W&B run: `log` a metrics record, `finish` with the summary. Disabled: does nothing."""

  def __init__(self, run: Any = None) -> None:
    self._run = run

  @property
  def enabled(self) -> bool:
    return self._run is not None

  def log(self, step: int, values: Mapping[str, float]) -> None:
    """One history row: `step` and `values`, as the metrics file's record holds them."""
    if self._run is not None:
      self._run.log({"step": int(step), **values})

  def mark_preempting(self) -> None:
    """Tells W&B the run is being preempted (it resumes), so it is not shown as crashed."""
    if self._run is not None:
      self._run.mark_preempting()

  def finish(self, summary: Mapping[str, Any] | None = None, exit_code: int = 0) -> None:
    """Adds the summary's scalars and strings to the run's summary, then ends the run.

    `loss_history` is left out (the history holds every loss), and so is any
    entry that is neither a number, a bool nor a string (a mixture's
    `data_sources` table; it is in `summary.json`).
    """
    if self._run is None:
      return
    run, self._run = self._run, None
    if summary:
      run.summary.update(
        {
          k: v
          for k, v in summary.items()
          if k != "loss_history" and isinstance(v, int | float | str | bool)
        }
      )
    run.finish(exit_code=exit_code)


def _run_id(workdir: epath.Path) -> str:
  """The W&B run id this workdir uses: read back on a restart, else made and kept."""
  path = workdir / RUN_ID_FILE
  workdir.mkdir(parents=True, exist_ok=True)  # the run starts before the trainer makes it
  if path.exists():
    return path.read_text().strip()
  run_id = secrets.token_hex(6)  # W&B ids take letters and digits
  path.write_text(run_id + "\n")
  return run_id


def start_run(
  settings: ml_collections.ConfigDict, workdir: str | os.PathLike, run_config: Mapping[str, Any]
) -> Tracker:
  """A W&B run for `workdir` (resumed when it has one), with `run_config` as its config."""
  try:
    import wandb
  except ImportError:
    raise ImportError(MISSING) from None
  workdir = paths.user_path(workdir)
  # W&B's files go under the workdir when it is local and WANDB_DIR does not
  # say otherwise: a run's records stay with its metrics and checkpoints.
  local = not paths.is_url(workdir) and not os.environ.get("WANDB_DIR")
  run = wandb.init(
    project=settings.project,
    entity=settings.entity or None,
    name=settings.name or workdir.name,
    mode=settings.mode or None,
    id=_run_id(workdir),
    resume="allow",
    dir=str(workdir) if local else None,
    config=dict(run_config),
  )
  # Charts plot against the training step, which rows carry themselves.
  run.define_metric("step")
  run.define_metric("*", step_metric="step")
  log.info("spmd-train: W&B run %s (project %s)", run.id, settings.project)
  return Tracker(run)


@contextmanager
def open_tracker(
  settings: ml_collections.ConfigDict,
  workdir: str | os.PathLike,
  run_config: Mapping[str, Any],
  enabled: bool,
) -> Iterator[Tracker]:
  """A `Tracker`, finished on the way out: failed (exit code 1) after an error.

  Disabled (does nothing) unless `enabled` (process 0) and `settings.project`.
  """
  tracker = start_run(settings, workdir, run_config) if enabled and settings.project else Tracker()
  try:
    yield tracker
  except BaseException:
    tracker.finish(exit_code=1)
    raise
  tracker.finish()
