"""An eval's JSONL file as items: multiple-choice questions or prompts, in file order.

Multiple choice (`kind="multiple_choice"`), by `layout`, each as lm-eval's
task of that dataset builds its context and choices (lm-evaluation-harness,
`lm_eval/tasks/{hellaswag,arc,mmlu}`):

  plain      {"context": str, "choices": [str, ...], "answer": int}
  hellaswag  {"activity_label"?, "ctx_a", "ctx_b", "endings", "label"} (or "ctx"
             for ctx_a + ctx_b): context `preprocess(activity_label + ": " +
             ctx_a + " " + ctx_b.capitalize())`, choices `preprocess(ending)`;
             `preprocess` strips, turns " [title]" into ". ", drops other
             [bracketed] WikiHow artefacts and doubled spaces
  arc        {"question", "choices": {"text": [...], "label": [...]}, "answerKey"}:
             context "Question: <question>\\nAnswer:", the answer the index of
             answerKey among the labels
  mmlu       {"question", "choices": [...], "answer": int}: context the question
             (stripped), then "A. <choice>" a line each, then "Answer:"; the
             choices are the letters "A", "B", ...

Generation (`kind="generation"`): {"prompt": str, "answer"?: str}.

A row that is not JSON, lacks a field, or has an answer out of range is a
`UserError` naming the eval, the file and the row (1-based, as editors count).

Example:
  >>> hellaswag({"activity_label": "Roof", "ctx_a": "A man is on a roof.", "ctx_b": "he",
  ...            "endings": ["falls [title] off.", "sits."], "label": "1"})
  ChoiceItem(context='Roof: A man is on a roof. He', choices=('falls. off.', 'sits.'), answer=1)
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from spmd.errors import UserError
from trainers import paths
from trainers.evals import specs
from trainers.evals.specs import MULTIPLE_CHOICE, EvalSpec


@dataclasses.dataclass(frozen=True)
class ChoiceItem:
  """A multiple-choice question: the context, its choices, the right one's index."""

  context: str
  choices: tuple[str, ...]
  answer: int


@dataclasses.dataclass(frozen=True)
class PromptItem:
  """A prompt to complete, and the answer an exact match compares with (None: no score)."""

  prompt: str
  answer: str | None = None


class _RowError(ValueError):
  """What is wrong with one row; `read_items` names the eval, file and row."""


def _field(row: Mapping, name: str, kind: type | tuple[type, ...]) -> Any:
  if name not in row:
    raise _RowError(f"has no {name!r} field (its fields: {sorted(row)})")
  value = row[name]
  if not isinstance(value, kind) or isinstance(value, bool):
    wanted = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    raise _RowError(f"{name}={value!r} is a {type(value).__name__}, not a {wanted}")
  return value


def _strings(row: Mapping, name: str, value: Any) -> tuple[str, ...]:
  if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
    raise _RowError(f"{name}={value!r} must be a list of strings")
  return tuple(value)


def _index(value: Any, name: str) -> int:
  """An answer given as an int or a string of digits (HellaSwag's "label")."""
  if isinstance(value, str) and value.strip().isdigit():
    return int(value)
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  raise _RowError(f"{name}={value!r} is not an index")


def _choice_item(context: str, choices: tuple[str, ...], answer: int, answer_name: str):
  if len(choices) < 2:
    raise _RowError(f"has {len(choices)} choice(s); a question needs 2 or more")
  if not 0 <= answer < len(choices):
    raise _RowError(f"{answer_name}={answer} is out of range for its {len(choices)} choices")
  return ChoiceItem(context, choices, answer)


def plain(row: Mapping) -> ChoiceItem:
  """`{"context", "choices", "answer"}` as it is."""
  choices = _strings(row, "choices", _field(row, "choices", list))
  return _choice_item(_field(row, "context", str), choices, _field(row, "answer", int), "answer")


def _hellaswag_text(text: str) -> str:
  # As lm-eval's hellaswag/utils.py: the brackets are WikiHow artefacts.
  text = text.strip().replace(" [title]", ". ")
  text = re.sub(r"\[.*?\]", "", text)
  return text.replace("  ", " ")


