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
import json
import os
import threading
from collections.abc import Callable
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


COPIES = ".spmd-copies.json"  # in a copy's target folder: what each file was copied from
_PARTIAL = ".partial-"  # `.NAME.partial-PID-RANDOM`: a file being copied, never read as data
_CHUNK = 8 << 20  # bytes per read and write while copying: memory stays bounded
_RACY_NS = 1_000_000_000  # a local file changed this recently may change again unseen
_SAVE_EVERY_S = 30.0  # a long copy records its progress this often (a kill loses less)


def copy_tree(
  source: epath.Path, target: epath.Path, exclude: Callable[[str], bool] | None = None
) -> int:
  """Copies the files under `source` to `target` (either may be remote); returns the count.

  `exclude(relative_name)` true: that file is not copied (a dataset's shards,
  when they are staged on demand instead).

  A file is copied again unless the one at the target is known to be a copy
  of the source's file as it is now. Identity is size plus version: the
  modification time in nanoseconds for a local file, and for an object the
  store's content hash (`md5Hash`, else `generation`, ETag or time). Each
  copy records in `target/.spmd-copies.json` the identity of the source file
  and of the copy it made; a later copy keeps a file only when both still
  match, or when the source's own record says the source is a copy of the
  target's file (a dataset prepared locally, uploaded, then staged back on
  each host is not copied back and forth). A record, not the target's size or
  time: a changed file of the same size (a task's code edited in place) is
  copied again, and an object store cannot take a file's time from its
  source (an upload's time is its own, and `epath`'s `stat` keeps whole
  seconds). A local file's time ticks coarsely (milliseconds), so one changed
  within a second before its copy is recorded as unknown and copied again
  next time (git's "racily clean" rule). As with rsync, a change that keeps
  both size and time (a local file rewritten and its time set back) is not
  seen.

  Each file is streamed in chunks (memory stays bounded) to a hidden
  `.NAME.partial-...` beside it, then renamed to its name: a copy cut short,
  by an error or a kill, never leaves a partial file under the final name. On
  an object store the rename is a copy within the store and a delete; it is
  needed there too, since an error mid-stream still closes the upload and
  would publish the part written (a kill mid-upload publishes nothing). A
  kill can leave a `.partial-` file behind; copies skip such names and the
  record file.

  Example:
    >>> import tempfile
    >>> src, dst = epath.Path(tempfile.mkdtemp()), epath.Path(tempfile.mkdtemp())
    >>> _ = (src / "a.txt").write_text("one")
    >>> os.utime(src / "a.txt", (1e9, 1e9))  # written long ago
    >>> copy_tree(src, dst), copy_tree(src, dst), (dst / "a.txt").read_text()
    (1, 0, 'one')
    >>> _ = (src / "a.txt").write_text("two")  # the same size, new contents
    >>> copy_tree(src, dst), (dst / "a.txt").read_text()
    (1, 'two')
  """
  import time

  records = _read_copies(target)
  reverse = _read_copies(source)  # when the source itself is a copy of the target
  count, changed, saved_at = 0, False, time.monotonic()
  for path in _files(source):
    name = path.relative_to(source).as_posix()
    if exclude is not None and exclude(name):
      continue
    dest = target / name
    source_id, dest_id = _identity(path), _identity(dest)
    record = {"source": source_id, "target": dest_id}
    if dest_id is not None and source_id[1] is not None:
      if records.get(name) == record:
        continue
      if reverse.get(name) == {"source": dest_id, "target": source_id}:
        records[name], changed = record, True
        continue
    _stream(path, dest)
    records[name] = {"source": _settled(source_id), "target": _identity(dest)}
    count, changed = count + 1, True
    if time.monotonic() - saved_at > _SAVE_EVERY_S:
      _write_copies(target, records)
      saved_at = time.monotonic()
  if changed:
    _write_copies(target, records)
  return count


def _identity(path: epath.Path) -> list | None:
  """[size, version] of a file, None when there is none; version None when unknown."""
  try:
    if not is_url(path):
      st = os.stat(path)
      return [st.st_size, st.st_mtime_ns]
    import fsspec

    fs, key = fsspec.core.url_to_fs(os.fspath(path))
    info = fs.info(key)
  except FileNotFoundError:
    return None
  for field in ("md5Hash", "generation", "ETag", "etag", "mtime", "LastModified", "updated"):
    if info.get(field):
      return [int(info["size"]), str(info[field])]
  return [int(info["size"]), None]  # never taken for the same file: copied every time


def _settled(identity: list) -> list:
  """`identity`, its local time None when too recent to tell a later change by (see above)."""
  import time

  size, version = identity
  if isinstance(version, int) and time.time_ns() - version < _RACY_NS:
    return [size, None]
  return identity


def copy_file(source: epath.Path, dest: epath.Path) -> None:
  """Copies one file (either side may be remote), whole or not at all under `dest`'s name.

  Streamed in chunks through a hidden partial file beside `dest`, renamed at
  the end (see `copy_tree`).
  """
  _stream(epath.Path(source), epath.Path(dest))


def _stream(source: epath.Path, dest: epath.Path) -> None:
  """`source` to `dest` in chunks, through a hidden partial file renamed at the end."""
  import secrets
  import shutil

  dest.parent.mkdir(parents=True, exist_ok=True)
  partial = dest.parent / f".{dest.name}{_PARTIAL}{os.getpid()}-{secrets.token_hex(4)}"
  try:
    with source.open("rb") as read, partial.open("wb") as write:
      shutil.copyfileobj(read, write, _CHUNK)
    _rename(partial, dest)
  except BaseException:
    try:  # what an error left (an object store publishes the part written)
      _remove(partial)
    except Exception:
      pass
    raise


def _rename(path: epath.Path, to: epath.Path) -> None:
  if not is_url(path):
    os.replace(path, to)  # atomic on one filesystem: `to` is whole or absent
    return
  import fsspec

  # A copy within the store, then a delete: fsspec's `mv` first tries an API
  # that buckets without hierarchical namespaces refuse, and logs an error.
  fs, key = fsspec.core.url_to_fs(os.fspath(path))
  fs.copy(key, fsspec.core.url_to_fs(os.fspath(to))[1])
  fs.rm(key)


def _remove(path: epath.Path) -> None:
  if not is_url(path):
    Path(path).unlink(missing_ok=True)
  elif path.exists():
    path.unlink()


def _read_copies(root: epath.Path) -> dict:
  try:
    found = json.loads((root / COPIES).read_text())
  except (FileNotFoundError, ValueError):  # none yet, or cut short: every file is checked again
    return {}
  return found if isinstance(found, dict) else {}


def _write_copies(root: epath.Path, records: dict) -> None:
  text = json.dumps(records, sort_keys=True)
  root.mkdir(parents=True, exist_ok=True)
  if is_url(root):  # an object is written whole when it closes
    (root / COPIES).write_text(text)
    return
  partial = root / f".{COPIES}{_PARTIAL}{os.getpid()}"
  partial.write_text(text)
  os.replace(partial, root / COPIES)


def _files(root: epath.Path) -> list[epath.Path]:
  # Listing folder by folder: epath refuses a recursive glob on object stores.
  # A copy's record and partial files are its own, never data.
  out, folders = [], [root]
  while folders:
    for path in sorted(folders.pop().iterdir()):
      if path.name == COPIES or (_PARTIAL in path.name and path.name.startswith(".")):
        continue
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
