"""What XLA said while compiling: its log, read from stderr and from libtpu's log folder.

XLA's C++ logging writes to file descriptor 2 itself, so `sys.stderr` (and
pytest's capture of it) never sees a line of it; libtpu's compiler writes
its warnings to its own log folder (`spmd.topology.libtpu_log_dir`), not
to stderr at all. `capture_compiler_log()` reads both around a block: fd 2
is pointed at a temporary file for the block (and what it caught is
written on to the real stderr afterwards, so nothing is hidden), and the
libtpu log files of this process are read from where they ended before it.

The warning that matters most is the SPMD partitioner's "Involuntary full
rematerialization": a sharding it cannot reach cheaply, so it replicates
the whole array on every device and slices it again, at any size.
`fallbacks(text)` lists them. A compile served from the persistent
compilation cache compiles nothing and says nothing, so the block runs
with that cache off (`without_persistent_cache`).

Example:
  >>> line = ('W1204 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. '
  ...         'The compiler cannot go from sharding {devices=[8,1]<=[8]} to {devices=[1,4,2]'
  ...         '<=[8] last_tile_dim_replicate} efficiently for HLO operation %gather.3 = '
  ...         'bf16[256,8192,256]{2,1,0} gather(%p, %i), metadata={op_name="jit(step)/gather"}. '
  ...         'As the last resort, SPMD will replicate the tensor and then partition it.')
  >>> [f] = fallbacks(line)
  >>> f.operation, f.shape, f.source
  ('gather', 'bf16[256,8192,256]', 'jit(step)/gather')
  >>> f.describe()
  'gather bf16[256,8192,256] (jit(step)/gather): {devices=[8,1]<=[8]} -> {devices=[1,4,2]<=[8] last_tile_dim_replicate}'
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import sys
import tempfile
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache.compilation_cache import reset_cache

from spmd.topology import libtpu_log_dir

FALLBACK = "Involuntary full rematerialization"
_FALLBACK_LINE = re.compile(
  r"Involuntary full rematerialization\..*?cannot go from sharding (?P<src>\{.*?\}) "
  r"to (?P<dst>\{.*?\}) efficiently for HLO operation %?(?P<name>[\w.\-]+) = "
  r"(?P<shape>[a-z]+\d*[a-z0-9]*\[[\d,]*\])\S*\s+(?P<op>[\w\-]+)\("
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Fallback:
  """One "Involuntary full rematerialization": an array XLA replicates to reshard it."""

  operation: str  # the HLO instruction's kind: gather, copy (a sharding constraint), ...
  name: str  # the HLO instruction's name, e.g. gather.3
  shape: str  # its global shape, e.g. bf16[256,8192,256]
  source: str  # the JAX operation it came from (op_name metadata), "" when not said
  from_sharding: str
  to_sharding: str

  def describe(self) -> str:
    """One line: the operation, its shape, where it came from, and the two shardings."""
    source = f" ({self.source})" if self.source else ""
    return f"{self.operation} {self.shape}{source}: {self.from_sharding} -> {self.to_sharding}"


def fallbacks(text: str) -> list[Fallback]:
  """Every distinct fallback XLA reported in `text` (a compiler log), in order.

  The partitioner may report one array more than once (it tries strategies
  on stand-in parameters before it picks one): each is listed once.
  """
  found: dict[Fallback, None] = {}
  for line in text.splitlines():
    if FALLBACK not in line:
      continue
    match = _FALLBACK_LINE.search(line)
    if match is None:
      # A wording this parser does not know is still a fallback: keep the line.
      found[Fallback("unknown", "", "", line.strip()[-300:], "", "")] = None
      continue
    rest = line[match.end() :]
    source = _OP_NAME.search(rest.split(". As the last resort", 1)[0])
    fallback = Fallback(
      operation=match.group("op"),
      name=match.group("name"),
      shape=match.group("shape"),
      source=source.group(1) if source else "",
      from_sharding=match.group("src"),
      to_sharding=match.group("dst"),
    )
    found[fallback] = None
  return list(found)


@dataclasses.dataclass
class CompilerLog:
  """What a `capture_compiler_log()` block made XLA write; filled in when the block ends."""

  stderr: str = ""  # what reached file descriptor 2 (XLA:CPU, GPU and libtpu's early lines)
  libtpu: str = ""  # what libtpu appended to this process's log files in its folder
  libtpu_dir: str | None = None  # where those were read, None when libtpu was not loaded

  @property
  def text(self) -> str:
    return self.stderr + self.libtpu

  @property
  def fallbacks(self) -> list[Fallback]:
    return fallbacks(self.text)


def _libtpu_logs(folder: str | None) -> dict[str, int]:
  """This process's libtpu log files in `folder`, with their sizes now.

  glog names each file `<program>.<host>.<user>.log.<LEVEL>.<date>-<time>.<pid>`;
  the WARNING file holds every warning and error (INFO would repeat them).
  """
  if not folder:
    return {}
  pattern = os.path.join(glob.escape(folder), f"*.log.WARNING.*.{os.getpid()}")
  return {path: os.path.getsize(path) for path in glob.glob(pattern)}


def _read_from(path: str, offset: int) -> str:
  with open(path, "rb") as f:
    f.seek(offset)
    return f.read().decode("utf-8", errors="replace")


@contextlib.contextmanager
def without_persistent_cache() -> Iterator[None]:
  """Runs the block with JAX's persistent compilation cache off, so every compile compiles.

  JAX decides once per process whether it uses the cache (at the first
  compile), so turning `jax_enable_compilation_cache` off is not enough
  after that: the cache's state is reset on the way in, and again on the
  way out, where the setting is restored (the next compile reads it afresh).
  """
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    reset_cache()


@contextlib.contextmanager
def capture_compiler_log(echo: bool = True, fresh: bool = True) -> Iterator[CompilerLog]:
  """Collects what XLA logs during the block, from fd 2 and libtpu's log folder.

  Args:
    echo: write what fd 2 caught on to the real stderr when the block ends.
    fresh: compile for real inside the block (`without_persistent_cache`):
      a program served from the cache would leave nothing to read.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> with capture_compiler_log() as log:
    ...   _ = jax.jit(jnp.sin).lower(1.0).compile()
    >>> log.fallbacks
    []
  """
  log = CompilerLog()
  before = _libtpu_logs(libtpu_log_dir())
  sys.stdout.flush()
  sys.stderr.flush()
  saved = os.dup(2)
  uncached = without_persistent_cache() if fresh else contextlib.nullcontext()
  with uncached, tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield log
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      log.stderr = caught.read().decode("utf-8", errors="replace")
      folder = libtpu_log_dir()
      log.libtpu_dir = folder
      log.libtpu = "".join(
        _read_from(path, before.get(path, 0)) for path in sorted(_libtpu_logs(folder))
      )
      if echo and log.stderr:
        sys.stderr.write(log.stderr)
        sys.stderr.flush()
