"""`config.data.sources`: the sources a run reads, the files each one is, and their identity.

The setting is a comma-separated list of `PATH_OR_GLOB` or
`PATH_OR_GLOB@WEIGHT`. Each path is local, a mounted path or a URL
(`gs://...`, through `fsspec`/`gcsfs`, as `etils.epath` reads it), and is
one of:

  * a file, or a glob of files (`**` recurses): every match must be in a
    format the readers know (`FORMATS`, by suffix);
  * a folder written by HF `datasets`' `save_to_disk`: its Arrow files, in
    the order its `state.json` lists them;
  * any other folder: the files under it in a known format (hidden ones
    skipped).

Each file has a split key (its path relative to the folder, or to the
glob's fixed prefix), which decides each of its documents' split
(`trainers.data.prepare.holdout`), and an identity: its size and its modification
time (local, in nanoseconds, with a digest of its first and last
`ENDS_BLOCK` bytes, so a same-size copy that kept its mtime is seen) or
generation (object stores). Prepared data is keyed by the identities, so a
changed file prepares anew.

Example:
  >>> [(s.spec, s.weight) for s in parse_sources("a/*.jsonl@0.7, gs://b/c.parquet@0.3")]
  [('a/*.jsonl', 0.7), ('gs://b/c.parquet', 0.3)]
  >>> parse_sources("a/*.jsonl@0.7,b.txt")
  Traceback (most recent call last):
  ...
  spmd.errors.UserError: data.sources='a/*.jsonl@0.7,b.txt': give every source a weight (PATH@WEIGHT) or none
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
from typing import Any

import fsspec

from spmd.errors import UserError
from trainers import paths

# Suffix -> format; the longest matching suffix wins (".jsonl.gz" before ".gz").
FORMATS = {
  ".jsonl": "jsonl",
  ".jsonl.gz": "jsonl.gz",
  ".jsonl.zst": "jsonl.zst",
  ".parquet": "parquet",
  ".txt": "txt",
  ".arrow": "arrow",  # the files of an HF `datasets` folder
}
HF_STATE = "state.json"  # what `Dataset.save_to_disk` writes beside its Arrow files
HF_DICT = "dataset_dict.json"  # `DatasetDict.save_to_disk`: one folder per split
_GLOB_MAGIC = frozenset("*?[")
ENDS_BLOCK = 16 << 10  # bytes read at each end of a local file for its identity


class SourceError(UserError):
  """A source of `config.data.sources` cannot be read: the message names the file and row."""


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """One entry of the setting: the path or glob as written, and its weight (None: not given)."""

  spec: str
  weight: float | None = None


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """One file of a source: where to read it, its format, split key and identity."""

  path: str  # an absolute local path or a URL
  key: str  # relative to the source's folder or glob prefix: decides each document's split
  format: str  # a value of FORMATS
  size: int
  version: str  # mtime in ns + a digest of the ends (local), or the object's generation

  def identity(self) -> list:
    return [self.key, self.format, self.size, self.version]


@dataclasses.dataclass(frozen=True)
class Source:
  """A source as listed: the spec it came from and its files, sorted by key."""

  spec: str
  weight: float | None
  files: tuple[SourceFile, ...]

  def identity(self) -> list:
    """What its documents are, for cache keys: the spec and every file's identity."""
    return [self.spec, [f.identity() for f in self.files]]


