"""Text to token ids and back: bytes, ids, or a subword tokenizer's text.

What the end-of-run sample and `spmd-sample` use to encode a prompt and show
what the model wrote; no task or model is needed.

Example:
  >>> token_codec(256).encode("hi"), token_codec(256).decode([104, 105])
  ([104, 105], 'hi')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

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
