"""Paths a user gives: local or a URL (`gs://...`), one type everywhere (`etils.epath`).

The workdir, checkpoints, metrics, TensorBoard events, the loss curve, the
summary, the saved config, `checkpoint.init_from`, the compilation cache, the
measured-peak cache and `data.dir` may all live on cloud storage: on a pod
every host must see the same run, and a host's local disk is its own.

A local path is made absolute once (runs started from another directory
find it); a URL is kept as it is. `os.path` is never used on these paths: on
a URL it produces a local directory named `gs:`.

Example:
  >>> user_path("gs://bucket/run") / "checkpoints"
  PosixGPath('gs://bucket/run/checkpoints')
  >>> is_url("gs://bucket/run"), is_url("/tmp/run"), user_path("/tmp/run").is_absolute()
  (True, False, True)
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from pathlib import Path

from etils import epath

DATA_CACHE_ENV = "SPMD_DATA_CACHE"  # where hosts stage remote datasets (default below)


def _no_listing_caches() -> None:
  # Hosts read what other hosts wrote (checkpoints, prepared data), and fsspec
  # keeps a process's directory listings: a cached listing would hide another
  # host's new files. Set before any filesystem is made (they are cached too).
  import fsspec.config

  for protocol in ("gs", "gcs", "s3"):
    fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


_no_listing_caches()


def is_url(path: str | os.PathLike) -> bool:
  """Whether `path` names remote storage (`scheme://...`)."""
  return "://" in os.fspath(path)


def user_path(path: str | os.PathLike) -> epath.Path:
  """A path a user gave, as an `epath.Path`: a URL as it is, a local path absolute."""
  text = os.fspath(path)
  if is_url(text):
    return epath.Path(text)
  return epath.Path(os.path.abspath(os.path.expanduser(text)))


def local_cache(name: str, url: str | os.PathLike) -> Path:
  """This host's local directory for a copy of `url` (`$SPMD_DATA_CACHE`, else ~/.cache).

  Example:
    >>> local_cache("data", "gs://b/data").parent.name
    'data'
  """
  root = os.environ.get(DATA_CACHE_ENV) or os.path.join(
    os.path.expanduser("~"), ".cache", "spmd-harness"
  )
  key = hashlib.sha256(os.fspath(url).encode()).hexdigest()[:16]
  return Path(root) / name / key


def copy_tree(source: epath.Path, target: epath.Path) -> int:
  """Copies the files under `source` to `target` (either may be remote); returns the count.

  A file already at the target with the same size is kept: data files are
  written once and never change, so a second staging copies nothing.
  """
  count = 0
  for path in _files(source):
    dest = target / path.relative_to(source)
    if dest.exists() and dest.stat().length == path.stat().length:
      continue
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(path.read_bytes())
    count += 1
  return count


def _files(root: epath.Path) -> list[epath.Path]:
  # Listing folder by folder: epath refuses a recursive glob on object stores.
  out, folders = [], [root]
  while folders:
    for path in sorted(folders.pop().iterdir()):
      (folders if path.is_dir() else out).append(path)
  return out


class RemoteTextFile:
  """A text file written line by line to storage that cannot append (object stores).

  Lines are kept in memory and the whole file is written again at most every
  `every_s` seconds and on `flush`/`close`; an existing file is read first, so
  a resumed run continues it.

  Example:
    >>> import tempfile
    >>> path = epath.Path(tempfile.mkdtemp()) / "log.txt"
    >>> f = RemoteTextFile(path); f.write("a\\n"); f.close()
    >>> f = RemoteTextFile(path); f.write("b\\n"); f.close(); path.read_text()
    'a\\nb\\n'
  """

  def __init__(self, path: epath.Path, every_s: float = 30.0):
    import time

    self._time = time.monotonic
    self.path, self._every = path, every_s
    self._text = io.StringIO()
    if path.exists():
      self._text.write(path.read_text())
    self._written = self._time()
    self._lock = threading.Lock()

  def write(self, text: str) -> None:
    with self._lock:
      self._text.write(text)
    if self._time() - self._written >= self._every:
      self.flush()

  def flush(self) -> None:
    with self._lock:
      content = self._text.getvalue()
    try:
      self.path.write_text(content)
    except Exception as e:
      e.add_note(f"writing {self.path} failed: is the store reachable?")
      raise
    self._written = self._time()

  def close(self) -> None:
    self.flush()
