"""A Hugging Face `config.json` as our Llama's fields, and back.

Families read: Llama 2, 3 and 3.1 (`rope_scaling` of type `llama3`),
Mistral without a sliding window (`"sliding_window": null`: transformers
gives a Mistral config without the field a window of 4096), Qwen2
(biases on q/k/v), and the mixtures of experts Mixtral (every layer routed,
softmax gates renormalised over the top k) and Qwen2-MoE (q/k/v biases, a
shared expert with its sigmoid gate, `norm_topk_prob`, routed layers every
`decoder_sparse_step`). A field left out takes the value transformers gives it
(`FAMILY_DEFAULTS`). Both
spellings of RoPE's settings are read: `rope_theta` with `rope_scaling`
(transformers 4) and `rope_parameters` (transformers 5).

Every field is accounted for: a field the model implements becomes one of
ours; a field that only describes the file, the tokenizer or inference
(`KNOWN_INERT`) is checked or passed over; anything else, or a value the
model cannot follow (a sliding window, another `rope_scaling` type, a bias
on the output projection, ...), is an `UnsupportedConfig` naming it. An
unknown field is never ignored: it might change what the model computes.

Example:
  >>> fields = llama_fields({"model_type": "llama", "vocab_size": 96, "hidden_size": 64,
  ...   "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
  ...   "num_key_value_heads": 2, "rope_theta": 500000.0, "tie_word_embeddings": False})
  >>> fields["d_model"], fields["num_kv_heads"], fields["rope_theta"], fields["qkv_bias"]
  (64, 2, 500000.0, False)
  >>> llama_fields({"model_type": "llama", "sliding_window": 4096, "vocab_size": 8})
  Traceback (most recent call last):
  ...
  trainers.hf.model_config.UnsupportedConfig: config.json: sliding_window=4096 is not implemented by this Llama (full causal attention only)
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath

FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "mixtral": "MixtralForCausalLM",
  "qwen2_moe": "Qwen2MoeForCausalLM",
}
# Families with q/k/v biases: Qwen2's always, Qwen2-MoE's unless `qkv_bias` is false.
_BIASED = ("qwen2", "qwen2_moe")
# config.json fields that describe the files, the tokenizer or inference, not
# what the model computes.
KNOWN_INERT = frozenset(
  {
    "architectures",
    "model_type",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "max_position_embeddings",
    "_name_or_path",
    "tokenizer_class",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "max_window_layers",  # Qwen2's layers without the sliding window: no window here
    "attention_dropout",  # checked to be 0 below
    "pretraining_tp",  # checked to be 1 below
    "output_router_logits",  # whether the forward pass returns them, not what it computes
    "router_aux_loss_coef",  # a training weight: `moe_training_fields`
  }
)


# What transformers' config classes (LlamaConfig, MistralConfig, Qwen2Config)
# take for a field config.json leaves out, so a folder means here what it
# means there. num_key_value_heads None: num_attention_heads. Qwen2's
# sliding_window counts only under use_sliding_window, which defaults to false.
FAMILY_DEFAULTS = {
  "llama": {
    "vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "num_key_value_heads": None,
    "sliding_window": None,
    "max_position_embeddings": 2048,
  },
  "mistral": {
    "vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "max_position_embeddings": 4096 * 32,
  },
  "qwen2": {
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "num_key_value_heads": 32,
    "sliding_window": 4096,
    "max_position_embeddings": 32768,
  },
  "mixtral": {
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "num_key_value_heads": 8,
    "sliding_window": None,
    "max_position_embeddings": 4096 * 32,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001,
  },
  "qwen2_moe": {
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "num_key_value_heads": 16,
    "sliding_window": 4096,
    "max_position_embeddings": 32768,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "router_aux_loss_coef": 0.001,
  },
}
# config.json's fields of a routed MLP, read by `_moe` (and `moe_training_fields`).
_MOE_FIELDS = {
  "mixtral": {"num_local_experts", "num_experts_per_tok", "router_jitter_noise"},
  "qwen2_moe": {
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "qkv_bias",
  },
}
# Our fields that say how RoPE turns positions into angles (`_rope`'s).
ROPE_FIELDS = (
  "rope_theta",
  "rope_scaling",
  "rope_factor",
  "rope_low_freq_factor",
  "rope_high_freq_factor",
  "rope_original_length",
)


class UnsupportedConfig(ValueError):
  """A config.json field or value this Llama does not implement (named in the message)."""


def read_config(folder: str | epath.Path) -> dict[str, Any]:
  """`folder/config.json` as a dict; a missing file is a `FileNotFoundError` naming it."""
  path = epath.Path(folder) / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist: a Hugging Face model folder has a config.json")
  return json.loads(path.read_text())


def max_positions(hf: dict[str, Any]) -> int:
  """The context the folder's model was trained for: `max_position_embeddings`, or its family's default.

  Example:
    >>> max_positions({"model_type": "llama", "max_position_embeddings": 8192})
    8192
    >>> max_positions({"model_type": "qwen2"})
    32768
  """
  defaults = FAMILY_DEFAULTS.get(hf.get("model_type"), FAMILY_DEFAULTS["llama"])
  return int(hf.get("max_position_embeddings", defaults["max_position_embeddings"]))


def _unsupported(name: str, value: Any, why: str) -> UnsupportedConfig:
  return UnsupportedConfig(
    f"config.json: {name}={value!r} is not implemented by this Llama ({why})"
  )


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
  """Our rope_* fields from `rope_parameters`, or `rope_theta` and `rope_scaling`."""
  params = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
  merged = {**scaling, **params}
  kind = merged.pop("rope_type", merged.pop("type", "default"))
  fields: dict[str, Any] = {"rope_theta": float(theta)}
  if kind == "default" and not merged:
    return {**fields, "rope_scaling": "none"}
  if kind != "llama3":
    raise _unsupported("rope_scaling", {"rope_type": kind, **merged}, "types: default, llama3")
  names = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_length",
  }
  unknown = sorted(set(merged) - set(names))
  if unknown:
    raise _unsupported("rope_scaling", merged, f"llama3 fields are {sorted(names)}, not {unknown}")
  fields["rope_scaling"] = "llama3"
  for theirs, ours in names.items():
    if theirs not in merged:
      raise _unsupported("rope_scaling", merged, f"llama3 needs {theirs}")
    value = merged[theirs]
    fields[ours] = int(value) if ours == "rope_original_length" else float(value)
  return fields


def _moe(hf: dict[str, Any], family: str) -> dict[str, Any]:
  """Our moe_* fields: `moe_experts` 0 for a dense family, the routed MLP's for Mixtral and Qwen2-MoE."""
  defaults = FAMILY_DEFAULTS[family]

  def get(name: str) -> Any:
    return hf.get(name, defaults.get(name))

  if family == "mixtral":
    jitter = hf.get("router_jitter_noise", 0.0)
    if jitter:  # noise on the router's input in training: not implemented
      raise _unsupported("router_jitter_noise", jitter, "allowed: 0.0")
    return {
      "moe_experts": get("num_local_experts"),
      "moe_top_k": get("num_experts_per_tok"),
      # Mixtral's experts are intermediate_size wide; every layer is routed.
      "moe_d_ff": hf.get("intermediate_size"),
      "moe_every": 1,
      "moe_gate": "softmax",
      "moe_norm_topk": True,
      "moe_shared_d_ff": 0,
      "moe_shared_gate": True,
    }
  if family != "qwen2_moe":
    return {"moe_experts": 0}
  experts, step = get("num_experts"), get("decoder_sparse_step")
  if not experts:  # transformers builds every layer dense
    return {"moe_experts": 0}
  shared = get("shared_expert_intermediate_size")
  if not shared:
    raise _unsupported(
      "shared_expert_intermediate_size", shared, "Qwen2-MoE's shared expert must have a width > 0"
    )
  # HF's layer i is routed unless i is in mlp_only_layers, or (i + 1) % step != 0;
  # ours by the step alone: a listed layer the step leaves routed cannot be dense here.
  routed_listed = sorted(i for i in hf.get("mlp_only_layers") or () if (i + 1) % step == 0)
  if routed_listed:
    raise _unsupported(
      "mlp_only_layers",
      hf["mlp_only_layers"],
      f"dense layers only where decoder_sparse_step={step} makes them: layers "
      f"{routed_listed} would be routed (model.moe_every routes every moe_every-th layer)",
    )
  return {
    "moe_experts": experts,
    "moe_top_k": get("num_experts_per_tok"),
    "moe_d_ff": get("moe_intermediate_size"),
    "moe_every": step,
    "moe_gate": "softmax",
    "moe_norm_topk": bool(get("norm_topk_prob")),
    "moe_shared_d_ff": shared,
    "moe_shared_gate": True,
  }


