"""Text to the token ids an eval scores or continues, as lm-eval tokenizes them.

A (context, continuation) pair is encoded as lm-eval's `_encode_pair`
(`lm_eval/models/huggingface.py`) does, whatever the tokenizer's family:

  1. spaces that end the context move to the front of the continuation
     ("Answer: " + "Paris" is scored as "Answer:" + " Paris");
  2. the whole text, context + continuation, is tokenized once, and the
     context alone once;
  3. the continuation's tokens are those of the whole after as many tokens
     as the context alone has: a token that merges across the boundary
     counts with the continuation, and the context is the context's own.

With `add_bos` a tokenizer's BOS opens the context, as it opens every
document the run trained on (lm-eval's `add_bos_token=True`; its default for
most HF models adds none). Bytes have no BOS. A pair longer than the model's
window loses context tokens from the left, as lm-eval's does.

Example, bytes (each character one id):
  >>> encoder = byte_encoder(256)
  >>> pair = encode_pair(encoder, "Answer: ", "Paris", add_bos=True, window=64)
  >>> text = encoder.decode(pair.tokens)
  >>> text[: len(text) - pair.scored], text[-pair.scored :]
  ('Answer:', ' Paris')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np

from trainers.data.prepare.token_codec import byte_codec, run_tokenizer


@dataclasses.dataclass(frozen=True)
class TextEncoder:
  """The run's text <-> ids for evals.

  Attributes:
    encode: text -> ids, with no BOS or EOS.
    decode: ids -> text.
    bos_id, eos_id: the tokenizer's document markers; None for bytes.
  """

  encode: Callable[[str], list[int]]
  decode: Callable[[Sequence[int]], str]
  bos_id: int | None = None
  eos_id: int | None = None


def byte_encoder(vocab_size: int) -> TextEncoder:
  """A run without a tokenizer: UTF-8 bytes (ids past 255 decode as U+FFFD).

  Example:
    >>> byte_encoder(256).encode("hé"), byte_encoder(256).decode([104, 195, 169])
    ([104, 195, 169], 'hé')
  """
  return TextEncoder(lambda text: list(text.encode()), byte_codec(vocab_size).decode)


def run_encoder(config: ml_collections.ConfigDict, workdir: str) -> TextEncoder:
  """The run's tokenizer (its copy in `workdir` first), or bytes.

  Raises:
    FileNotFoundError: the run used a tokenizer and neither its copy nor the file is there.
  """
  tokenizer = run_tokenizer(config, workdir)
  if tokenizer is None:
    return byte_encoder(config.model.vocab_size)
  return TextEncoder(tokenizer.encode, tokenizer.decode, tokenizer.bos_id, tokenizer.eos_id)


@dataclasses.dataclass(frozen=True)
class Pair:
  """An encoded (context, continuation): `tokens` int32, the last `scored` the continuation's."""

  tokens: np.ndarray
  scored: int
  truncated: bool = False  # context tokens were dropped to fit the window


class PairError(ValueError):
  """A pair that cannot be scored (an empty context or continuation, one too long)."""


def encode_pair(
  encoder: TextEncoder, context: str, continuation: str, *, add_bos: bool, window: int
) -> Pair:
  """`context` then `continuation`, as the module docstring says; `window` is the model's seq_len.

  The model reads `tokens[:-1]`, at most `window` of them, and scores the
  continuation's.

  Raises:
    PairError: the continuation has no tokens or more than `window`, or
      nothing precedes it (an empty context and no BOS).
  """
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  prefix = [encoder.bos_id] if add_bos and encoder.bos_id is not None else []
  whole = prefix + encoder.encode(context + continuation)
  own = prefix + encoder.encode(context)
  scored = whole[len(own) :]
  if not scored:
    raise PairError(f"the continuation {continuation!r} has no tokens of its own after the context")
  if not own:
    raise PairError("the context is empty and the tokenizer has no BOS to start from")
  if len(scored) > window:
    raise PairError(f"the continuation is {len(scored)} tokens; the model reads {window}")
  tokens = own + scored
  truncated = len(tokens) - 1 > window
  return Pair(np.asarray(tokens[-(window + 1) :], np.int32), len(scored), truncated)


def encode_prompt(encoder: TextEncoder, prompt: str, *, add_bos: bool, room: int) -> list[int]:
  """A generation prompt's ids, its last `room` when longer (lm-eval cuts from the left too).

  Example:
    >>> encode_prompt(byte_encoder(256), "abcdef", add_bos=True, room=4)
    [99, 100, 101, 102]
  """
  prefix = [encoder.bos_id] if add_bos and encoder.bos_id is not None else []
  ids = prefix + encoder.encode(prompt)
  if not ids:
    raise PairError("the prompt is empty and the tokenizer has no BOS to start from")
  return ids[-room:]
