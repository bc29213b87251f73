"""`text_corpus`: a TFDS builder for byte-level language-model data from local text files.

Each example is one chunk of one file:

  tokens  uint8[n]  the file's bytes [offset, offset + n), n <= chunk_bytes (vocab 256)
  source  Text      the absolute path it came from (read back as bytes: os.fsdecode)
  offset  int64     where the chunk starts in that file

Concatenating a file's chunks in `offset` order gives back the file, byte for
byte. Empty files give no chunks. Each split's chunk lengths are kept beside
the index (`trainers.data.records.stored_lengths`), so opening it reads no chunk.

The source is part of the config (for your own files, also each file's size
and modification time), so each source, and each state of its files, has its
own cached dataset under `data_dir/text_corpus/<config name>/<version>/`:

  * `None` (the default): the `.py` files of this Python's standard library
    (`sysconfig.get_paths()["stdlib"]`, without site-packages), about 30 MB
    of real text on any machine with Python;
  * a directory: every regular file under it, hidden ones skipped;
  * a glob pattern (`**` recurses): the matching regular files;
  * a list or tuple of files: exactly those.

Files are read in sorted order, so a build is deterministic. A file goes to
"validation" when a hash of its split key (its path relative to the
directory, or to the glob's fixed prefix; a listed file's path as written)
falls in the first `validation_percent` of the hash range; the assignment of a
file never changes when other files are added.

The data is written as ArrayRecord and read back with `tfds.data_source`
(random access, no TensorFlow). Build it with
`prepare_text_corpus(data_dir)` (below), or directly:

  >>> import tempfile, pathlib
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> (root / "src").mkdir()
  >>> _ = (root / "src" / "a.txt").write_text("hello world")
  >>> config = text_corpus_config(root / "src", chunk_bytes=8)
  >>> builder = TextCorpus(data_dir=str(root / "data"), config=config)
  >>> builder.download_and_prepare(download_config=DOWNLOAD_CONFIG)  # doctest: +ELLIPSIS
  Downloading and preparing dataset ...
  Dataset text_corpus downloaded and prepared to ...
  >>> source = builder.as_data_source("train")
  >>> sorted((int(x["offset"]), x["tokens"].tobytes()) for x in source)
  [(0, b'hello wo'), (8, b'rld')]
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import platform
import sysconfig
from collections.abc import Iterator, Sequence
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from trainers.data.prepare import preparation_lock

# The split rule is shared with `config.data.sources` (which holds out documents).
from trainers.data.prepare.holdout import (  # noqa: F401  (re-exported: text_corpus.split_of, ...)
  DEFAULT_VALIDATION_PERCENT,
  TRAIN,
  VALIDATION,
  split_of,
  validation_percent_to_hold_out,
)
from trainers.data.records import stored_lengths

DEFAULT_CHUNK_BYTES = 4096

# Nothing is ever downloaded; the GCS check is off so a build never touches the network.
DOWNLOAD_CONFIG = tfds.download.DownloadConfig(try_download_gcs=False)

# Third-party packages live inside the stdlib directory but are not the stdlib.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_GLOB_MAGIC = frozenset("*?[")

SourceSpec = str | os.PathLike | Sequence[str | os.PathLike] | None


@dataclasses.dataclass(frozen=True)
class SourceFile:
  """One input file: where to read it, and the key that decides its split."""

  path: str
  key: str


def stdlib_dir() -> str:
  """This Python's standard-library directory, the default corpus source.

  >>> import os
  >>> os.path.isfile(os.path.join(stdlib_dir(), "os.py"))
  True
  """
  return os.path.abspath(sysconfig.get_paths()["stdlib"])


def _walk(root: str, *, suffix: str, skip_dirs: frozenset[str]) -> list[SourceFile]:
  files = []
  # followlinks=False: a symlinked directory could loop or leave the tree.
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
    for filename in filenames:
      path = os.path.join(dirpath, filename)
      if filename.endswith(suffix) and not filename.startswith(".") and os.path.isfile(path):
        files.append(SourceFile(path=path, key=os.path.relpath(path, root)))
  return files


def _glob_root(pattern: str) -> str:
  """The directory part of `pattern` before its first wildcard."""
  parts = pattern.split(os.sep)
  fixed = []
  for part in parts[:-1]:
    if any(c in _GLOB_MAGIC for c in part):
      break
    fixed.append(part)
  return os.sep.join(fixed) or os.sep


def list_source_files(source: SourceSpec = None) -> list[SourceFile]:
  """The files a source spec selects, sorted by split key.

  Args:
    source: None for the standard library's `.py` files, a directory, a glob
      pattern, or a list of files (see the module docstring).

  Returns:
    The selected files, sorted by `key` so that builds are deterministic.

  Raises:
    FileNotFoundError: a directory or listed file does not exist, or the
      source selects no file.

  >>> files = list_source_files()
  >>> any(f.key == "os.py" for f in files), any("site-packages" in f.path for f in files)
  (True, False)
  """
  if source is None:
    files = _walk(stdlib_dir(), suffix=".py", skip_dirs=_STDLIB_SKIP_DIRS)
  elif isinstance(source, str | os.PathLike):
    spec = os.path.abspath(os.fspath(source))
    if any(c in _GLOB_MAGIC for c in spec):
      root = _glob_root(spec)
      paths = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
      files = [SourceFile(path=p, key=os.path.relpath(p, root)) for p in paths]
    elif os.path.isdir(spec):
      files = _walk(spec, suffix="", skip_dirs=frozenset())
    elif os.path.isfile(spec):
      files = [SourceFile(path=spec, key=os.path.basename(spec))]
    else:
      raise FileNotFoundError(f"{source=} is not a file, a directory or a glob pattern")
  else:
    listed = sorted({os.fspath(p) for p in source})
    missing = [p for p in listed if not os.path.isfile(p)]
    if missing:
      raise FileNotFoundError(f"these listed source files do not exist: {missing}")
    files = [SourceFile(path=os.path.abspath(p), key=p) for p in listed]
  if not files:
    raise FileNotFoundError(f"{source=} selects no file")
  return sorted(files, key=lambda f: f.key)


def corpus_files(
  source: SourceSpec = None, exclude: str | os.PathLike | None = None
) -> list[SourceFile]:
  """`list_source_files(source)` without the files under `exclude` (the data dir).

  A data dir inside the source directory must not feed a build its own
  output, nor change the corpus's cache key by being written.

  >>> len(corpus_files(exclude=stdlib_dir()))  # the whole stdlib excluded
  0
  """
  files = list_source_files(source)
  if exclude is None:
    return files
  root = os.path.join(os.path.abspath(os.fspath(exclude)), "")
  return [f for f in files if not f.path.startswith(root)]


def split_files(
  files: Sequence[SourceFile], validation_percent: float = DEFAULT_VALIDATION_PERCENT
) -> dict[str, list[SourceFile]]:
  """The non-empty files of each split; a split without text is left out.

  TFDS cannot write a split without examples, so a split with no text has no
  entry (e.g. "validation" of a handful of files).
  """
  by_split: dict[str, list[SourceFile]] = {TRAIN: [], VALIDATION: []}
  for f in files:
    if os.path.getsize(f.path):
      by_split[split_of(f.key, validation_percent)].append(f)
  return {split: found for split, found in by_split.items() if found}


@dataclasses.dataclass(eq=False)
class TextCorpusConfig(tfds.core.BuilderConfig):
  """A `text_corpus` config: where the text comes from and how it is cut.

  Make one with `text_corpus_config`, which derives `name` from the rest.
  """

  source: str | tuple[str, ...] | None = None
  chunk_bytes: int = DEFAULT_CHUNK_BYTES
  validation_percent: float = DEFAULT_VALIDATION_PERCENT


def text_corpus_config(
  source: SourceSpec = None,
  *,
  chunk_bytes: int = DEFAULT_CHUNK_BYTES,
  validation_percent: float = DEFAULT_VALIDATION_PERCENT,
  exclude: str | os.PathLike | None = None,
) -> TextCorpusConfig:
  """A config whose name is unique to the source, its files, chunk size and split fraction.

  The name is `<label>-<chunk_bytes>b-<hash>`. For your own files the hash
  covers the absolute source spec and each selected file's split key, size
  and modification time (files under `exclude`, the data dir, left out), so
  adding, removing or editing a file builds a new corpus instead of
  silently reusing the old one. Copies of the files on other hosts must
  keep their times (`cp -p`, `rsync -t`) to share one build. The default
  (the stdlib) is keyed by its directory and the Python version, which is
  when its files change, so its name is the same on every machine.

  >>> text_corpus_config().name.startswith("stdlib-4096b-")
  True
  >>> text_corpus_config(__file__).name == text_corpus_config(__file__, chunk_bytes=8).name
  False
  """
  if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
    raise ValueError(f"{chunk_bytes=} must be a positive int")
  if not 0 <= validation_percent <= 100:
    raise ValueError(f"{validation_percent=} must be between 0 and 100")
  validation_percent = float(validation_percent)  # So that 2 and 2.0 name the same config.
  if source is None:
    label, spec = "stdlib", None
    what = f"the .py files of the Python {platform.python_version()} standard library"
    identity = ["stdlib", stdlib_dir(), platform.python_version()]
  elif isinstance(source, str | os.PathLike):
    label, spec = "files", os.path.abspath(os.fspath(source))
    what = f"the files selected by {spec!r}"
    identity = ["path", spec, _stamps(spec, exclude)]
  else:
    label, spec = "files", tuple(sorted({os.fspath(p) for p in source}))
    if not spec:
      raise ValueError(f"{source=} is an empty list of files")
    what = f"{len(spec)} listed files"
    # A listed path counts as written (its split key) and as resolved (what is read).
    identity = ["list", *[[p, os.path.abspath(p)] for p in spec], _stamps(spec, exclude)]
  digest = hashlib.sha256(
    json.dumps([*identity, chunk_bytes, validation_percent]).encode("utf-8", "surrogateescape")
  ).hexdigest()[:12]
  return TextCorpusConfig(
    name=f"{label}-{chunk_bytes}b-{digest}",
    description=(
      f"Byte-level text from {what}, in chunks of at most {chunk_bytes} bytes, "
      f"{validation_percent}% of files in validation."
    ),
    source=spec,
    chunk_bytes=chunk_bytes,
    validation_percent=validation_percent,
  )


def _stamps(source: SourceSpec, exclude: str | os.PathLike | None) -> list[list]:
  """Each selected file's split key, size and modification time, for the cache key."""
  stamps = []
  for f in corpus_files(source, exclude):
    stat = os.stat(f.path)
    stamps.append([f.key, stat.st_size, stat.st_mtime_ns])
  return stamps


