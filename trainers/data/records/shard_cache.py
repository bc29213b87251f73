"""A remote dataset's shards staged on demand into a bounded local folder, least recently used out.

ArrayRecord reads local files only (riegeli's file reader), so a `gs://`
`data.dir` is read through local copies. Copying the whole folder to every
host caps a dataset at one host's disk; a `ShardCache` instead copies a
shard when a read first needs it, into `folder`, and removes the least
recently used of its own copies to stay within `capacity` bytes. It pairs
with a record order that reads a few shards at a time
(`record_order.ShardWindows`); under one permutation of all records each
batch would touch every shard and the cache would copy without end.

Each process has its own folder (simulated hosts share a disk), and only
files it staged there are removed: copies are made through a hidden
partial file renamed at the end (`paths.copy_file`), so a name in the
folder is always a whole shard. A reader open on a shard is closed before
the shard is removed.

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
  >>> cache.staged, sorted(p.name[-2:] for p in local.iterdir())  # s1 was used least recently
  (4, ['s0', 's2'])
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import threading
from collections.abc import Sequence

from array_record.python import array_record_module
from etils import epath

from trainers import paths

log = logging.getLogger(__name__)
_OWN = re.compile(r"[0-9a-f]{8}-.+")  # `{hash of the url}-{shard name}`: a copy this cache made
_OWN_PARTIAL = re.compile(r"\.[0-9a-f]{8}-.+\.partial-.+")  # one a kill cut short


class ShardCache:
  """Local copies of remote shards, at most `capacity` bytes of them; reads records by index.

  Args:
    folder: this process's local folder for the copies (created).
    capacity: bytes the copies may take at once (`data.cache_bytes`).
  """

  def __init__(self, folder: str | os.PathLike, capacity: int):
    self.folder = epath.Path(folder)
    self.capacity = int(capacity)
    self.staged = 0  # shards copied so far (for tests and logs)
    self._evicted = False
    self._lock = threading.Lock()
    # url -> (local path, bytes, reader or None), least recently used first.
    self._shards: collections.OrderedDict[str, list] = collections.OrderedDict()
    self.folder.mkdir(parents=True, exist_ok=True)
    # Copies an earlier run left: this cache's own (its folder, its names),
    # which it cannot map back to their shards. Removed, so that the folder
    # never holds more than `capacity`.
    for path in self.folder.iterdir():
      if _OWN.fullmatch(path.name) or _OWN_PARTIAL.fullmatch(path.name):
        path.unlink()

  @property
  def used(self) -> int:
    """Bytes of the copies held now."""
    return sum(size for _, size, _ in self._shards.values())

  def read(self, url: str, indices: Sequence[int]) -> list[bytes]:
    """The records at `indices` of shard `url`, staged first when it is not here.

    Raises:
      ValueError: the shard alone is larger than the cache's capacity (naming
        `data.cache_bytes`), or its copy cannot be read as ArrayRecord.
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
      raise ValueError(
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
    """Closes the open readers (the copies stay for the next run's reads)."""
    with self._lock:
      for entry in self._shards.values():
        if entry[2] is not None:
          entry[2].close()
          entry[2] = None
