"""The documents of a source's files, streamed: a batch of rows at a time, never a whole file.

One reader per format, each with the library made for it:

  .jsonl, .jsonl.gz, .jsonl.zst  a JSON object per line, its `text_field` the
                                 document (`json`; `gzip`; `zstandard`, the
                                 reference binding of the zstd library);
  .parquet                       the `text_field` column, read in batches of
                                 rows and only that column (`pyarrow.parquet`);
  .arrow                         an HF `datasets` folder's files, Arrow IPC
                                 streams (`pyarrow.ipc`: no `datasets` needed);
  .txt                           the whole file is one document (UTF-8; bytes
                                 that are not become U+FFFD, as the text corpus),
                                 read in pieces of about `TEXT_PIECE` bytes
                                 cut at line breaks (`Document.part` counts
                                 them), so a large file is never held whole.

With `PROMPT_COMPLETION` as the field (`data.format="prompt_completion"`),
a JSONL row is a fine-tuning example: its `prompt` and `completion`, both
strings, become a `Document` whose `prompt` is the one and `text` the other.
Other formats hold no such rows: reading one for them is a `SourceError`.

Rows are named as a user finds them: `line N` (from 1) in JSONL, `row N`
(from 0, within the file) in Parquet and Arrow. A row that cannot be a
document (not JSON, no `text_field`, a value that is not a string, a null,
text that is not UTF-8) is a `BadRow`; `SourceDocuments` lets a source have `skip_bad_rows` of them
and raises `SourceError` naming the file and row of the next. A file that
cannot be read at all (corrupt, truncated, not the format its name says)
is a `SourceError` naming the file and the row it reached.

Example:
  >>> import tempfile, pathlib
  >>> from trainers.data.prepare.source_files import SourceSpec, list_source
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.jsonl").write_text('{"text": "one"}\\n{"body": "two"}\\n{"text": "three"}\\n')
  >>> docs = SourceDocuments(list_source(SourceSpec(str(root / "*.jsonl"))), skip_bad_rows=1)
  >>> [(d.row, d.text) for d in docs], [str(b).split(" ", 1)[1] for b in docs.bad]
  ([(1, 'one'), (3, 'three')], ["line 2: has no 'text' field (its fields: ['body'])"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import zstandard
from etils import epath

from trainers.data.prepare.source_files import Source, SourceError, SourceFile

ARROW_BATCH_ROWS = 1024  # Parquet rows per read: memory is a batch, not a file
TEXT_PIECE = 4 << 20  # bytes of a .txt file read at a time: memory is a piece, not a file
BAD_ROWS_SHOWN = 20  # bad rows a report names; the count is always whole
# A trained BPE learns from at most this many characters of text, shared
# between the sources, and from each file at least MIN_FILE_SAMPLE of it (so
# a corpus of many files is sampled across files, not only from the first).
BPE_SAMPLE_CHARS = 32 << 20
MIN_FILE_SAMPLE = 64 << 10
PROMPT_COMPLETION = ("prompt", "completion")  # the fields of a fine-tuning example's row
Fields = str | tuple[str, ...]  # a document's field, or PROMPT_COMPLETION


@dataclasses.dataclass(frozen=True)
class Document:
  """One document: its text and where it came from."""

  file: SourceFile
  row: int  # the line (JSONL, from 1) or row (Parquet and Arrow, from 0; .txt: 0)
  text: str
  part: int = 0  # a .txt file's pieces after the first (1, 2, ...) continue its document
  prompt: str = ""  # a fine-tuning example's prompt (`text` is then its completion)

  @property
  def key(self) -> str:
    """Its split key: the file's key and the row (`trainers.data.prepare.holdout.split_of`)."""
    return f"{self.file.key}#{self.row}"


@dataclasses.dataclass(frozen=True)
class BadRow:
  """A row that is no document, and why."""

  path: str
  where: str  # "line 17", "row 16"
  reason: str

  def __str__(self) -> str:
    return f"{self.path} {self.where}: {self.reason}"


Row = Document | BadRow


def _json_type(value: Any) -> str:
  names = {bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}
  return "null" if value is None else names.get(type(value), type(value).__name__)


def _jsonl_rows(file: SourceFile, lines: BinaryIO, field: Fields) -> Iterator[Row]:
  fields = (field,) if isinstance(field, str) else field
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue  # a blank line (the usual one at the end) holds no row
    where = f"line {number}"
    try:
      value = json.loads(line)
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bytes not UTF-8
      yield BadRow(file.path, where, f"is not JSON ({e})")
      continue
    if not isinstance(value, dict):
      yield BadRow(file.path, where, f"is a JSON {_json_type(value)}, not an object")
      continue
    missing = [f for f in fields if f not in value]
    wrong = [f for f in fields if f in value and not isinstance(value[f], str)]
    if missing:
      found = sorted(value)[:10]
      yield BadRow(file.path, where, f"has no {missing[0]!r} field (its fields: {found})")
    elif wrong:
      yield BadRow(
        file.path, where, f"{wrong[0]!r} is a {_json_type(value[wrong[0]])}, not a string"
      )
    elif len(fields) == 1:
      yield Document(file, number, _text(value[field]))
    else:
      prompt, completion = (_text(value[f]) for f in fields)
      yield Document(file, number, completion, prompt=prompt)