def moe_training_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """The routed MLP's training weights a folder states: none for a dense family.

  transformers' load-balancing loss counts each token's k choices as k
  whole tokens, `num_experts_per_tok` times ours (`trainers.models.moe`), so
  `router_aux_loss_coef` becomes that many times our
  `moe_load_balancing_coef`: the same loss. Neither family has a z-loss.
  These are settings of the run, not of the model: the agreement check
  (`trainers.hf.agreement`) leaves them free.

  Example:
    >>> moe_training_fields({"model_type": "mixtral", "num_experts_per_tok": 2,
    ...                      "router_aux_loss_coef": 0.02})
    {'moe_load_balancing_coef': 0.04, 'moe_z_loss_coef': 0.0}
  """
  family = hf.get("model_type")
  if family not in _MOE_FIELDS:
    return {}
  defaults = FAMILY_DEFAULTS[family]
  coef = hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])
  top_k = hf.get("num_experts_per_tok", defaults["num_experts_per_tok"])
  return {"moe_load_balancing_coef": float(coef) * top_k, "moe_z_loss_coef": 0.0}


def llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
  """`trainers.models.llama.LlamaConfig`'s fields (sizes, RoPE, biases) that `hf` describes.

  Raises:
    UnsupportedConfig: a family, field or value the model does not implement.
  """
  family = hf.get("model_type")
  if family not in FAMILIES:
    raise _unsupported("model_type", family, f"families: {', '.join(FAMILIES)}")
  for name, allowed in (
    ("hidden_act", ("silu",)),
    ("attention_bias", (False,)),
    ("mlp_bias", (False,)),
    ("attention_dropout", (0, 0.0)),
    ("pretraining_tp", (1,)),
    ("use_sliding_window", (False,)),
  ):
    if name in hf and hf[name] not in allowed:
      raise _unsupported(name, hf[name], f"allowed: {allowed}")
  defaults = FAMILY_DEFAULTS[family]
  window = hf.get("sliding_window", defaults["sliding_window"])
  if window is not None and not (family in _BIASED and not hf.get("use_sliding_window")):
    raise _unsupported("sliding_window", window, "full causal attention only")
  layer_types = hf.get("layer_types")
  if layer_types is not None and set(layer_types) != {"full_attention"}:
    raise _unsupported("layer_types", sorted(set(layer_types)), "full_attention only")
  heads = hf["num_attention_heads"] if "num_attention_heads" in hf else None
  fields: dict[str, Any] = {
    # A family without a default leaves it None: named below with the missing sizes.
    "vocab_size": hf.get("vocab_size", defaults.get("vocab_size")),
    "d_model": hf.get("hidden_size"),
    "d_ff": hf.get("intermediate_size"),
    "num_layers": hf.get("num_hidden_layers"),
    "num_heads": heads,
    "num_kv_heads": hf.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads,
    "norm_eps": float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
    "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    "qkv_bias": family == "qwen2" or (family == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
    **_rope(hf),
    **_moe(hf, family),
  }
  head_dim = hf.get("head_dim")
  if head_dim is not None and heads and head_dim * heads != hf.get("hidden_size"):
    raise _unsupported(
      "head_dim",
      head_dim,
      f"head_dim * num_attention_heads must be hidden_size={hf['hidden_size']}",
    )
  consumed = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "head_dim",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "sliding_window",
    "layer_types",
    *_MOE_FIELDS.get(family, ()),
  }
  unknown = sorted(set(hf) - consumed - KNOWN_INERT)
  if unknown:
    raise UnsupportedConfig(
      f"config.json: fields {unknown} are not implemented by this Llama: an unknown field "
      "might change what the model computes, so it is not ignored"
    )
  missing = sorted(k for k, v in fields.items() if v is None)
  if missing:
    raise UnsupportedConfig(f"config.json lacks the sizes of {missing}")
  return fields


