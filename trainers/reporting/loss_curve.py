"""The loss curve: loss (and eval loss) against step, from a run's metrics file, as a PNG."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainers import paths
from trainers.reporting.metrics import RESERVED_KEYS, read_metrics

if TYPE_CHECKING:
  import matplotlib.figure


def _series(records: Iterable[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
  # A resumed run logs again the steps between its checkpoint and the crash;
  # the later record of a step wins, so the curve never runs backwards.
  by_step = {int(r["step"]): float(r[key]) for r in records if key in r and "step" in r}
  steps = sorted(by_step)
  return steps, [by_step[s] for s in steps]


def loss_figure(
  records: Iterable[Mapping[str, Any]],
  keys: Iterable[str] = ("loss", "eval_loss"),
  title: str = "Loss",
) -> matplotlib.figure.Figure:
  """A matplotlib figure with one line per key of `keys` found in `records`.

  Made without pyplot, so it touches no global backend state.

  Example:
    >>> fig = loss_figure([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0, "eval_loss": 1.5}])
    >>> [line.get_label() for line in fig.axes[0].get_lines()]
    ['loss', 'eval_loss']
  """
  records = list(records)
  keys = tuple(keys)
  series = {key: _series(records, key) for key in keys}
  series = {key: s for key, s in series.items() if s[0]}
  if not series:
    present = sorted({k for r in records for k in r} - set(RESERVED_KEYS))
    raise ValueError(f"none of {keys=} is in the records; they have {present}")
  from matplotlib.figure import Figure  # here: a slow import that only the plot needs

  fig = Figure(figsize=(7, 4.5), layout="tight")
  ax = fig.subplots()
  for key, (steps, values) in series.items():
    # Eval points are few and far apart: markers show where they really are.
    marker = "o" if key != "loss" and len(steps) <= 50 else None
    ax.plot(steps, values, label=key, marker=marker)
  ax.set_title(title)
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.grid(True, alpha=0.3)
  ax.legend()
  return fig


def plot_loss_curve(
  jsonl_path: str | os.PathLike,
  png_path: str | os.PathLike,
  keys: Iterable[str] = ("loss", "eval_loss"),
) -> Path:
  """Draws `keys` from a metrics JSONL file against step into a PNG; returns its path.

  Keys missing from the file are left out; if all are missing it is a
  ValueError naming the keys the file does have.

  Example:
    >>> import tempfile
    >>> from trainers.reporting.metrics import MetricsWriter
    >>> workdir = Path(tempfile.mkdtemp())
    >>> with MetricsWriter(workdir, enabled=True) as w:
    ...   w.write(1, {"loss": 2.0})
    >>> plot_loss_curve(workdir / "metrics.jsonl", workdir / "loss.png").read_bytes()[:4]
    b'\\x89PNG'
  """
  png_path = paths.user_path(png_path)
  title = f"Loss: {paths.user_path(jsonl_path).parent.name}"
  fig = loss_figure(read_metrics(jsonl_path), keys, title=title)
  png_path.parent.mkdir(parents=True, exist_ok=True)
  with png_path.open("wb") as f:
    fig.savefig(f, format="png", dpi=100)
  return png_path
