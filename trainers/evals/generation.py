"""A generation eval: greedy completions of every prompt, written to a file, exact-match scored.

The prompts are encoded as the run's documents start (BOS, with `add_bos`),
cut from the left to leave `max_new_tokens` of the window (as lm-eval cuts
them), and continued `rows` at a time by the batched decoder with its KV
cache on the run's mesh (`trainers.models.decode_batch.generate_batch`,
greedy), each to the tokenizer's EOS or `max_new_tokens`. A completion ends
before the first of `stop` it holds (lm-eval's `until`), the EOS dropped.

Rows that give an `answer` are scored by exact match after stripping
whitespace at both ends of the completion and the answer; nothing else is
normalised (case and punctuation count).

Process 0 writes one JSON line per prompt, in file order, to the `out`
file: prompt, completion, tokens (new tokens, to the stop), stopped
("eos", "stop" or "length"), and answer and match where the row has an answer.

Example, with a decoder that always says "Paris" then EOS:
  >>> from trainers.evals.encoding import byte_encoder
  >>> from trainers.evals.items import PromptItem
  >>> from trainers.evals.specs import EvalSpec
  >>> spec = EvalSpec("qa", "generation", "qa.jsonl", max_new_tokens=8, stop=("\\n",))
  >>> def decode(prompts, count):
  ...   ids = list(b"Paris\\n!")[:count]
  ...   return np.array([ids] * len(prompts)), np.array([len(ids)] * len(prompts))
  >>> items = [PromptItem("Capital of France?", " Paris"), PromptItem("Of Italy?", "Rome")]
  >>> found = complete_items(spec, items, byte_encoder(256), window=64, rows=2, decode=decode)
  >>> [r["completion"] for r in found.rows], found.metrics["exact_match"]
  (['Paris', 'Paris'], 0.5)
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from etils import epath

from spmd.errors import UserError
from trainers.data.prepare.token_codec import TokenCodec, cut_at_stop
from trainers.evals.encoding import PairError, TextEncoder, encode_prompt
from trainers.evals.items import PromptItem
from trainers.evals.specs import EvalSpec


@dataclasses.dataclass(frozen=True)
class Completions:
  """What a generation eval made: one dict a prompt (the file's rows), and its metrics.

  Attributes:
    rows: prompt, completion, tokens, stopped, and answer and match where given.
    metrics: items, answered, exact_match (when any row has an answer),
      tokens (new tokens, to each stop), seconds and tokens_per_s.
  """

  rows: list[dict[str, Any]]
  metrics: dict[str, float]


def _finish(text: str, stops: Sequence[str]) -> tuple[str, bool]:
  """`text` before the first stop string it holds, and whether one was there."""
  cuts = [text.index(s) for s in stops if s in text]
  return (text[: min(cuts)], True) if cuts else (text, False)


def encode_prompts(
  spec: EvalSpec, items: Sequence[PromptItem], encoder: TextEncoder, window: int
) -> list[list[int]]:
  """Each prompt's ids, cut from the left to leave `max_new_tokens` of `window`.

  Raises:
    UserError: the window leaves no room for a prompt, or a prompt is empty.
  """
  room = window - spec.max_new_tokens
  if room < 1:
    raise UserError(
      f"{spec.where}: max_new_tokens={spec.max_new_tokens} leaves no room for a prompt in "
      f"the model's seq_len={window}"
    )
  prompts = []
  for number, item in enumerate(items, start=1):
    try:
      prompts.append(encode_prompt(encoder, item.prompt, add_bos=spec.add_bos, room=room))
    except PairError as e:
      raise UserError(f"{spec.where} item {number}: {e}") from None
  return prompts


def complete_items(
  spec: EvalSpec,
  items: Sequence[PromptItem],
  encoder: TextEncoder,
  window: int,
  rows: int,
  decode: Callable[[list[list[int]], int], tuple[np.ndarray, np.ndarray]],
) -> Completions:
  """`encode_prompts` then `complete_prompts`: the whole eval of `items` in one call."""
  prompts = encode_prompts(spec, items, encoder, window)
  return complete_prompts(spec, items, prompts, encoder, rows, decode)


def complete_prompts(
  spec: EvalSpec,
  items: Sequence[PromptItem],
  prompts: Sequence[list[int]],
  encoder: TextEncoder,
  rows: int,
  decode: Callable[[list[list[int]], int], tuple[np.ndarray, np.ndarray]],
) -> Completions:
  """Completes the encoded `prompts` through `decode(prompts, count) -> (tokens [B, count], lengths [B])`.

  `decode` gets `rows` prompts at a time (the last batch filled up with
  its first prompt; those rows are dropped).
  """
  started = time.perf_counter()
  made: list[list[int]] = []
  for first in range(0, len(prompts), rows):
    chunk = list(prompts[first : first + rows])
    tokens, lengths = decode(chunk + [chunk[0]] * (rows - len(chunk)), spec.max_new_tokens)
    made += [[int(t) for t in tokens[r, : int(lengths[r])]] for r in range(len(chunk))]
  seconds = time.perf_counter() - started
  out, matches, new_tokens = [], [], 0
  codec = TokenCodec(encode=encoder.encode, decode=encoder.decode, describe="")
  for item, ids in zip(items, made):
    eos = encoder.eos_id is not None and bool(ids) and ids[-1] == encoder.eos_id
    shown = ids[:-1] if eos else ids
    completion, stopped = _finish(encoder.decode(shown), spec.stop)
    if stopped:  # the tokens it took to reach the stop string
      ids = ids[: cut_at_stop(codec, shown, spec.stop)[1]]
    row: dict[str, Any] = {
      "prompt": item.prompt,
      "completion": completion,
      "tokens": len(ids),
      "stopped": "stop" if stopped else "eos" if eos else "length",
    }
    if item.answer is not None:
      row["answer"] = item.answer
      row["match"] = completion.strip() == item.answer.strip()
      matches.append(row["match"])
    out.append(row)
    new_tokens += len(ids)
  metrics = {
    "items": float(len(items)),
    "answered": float(len(matches)),
    "tokens": float(new_tokens),
    "seconds": seconds,
    "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0,
  }
  if matches:
    metrics["exact_match"] = sum(matches) / len(matches)
  return Completions(out, metrics)


def completions_file(workdir: str | epath.Path, name: str, step: int) -> epath.Path:
  """Where a generation eval's completions at `step` go: `W/evals/<name>/step_<step>.jsonl`."""
  return epath.Path(workdir) / "evals" / name / f"step_{step}.jsonl"


def write_completions(path: epath.Path, rows: Sequence[dict[str, Any]]) -> None:
  """The rows as JSON lines (process 0 calls it)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