def parse_sources(text: str, setting: str = "data.sources") -> list[SourceSpec]:
  """The entries of a sources setting; raises `UserError` naming a malformed one.

  `@WEIGHT` counts as a weight only when it is a number, so a path holding
  `@` keeps it. Either every entry has a weight or none has.
  """
  entries = [e.strip() for e in text.split(",")]
  if not text.strip() or not all(entries):
    raise UserError(f"{setting}={text!r} has an empty entry; entries are PATH_OR_GLOB[@WEIGHT]")
  specs = []
  for entry in entries:
    path, at, tail = entry.rpartition("@")
    weight = None
    if at and path:
      try:
        weight = float(tail)
      except ValueError:
        path = entry  # an "@" inside the path
    else:
      path = entry
    if weight is not None and not (math.isfinite(weight) and weight > 0):
      raise UserError(f"{setting}: {entry!r} has weight {tail!r}; a weight must be a number > 0")
    specs.append(SourceSpec(path.strip(), weight))
  weighted = [s.weight is not None for s in specs]
  if any(weighted) and not all(weighted):
    raise UserError(f"{setting}={text!r}: give every source a weight (PATH@WEIGHT) or none")
  seen = [s.spec for s in specs]
  twice = sorted({s for s in seen if seen.count(s) > 1})
  if twice:
    raise UserError(f"{setting}={text!r} names {twice} more than once")
  return specs


def format_of(path: str) -> str | None:
  """The format of a file by its suffix, None when no reader knows it.

  >>> format_of("a/b.jsonl.zst"), format_of("c.parquet"), format_of("d.csv")
  ('jsonl.zst', 'parquet', None)
  """
  name = path.rsplit("/", 1)[-1].lower()
  found = [suffix for suffix in FORMATS if name.endswith(suffix)]
  return FORMATS[max(found, key=len)] if found else None


def list_source(spec: SourceSpec, setting: str = "data.sources") -> Source:
  """The files of one source, sorted by split key; `SourceError` when there are none.

  >>> import tempfile, pathlib
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.jsonl").write_text('{"text": "hi"}\\n')
  >>> [(f.key, f.format) for f in list_source(SourceSpec(str(root / "*.jsonl"))).files]
  [('a.jsonl', 'jsonl')]
  """
  text = spec.spec
  if paths.is_url(text):
    fs, root_path = fsspec.core.url_to_fs(text)
  else:
    fs, root_path = None, os.path.abspath(os.path.expanduser(text))
  lister = _Lister(fs, setting, text)
  if any(c in _GLOB_MAGIC for c in root_path):
    root = _glob_root(root_path)
    files = [
      lister.file(p, info, _relative(p, root), strict=True) for p, info in lister.glob(root_path)
    ]
    if not files:
      raise SourceError(f"{setting}: {text!r} matches no file")
  elif lister.isdir(root_path):
    files = lister.folder(root_path)
  elif lister.isfile(root_path):
    files = [lister.file(root_path, lister.info(root_path), root_path.rsplit("/", 1)[-1], True)]
  else:
    raise SourceError(f"{setting}: {text!r} is not a file, a folder or a glob that matches files")
  return Source(spec=text, weight=spec.weight, files=tuple(sorted(files, key=lambda f: f.key)))


def list_sources(specs: list[SourceSpec], setting: str = "data.sources") -> list[Source]:
  """Every source of a setting listed (`list_source`), each file read by one of them once.

  A file that two sources list (`d/c.jsonl` and `d/*.jsonl`), or one source
  twice (through a link), would be trained on twice an epoch without a
  word: it is a `SourceError` naming both. Local paths are compared
  resolved (`..`, `.` and links), URLs as listed.

  >>> import tempfile, pathlib
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.jsonl").write_text('{"text": "hi"}\\n')
  >>> list_sources(parse_sources(f"{root}/a.jsonl,{root}/*.jsonl"))  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  trainers.data.prepare.source_files.SourceError: data.sources: .../a.jsonl is listed by '.../a.jsonl' and by '.../*.jsonl'; ...
  """
  sources = [list_source(spec, setting) for spec in specs]
  seen: dict[str, tuple[SourceFile, str]] = {}
  for source in sources:
    for file in source.files:
      same = _same_file(file)
      if same not in seen:
        seen[same] = (file, source.spec)
        continue
      first, by = seen[same]
      if first.path == file.path:
        what = f"{file.path} is listed by {by!r} and by {source.spec!r}"
      else:
        what = (
          f"{file.path} (listed by {source.spec!r}) and {first.path} (listed by {by!r}) are "
          f"one file, {same}"
        )
      raise SourceError(
        f"{setting}: {what}; a file is read once an epoch, so list it in one source only "
        "(narrow the glob, or give it its own source and a weight)"
      )
  return sources


