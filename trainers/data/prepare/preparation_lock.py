"""One run at a time prepares a dataset in a shared `data.dir`; another run waits, then reads it.

A sweep starts several `spmd-train` runs with the same sources and the same
default `data.dir`. Their preparations would write the same hidden
workspace (`source_shards`): one run's rename finds the other's file gone.
So process 0 of a run holds an exclusive lock on a file beside the dataset
(`.VERSION.lock`) from before it looks for the dataset until the dataset
is published; a second run waits for the lock, then finds the dataset
there and prepares nothing.

The lock is the operating system's (`fcntl.flock`, which NFS carries as a
byte-range lock): it is released when its holder's file is closed, so a
run that is killed holds nothing, and the next run resumes its workspace.
A lock held is therefore a run alive; the lock file itself stays, holding
the holder's host and process id for the message a waiting run logs
(removing it would let a waiting run and a new one lock two different
files). A filesystem without locks is logged, and the preparation goes on
unguarded, as before.

`data.sources` takes the lock in `source_shards`; our TFDS builders
(`text_corpus`, `packed`, `blobs`) through `prepare_builder`, since TFDS
publishes a dataset by renaming its own workspace onto the version folder,
which fails in the second of two runs that prepared it at once.

Example:
  >>> import tempfile, pathlib
  >>> path = pathlib.Path(tempfile.mkdtemp()) / ".1.0.0.lock"
  >>> with held(path, "packed_source/demo/1.0.0"):
  ...   path.read_text().split()[1]  # the holder: host, then "pid N"
  'pid'
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pathlib
import socket
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@contextlib.contextmanager
def held(path: str | os.PathLike, what: str) -> Iterator[None]:
  """Holds the exclusive lock of file `path` (created), waiting while another process holds it.

  `what` names the dataset for the message logged while waiting.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    _lock(fd, path, what)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
    yield
  finally:
    os.close(fd)  # releases the lock


def _lock(fd: int, path: pathlib.Path, what: str) -> None:
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return
  except BlockingIOError:
    holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a process"
    log.warning(
      "spmd-train: data: %s is being prepared by another run (%s holds %s); waiting for it",
      what,
      holder,
      path,
    )
  except OSError as e:
    if e.errno not in _NO_LOCKS:
      raise
    log.warning(
      "spmd-train: data: %s: the filesystem has no locks (%s); two runs preparing %s at once "
      "on this data.dir would collide",
      path,
      e,
      what,
    )
    return
  fcntl.flock(fd, fcntl.LOCK_EX)  # the other run's preparation ends: it publishes or dies


def prepare_builder(builder: Any, download_config: Any) -> None:
  """`builder.download_and_prepare(download_config=...)`, one run at a time in its data_dir.

  `builder`: a TFDS `DatasetBuilder`. The lock is taken only when the
  dataset is not there (or a rebuild is asked), so a run that reads a
  prepared one writes nothing; on a remote data_dir (`gs://`, which has no
  locks) the builder runs unguarded.

  >>> import tempfile
  >>> from trainers.data.prepare import blobs, text_corpus
  >>> builder = blobs.Blobs(data_dir=tempfile.mkdtemp())
  >>> prepare_builder(builder, text_corpus.DOWNLOAD_CONFIG)  # doctest: +ELLIPSIS
  Downloading and preparing dataset ...
  >>> builder.data_path.exists(), (builder.data_path.parent / ".1.0.0.lock").exists()
  (True, True)
  """
  path = builder.data_path
  mode = download_config.download_mode
  reuse = str(getattr(mode, "value", mode)) == "reuse_dataset_if_exists"
  if "://" in str(path) or (reuse and path.exists()):
    builder.download_and_prepare(download_config=download_config)
    return
  with held(pathlib.Path(path).parent / f".{path.name}.lock", str(path)):
    # Run after the lock: TFDS looks for the dataset again, and reuses what the
    # run that held it published.
    builder.download_and_prepare(download_config=download_config)