def hf_config(fields: dict[str, Any], dtype: str, base: dict[str, Any] | None = None) -> dict:
  """A config.json for a model with our Llama `fields`, its files in `dtype` ("bfloat16", ...).

  `base`: the config.json the weights were imported with, whose other
  fields (token ids, ...) are kept. `max_position_embeddings` is the base's,
  or the model's `seq_len` where that is longer (a run trained past the
  folder's context, `config.checkpoint.rope_override`), so that a reader
  takes the new positions.

  Example:
    >>> from trainers.models.llama import LlamaConfig
    >>> import dataclasses
    >>> out = hf_config(dataclasses.asdict(LlamaConfig()), "float32")
    >>> out["model_type"], out["num_key_value_heads"], out["rope_theta"]
    ('llama', 2, 10000.0)
    >>> llama_fields(out)["d_ff"]
    384
  """
  family = (base or {}).get("model_type") or _family_of(fields)
  out = dict(base or {})
  # Written afresh below in transformers 4's names, which 5 reads too; a
  # base's `dtype` (5's name) would otherwise contradict a chosen --dtype.
  for stale in ("rope_parameters", "rope_scaling", "dtype", "torch_dtype", "transformers_version"):
    out.pop(stale, None)
  out.update(
    {
      "architectures": [ARCHITECTURES[family]],
      "model_type": family,
      "vocab_size": fields["vocab_size"],
      "hidden_size": fields["d_model"],
      "intermediate_size": fields["d_ff"],
      "num_hidden_layers": fields["num_layers"],
      "num_attention_heads": fields["num_heads"],
      "num_key_value_heads": fields["num_kv_heads"],
      "head_dim": fields["d_model"] // fields["num_heads"],
      "rms_norm_eps": fields["norm_eps"],
      "tie_word_embeddings": fields["tie_embeddings"],
      "hidden_act": "silu",
      "rope_theta": fields["rope_theta"],
      "torch_dtype": dtype,
    }
  )
  seq_len = fields.get("seq_len", 2048)
  out["max_position_embeddings"] = max(max_positions(base), seq_len) if base else seq_len
  if family == "llama":
    out.setdefault("attention_bias", False)
    out.setdefault("mlp_bias", False)
  if fields["rope_scaling"] == "llama3":
    out["rope_scaling"] = {
      "rope_type": "llama3",
      "factor": fields["rope_factor"],
      "low_freq_factor": fields["rope_low_freq_factor"],
      "high_freq_factor": fields["rope_high_freq_factor"],
      "original_max_position_embeddings": fields["rope_original_length"],
    }
  if family == "qwen2" and not fields["qkv_bias"]:
    raise ValueError("a qwen2 config.json needs qkv_bias=True (Qwen2 has q/k/v biases)")
  if family not in _BIASED and fields["qkv_bias"]:
    raise ValueError(f"qkv_bias=True has no {family} config.json (Qwen2's has)")
  out.update(_moe_config(fields, family))
  return out