def refuse_shared_files(train: list[Source], held: list[Source]) -> None:
  """`SourceError` naming a file that both `data.sources` and `data.eval_sources` list.

  A file trained on and evaluated on makes the eval loss a train loss
  without a word; files are compared as `list_sources` compares them.

  >>> import tempfile, pathlib
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> for name in ("a.jsonl", "b.jsonl"):
  ...   _ = (root / name).write_text('{"text": "hi"}\\n')
  >>> refuse_shared_files(list_sources(parse_sources(f"{root}/a.jsonl")),
  ...                     list_sources(parse_sources(f"{root}/b.jsonl")))
  >>> refuse_shared_files(list_sources(parse_sources(f"{root}/*.jsonl")),
  ...                     list_sources(parse_sources(f"{root}/b.jsonl")))  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  trainers.data.prepare.source_files.SourceError: .../b.jsonl is in data.sources ('.../*.jsonl') and in data.eval_sources ...
  """
  trained = {_same_file(f): (f, s.spec) for s in train for f in s.files}
  for source in held:
    for file in source.files:
      if _same_file(file) in trained:
        first, by = trained[_same_file(file)]
        named = file.path if first.path == file.path else f"{file.path} ({first.path})"
        raise SourceError(
          f"{named} is in data.sources ({by!r}) and in data.eval_sources ({source.spec!r}): "
          "a run would evaluate on what it trains on; leave it out of one (narrow the glob)"
        )


def _same_file(file: SourceFile) -> str:
  """What makes two listed files one: a URL as listed, a local path resolved (`..`, links)."""
  return file.path if paths.is_url(file.path) else os.path.realpath(file.path)


def _glob_root(pattern: str) -> str:
  """The folder part of `pattern` before its first wildcard."""
  fixed = []
  for part in pattern.split("/")[:-1]:
    if any(c in _GLOB_MAGIC for c in part):
      break
    fixed.append(part)
  return "/".join(fixed) or "/"


def _relative(path: str, root: str) -> str:
  root = root.rstrip("/") + "/"
  return path[len(root) :] if path.startswith(root) else path.rsplit("/", 1)[-1]


