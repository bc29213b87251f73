"""Subword tokenizers for LM data: a BPE trained on the corpus, or a user's file.

`config.data.tokenizer` names one of three things:

  "bytes"      no tokenizer: token ids are the text's bytes (vocab 256);
  "bpe"        a byte-level BPE (HF `tokenizers`) trained on the text
               corpus's train files on first use, with `config.model.vocab_size`
               ids, cached under `<data dir>/tokenizers/` (`bpe_tokenizer`);
  a path/URL   a `tokenizer.json` (HF `tokenizers`) or a SentencePiece
               `.model`, on any `etils.epath` path (gs://...), copied into
               `<data dir>/tokenizers/` (`user_tokenizer`).

A trained BPE reserves its first ids: 0 `<pad>` (never a real token), 1
`<s>` (BOS), 2 `</s>` (EOS). Its ByteLevel pre-tokenizer and decoder make any
text round-trip. A user's file brings its own BOS/EOS (looked up by their
common names, or SentencePiece's `bos_id`/`eos_id`); `Tokenizer.missing`
says which it lacks.

A tokenizer's identity is the sha256 of its file: the packed data is keyed
by it, and a run refuses to resume on data made with another one.

Example:
  >>> import tempfile, pathlib
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> path = train_bpe(["def f(x):\\n  return x\\n"] * 20, 300, root / "tokenizer.json")
  >>> tok = Tokenizer(path)
  >>> tok.bos_id, tok.eos_id, tok.decode(tok.encode("def g(y): é"))
  (1, 2, 'def g(y): é')
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from etils import epath

BYTES = "bytes"
BPE = "bpe"
PAD_ID = 0
BPE_SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 of a trained BPE
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte
BPE_MIN_VOCAB = BYTE_ALPHABET + len(BPE_SPECIALS)
# Common names of the document markers in tokenizer files, in the order they are tried.
BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "[BOS]", "<|endoftext|>")
EOS_NAMES = ("</s>", "<eos>", "<|end_of_text|>", "[EOS]", "<|endoftext|>")
SENTENCEPIECE_SUFFIX = ".model"
CACHE_DIR = "tokenizers"


def file_identity(data: bytes) -> str:
  """The identity of a tokenizer file: `sha256:<hex>` of its bytes.

  >>> file_identity(b"")[:15]
  'sha256:e3b0c442'
  """
  return "sha256:" + hashlib.sha256(data).hexdigest()


class Tokenizer:
  """A tokenizer file, loaded: HF `tokenizers` JSON, or SentencePiece (`.model`).

  Attributes:
    path: the local file it was loaded from.
    identity: `file_identity` of the file.
    kind: "tokenizers" or "sentencepiece".
    vocab_size: ids it can produce (special tokens included).
    bos_id, eos_id: the document markers, None when the file has none.
    missing: the markers it lacks, for messages ("" when it has both).
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    data = epath.Path(self.path).read_bytes()  # a URL too: only the bytes are needed
    self.identity = file_identity(data)
    if self.path.endswith(SENTENCEPIECE_SUFFIX):
      import sentencepiece

      self.kind = "sentencepiece"
      self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
      self.vocab_size = int(self._sp.GetPieceSize())
      bos, eos = int(self._sp.bos_id()), int(self._sp.eos_id())
      self.bos_id, self.eos_id = (bos if bos >= 0 else None), (eos if eos >= 0 else None)
    else:
      import tokenizers

      self.kind = "tokenizers"
      try:
        self._hf = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
      except Exception as e:  # the library's own error type is not public
        raise ValueError(
          f"{self.path} is not a `tokenizers` tokenizer.json (nor a SentencePiece "
          f"{SENTENCEPIECE_SUFFIX} file): {e}"
        ) from None
      # Text that spells a special token ("<s>" in an HTML file) is text, never a
      # marker: only packing puts BOS/EOS (and nothing puts pad) in the stream.
      self._hf.encode_special_tokens = True
      # Ids never come from the post-processor here (it adds markers only with
      # add_special_tokens, which is never asked), and one that trims spaces from
      # the offsets (GPT-2's ByteLevel) would take a space token's text from it.
      self._hf.post_processor = None
      self.vocab_size = int(self._hf.get_vocab_size(with_added_tokens=True))
      self.bos_id = _first_id(self._hf, BOS_NAMES)
      self.eos_id = _first_id(self._hf, EOS_NAMES)
    lacks = [n for n, i in (("BOS", self.bos_id), ("EOS", self.eos_id)) if i is None]
    self.missing = (
      f"{self.path} has no {' and no '.join(lacks)} token (looked for "
      f"{BOS_NAMES if 'BOS' in lacks else EOS_NAMES}"
      f"{' or bos_id/eos_id' if self.kind == 'sentencepiece' else ''})"
      if lacks
      else ""
    )

  def encode(self, text: str) -> list[int]:
    """The ids of `text`, without BOS/EOS (documents are framed when packed)."""
    if self.kind == "sentencepiece":
      return list(self._sp.encode(text, out_type=int))
    return list(self._hf.encode(text, add_special_tokens=False).ids)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` of many texts at once (the libraries use several threads)."""
    if self.kind == "sentencepiece":
      return [np.asarray(ids, np.int64) for ids in self._sp.encode(list(texts), out_type=int)]
    # Without the offsets (`tokenizers` 0.20's `encode_batch_fast`): the same ids, and
    # packing reads nothing else; computing every token's offsets doubles the CPU.
    encoded = self._hf.encode_batch_fast(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, np.int64) for e in encoded]

  def encode_batch_with_offsets(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each text's ids (as `encode`) and each id's span of the text: characters `[start, end)`.

    A span says which characters a token holds: a token of a SentencePiece-style
    tokenizer holds the space it shows as "▁", and a byte of a character split
    into bytes holds that character. A token that holds no character (a dummy
    prefix) has an empty span where it stands.

    >>> import tempfile, pathlib
    >>> path = train_bpe(["The capital is Paris."] * 20, 300,
    ...                  pathlib.Path(tempfile.mkdtemp()) / "tokenizer.json")
    >>> [(ids, spans)] = Tokenizer(path).encode_batch_with_offsets(["The capital is Paris."])
    >>> spans[-2:].tolist()
    [[14, 20], [20, 21]]
    """
    if self.kind == "sentencepiece":
      out = []
      for text, proto in zip(texts, self._sp.encode(list(texts), return_type="proto")):
        # The library gives spans in bytes of UTF-8: characters are counted by their lead bytes.
        raw = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
        begun = np.concatenate([[0], np.cumsum((raw & 0xC0) != 0x80)])  # chars before byte i
        ids = np.asarray([p.id for p in proto.pieces], np.int64)
        begins = np.asarray([p.begin for p in proto.pieces], np.int64)
        ends = np.asarray([p.end for p in proto.pieces], np.int64)
        # A span that begins inside a character begins at that character.
        holding = np.append(begun[1:], begun[-1] + 1) - 1  # the character of byte i
        spans = np.stack([holding[begins], begun[ends]], axis=-1).reshape(-1, 2)
        out.append((ids, spans))
      return out
    encoded = self._hf.encode_batch(list(texts), add_special_tokens=False)
    return [
      (np.asarray(e.ids, np.int64), np.asarray(e.offsets, np.int64).reshape(-1, 2)) for e in encoded
    ]

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids`; special tokens are dropped."""
    ids = [int(i) for i in ids]
    if self.kind == "sentencepiece":
      return self._sp.decode(ids)
    return self._hf.decode(ids, skip_special_tokens=True)

  def __repr__(self) -> str:
    return f"Tokenizer({self.path!r}, {self.kind}, vocab {self.vocab_size}, {self.identity[:19]})"


def _first_id(hf, names: Sequence[str]) -> int | None:
  for name in names:
    found = hf.token_to_id(name)
    if found is not None:
      return int(found)
  return None


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike) -> pathlib.Path:
  """Trains a byte-level BPE of at most `vocab_size` ids on `texts`; writes it to `path`.

  Ids 0, 1, 2 are `<pad>`, `<s>`, `</s>` (`BPE_SPECIALS`); all 256 bytes
  are in the vocabulary, so any text encodes. A small corpus may give fewer
  than `vocab_size` ids. The file is written whole or not at all.
  """
  from tokenizers import Tokenizer as HfTokenizer
  from tokenizers import decoders, models, pre_tokenizers, trainers

  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < BPE_MIN_VOCAB:
    raise ValueError(
      f"{vocab_size=} is too small for a byte-level BPE: it needs at least {BPE_MIN_VOCAB} "
      f"({BYTE_ALPHABET} bytes and {len(BPE_SPECIALS)} special tokens)"
    )
  tok = HfTokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(BPE_SPECIALS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  partial = path.with_name(path.name + f".partial-{os.getpid()}")
  partial.write_text(tok.to_str())
  partial.replace(path)  # atomic: a reader finds the old file or the whole new one
  return path


def read_text(path: str) -> str:
  """A corpus file as text; bytes that are not UTF-8 become U+FFFD."""
  with open(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def bpe_tokenizer(
  data_dir: str | os.PathLike,
  corpus_key: str,
  files: Sequence[str] = (),
  vocab_size: int = BPE_MIN_VOCAB,
  texts: Callable[[], Iterable[str]] | None = None,
) -> Tokenizer:
  """The BPE of `vocab_size` trained on `files` (or on `texts()`), trained on first use and cached.

  `corpus_key` names the text's state (e.g. a `text_corpus_config` name,
  which hashes the files' names, sizes and times): other text, another cache.
  `texts`, when given, is called only to train (a sample of `data.sources`).
  """
  path = pathlib.Path(data_dir) / CACHE_DIR / f"bpe-{vocab_size}-{corpus_key}" / "tokenizer.json"
  if not path.is_file():
    if texts is None:
      if not files:
        raise ValueError(f"no text to train the BPE tokenizer on ({corpus_key=})")
      train_bpe((read_text(f) for f in files), vocab_size, path)
    else:
      train_bpe(_nonempty(texts(), corpus_key), vocab_size, path)
  return Tokenizer(path)


def _nonempty(texts: Iterable[str], corpus_key: str) -> Iterator[str]:
  """`texts`, raising `ValueError` at the end when there was none."""
  found = False
  for text in texts:
    found = True
    yield text
  if not found:
    raise ValueError(f"no text to train the BPE tokenizer on ({corpus_key=})")


def user_tokenizer(spec: str, data_dir: str | os.PathLike) -> Tokenizer:
  """A user's tokenizer file (path or URL), copied into `data_dir`'s cache and loaded.

  The copy is named by the file's hash, so a changed file is a new copy.
  """
  source = epath.Path(spec)
  if not source.exists():
    raise FileNotFoundError(f"data.tokenizer={spec!r} does not exist")
  data = source.read_bytes()
  digest = file_identity(data).split(":")[1][:16]
  path = pathlib.Path(data_dir) / CACHE_DIR / f"file-{digest}" / source.name
  if not path.is_file():
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".partial-{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(path)
  return Tokenizer(path)


def check_spec(spec: str) -> None:
  """Raises `ValueError` unless `spec` is "bytes", "bpe" or an existing tokenizer file.

  >>> check_spec("bpe")
  >>> check_spec("/nonexistent/tokenizer.json")
  Traceback (most recent call last):
  ...
  ValueError: data.tokenizer='/nonexistent/tokenizer.json' is not 'bytes', 'bpe' or an existing tokenizer file (tokenizer.json or SentencePiece .model)
  """
  if spec in (BYTES, BPE):
    return
  if not spec or not epath.Path(spec).is_file():
    raise ValueError(
      f"data.tokenizer={spec!r} is not {BYTES!r}, {BPE!r} or an existing tokenizer file "
      f"(tokenizer.json or SentencePiece {SENTENCEPIECE_SUFFIX})"
    )


def tokenizer_spec(config: Any) -> str:
  """`config.data.tokenizer`: "bytes", "bpe", or a tokenizer file's path/URL."""
  return config.data.get("tokenizer", "bytes") or "bytes"