def _text(value: str) -> str:
  """`value`, with its lone surrogates (JSON's `"\\ud800"`, which no UTF-8 holds) as U+FFFD.

  Through UTF-16, where a valid pair joins into its character and a lone half
  decodes to U+FFFD, so the tokenizers (which take UTF-8) get text.

  >>> _text("a\\ud800b") == "a\\ufffdb", _text("ok")
  (True, 'ok')
  """
  try:
    value.encode("utf-8")
  except UnicodeEncodeError:
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
  return value


def _is_text(kind: pa.DataType) -> bool:
  if pa.types.is_dictionary(kind):
    kind = kind.value_type
  return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _check_column(file: SourceFile, schema: pa.Schema, field: str) -> None:
  """A column missing, or of another type, is every row's fault: an error, not bad rows."""
  if field not in schema.names:
    raise SourceError(
      f"{file.path} row 0: has no column {field!r} (its columns: {schema.names[:10]}); set "
      "data.text_field to the column that holds the text"
    )
  kind = schema.field(field).type
  if not _is_text(kind):
    raise SourceError(f"{file.path} row 0: column {field!r} holds {kind}, not strings")


def _decoded(column: pa.Array) -> list[str | UnicodeDecodeError | None]:
  """A batch's strings; a value that is not UTF-8 (Arrow does not check) as its error."""
  try:
    return column.to_pylist()
  except UnicodeDecodeError:  # rare: find the rows one by one
    values = []
    for scalar in column:
      try:
        values.append(scalar.as_py())
      except UnicodeDecodeError as e:
        values.append(e)
    return values


def _column_rows(file: SourceFile, batches: Iterator[pa.RecordBatch], field: str) -> Iterator[Row]:
  row = 0
  for batch in batches:
    for value in _decoded(batch.column(field)):
      if value is None:
        yield BadRow(file.path, f"row {row}", f"{field!r} is null, not a string")
      elif isinstance(value, UnicodeDecodeError):
        yield BadRow(file.path, f"row {row}", f"{field!r} is not valid UTF-8 ({value})")
      else:
        yield Document(file, row, value)
      row += 1


def _parquet_rows(file: SourceFile, raw: BinaryIO, field: str) -> Iterator[Row]:
  parquet = pq.ParquetFile(raw)
  _check_column(file, parquet.schema_arrow, field)
  yield from _column_rows(
    file, parquet.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=[field]), field
  )


def _arrow_rows(file: SourceFile, raw: BinaryIO, field: str) -> Iterator[Row]:
  # `datasets` writes IPC streams; an Arrow file (the random-access format) reads too.
  try:
    reader = pa.ipc.open_stream(raw)
  except pa.ArrowInvalid:
    raw.seek(0)
    reader = pa.ipc.open_file(raw)
    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
  else:
    batches = iter(reader)
  _check_column(file, reader.schema, field)
  yield from _column_rows(file, batches, field)


def _text_rows(file: SourceFile, raw: BinaryIO, field: str) -> Iterator[Row]:
  """The file as one document, in pieces that end at a line break (a line longer stays whole).

  No UTF-8 sequence holds the byte of a line break, so the pieces decode as
  the whole file would.
  """
  del field  # a text file is its own document
  part, held = 0, bytearray()
  while block := raw.read(TEXT_PIECE):
    held += block
    cut = held.rfind(b"\n") + 1
    if cut:
      yield Document(file, 0, held[:cut].decode("utf-8", errors="replace"), part)
      part, held = part + 1, held[cut:]
  if held:
    yield Document(file, 0, held.decode("utf-8", errors="replace"), part)


def _lines(file: SourceFile, raw: BinaryIO) -> BinaryIO:
  if file.format == "jsonl.gz":
    return gzip.GzipFile(fileobj=raw)
  if file.format == "jsonl.zst":
    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return io.BufferedReader(reader)
  return raw


def _rows_of(file: SourceFile, raw: BinaryIO, field: Fields) -> Iterator[Row]:
  if file.format.startswith("jsonl"):
    return _jsonl_rows(file, _lines(file, raw), field)
  if not isinstance(field, str):
    raise SourceError(
      f"{file.path}: data.format='prompt_completion' reads JSONL rows with {list(field)} "
      f"fields, and this file is {file.format}"
    )
  readers = {"parquet": _parquet_rows, "arrow": _arrow_rows, "txt": _text_rows}
  return readers[file.format](file, raw, field)