def hellaswag(row: Mapping) -> ChoiceItem:
  """HellaSwag's row as lm-eval's `hellaswag` task reads it."""
  if "ctx_a" in row or "ctx" not in row:
    ctx = _field(row, "ctx_a", str) + " " + _field(row, "ctx_b", str).capitalize()
  else:
    ctx = _field(row, "ctx", str)
  label = row.get("activity_label")
  context = _hellaswag_text(f"{label}: {ctx}" if isinstance(label, str) and label else ctx)
  endings = _strings(row, "endings", _field(row, "endings", list))
  answer = _index(_field(row, "label", (int, str)), "label")
  return _choice_item(context, tuple(_hellaswag_text(e) for e in endings), answer, "label")


def arc(row: Mapping) -> ChoiceItem:
  """ARC's row as lm-eval's `arc_easy`/`arc_challenge` read it."""
  question = _field(row, "question", str)
  choices = _field(row, "choices", dict)
  texts = _strings(row, "choices.text", choices.get("text"))
  labels = _strings(row, "choices.label", choices.get("label"))
  if len(texts) != len(labels):
    raise _RowError(f"has {len(texts)} choices.text but {len(labels)} choices.label")
  key = _field(row, "answerKey", str)
  if key not in labels:
    raise _RowError(f"answerKey={key!r} is not one of its labels {list(labels)}")
  return _choice_item(f"Question: {question}\nAnswer:", texts, labels.index(key), "answerKey")


def mmlu(row: Mapping) -> ChoiceItem:
  """MMLU's row as lm-eval's `mmlu` tasks read it: the letters are the choices."""
  question = _field(row, "question", str)
  options = _strings(row, "choices", _field(row, "choices", list))
  if len(options) > 26:
    raise _RowError(f"has {len(options)} choices; letters run out after 26")
  letters = tuple(chr(ord("A") + i) for i in range(len(options)))
  lines = [question.strip(), *(f"{letter}. {text}" for letter, text in zip(letters, options))]
  context = "\n".join(lines) + "\nAnswer:"
  return _choice_item(context, letters, _field(row, "answer", int), "answer")


def prompt(row: Mapping) -> PromptItem:
  """A generation row: `{"prompt", "answer"?}`."""
  answer = row.get("answer")
  if answer is not None and not isinstance(answer, str):
    raise _RowError(f"answer={answer!r} is a {type(answer).__name__}, not a str")
  return PromptItem(_field(row, "prompt", str), answer)


LAYOUTS: dict[str, Callable[[Mapping], ChoiceItem]] = {
  "plain": plain,
  "hellaswag": hellaswag,
  "arc": arc,
  "mmlu": mmlu,
}
assert tuple(LAYOUTS) == specs.LAYOUTS  # the names config checks accept


def read_items(spec: EvalSpec) -> list[ChoiceItem] | list[PromptItem]:
  """The items of `spec.path` (its first `spec.limit`, when set), in file order.

  Blank lines are skipped.

  Raises:
    UserError: the file is missing or empty, or a row is bad (named with the eval, file and row).
  """
  convert = LAYOUTS[spec.layout] if spec.kind == MULTIPLE_CHOICE else prompt
  path = paths.user_path(spec.path)
  try:
    lines = path.read_text(encoding="utf-8").splitlines()
  except FileNotFoundError:
    raise UserError(f"{spec.where}: no such file") from None
  items = []
  for number, line in enumerate(lines, start=1):
    if spec.limit and len(items) >= spec.limit:
      break
    if not line.strip():
      continue
    try:
      row = json.loads(line)
      if not isinstance(row, dict):
        raise _RowError(f"is a JSON {type(row).__name__}, not an object")
      items.append(convert(row))
    except (ValueError, AttributeError) as e:  # _RowError, JSONDecodeError
      what = "is not JSON" if isinstance(e, json.JSONDecodeError) else str(e)
      raise UserError(
        f"{spec.where} row {number} ({spec.layout if spec.kind == MULTIPLE_CHOICE else spec.kind}"
        f" layout): {what}"
      ) from None
  if not items:
    raise UserError(f"{spec.where} has no items")
  return items
