"""Text to token ids and back: bytes, ids, or a subword tokenizer's text.

What the end-of-run sample, `spmd-sample` and the evals use to encode a
prompt and show what the model wrote; no task or model is needed. A run's
own (`run_codec`, `run_tokenizer`) is its tokenizer's copy in the workdir.

Example:
  >>> token_codec(256).encode("hi"), token_codec(256).decode([104, 105])
  ([104, 105], 'hi')
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence

import ml_collections

from trainers import paths
from trainers.data.prepare import tokenizer as tok

BYTE_VOCAB = 256  # a vocabulary this size or smaller is read as bytes


@dataclasses.dataclass(frozen=True)
class TokenCodec:
  """Text to token ids and back, for the sample; where a tokenizer plugs in.

  Attributes:
    encode: `text -> ids`, for the prompt.
    decode: `ids -> text`, for the sample.
    describe: how the sample is shown, for its heading.
  """

  encode: Callable[[str], list[int]]
  decode: Callable[[Sequence[int]], str]
  describe: str


def token_codec(vocab_size: int) -> TokenCodec:
  """The codec of a vocabulary: bytes when it is byte-level (<= 256 ids), else ids.

  Without a tokenizer a larger vocabulary's ids have no text: the prompt
  becomes its UTF-8 bytes (ids every such vocabulary has) and the sample is
  shown as token ids, never as bytes it is not.

  Example:
    >>> token_codec(256).encode("hi"), token_codec(256).decode([104, 105])
    ([104, 105], 'hi')
    >>> token_codec(1000).decode([104, 999])
    '[104, 999]'
  """
  encode = list  # a str's UTF-8 bytes, as ints
  if vocab_size <= BYTE_VOCAB:
    return TokenCodec(
      encode=lambda text: encode(text.encode()),
      decode=lambda ids: bytes(int(t) for t in ids).decode("utf-8", errors="replace"),
      describe="bytes",
    )
  return TokenCodec(
    encode=lambda text: encode(text.encode()),
    decode=lambda ids: str([int(t) for t in ids]),
    describe=f"token ids: {vocab_size=} is not byte-level and there is no tokenizer; "
    "the prompt is its UTF-8 bytes",
  )


def prompt_ids(codec: TokenCodec, prompt: str, vocab: int, seq_len: int) -> list[int]:
  """The prompt's ids, checked up front so that the sample cannot fail at the end."""
  ids = codec.encode(prompt)
  if not ids or len(ids) >= seq_len:
    raise ValueError(
      f"config.sample_prompt={prompt!r} is {len(ids)} tokens; a sample needs 1 to "
      f"{seq_len - 1} ({seq_len=}), or config.sample_tokens=0 for no sample"
    )
  if max(ids) >= vocab:
    raise ValueError(
      f"config.sample_prompt={prompt!r} has token id {max(ids)}, outside vocab_size={vocab}; "
      "use a prompt of ASCII text, or config.sample_tokens=0 for no sample"
    )
  return ids


def tokenizer_codec(tokenizer) -> TokenCodec:
  """The codec of a subword tokenizer: the prompt opens a document (BOS first).

  Example:
    >>> import tempfile, pathlib
    >>> from trainers.data.prepare.tokenizer import Tokenizer, train_bpe
    >>> path = train_bpe(["def f(): pass"] * 9, 300, pathlib.Path(tempfile.mkdtemp()) / "t.json")
    >>> codec = tokenizer_codec(Tokenizer(path))
    >>> codec.encode("def")[0], codec.decode(codec.encode("def g"))
    (1, 'def g')
  """
  bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
  return TokenCodec(
    encode=lambda text: bos + tokenizer.encode(text),
    decode=tokenizer.decode,
    describe=f"text through the tokenizer {os.path.basename(tokenizer.path)}",
  )


def byte_codec(vocab_size: int) -> TokenCodec:
  """A byte-level run's codec: ids < 256 are UTF-8 bytes whatever the vocabulary's size.

  Example:
    >>> byte_codec(512).decode([104, 105, 300])
    'hi\ufffd'
  """

  def decode(ids):
    # Ids past the bytes are never in byte data; one the model makes anyway
    # shows as U+FFFD, as a byte that is no UTF-8 does.
    runs = itertools.groupby((int(t) for t in ids), key=lambda t: t < BYTE_VOCAB)
    return "".join(
      bytes(run).decode("utf-8", errors="replace") if is_byte else "\ufffd" * len(list(run))
      for is_byte, run in runs
    )

  extra = f"; ids 256..{vocab_size - 1} show as U+FFFD" if vocab_size > BYTE_VOCAB else ""
  return TokenCodec(
    encode=lambda text: list(text.encode()), decode=decode, describe="bytes" + extra
  )


def run_tokenizer(config: ml_collections.ConfigDict, workdir: str) -> tok.Tokenizer | None:
  """The run's tokenizer (its copy in `workdir` first, else the file it names), or None for bytes.

  Example:
    >>> from configs import lm_tiny_bytes
    >>> run_tokenizer(lm_tiny_bytes.get_config(), "W") is None
    True

  Raises:
    FileNotFoundError: the run used a tokenizer and neither file is there.
  """
  spec = tok.tokenizer_spec(config)
  if spec == tok.BYTES:
    return None
  suffix = ".json" if spec == tok.BPE else (paths.user_path(spec).suffix or ".json")
  candidates = [paths.user_path(workdir) / f"tokenizer{suffix}"]
  if spec != tok.BPE:
    candidates.append(paths.user_path(spec))
  for path in candidates:
    if path.exists():
      return tok.Tokenizer(str(path))
  raise FileNotFoundError(
    f"data.tokenizer={spec!r}: the run's tokenizer is not at {[str(p) for p in candidates]} "
    "(a run keeps a copy in its workdir when it starts)"
  )


def run_codec(config: ml_collections.ConfigDict, workdir: str) -> TokenCodec:
  """The run's text <-> ids: its tokenizer file (the workdir's copy first), or bytes.

  Raises:
    FileNotFoundError: the run used a tokenizer and neither its copy in the
      workdir nor the original file is there.
  """
  found = run_tokenizer(config, workdir)
  return byte_codec(config.model.vocab_size) if found is None else tokenizer_codec(found)


def cut_at_stop(
  codec: TokenCodec, new: Sequence[int], stops: Sequence[str]
) -> tuple[str, int] | None:
  """(text to the end of the first stop string it reaches, tokens it took), or None.

  Example:
    >>> cut_at_stop(byte_codec(256), list(b"x = 1\\n\\ny"), ["\\n\\n"])
    ('x = 1\\n\\n', 7)
  """
  if not stops or not any(s in codec.decode(new) for s in stops):
    return None
  for n in range(1, len(new) + 1):  # the fewest tokens whose text holds a stop string
    text = codec.decode(new[:n])
    ends = [text.index(s) + len(s) for s in stops if s in text]
    if ends:
      return text[: min(ends)], n
  return None