def read_rows(file: SourceFile, text_field: Fields = "text") -> Iterator[Row]:
  """The rows of one file, in order, as `Document`s and `BadRow`s (see the module docstring).

  Raises `SourceError` naming the file, and the last row read, when the file
  cannot be read.
  """
  last = "its start"
  try:
    with epath.Path(file.path).open("rb") as raw:
      for row in _rows_of(file, raw, text_field):
        last = row.where if isinstance(row, BadRow) else _where(file, row.row)
        yield row
  except SourceError:
    raise
  except (OSError, EOFError, zstandard.ZstdError, pa.ArrowException) as e:
    raise SourceError(
      f"{file.path}: cannot be read as {file.format} after {last} ({type(e).__name__}: {e}); "
      "is it truncated or corrupt?"
    ) from None


def _where(file: SourceFile, row: int) -> str:
  return f"line {row}" if file.format.startswith("jsonl") else f"row {row}"


class SourceDocuments:
  """A source's documents, file after file; bad rows skipped up to `skip_bad_rows`, then an error.

  Iterating again reads the files again (each pass counts its own bad rows).

  Attributes:
    bad: the bad rows the last pass met (`BadRow`s, the first `BAD_ROWS_SHOWN`).
    bad_count: how many the last pass met.
  """

  def __init__(
    self,
    source: Source,
    text_field: Fields = "text",
    skip_bad_rows: int = 0,
    keep: Callable[[Document], bool] | None = None,
  ):
    self.source, self.text_field, self.skip_bad_rows = source, text_field, skip_bad_rows
    self.keep = keep
    self.bad: list[BadRow] = []
    self.bad_count = 0

  def __iter__(self) -> Iterator[Document]:
    self.bad, self.bad_count = [], 0
    for file in self.source.files:
      yield from self.of_file(file)

  def of_file(self, file: SourceFile) -> Iterator[Document]:
    """One file's documents (kept by `keep`), its bad rows counted with the pass's."""
    with contextlib.closing(read_rows(file, self.text_field)) as rows:
      for row in rows:
        if isinstance(row, BadRow):
          self._count(row)
        elif self.keep is None or self.keep(row):
          yield row

  def _count(self, row: BadRow) -> None:
    self.bad_count += 1
    if len(self.bad) < BAD_ROWS_SHOWN:
      self.bad.append(row)
    if self.bad_count > self.skip_bad_rows:
      allowed = (
        "set data.skip_bad_rows=N to let a source skip up to N bad rows"
        if not self.skip_bad_rows
        else f"this is its bad row number {self.bad_count}, and data.skip_bad_rows="
        f"{self.skip_bad_rows} lets a source skip that many"
      )
      hint = ""
      if "field (its fields" in row.reason and isinstance(self.text_field, str):
        hint = " (data.text_field names the field that holds the text)"
      raise SourceError(f"data.sources {self.source.spec!r}: {row}{hint}; {allowed}")

  def report(self) -> dict[str, Any]:
    """What the last pass skipped, for the prepared data's record: `{count, rows}`."""
    return {"count": self.bad_count, "rows": [str(b) for b in self.bad]}


def sample_texts(
  sources: Sequence[Source],
  text_field: Fields = "text",
  skip_bad_rows: int = 0,
  keep: Callable[[Document], bool] | None = None,
  budget: int = BPE_SAMPLE_CHARS,
) -> Iterator[str]:
  """A deterministic sample of every source's text, `budget` characters at most in all.

  Each source gives an equal share; within a source, files are visited in
  an order drawn from their keys (not the seed: the same sample, the same
  tokenizer, for any run) and each gives at most `MIN_FILE_SAMPLE` or its
  share of the source's, whichever is more, so a sample spreads over the
  files instead of reading the first ones whole. Memory and reading stop at
  the budget, however large the corpus. `keep` chooses the documents (the
  train split's).

  >>> import tempfile, pathlib
  >>> from trainers.data.prepare.source_files import SourceSpec, list_source
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.txt").write_text("x" * 100)
  >>> [len(t) for t in sample_texts([list_source(SourceSpec(str(root)))], budget=30)]
  [30]
  """
  share = max(1, budget // max(1, len(sources)))
  for source in sources:
    documents = SourceDocuments(source, text_field, skip_bad_rows, keep)
    per_file = max(MIN_FILE_SAMPLE, share // len(source.files))
    files = sorted(source.files, key=lambda f: hashlib.sha256(f.key.encode()).digest())
    taken = 0
    for file in files:
      from_file = 0
      with contextlib.closing(documents.of_file(file)) as found:
        for document in found:
          text = (document.prompt + document.text)[: min(share - taken, per_file - from_file)]
          yield text
          taken, from_file = taken + len(text), from_file + len(text)
          if taken >= share or from_file >= per_file:
            break
      if taken >= share:
        break
