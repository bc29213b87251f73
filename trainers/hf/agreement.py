"""Whether a model's fields agree with the Hugging Face folder it starts from; RoPE may differ on request.

A run that starts from a folder (`checkpoint.init_from`) must build the model
the folder's weights were trained as: each field config.json sets
(`model_config.llama_fields`) must equal the model's, and its `seq_len` must
not exceed the folder's `max_position_embeddings`. Otherwise the weights
would load into another model and train without a complaint.

One disagreement is a method, not an accident: training longer than the
folder was trained, with RoPE stretched for the new length (a larger
`rope_theta`, or Llama 3.1's `llama3` scaling). A run opts in by name,
`config.checkpoint.rope_override=True` (`OPT_IN`); then the RoPE fields
(`model_config.ROPE_FIELDS`) and `seq_len` may differ, and every other field
must still agree. Without it a RoPE change is refused like any other, and
the error says how to opt in.

Example:
  >>> hf = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64,
  ...   "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
  ...   "num_key_value_heads": 2, "rope_theta": 500000.0, "max_position_embeddings": 256}
  >>> fields = {**model_config.llama_fields(hf), "seq_len": 1024, "rope_theta": 2e6}
  >>> check_fields(fields, hf, "folder", rope_override=True)
  ['rope_theta 500000.0 -> 2000000.0', 'max positions 256 -> 1024']
  >>> check_fields(fields, hf, "folder")
  Traceback (most recent call last):
  ...
  ValueError: config.model disagrees with folder/config.json: rope_theta=2000000.0 but the folder's is 500000.0, seq_len=1024 but the folder's max_position_embeddings is 256 (configs/hf.py takes them from the folder); to train with other RoPE settings or longer than the folder was trained, set config.checkpoint.rope_override=True (docs/finetune.md)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainers.hf import model_config

OPT_IN = "config.checkpoint.rope_override"
# What may differ under OPT_IN: the RoPE fields and the training length.
OVERRIDABLE = frozenset({*model_config.ROPE_FIELDS, "seq_len"})
_BASE_ROPE = ("rope_theta", "rope_scaling")  # the rest are llama3's


def _disagreements(fields: Mapping[str, Any], hf: dict[str, Any]) -> dict[str, str]:
  """Each field of `fields` that the folder's config.json contradicts, by name, in words."""
  wrong = {
    name: f"{name}={fields[name]!r} but the folder's is {value!r}"
    for name, value in model_config.llama_fields(hf).items()
    if fields[name] != value
  }
  longest = model_config.max_positions(hf)
  if fields["seq_len"] > longest:
    wrong["seq_len"] = (
      f"seq_len={fields['seq_len']} but the folder's max_position_embeddings is {longest}"
    )
  return wrong


def _rope(fields: Mapping[str, Any]) -> dict[str, Any]:
  """The RoPE fields that count: the llama3 ones only with `rope_scaling="llama3"`."""
  llama3 = fields["rope_scaling"] == "llama3"
  return {name: fields[name] for name in (model_config.ROPE_FIELDS if llama3 else _BASE_ROPE)}


def _changed(fields: Mapping[str, Any], hf: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """The RoPE fields `fields` change of the folder's, by name: (the folder's or None, ours)."""
  theirs, ours = _rope(model_config.llama_fields(hf)), _rope(fields)
  return {
    name: (theirs.get(name), value) for name, value in ours.items() if theirs.get(name) != value
  }


def rope_changes(fields: Mapping[str, Any], hf: dict[str, Any]) -> list[str]:
  """What `fields` change of the folder's RoPE and context, as "name old -> new" (none: []).

  Example:
    >>> hf = {"model_type": "llama", "vocab_size": 8, "hidden_size": 64,
    ...   "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...   "max_position_embeddings": 64}
    >>> fields = {"rope_theta": 10000.0, "rope_scaling": "llama3", "rope_factor": 4.0,
    ...           "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
    ...           "rope_original_length": 64, "seq_len": 256}
    >>> rope_changes(fields, hf)  # doctest: +NORMALIZE_WHITESPACE
    ["rope_scaling 'none' -> 'llama3'", 'rope_factor unset -> 4.0',
     'rope_low_freq_factor unset -> 1.0', 'rope_high_freq_factor unset -> 4.0',
     'rope_original_length unset -> 64', 'max positions 64 -> 256']
  """
  changes = [
    f"{name} {'unset' if old is None else repr(old)} -> {new!r}"
    for name, (old, new) in _changed(fields, hf).items()
  ]
  longest = model_config.max_positions(hf)
  if fields["seq_len"] > longest:
    changes.append(f"max positions {longest} -> {fields['seq_len']}")
  return changes


def _check_llama3(fields: Mapping[str, Any], hf: dict[str, Any], where: str) -> None:
  """A llama3 scaling the run sets must stretch the folder's context to the run's longer one."""
  factor, original = fields["rope_factor"], fields["rope_original_length"]
  longest = model_config.max_positions(hf)
  if not factor > 1:
    raise ValueError(
      f"config.model.rope_factor={factor!r} must be > 1 to stretch {where}'s context with "
      "rope_scaling='llama3' (1 leaves RoPE as it was)"
    )
  if original > longest:
    raise ValueError(
      f"config.model.rope_original_length={original} is longer than {where}'s "
      f"max_position_embeddings={longest}: it is the context the model was trained for "
      f"(set config.model.rope_original_length={longest})"
    )
  if original > fields["seq_len"]:
    raise ValueError(
      f"config.model.rope_original_length={original} is longer than seq_len="
      f"{fields['seq_len']}: llama3 scaling stretches positions past the original length, "
      "which a shorter training length never reaches"
    )


def check_fields(
  fields: Mapping[str, Any], hf: dict[str, Any], where: str, rope_override: bool = False
) -> list[str]:
  """Raises `ValueError` naming each field the folder `where` contradicts; returns the RoPE changes.

  `fields`: the model's (`dataclasses.asdict(LlamaConfig)`), `hf` the
  folder's config.json. With `rope_override` the RoPE fields and a longer
  `seq_len` may differ (see the module docstring); what they change is
  returned for the run's log (`rope_changes`), after the checks a llama3
  scaling must pass (`rope_factor` > 1, `rope_original_length` at most the
  folder's context and the run's `seq_len`).
  """
  wrong = _disagreements(fields, hf)
  allowed = set(OVERRIDABLE) if rope_override else set()
  refused = [text for name, text in wrong.items() if name not in allowed]
  if refused:
    shown = ", ".join(refused[:5]) + (", ..." if len(refused) > 5 else "")
    if rope_override:
      hint = f"; {OPT_IN} lets only the RoPE fields and seq_len differ"
    elif set(wrong) & OVERRIDABLE:
      hint = (
        "; to train with other RoPE settings or longer than the folder was trained, "
        f"set {OPT_IN}=True (docs/finetune.md)"
      )
    else:
      hint = ""
    raise ValueError(
      f"config.model disagrees with {where}/config.json: {shown} (configs/hf.py takes them "
      f"from the folder){hint}"
    )
  if not rope_override:
    return []
  # A llama3 scaling the run sets or changes; the folder's own is not ours to judge.
  if fields["rope_scaling"] == "llama3" and set(_changed(fields, hf)) - {"rope_theta"}:
    _check_llama3(fields, hf, where)
  return rope_changes(fields, hf)
