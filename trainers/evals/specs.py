"""`config.evals`: named eval tasks, their keys, defaults and checks.

Each entry of `config.evals` is a section whose name names its metrics
(`evals/<name>/acc`) and its output folder (`W/evals/<name>/`):

  config.evals.arc = ml_collections.ConfigDict(dict(
      kind="multiple_choice", path="arc_easy.jsonl", layout="arc"))
  config.evals.qa = ml_collections.ConfigDict(dict(
      kind="generation", path="qa.jsonl", max_new_tokens=32, stop=["\\n"]))

and any of its keys can be changed on the command line once the config
file has the entry: `--config.evals.arc.limit=100`. The keys:

  kind            "multiple_choice" or "generation" (required)
  path            the JSONL file, local or a URL (gs://...) (required)
  limit           the first N items only (0: all)
  batch           rows per forward pass (0: config.global_batch); a multiple
                  of the mesh's batch axes
  add_bos         a tokenizer's BOS before each context or prompt, as the run's
                  documents start (lm-eval's add_bos_token=True); bytes have none
  multiple_choice only:
    layout        "plain" ({"context", "choices", "answer"}), "hellaswag",
                  "arc" or "mmlu" (the datasets' own rows; items.py)
    delimiter     between the context and each choice (lm-eval's target_delimiter)
  generation only:
    max_new_tokens  tokens a completion makes at most (greedy)
    stop          strings that end a completion (it keeps the first it reaches)

Example:
  >>> import ml_collections
  >>> evals = ml_collections.ConfigDict({"qa": {"kind": "generation", "path": "README.md"}})
  >>> [(s.name, s.kind, s.max_new_tokens) for s in eval_specs(evals)]
  [('qa', 'generation', 32)]
  >>> eval_specs(ml_collections.ConfigDict({"qa": {"kind": "generate", "path": "README.md"}}))
  Traceback (most recent call last):
  ...
  spmd.errors.UserError: config.evals.qa.kind='generate' must be one of ('multiple_choice', 'generation')
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from spmd.errors import UserError, nearest
from trainers import paths

MULTIPLE_CHOICE, GENERATION = "multiple_choice", "generation"
KINDS = (MULTIPLE_CHOICE, GENERATION)
LAYOUTS = ("plain", "hellaswag", "arc", "mmlu")

_COMMON = {"kind": "", "path": "", "limit": 0, "batch": 0, "add_bos": True}
_OWN = {
  MULTIPLE_CHOICE: {"layout": "plain", "delimiter": " "},
  GENERATION: {"max_new_tokens": 32, "stop": ()},
}
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # a metric name's part and a folder's name


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """One entry of `config.evals`, checked, with its defaults filled in."""

  name: str
  kind: str
  path: str
  limit: int = 0
  batch: int = 0
  add_bos: bool = True
  layout: str = "plain"
  delimiter: str = " "
  max_new_tokens: int = 32
  stop: tuple[str, ...] = ()

  @property
  def where(self) -> str:
    """How errors name it: `config.evals.<name> (<path>)`."""
    return f"config.evals.{self.name} ({self.path})"


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _check_value(prefix: str, key: str, value: Any) -> None:
  if key in ("limit", "batch") and not (_is_int(value) and value >= 0):
    raise UserError(f"{prefix}.{key}={value!r} must be an integer >= 0")
  if key == "max_new_tokens" and not (_is_int(value) and value >= 1):
    raise UserError(f"{prefix}.{key}={value!r} must be an integer >= 1")
  if key == "add_bos" and not isinstance(value, bool):
    raise UserError(f"{prefix}.{key}={value!r} must be True or False")
  if key in ("path", "delimiter") and not isinstance(value, str):
    raise UserError(f"{prefix}.{key}={value!r} must be a string")
  if key == "layout" and value not in LAYOUTS:
    raise UserError(f"{prefix}.{key}={value!r} must be one of {LAYOUTS}")
  if key == "stop" and (
    isinstance(value, str)
    or not isinstance(value, list | tuple)
    or not all(isinstance(s, str) and s for s in value)
  ):
    raise UserError(f"{prefix}.{key}={value!r} must be a list of non-empty strings")


def eval_spec(name: str, entry: Mapping) -> EvalSpec:
  """The entry `config.evals.<name>`, checked (kind, keys, types, the file's presence).

  Raises:
    UserError: naming the entry and its key.
  """
  prefix = f"config.evals.{name}"
  if not _NAME.match(name):
    raise UserError(f"{prefix}: an eval's name is letters, digits, '_', '.' or '-'")
  if not isinstance(entry, Mapping) and not hasattr(entry, "to_dict"):
    raise UserError(f"{prefix}={entry!r} must be a section (ml_collections.ConfigDict)")
  entry = dict(entry.to_dict() if hasattr(entry, "to_dict") else entry)
  kind = entry.get("kind", "")
  if kind not in KINDS:
    raise UserError(f"{prefix}.kind={kind!r} must be one of {KINDS}")
  known = {**_COMMON, **_OWN[kind]}
  for key, value in entry.items():
    if key not in known:
      raise UserError(
        f"{prefix}.{key} is not a key of a {kind} eval{nearest(key, known)}; its keys: "
        f"{sorted(known)}"
      )
    _check_value(prefix, key, value)
  if not entry.get("path"):
    raise UserError(f"{prefix}.path is required: the eval's JSONL file")
  if not paths.user_path(entry["path"]).exists():
    raise UserError(f"{prefix}.path={entry['path']!r}: no such file")
  values = {**known, **entry}
  if "stop" in values:
    values["stop"] = tuple(values["stop"])
  return EvalSpec(name=name, **values)


def eval_specs(evals: Mapping | None) -> list[EvalSpec]:
  """Every entry of `config.evals`, by name (the same order on every host)."""
  if not evals:
    return []
  return [eval_spec(name, evals[name]) for name in sorted(evals.keys())]