class TextCorpus(tfds.core.GeneratorBasedBuilder):
  """Byte-level LM data from local text files, one example per chunk of a file."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES: ClassVar[dict[str, str]] = {
    "1.0.0": "First version: tokens (uint8 bytes), source, offset."
  }
  # The default config, the one "text_corpus" means without a config name.
  BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [text_corpus_config()]
  # tfds 4.9.10 works this out for package modules through `importlib_resources`,
  # a backport it only installs for Python < 3.9; the answer is simply this file.
  code_path = epath.Path(__file__)

  def __init__(self, **kwargs):
    # ArrayRecord is the format that `tfds.data_source` reads without TensorFlow.
    kwargs.setdefault("file_format", "array_record")
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly: `dataset_info_from_configs` looks for metadata
    # files next to a dataset package, which this module is not.
    return tfds.core.DatasetInfo(
      builder=self,
      description=self.builder_config.description,
      features=tfds.features.FeaturesDict(
        {
          # BYTES keeps a chunk as raw bytes on disk (1 byte a token), not as int64s.
          "tokens": tfds.features.Tensor(shape=(None,), dtype=np.uint8, encoding="bytes"),
          "source": tfds.features.Text(),
          "offset": tfds.features.Scalar(dtype=np.int64),
        }
      ),
    )

  def _download_and_prepare(self, dl_manager, download_config) -> None:
    super()._download_and_prepare(dl_manager, download_config)
    # Inside TFDS's temporary folder, before it writes the index and renames
    # the folder into place: a published corpus always has its lengths.
    stored_lengths.keep_lengths(self.data_dir, self.info, "tokens")

  def _split_generators(self, dl_manager) -> dict[str, Iterator]:
    del dl_manager  # Everything is local.
    config = self.builder_config
    files = corpus_files(config.source, exclude=os.fspath(self.data_dir_root))
    # A split with no text is left out; opening it names the splits there are.
    nonempty = split_files(files, config.validation_percent)
    if not nonempty:
      raise ValueError(f"{config.source=} has no text: its {len(files)} files are empty")
    return {split: self._generate_examples(found) for split, found in nonempty.items()}

  def _generate_examples(self, files: list[SourceFile]) -> Iterator[tuple[str, dict]]:
    chunk = self.builder_config.chunk_bytes
    for f in files:
      with open(f.path, "rb") as fh:
        data = fh.read()
      for offset in range(0, len(data), chunk):
        piece = np.frombuffer(
          data, dtype=np.uint8, count=min(chunk, len(data) - offset), offset=offset
        )
        yield (
          f"{f.key}@{offset}",
          {"tokens": piece, "source": os.fsencode(f.path), "offset": offset},
        )


def prepare_text_corpus(
  data_dir: str | os.PathLike,
  source: SourceSpec = None,
  *,
  chunk_bytes: int = DEFAULT_CHUNK_BYTES,
  validation_percent: float = DEFAULT_VALIDATION_PERCENT,
  rebuild: bool = False,
) -> str:
  """Builds the text corpus in `data_dir` unless it is there already.

  Args:
    data_dir: the TFDS data directory to build into.
    source: None for the Python standard library's `.py` files, or a
      directory, glob pattern or list of files (see this module's docstring).
    chunk_bytes: the most bytes (tokens) in one record.
    validation_percent: the share of files that go to "validation".
    rebuild: build again even if prepared. Rarely needed: the cache is keyed
      by the source spec and its files' names, sizes and modification times
      (`text_corpus_config`), so changed files build anew.

  Returns:
    The name to pass to `trainers.data.records.datasets.open_source`: "text_corpus/<config>:<version>".

  >>> import tempfile
  >>> data_dir = tempfile.mkdtemp()
  >>> name = prepare_text_corpus(data_dir, source=[__file__])  # doctest: +ELLIPSIS
  Downloading and preparing dataset ...
  >>> prepare_text_corpus(data_dir, source=[__file__]) == name  # Reused: prints nothing.
  True
  """
  config = text_corpus_config(
    source, chunk_bytes=chunk_bytes, validation_percent=validation_percent, exclude=data_dir
  )
  # TFDS wants the class's own object for a config the class lists (the default).
  config = TextCorpus.builder_configs.get(config.name, config)
  builder = TextCorpus(data_dir=os.fspath(data_dir), config=config)
  mode = tfds.download.GenerateMode
  download_config = tfds.download.DownloadConfig(
    try_download_gcs=False,
    download_mode=mode.REUSE_CACHE_IF_EXISTS if rebuild else mode.REUSE_DATASET_IF_EXISTS,
  )
  preparation_lock.prepare_builder(builder, download_config)
  return f"{builder.name}/{config.name}:{builder.version}"
