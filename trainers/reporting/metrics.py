"""A run's metrics files: one JSON line per logged step, and the same scalars for TensorBoard.

Only process 0 writes; every other process builds the same writer with
`enabled=False` and it does nothing, so callers need no `if` around it.

  * `MetricsWriter`: `workdir/metrics.jsonl` and `workdir/tensorboard/`.
  * `read_metrics`: the JSONL read back (`loss_curve.py` draws it).

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
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
  from tensorboardX import SummaryWriter

  from trainers.reporting.tracking import Tracker

from trainers import paths

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
RESERVED_KEYS = ("step", "time")  # what each record holds besides its metrics


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
  `tracker` (`trainers.reporting.tracking`), when given, gets each record as
  written, so W&B holds the file's scalars; closing the writer leaves it open.

  Example:
    >>> import tempfile, numpy as np
    >>> workdir = tempfile.mkdtemp()
    >>> writer = MetricsWriter(workdir, enabled=True)
    >>> writer.write(10, {"loss": np.float32(1.5)})
    >>> writer.close()
    >>> read_metrics(f"{workdir}/metrics.jsonl")[0]["loss"]
    1.5
  """

  def __init__(
    self, workdir: str | os.PathLike, enabled: bool, tracker: Tracker | None = None
  ) -> None:
    self.workdir = paths.user_path(workdir)
    self.enabled = enabled
    self._tracker = tracker
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
      # Here: only the writing process (process 0) pays tensorboardX's import
      # (google-cloud-storage and grpc come with it); the others never use it.
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(logdir=str(self.tensorboard_dir))

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Records `metrics` (name -> scalar) at `step`."""
    if not self.enabled:
      return
    if self._file is None or self._tb is None:
      raise ValueError(f"MetricsWriter for {str(self.workdir)!r} is closed; cannot write {step=}")
    clash = [k for k in metrics if k in RESERVED_KEYS]
    if clash:
      raise ValueError(f"metric names {clash} are reserved for the record itself ({RESERVED_KEYS})")
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
    if self._tracker is not None:
      self._tracker.log(int(step), values)

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
    try:
      self._path.write_bytes(self._buffer.getvalue())
    except Exception as e:
      # A store's own error names a host and port, not the run: say what was being written.
      e.add_note(f"writing {self._path} failed: is the store reachable?")
      raise

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
