"""A remote dataset's shards staged on demand into a bounded local folder, least recently used out.

ArrayRecord reads local files only (riegeli's file reader), so a `gs://`
`data.dir` is read through local copies. Copying the whole folder to every
host caps a dataset at one host's disk; a `ShardCache` instead copies a
shard when a read first needs it, into `folder`, and removes the least
recently used of its own copies to stay within `capacity` bytes. It pairs
with a record order that reads a few shards at a time
(`record_order.ShardWindows`); under one permutation of all records each
batch would touch every shard and the cache would copy without end.

Each cache has a folder of its own, `cache-<pid>-<random>` inside the
folder it is given (the process's: simulated hosts share a disk), since
two runs on one host (training, and an eval beside it) are given the same
one. It holds an `flock` on a `.lock` file there while it lives; a new
cache removes the copies of caches whose lock is free (their process has
ended: the operating system released it), and never those of a cache
alive. Only files a cache staged are removed: copies are made through a
hidden partial file renamed at the end (`paths.copy_file`), so a name in
the folder is always a whole shard. A reader open on a shard is closed
before the shard is removed.

Example:
  >>> import tempfile, numpy as np
  >>> from array_record.python import array_record_module
  >>> remote, local = epath.Path(tempfile.mkdtemp()), epath.Path(tempfile.mkdtemp())
  >>> for k in range(3):
  ...   writer = array_record_module.ArrayRecordWriter(str(remote / f"s{k}"), "group_size:1")
  ...   writer.write(bytes([k]) * 100)
  ...   writer.close()
  >>> cache = ShardCache(local, capacity=2 * (remote / "s0").stat().length)
  >>> [cache.read(str(remote / f"s{k}"), [0])[0][:1] for k in (0, 1, 2, 0)]
  [b'\\x00', b'\\x01', b'\\x02', b'\\x00']
  >>> cache.staged, sorted(p.name[-2:] for p in cache.folder.glob("*-s*"))  # s1: least recently
  (4, ['s0', 's2'])
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import logging
import os
import pathlib
import re
import secrets
import threading
from collections.abc import Sequence

from array_record.python import array_record_module
from etils import epath

from spmd.errors import UserError
from trainers import paths

log = logging.getLogger(__name__)
_OWN = re.compile(r"[0-9a-f]{8}-.+")  # `{hash of the url}-{shard name}`: a copy this cache made
_OWN_PARTIAL = re.compile(r"\.[0-9a-f]{8}-.+\.partial-.+")  # one a kill cut short
_FOLDER = re.compile(r"cache-[0-9]+-[0-9a-f]{8}")  # a cache's own folder (`_own_folder`)


class ShardCache:
  """Local copies of remote shards, at most `capacity` bytes of them; reads records by index.

  Args:
    folder: this process's local folder; the cache's copies go into a folder
      of its own inside (`self.folder`), created.
    capacity: bytes the copies may take at once (`data.cache_bytes`).
  """

  def __init__(self, folder: str | os.PathLike, capacity: int):
    root = pathlib.Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    _remove_ended(root)
    self._lock_fd, self.folder = _own_folder(root)
    self.capacity = int(capacity)
    self.staged = 0  # shards copied so far (for tests and logs)
    self._evicted = False
    self._lock = threading.Lock()
    # url -> (local path, bytes, reader or None), least recently used first.
    self._shards: collections.OrderedDict[str, list] = collections.OrderedDict()

  @property
  def used(self) -> int:
    """Bytes of the copies held now."""
    return sum(size for _, size, _ in self._shards.values())

  def read(self, url: str, indices: Sequence[int]) -> list[bytes]:
    """The records at `indices` of shard `url`, staged first when it is not here.

    Raises:
      UserError: the shard alone is larger than the cache's capacity (naming
        `data.cache_bytes`).
      ValueError: its copy cannot be read as ArrayRecord.
    """
    with self._lock:  # one read at a time: a shard is never removed under a reader
      entry = self._shards.get(url)
      if entry is None:
        entry = self._stage(url)
      self._shards.move_to_end(url)
      if entry[2] is None:
        entry[2] = array_record_module.ArrayRecordReader(os.fspath(entry[0]))
        if not entry[2].ok():
          raise ValueError(f"{url}: its local copy {entry[0]} is not a readable ArrayRecord file")
      return list(entry[2].read(list(indices)))

  def _stage(self, url: str) -> list:
    source = epath.Path(url)
    size = source.stat().length
    if size > self.capacity:
      raise UserError(
        f"data.cache_bytes={self.capacity} cannot hold shard {url} ({size} bytes): "
        "give the cache at least two shards' bytes"
      )
    while self._shards and self.used + size > self.capacity:
      if not self._evicted:  # once: that the cache, not the disk, bounds what is held
        log.warning(
          "spmd-train: data: the cache of staged shards is full (%d of %d bytes, %d shards, "
          "in %s): each new shard now replaces the least recently used",
          self.used,
          self.capacity,
          len(self._shards),
          self.folder,
        )
        self._evicted = True
      _, (path, _, reader) = self._shards.popitem(last=False)
      if reader is not None:
        reader.close()
      os.unlink(path)  # a copy this cache made: never a file it did not write
    key = hashlib.sha256(url.encode()).hexdigest()[:8]
    local = self.folder / f"{key}-{source.name}"
    paths.copy_file(source, local)
    self.staged += 1
    entry = [local, size, None]
    self._shards[url] = entry
    return entry

  def close(self) -> None:
    """Closes the open readers and releases the folder (the next cache removes its copies)."""
    with self._lock:
      for entry in self._shards.values():
        if entry[2] is not None:
          entry[2].close()
          entry[2] = None
      if self._lock_fd is not None:
        os.close(self._lock_fd)
        self._lock_fd = None


def _own_folder(root: pathlib.Path) -> tuple[int, epath.Path]:
  """(the held lock's fd, a new folder of this cache's own in `root`).

  The folder is made under a name `_remove_ended` passes over, locked, then
  renamed: no other cache ever sees it unlocked.
  """
  name = f"cache-{os.getpid()}-{secrets.token_hex(4)}"
  starting = root / f".{name}.starting"
  starting.mkdir()
  fd = os.open(starting / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else can hold it
  os.replace(starting, root / name)
  return fd, epath.Path(root / name)


def _remove_ended(root: pathlib.Path) -> None:
  """Removes the copies of caches in `root` whose process has ended (their lock is free).

  Copies an ended cache left cannot be mapped back to their shards by
  another; removed, so that the disk holds no more than the live caches'
  capacities. Files a cache did not write stay, and so does their folder.
  """
  for path in root.iterdir():
    if _OWN.fullmatch(path.name) or _OWN_PARTIAL.fullmatch(path.name):
      path.unlink()  # copies of a release that staged into `root` itself
    elif _FOLDER.fullmatch(path.name) and path.is_dir():
      try:
        fd = os.open(path / ".lock", os.O_RDWR)
      except FileNotFoundError:
        continue  # not a cache's folder after all
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        continue  # a cache alive: its process holds the lock
      else:
        with contextlib.suppress(FileNotFoundError):  # another new cache removed it first
          for copy in path.iterdir():
            if _OWN.fullmatch(copy.name) or _OWN_PARTIAL.fullmatch(copy.name):
              copy.unlink()
          (path / ".lock").unlink()
        with contextlib.suppress(OSError):  # a file the cache did not write keeps it
          path.rmdir()
      finally:
        os.close(fd)
