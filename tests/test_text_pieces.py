"""A `.txt` file read in pieces tokenizes as it would whole (issue 59, defect 2), for each tokenizer
family users bring (`tests/tokenizer_families.py`): code with blank lines before a cut, CRLF, lines
longer than a piece and non-ASCII text at the pieces' boundaries, and the file is tokenized a piece
at a time with every family (SentencePiece's dummy prefix included). In-process: the pieces come
from the source's reader with a small piece size, and a `hypothesis` property cuts several files
in a row at any of their line breaks."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import tokenizer_families
from trainers.data.prepare import documents as docs
from trainers.data.prepare import packed, source_packed
from trainers.data.prepare.source_files import SourceFile, SourceSpec, list_source
from trainers.data.prepare.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
  folder = tmp_path_factory.mktemp("families")
  return {
    name: Tokenizer(tokenizer_families.tokenizer_file(name, folder))
    for name in tokenizer_families.FAMILIES
  }


def _stream(ids) -> np.ndarray:
  """The ids `_token_ids` gives, joined, checking that only the first piece opens a document."""
  parts = list(ids)
  assert not isinstance(parts[0], packed.Continued)
  assert all(isinstance(p, packed.Continued) for p in parts[1:])
  return np.concatenate([p.tokens if isinstance(p, packed.Continued) else p for p in parts])


def _whole(text: str, tokenizer: Tokenizer) -> np.ndarray:
  return np.asarray([tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id])


def _first_difference(got: np.ndarray, want: np.ndarray, tokenizer: Tokenizer) -> str:
  at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
  pieces = tokenizer_families.token_names(tokenizer, got[max(0, at - 2) : at + 2])
  whole = tokenizer_families.token_names(tokenizer, want[max(0, at - 2) : at + 2])
  return f"{len(got)} ids in pieces, {len(want)} whole; at id {at}: {pieces} vs {whole}"


# Code and prose as files hold them: a blank line before a `def` or a
# paragraph, so that a cut after it splits the whitespace a BPE merges
# ("\n\n"); blank CRLF lines; non-ASCII text either side of a line break.
CODE = (
  "import os\n\n\nclass Reader:\n    def lines(self):\n        return []\n\n"
  "    def count(self):\n        return 0\n\ndef main():\n    return Reader()\n"
)
PROSE = (
  "Naïve café — Zürich 東京, the capital.\r\nQuestion: two plus two?\r\n\r\nAnswer: four.\r\n"
  "A first paragraph ends here.\n\nThe second one starts with a word.\n\n東京 starts the third.\n"
)
LONG_LINE = "x = [" + ", ".join(str(i) for i in range(120)) + "]\n"


@pytest.mark.parametrize("family", tokenizer_families.FAMILIES)
def test_a_text_file_read_in_pieces_gives_the_ids_of_the_whole(
  tmp_path, monkeypatch, tokenizers, family
):
  """Cut every 64 bytes (so at many kinds of line) of code, CRLF prose and lines longer than a piece."""
  tokenizer = tokenizers[family]
  text = (CODE * 3 + PROSE + LONG_LINE) * 12
  path = tmp_path / "corpus.txt"
  path.write_bytes(text.encode())
  monkeypatch.setattr(docs, "TEXT_PIECE", 64)
  monkeypatch.setattr(source_packed, "_ENCODE_CHARS", 64)  # a piece per tokenizer call
  read = docs.SourceDocuments(list_source(SourceSpec(str(path))))
  got = _stream(source_packed._token_ids(read, tokenizer))
  want = _whole(text, tokenizer)
  assert np.array_equal(got, want), _first_difference(got, want, tokenizer)
  # Tokenized in pieces, not joined into the file: memory holds a piece, for every family.
  pieces = [len(p.text) for p in source_packed._pieces(read, tokenizer)]
  assert len(pieces) > len(text) // 256 and max(pieces) < 1024, (len(pieces), max(pieces))


LINES = st.sampled_from(
  [
    "",
    " ",
    "    ",
    "\t",
    "\r",
    "class Reader:",
    "    def f(self):",
    "        return x  ",
    "Naïve café — 東京",
    "Zürich,",
    "😀 ok",
    " the capital is",
    "12345",
    "))",
    LONG_LINE.rstrip("\n"),
  ]
)


@st.composite
def cut_texts(draw) -> tuple[str, list[int]]:
  """A text of lines unlike one another, and the line breaks it is cut after."""
  lines = draw(st.lists(LINES, min_size=1, max_size=24))
  text = "".join(line + "\n" for line in lines)
  ends = [i + 1 for i, c in enumerate(text) if c == "\n"][:-1]
  if draw(st.booleans()):  # a file need not end with a line break
    text = text[:-1]
  cuts = draw(st.lists(st.sampled_from(ends), unique=True)) if ends else []
  return text, sorted(cuts)


@pytest.mark.parametrize("family", tokenizer_families.FAMILIES)
@settings(
  max_examples=40,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(documents=st.lists(cut_texts(), min_size=1, max_size=3))
def test_documents_cut_at_any_line_break_give_the_ids_of_each_whole(tokenizers, family, documents):
  """Several files in a row, each in pieces: no piece's context reaches into another file."""
  tokenizer = tokenizers[family]
  read = []
  for n, (text, cuts) in enumerate(documents):
    file = SourceFile(f"{n}.txt", f"{n}.txt", "txt", len(text), "")
    bounds = [0, *cuts, len(text)]
    read += [
      docs.Document(file, 0, text[a:b], part)
      for part, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
  ids = list(source_packed._token_ids(read, tokenizer))
  opens = [i for i, part in enumerate(ids) if not isinstance(part, packed.Continued)]
  assert len(opens) == len(documents)
  for (text, _), lo, hi in zip(documents, opens, [*opens[1:], len(ids)]):
    got, want = _stream(ids[lo:hi]), _whole(text, tokenizer)
    assert np.array_equal(got, want), _first_difference(got, want, tokenizer)