def _family_of(fields: dict[str, Any]) -> str:
  """The family a model with no source folder is written as."""
  if fields.get("moe_experts"):
    return "qwen2_moe" if fields["moe_shared_d_ff"] or fields["moe_every"] > 1 else "mixtral"
  return "qwen2" if fields["qkv_bias"] else "llama"


def _moe_config(fields: dict[str, Any], family: str) -> dict[str, Any]:
  """config.json's routed-MLP fields of `family`; a `ValueError` naming what it cannot say."""
  experts = fields.get("moe_experts", 0)
  if family not in _MOE_FIELDS:
    if experts:
      raise ValueError(
        f"model.moe_experts={experts}: a {family} config.json has no routed MLP "
        f"(routed Llamas are written as {' or '.join(_MOE_FIELDS)})"
      )
    return {}
  if family == "qwen2_moe" and not experts:
    return {"num_experts": 0}
  # What the family's config.json fixes: Mixtral routes every layer with
  # renormalised softmax gates and no shared expert; Qwen2-MoE has softmax
  # gates and a sigmoid-gated shared expert.
  fixed = {"moe_gate": "softmax", "moe_shared_gate": True}
  if family == "mixtral":
    fixed.update(moe_every=1, moe_shared_d_ff=0, moe_norm_topk=True)
  cannot = [f"{name}={fields[name]!r}" for name, value in fixed.items() if fields[name] != value]
  if family == "qwen2_moe" and not fields["moe_shared_d_ff"]:
    cannot.append("moe_shared_d_ff=0")  # Qwen2-MoE always has its shared expert
  if cannot:
    raise ValueError(
      f"a {family} config.json cannot describe {', '.join(cannot)} "
      f'(docs/finetune.md, "Mixtures of experts")'
    )
  top_k = fields["moe_top_k"]
  common = {
    "num_experts_per_tok": top_k,
    "router_aux_loss_coef": fields["moe_load_balancing_coef"] / top_k,  # moe_training_fields
  }
  if family == "mixtral":
    return {
      **common,
      "num_local_experts": experts,
      "intermediate_size": fields["moe_d_ff"] or fields["d_ff"],
    }
  return {
    **common,
    "num_experts": experts,
    "moe_intermediate_size": fields["moe_d_ff"] or fields["d_ff"],
    "shared_expert_intermediate_size": fields["moe_shared_d_ff"],
    "norm_topk_prob": fields["moe_norm_topk"],
    "decoder_sparse_step": fields["moe_every"],
    "mlp_only_layers": [],
    "qkv_bias": fields["qkv_bias"],
  }
