"""A multiple-choice eval by log-likelihood: each choice after its context, scored in packed rows.

Every (context, delimiter + choice) pair is encoded as lm-eval encodes it
(`encoding.encode_pair`), the pairs are packed into rows of the model's
window (`packing.pack`), the rows go through the model in batches of
`rows`, and each choice's log-likelihood is the sum of its continuation
tokens' log-probabilities. An item counts for:

  acc       its answer has the largest log-likelihood;
  acc_norm  its answer has the largest log-likelihood divided by the
            choice's length in UTF-8 bytes (lm-eval's acc_norm divides by
            `len(choice)`, the characters: the same on ASCII text).

Ties go to the first choice, as `np.argmax`'s do in lm-eval.

Example, with a scorer that likes short continuations:
  >>> from trainers.evals.encoding import byte_encoder
  >>> from trainers.evals.items import ChoiceItem
  >>> from trainers.evals.specs import EvalSpec
  >>> spec = EvalSpec("toy", "multiple_choice", "toy.jsonl")
  >>> items = [ChoiceItem("2 + 2 =", ("4", "five"), 0), ChoiceItem("Sky:", ("green", "blue"), 1)]
  >>> score = lambda batch: -(batch["segment_ids"] > 0).astype(np.float32)
  >>> found = score_items(spec, items, byte_encoder(256), window=32, rows=2, score=score)
  >>> [ll.tolist() for ll in found.loglikelihoods], found.metrics["acc"]
  ([[-2.0, -5.0], [-6.0, -5.0]], 1.0)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from spmd.errors import UserError
from trainers.evals import packing
from trainers.evals.encoding import PairError, TextEncoder, encode_pair
from trainers.evals.items import ChoiceItem
from trainers.evals.specs import EvalSpec


@dataclasses.dataclass(frozen=True)
class ChoiceScores:
  """What a multiple-choice eval found.

  Attributes:
    loglikelihoods: one float64 array per item: each choice's log-likelihood.
    metrics: acc, acc_norm, answer_loglikelihood (the right choices' mean:
      a score that moves before the accuracy does), items, tokens (real inputs read, padding left
      out), rows (forward rows, padding included), truncated (pairs that lost
      context to fit the window), seconds and tokens_per_s (the forward passes).
  """

  loglikelihoods: list[np.ndarray]
  metrics: dict[str, float]


def encode_items(
  spec: EvalSpec, items: Sequence[ChoiceItem], encoder: TextEncoder, window: int
) -> tuple[list, list[int]]:
  """(every choice's `Pair`, in item then choice order; each item's choice count).

  Raises:
    UserError: a pair that cannot be scored, named with the eval and the item.
  """
  pairs, counts = [], []
  for number, item in enumerate(items, start=1):
    for choice in item.choices:
      try:
        pairs.append(
          encode_pair(
            encoder, item.context, spec.delimiter + choice, add_bos=spec.add_bos, window=window
          )
        )
      except PairError as e:
        raise UserError(f"{spec.where} item {number}, choice {choice!r}: {e}") from None
    counts.append(len(item.choices))
  return pairs, counts


@dataclasses.dataclass(frozen=True)
class PackedChoices:
  """A multiple-choice eval's items, encoded and packed once for every time it runs."""

  items: Sequence[ChoiceItem]
  counts: list[int]  # each item's choices
  rows: packing.Rows
  truncated: int  # pairs that lost context to fit the window


def pack_items(
  spec: EvalSpec, items: Sequence[ChoiceItem], encoder: TextEncoder, window: int, rows: int
) -> PackedChoices:
  """Every choice of `items` encoded and packed into rows of `window`, a multiple of `rows`."""
  pairs, counts = encode_items(spec, items, encoder, window)
  packed = packing.pack([p.tokens for p in pairs], [p.scored for p in pairs], window, rows)
  return PackedChoices(items, counts, packed, sum(p.truncated for p in pairs))


def score_packed(
  packed: PackedChoices, rows: int, score: Callable[[dict[str, np.ndarray]], object]
) -> ChoiceScores:
  """Scores packed items through `score(batch) -> log-probabilities [rows, window]`.

  `score` may return device arrays: they are fetched together, after the last batch.
  """
  started = time.perf_counter()
  outs = [score(batch) for batch in packed.rows.batches(rows)]
  logprobs = np.concatenate([np.asarray(o) for o in jax.device_get(outs)])
  seconds = time.perf_counter() - started
  sums = packing.sums_of(packed.rows, logprobs)
  loglikelihoods = np.split(sums, np.cumsum(packed.counts)[:-1])
  right = right_norm = 0
  for item, ll in zip(packed.items, loglikelihoods):
    sizes = np.array([max(1, len(c.encode("utf-8"))) for c in item.choices], np.float64)
    right += int(np.argmax(ll)) == item.answer
    right_norm += int(np.argmax(ll / sizes)) == item.answer
  count, tokens = len(packed.items), packed.rows.tokens
  answers = [ll[item.answer] for item, ll in zip(packed.items, loglikelihoods)]
  metrics = {
    "acc": right / count,
    "acc_norm": right_norm / count,
    "answer_loglikelihood": float(np.mean(answers)),
    "items": float(count),
    "tokens": float(tokens),
    "rows": float(len(packed.rows.inputs)),
    "truncated": float(packed.truncated),
    "seconds": seconds,
    "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
  }
  return ChoiceScores(loglikelihoods, metrics)


def score_items(
  spec: EvalSpec,
  items: Sequence[ChoiceItem],
  encoder: TextEncoder,
  window: int,
  rows: int,
  score: Callable[[dict[str, np.ndarray]], object],
) -> ChoiceScores:
  """`pack_items` then `score_packed`: the whole eval of `items` in one call."""
  return score_packed(pack_items(spec, items, encoder, window, rows), rows, score)
