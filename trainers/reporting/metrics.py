"""What a run reports: metrics files, a loss curve, a progress bar, a summary.

Only process 0 writes or prints; every other process builds the same objects
with `enabled=False` and they do nothing, so callers need no `if` around them.

  * `MetricsWriter`: one JSON line per logged step in `workdir/metrics.jsonl`
    and the same scalars as TensorBoard events in `workdir/tensorboard/`.
  * `read_metrics`, `loss_figure`, `plot_loss_curve`: read the JSONL back and
    draw loss (and eval loss) against step as a PNG.
  * `Progress`: a tqdm bar with loss, tokens/s, the task's metrics and ETA.
  * `format_summary`: the aligned end-of-run summary.

Example:
  >>> import tempfile
  >>> workdir = tempfile.mkdtemp()
  >>> with MetricsWriter(workdir, enabled=True) as writer:
  ...   writer.write(1, {"loss": 2.5})
  ...   writer.write(2, {"loss": 2.0, "eval_loss": 2.25})
  >>> [(r["step"], r["loss"]) for r in read_metrics(f"{workdir}/metrics.jsonl")]
  [(1, 2.5), (2, 2.0)]
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self

import jax
import tqdm

if TYPE_CHECKING:
  import matplotlib.figure
from tensorboardX import SummaryWriter

from trainers import paths

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("step", "time")


def _drop_cut_last_line(path: Path) -> None:
  # A writer killed mid-line leaves a line without its newline; appending to
  # it would glue the resumed run's first record onto it and lose both.
  if not path.exists():
    return
  data = path.read_bytes()
  if data and not data.endswith(b"\n"):
    os.truncate(path, data.rfind(b"\n") + 1)


class MetricsWriter:
  """Appends scalar metrics to `workdir/metrics.jsonl` and TensorBoard.

  Each `write` adds one line `{"step": ..., "time": ..., key: value, ...}`
  (`time` is Unix wall-clock seconds) and one TensorBoard scalar per key.
  The JSONL file is appended to and flushed per line, so a resumed run
  continues the same file (dropping a line a crash cut short) and a crash
  loses at most the TensorBoard events since the last flush.

  Values are converted with `float()`: numpy scalars and 0-d jax arrays are
  accepted, but a jax array costs a device-to-host copy, so fetch a step's
  metrics together (`jax.device_get`) before writing.
  NaN and infinity are written as JSON's `NaN`/`Infinity` (Python reads them
  back) so a diverged run's log shows the divergence.

  With `enabled=False` (every process but 0) nothing is created or written.

  Example:
    >>> import tempfile, numpy as np
    >>> workdir = tempfile.mkdtemp()
    >>> writer = MetricsWriter(workdir, enabled=True)
    >>> writer.write(10, {"loss": np.float32(1.5)})
    >>> writer.close()
    >>> read_metrics(f"{workdir}/metrics.jsonl")[0]["loss"]
    1.5
  """

  def __init__(self, workdir: str | os.PathLike, enabled: bool) -> None:
    self.workdir = paths.user_path(workdir)
    self.enabled = enabled
    self.path = self.workdir / METRICS_FILE
    self.tensorboard_dir = self.workdir / TENSORBOARD_DIR
    self._file: IO[str] | paths.RemoteTextFile | None = None
    self._tb: SummaryWriter | None = None
    if enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)
      if paths.is_url(self.workdir):  # object stores cannot append: the file is rewritten
        _register_tensorboard_writer(str(self.workdir).split("://", 1)[0])
        self._file = paths.RemoteTextFile(self.path)
      else:
        _drop_cut_last_line(Path(self.path))
        self._file = open(self.path, "a", encoding="utf-8")
      self._tb = SummaryWriter(logdir=str(self.tensorboard_dir))

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Records `metrics` (name -> scalar) at `step`."""
    if not self.enabled:
      return
    if self._file is None or self._tb is None:
      raise ValueError(f"MetricsWriter for {str(self.workdir)!r} is closed; cannot write {step=}")
    clash = [k for k in metrics if k in _RESERVED]
    if clash:
      raise ValueError(f"metric names {clash} are reserved for the record itself ({_RESERVED})")
    values = {}
    for key, value in metrics.items():
      try:
        values[key] = float(value)
      except (TypeError, ValueError) as e:
        raise ValueError(f"metric {key!r}={value!r} at {step=} is not a scalar") from e
    now = time.time()
    record = {"step": int(step), "time": now, **values}
    self._file.write(json.dumps(record) + "\n")
    if not isinstance(self._file, paths.RemoteTextFile):  # that one uploads on its own clock
      self._file.flush()
    for key, value in values.items():
      self._tb.add_scalar(key, value, global_step=int(step), walltime=now)

  def flush(self) -> None:
    """Pushes buffered lines and TensorBoard events to disk."""
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes both files; later `close` calls do nothing."""
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


class _WholeFileRecordWriter:
  """TensorBoard's event file on storage without appends: rewritten whole on flush."""

  def __init__(self, path: str):
    self._path = paths.user_path(path)
    self._buffer = io.BytesIO()

  def write(self, data: bytes) -> None:
    self._buffer.write(data)

  def flush(self) -> None:
    self._path.write_bytes(self._buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _WholeFileRecordWriterFactory:
  def open(self, path: str) -> _WholeFileRecordWriter:
    return _WholeFileRecordWriter(path)

  def directory_check(self, path: str) -> None:
    paths.user_path(path).mkdir(parents=True, exist_ok=True)


def _register_tensorboard_writer(scheme: str) -> None:
  # tensorboardX's own gs:// writer needs google-cloud-storage and its
  # credentials; this one goes through etils.epath like every other path here.
  from tensorboardX import record_writer

  record_writer.register_writer_factory(scheme, _WholeFileRecordWriterFactory())


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The records of a metrics JSONL file, in file order.

  A last line cut short (the writer was killed mid-line) is dropped; a bad
  line anywhere else is a ValueError naming the line.

  Example:
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> _ = path.write_text('{"step": 1, "loss": 3.0}\\n{"step": 2, "lo')
    >>> read_metrics(path)
    [{'step': 1, 'loss': 3.0}]
  """
  lines = paths.user_path(path).read_text(encoding="utf-8").splitlines()
  records = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except ValueError as e:
      if number == len(lines):
        break
      raise ValueError(f"{str(path)!r} line {number} is not JSON: {line[:80]!r}") from e
  return records


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
    present = sorted({k for r in records for k in r} - set(_RESERVED))
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


def _short(value: float) -> str:
  if abs(value) >= 1000:
    return tqdm.tqdm.format_sizeof(value, divisor=1000)
  return f"{value:.4g}"


class Progress:
  """A tqdm progress bar over training steps, shown on process 0 only.

  `initial` is the step a resumed run starts from: the bar starts there, so
  the rate and ETA count only this run's steps. `update(step, loss=...,
  tokens_per_s=...)` moves the bar to `step` and shows the given values; they
  must be plain numbers the caller already has on the host: a jax array is a
  TypeError, because converting it here would wait for the device each step.
  With `enabled=False` nothing is printed.

  Example:
    >>> import io
    >>> out = io.StringIO()
    >>> with Progress(total_steps=100, initial=10, enabled=True, file=out) as bar:
    ...   bar.update(20, loss=2.5, tokens_per_s=12345.0)
    >>> "20/100" in out.getvalue() and "loss=2.5" in out.getvalue()
    True
  """

  def __init__(
    self,
    total_steps: int,
    initial: int = 0,
    enabled: bool = True,
    file: IO[str] | None = None,
    mininterval_s: float = 1.0,
  ) -> None:
    if not 0 <= initial <= total_steps:
      raise ValueError(f"{initial=} must be within 0..{total_steps=}")
    self.enabled = enabled
    self._bar: tqdm.tqdm | None = None
    if enabled:
      self._bar = tqdm.tqdm(
        total=total_steps,
        initial=initial,
        unit="step",
        file=sys.stderr if file is None else file,
        dynamic_ncols=True,
        mininterval=mininterval_s,
      )

  def update(self, step: int, /, **postfix: float) -> None:
    """Moves the bar to `step` (absolute, not a delta) and shows `postfix` (name -> number)."""
    if self._bar is None:
      return
    shown = {}
    for key, value in postfix.items():
      if isinstance(value, jax.Array):
        raise TypeError(
          f"Progress.update({key}=<jax.Array>): pass a host float, not a device value"
        )
      label = "tok/s" if key == "tokens_per_s" else key
      shown[label] = _short(float(value))
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()


def _duration(seconds: float) -> str:
  seconds = round(seconds)
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _flops(value: float) -> str:
  for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
    if value >= scale:
      return f"{value / scale:.4g} {prefix}FLOP/s"
  return f"{value:.4g} FLOP/s"


# Summary entries in print order: key -> (label, formatter). The trainer fills
# what it has; a key it does not set (or sets to None) is left out.
_SUMMARY: dict[str, tuple[str, Callable[[Any], str]]] = {
  "steps": ("steps", lambda v: f"{int(v):,}"),
  "train_loss": ("final train loss", lambda v: f"{v:.4f}"),
  "eval_loss": ("eval loss", lambda v: f"{v:.4f}"),
  "eval_accuracy": ("eval accuracy", lambda v: f"{100 * v:.2f}%"),
  "tokens_per_s": ("tokens/s", lambda v: f"{v:,.0f}"),
  "examples_per_s": ("examples/s", lambda v: f"{v:,.0f}"),
  "real_token_share": ("real tokens per batch", lambda v: f"{100 * v:.1f}%"),
  "mfu": ("MFU", lambda v: f"{100 * v:.1f}%"),
  "hfu": ("HFU (compiled matmul FLOPs)", lambda v: f"{100 * v:.1f}%"),
  "peak_flops_per_s": ("peak per device", _flops),
  "peak_source": ("peak source", str),
  "wall_time_s": ("wall time", _duration),
  "first_step_s": ("first step done after", _duration),
  "resumed_from": ("state from", str),
  "workdir": ("workdir", str),
  "checkpoints": ("checkpoints", str),
  "metrics": ("metrics", str),
  "tensorboard": ("tensorboard", str),
  "loss_curve": ("loss curve", str),
  "param_hash": ("param hash", str),
}


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_summary(d: Mapping[str, Any]) -> str:
  """An aligned end-of-run summary of the known entries of `d`.

  Known keys, in print order: steps, train_loss, eval_loss, the task's eval
  metrics (`eval_<name>`, whatever the names: "eval <name>" with 4
  significant digits; `eval_accuracy`, a fraction, as %), tokens_per_s (any
  `<unit>_per_s`), mfu (a fraction, printed as %), peak_flops_per_s,
  peak_source, wall_time_s, first_step_s, resumed_from, workdir, and the
  paths checkpoints, metrics, tensorboard, loss_curve. Entries that are absent
  or None are skipped, and so are other keys, because the same dict is also
  the trainer's result (loss history, samples). Non-finite numbers print as
  "nan"/"inf".

  Example:
    >>> print(format_summary({"steps": 1000, "train_loss": 2.34567, "eval_mae": 0.012341,
    ...                       "mfu": 0.4123, "x": [1]}))
    run summary
      steps            : 1,000
      final train loss : 2.3457
      eval mae         : 0.01234
      MFU              : 41.2%
  """
  rows = []
  table = dict(_SUMMARY)
  # Where an entry the table does not name goes: "<unit>_per_s" (any task's
  # unit) as "<unit>/s" beside the built-in rates, a task's eval metric
  # "eval_<name>" as "eval <name>" beside the eval loss.
  anchor = {}
  for key, value in d.items():
    if key in table:
      continue
    if key.endswith("_per_s") and key != "peak_flops_per_s":
      table[key] = (key[: -len("_per_s")] + "/s", lambda v: f"{v:,.0f}")
      anchor[key] = "tokens_per_s"
    elif key.startswith("eval_") and _is_number(value):
      table[key] = ("eval " + key[len("eval_") :], lambda v: f"{v:.4g}")
      anchor[key] = "eval_accuracy"
  ordered = sorted(table, key=lambda k: list(_SUMMARY).index(anchor.get(k, k)))
  for key in ordered:
    label, fmt = table[key]
    value = d.get(key)
    if value is None:
      continue
    if isinstance(value, float) and not math.isfinite(value):
      rows.append((label, str(value)))
    else:
      rows.append((label, fmt(value)))
  width = max((len(label) for label, _ in rows), default=0)
  return "\n".join(["run summary", *(f"  {label:<{width}} : {text}" for label, text in rows)])