class _Lister:
  """Listing and identities, local (`os`, `glob`) or on a store (`fsspec`)."""

  def __init__(self, fs: Any, setting: str, spec: str):
    self.fs, self.setting, self.spec = fs, setting, spec

  def url(self, path: str) -> str:
    return path if self.fs is None else self.fs.unstrip_protocol(path)

  def isdir(self, path: str) -> bool:
    return os.path.isdir(path) if self.fs is None else self.fs.isdir(path)

  def isfile(self, path: str) -> bool:
    return os.path.isfile(path) if self.fs is None else self.fs.isfile(path)

  def info(self, path: str) -> dict:
    if self.fs is None:
      stat = os.stat(path)
      return {"size": stat.st_size, "version": str(stat.st_mtime_ns)}
    return self.fs.info(path)

  def glob(self, pattern: str) -> list[tuple[str, dict]]:
    if self.fs is None:
      found = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
      return [(p, self.info(p)) for p in found]
    listed = self.fs.glob(pattern, detail=True)
    return [(p, info) for p, info in listed.items() if info.get("type") == "file"]

  def file(self, path: str, info: dict, key: str, strict: bool) -> SourceFile | None:
    kind = format_of(path)
    if kind is None:
      if strict:
        raise SourceError(
          f"{self.setting}: {self.url(path)} (matched by {self.spec!r}) is in no format the "
          f"readers know; they read {sorted(FORMATS)} and HF `datasets` folders"
        )
      return None
    return SourceFile(self.url(path), key, kind, *self._size_and_version(path, info))

  def folder(self, root: str) -> list[SourceFile]:
    join = os.path.join if self.fs is None else lambda a, b: f"{a.rstrip('/')}/{b}"
    if self.isfile(join(root, HF_DICT)):
      splits = json.loads(self._read(join(root, HF_DICT))).get("splits", [])
      raise SourceError(
        f"{self.setting}: {self.url(root)} is an HF DatasetDict with splits {splits}; name one "
        f"split's folder, e.g. {self.url(join(root, splits[0] if splits else 'train'))}"
      )
    if self.isfile(join(root, HF_STATE)):
      return self._hf_files(root, join)
    if self.fs is None:
      found = []
      for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
      listed = [(p, self.info(p)) for p in found if os.path.isfile(p)]
    else:
      listed = [
        (p, info)
        for p, info in self.fs.find(root, detail=True).items()
        if not any(part.startswith(".") for part in p[len(root) :].split("/"))
      ]
    files = [self.file(p, info, _relative(p, root), strict=False) for p, info in listed]
    files = [f for f in files if f is not None]
    if not files:
      raise SourceError(
        f"{self.setting}: the folder {self.url(root)} holds no file in a known format "
        f"({sorted(FORMATS)}) and is not an HF `datasets` folder"
      )
    return files

  def _hf_files(self, root: str, join) -> list[SourceFile]:
    state_path = join(root, HF_STATE)
    try:
      names = [entry["filename"] for entry in json.loads(self._read(state_path))["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
      raise SourceError(
        f"{self.setting}: {self.url(state_path)} is not an HF `datasets` state file ({e!r})"
      ) from None
    files = []
    # The Arrow files' order is the dataset's row order: the keys keep it.
    for index, name in enumerate(names):
      path = join(root, name)
      if not self.isfile(path):
        raise SourceError(f"{self.setting}: {self.url(path)}, listed in {HF_STATE}, is missing")
      key = f"{index:05d}-{name}"
      identity = self._size_and_version(path, self.info(path))
      files.append(SourceFile(self.url(path), key, "arrow", *identity))
    if not files:
      raise SourceError(f"{self.setting}: the HF `datasets` folder {self.url(root)} has no files")
    return files

  def _size_and_version(self, path: str, info: dict) -> tuple[int, str]:
    size, version = _size_and_version(info)
    if self.fs is None:  # a store's generation changes with the content; a local mtime need not
      version = f"{version}+{_ends_checksum(path, size)}"
    return size, version

  def _read(self, path: str) -> str:
    if self.fs is None:
      with open(path, encoding="utf-8") as f:
        return f.read()
    return self.fs.cat_file(path).decode("utf-8")


def _ends_checksum(path: str, size: int) -> str:
  """A digest of a local file's first and last `ENDS_BLOCK` bytes (the whole of a small file).

  A copy that keeps its size and mtime (`cp -p`, `rsync -t`) but not its
  content changes at its start or end; reading two blocks costs little
  however large the file. A change inside a large file's middle alone, with
  size and mtime kept, is not seen (docs/data.md says so).

  >>> import tempfile, pathlib
  >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
  >>> _ = path.write_text("x" * 100)
  >>> _ends_checksum(str(path), 100) == _ends_checksum(str(path), 100), len(_ends_checksum(str(path), 100))
  (True, 16)
  """
  digest = hashlib.sha256()
  try:
    with open(path, "rb") as f:
      digest.update(f.read(ENDS_BLOCK))
      if size > ENDS_BLOCK:
        f.seek(max(ENDS_BLOCK, size - ENDS_BLOCK))
        digest.update(f.read(ENDS_BLOCK))
  except OSError as e:
    raise SourceError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
  return digest.hexdigest()[:16]


def _size_and_version(info: dict) -> tuple[int, str]:
  """A listed file's size and version: its local time in ns, else the store's generation."""
  version = info.get("version")
  for field in ("generation", "md5Hash", "etag", "ETag", "mtime", "updated"):
    if version is None and info.get(field):
      version = str(info[field])
  return int(info["size"]), str(version)
