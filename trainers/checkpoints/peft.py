"""LoRA adapters in `peft`'s folder format: written from a run, read into one.

  spmd-export --format=peft --workdir=W [--out=DIR]

writes DIR (default `W/export/peft_step_<N>/`) as `peft`'s `save_pretrained` does:

  adapter_config.json        peft_type "LORA", task_type "CAUSAL_LM", r, lora_alpha,
                             lora_dropout, target_modules (q_proj, ..., down_proj), bias "none",
                             fan_in_fan_out false, use_rslora false, use_dora false,
                             base_model_name_or_path (the run's checkpoint.init_from)
  adapter_model.safetensors  float32, one A and one B per adapted weight and layer:
                             base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight [r, in]
                             base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight [out, r]

The names are the base weight's (`trainers.hf.layouts`, as `spmd-export
--format=safetensors` writes it) with `lora_A`/`lora_B` before `weight` and
`base_model.model.` in front. An HF weight is [out, in] with our input dims
flattened in order and our output dims likewise (`ours.reshape(in, out).T`,
for every weight of the Llama), so A [*in, r] is `lora_A` transposed and
B [r, *out] is `lora_B` transposed; the scale is peft's, `lora_alpha / r`.

The file carries `WRITTEN_BY` in its metadata, as the safetensors export's
do: a later export into the same folder replaces it, and an
`adapter_model.safetensors` that no export wrote is an error, never
overwritten.

`read_adapters(folder, adapters, scanned)` reads such a folder back into
our A and B (`config.lora.init_from`), after `read_config` has refused the
settings it cannot reproduce (rslora, DoRA, modules_to_save, rank or alpha
patterns, bias, ...) in one line naming them.

Example:
  >>> from trainers.models.lora import Adapter
  >>> query = Adapter(("blocks", "attn", "query"), (2, 64, 4, 16), ("layers", "embed", "heads", "kv"),
  ...                 stack=1, inputs=1, rank=4, scale=3.0)
  >>> [(t.name, t.shape) for t in plan([query])][:2]  # doctest: +NORMALIZE_WHITESPACE
  [('base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight', (4, 64)),
   ('base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight', (64, 4))]
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from trainers.hf.layouts import layout_for
from trainers.hf.safetensors_files import TensorFile
from trainers.models.lora import Adapter, LoRASettings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# What peft's LoraConfig writes with its defaults (peft 0.21); ours fill the rest.
_DEFAULTS: dict[str, Any] = {
  "alpha_pattern": {},
  "auto_mapping": None,
  "bias": "none",
  "exclude_modules": None,
  "fan_in_fan_out": False,
  "inference_mode": True,
  "init_lora_weights": True,
  "layer_replication": None,
  "layers_pattern": None,
  "layers_to_transform": None,
  "loftq_config": {},
  "lora_bias": False,
  "lora_dropout": 0.0,
  "megatron_config": None,
  "megatron_core": "megatron.core",
  "modules_to_save": None,
  "peft_type": "LORA",
  "rank_pattern": {},
  "revision": None,
  "target_parameters": None,
  "task_type": "CAUSAL_LM",
  "trainable_token_indices": None,
  "use_dora": False,
  "use_qalora": False,
  "use_rslora": False,
}
# Settings a folder may carry that change what the adapters compute: each must
# be as peft's plain LoRA has it, or the folder is refused (`read_config`).
_PLAIN = {
  "peft_type": "LORA",
  "bias": "none",
  "use_rslora": False,
  "use_dora": False,
  "fan_in_fan_out": False,
  "lora_bias": False,
  "use_qalora": False,
}
_EMPTY = (
  "modules_to_save",
  "rank_pattern",
  "alpha_pattern",
  "layers_to_transform",
  "layer_replication",
  "target_parameters",
  "trainable_token_indices",
)


@dataclasses.dataclass(frozen=True)
class PeftTensor:
  """One tensor of the adapter file: its name and shape, and the saved array (and layer) it is."""

  name: str
  source: tuple[str, ...]  # the adapter's A or B path in the parameters
  layer: int | None  # its index along the stack (scanned layers), or None: all of it
  shape: tuple[int, ...]
  adapter: Adapter
  is_a: bool


def _base_name(adapter: Adapter, layer: int | None) -> str:
  # Unrolled layers are `blocks/0/attn/query`, scanned ones `blocks/attn/query`.
  scanned = not (len(adapter.path) > 1 and adapter.path[1].isdigit())
  name = layout_for("/".join(adapter.path), scanned).hf_name(layer)
  if not name.endswith(".weight") or ".layers." not in name:
    raise ValueError(
      f"LoRA on {'/'.join(adapter.path)} ({name}): peft's format covers the layers' "
      "projections (q, k, v, o, gate, up, down), not this weight"
    )
  return PREFIX + name.removesuffix(".weight")


def module_name(adapter: Adapter) -> str:
  """peft's `target_modules` entry of an adapter: its weight's module, `q_proj`."""
  return _base_name(adapter, 0).rsplit(".", 1)[-1]


def plan(adapters: Sequence[Adapter]) -> list[PeftTensor]:
  """The adapter file's tensors, A then B of each layer of each adapter, in our parameters' order."""
  out = []
  for adapter in sorted(adapters, key=lambda a: a.path):
    n_in = math.prod(adapter.shape[adapter.stack : adapter.stack + adapter.inputs])
    n_out = math.prod(adapter.shape[adapter.stack + adapter.inputs :])
    layers = range(adapter.shape[0]) if adapter.stack else [None]
    for layer in layers:
      base = _base_name(adapter, layer)
      out.append(
        PeftTensor(
          base + ".lora_A.weight", adapter.a_path, layer, (adapter.rank, n_in), adapter, True
        )
      )
      out.append(
        PeftTensor(
          base + ".lora_B.weight", adapter.b_path, layer, (n_out, adapter.rank), adapter, False
        )
      )
  return out


def to_peft(tensor: PeftTensor, value: np.ndarray) -> np.ndarray:
  """One layer's A [*in, r] or B [r, *out] as peft stores it: [r, in] or [out, r], float32."""
  rank = tensor.adapter.rank
  flat = value.reshape(-1, rank) if tensor.is_a else value.reshape(rank, -1)
  return np.ascontiguousarray(flat.T, dtype=np.float32)


def from_peft(tensor: PeftTensor, value: np.ndarray) -> np.ndarray:
  """`to_peft`'s inverse: peft's [r, in] or [out, r] as one layer of our A or B."""
  adapter = tensor.adapter
  one = adapter.a_shape if tensor.is_a else adapter.b_shape
  return np.ascontiguousarray(value.T).reshape(one[adapter.stack :])


def adapter_config(
  settings: LoRASettings, adapters: Sequence[Adapter], base: str
) -> dict[str, Any]:
  """adapter_config.json's fields for these adapters (peft's defaults for the rest)."""
  alpha = float(settings.alpha)
  return {
    **_DEFAULTS,
    "base_model_name_or_path": base or None,
    "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
    "lora_dropout": float(settings.dropout),
    "r": settings.rank,
    "target_modules": sorted({module_name(a) for a in adapters}),
  }


def read_config(folder: str | epath.Path) -> dict[str, Any]:
  """The folder's adapter_config.json, or a `ValueError` naming the settings we do not implement.

  Example:
    >>> import tempfile
    >>> folder = epath.Path(tempfile.mkdtemp())
    >>> _ = (folder / CONFIG_FILE).write_text(json.dumps(
    ...   {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {"q": 8}}))
    >>> read_config(folder)
    Traceback (most recent call last):
    ...
    ValueError: ...: use_rslora=True, rank_pattern={'q': 8} are not implemented (plain LoRA only: ...)
  """
  path = epath.Path(folder) / CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(f"{folder} holds no {CONFIG_FILE}: not a peft adapter folder")
  config = json.loads(path.read_text())
  wrong = [f"{k}={config[k]!r}" for k, v in _PLAIN.items() if k in config and config[k] != v]
  wrong += [f"{k}={config[k]!r}" for k in _EMPTY if config.get(k)]
  if wrong:
    raise ValueError(
      f"{path}: {', '.join(wrong)} are not implemented (plain LoRA only: peft_type LORA, bias "
      "none, no rslora, DoRA, modules_to_save, rank or alpha patterns, or layer selections)"
    )
  return config


def check_folder(folder: str | epath.Path, adapters: Sequence[Adapter]) -> TensorFile:
  """The folder's adapter file, once its settings and tensors are found to be `adapters`'.

  Reads adapter_config.json and the file's header, no tensor.

  Raises:
    ValueError: the folder's settings are not implemented (`read_config`),
      its r, lora_alpha or lora_dropout differ from the adapters', or its tensors are not
      theirs (missing, extra or of another shape; all named).
    FileNotFoundError: no adapter_config.json or adapter_model.safetensors.
  """
  folder = epath.Path(folder)
  config = read_config(folder)
  if adapters:
    rank, alpha = adapters[0].rank, adapters[0].scale * adapters[0].rank
    dropout = adapters[0].dropout
    # peft's default lora_dropout is 0.0; a folder's dropout is part of the
    # recipe it was trained with, continued here as r and alpha are.
    theirs = float(config.get("lora_dropout") or 0.0)
    if (
      config.get("r") != rank
      or not math.isclose(float(config.get("lora_alpha", 0)), alpha)
      or not math.isclose(theirs, dropout)
    ):
      raise ValueError(
        f"{folder / CONFIG_FILE}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')}, "
        f"lora_dropout={theirs:g}, but config.lora has rank={rank}, alpha={alpha:g}, "
        f"dropout={dropout:g}: set them as the folder has them"
      )
  planned = plan(adapters)
  if not (folder / WEIGHTS_FILE).exists():
    raise FileNotFoundError(f"{folder} holds no {WEIGHTS_FILE}: not a peft adapter folder")
  stored = TensorFile(folder / WEIGHTS_FILE)
  names = set(stored.names())
  # Named by module (`q_proj`): a folder on other targets differs in every layer.
  missing = sorted({t.name.split(".")[-3] for t in planned if t.name not in names})
  extra = sorted({n.split(".")[-3] for n in names - {t.name for t in planned}})
  wrong = [
    f"{t.name} {stored.shape(t.name)} (ours {t.shape})"
    for t in planned
    if t.name in names and tuple(stored.shape(t.name)) != t.shape
  ]
  if missing or extra or wrong:
    parts = [
      f"{what}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
      for what, items in (
        ("config.lora.targets adapts, the folder does not", missing),
        ("the folder adapts, config.lora.targets does not", extra),
        ("other shapes", wrong),
      )
      if items
    ]
    raise ValueError(
      f"{folder / WEIGHTS_FILE} does not hold config.lora's adapters ({'; '.join(parts)})"
    )
  return stored


def read_adapters(
  folder: str | epath.Path, adapters: Sequence[Adapter]
) -> dict[tuple[str, ...], np.ndarray]:
  """Each adapter's A and B (by path, stacked over the layers, float32) from a peft folder.

  Raises:
    ValueError, FileNotFoundError: as `check_folder`.
  """
  stored = check_folder(folder, adapters)
  out: dict[tuple[str, ...], np.ndarray] = {}
  for adapter in adapters:
    for path, shape in ((adapter.a_path, adapter.a_shape), (adapter.b_path, adapter.b_shape)):
      out[path] = np.zeros(shape, np.float32)
  for t in plan(adapters):
    value = from_peft(t, stored.read(t.name).astype(np.float32))
    if t.layer is None:
      out[t.source][...] = value
    else:
      out[t.source][t.layer] = value
  return out


def initial_adapters(folder: str | epath.Path, adapters: Sequence[Adapter]) -> Any:
  """`restore_or_init`'s `initial_adapters`: the folder's A and B as global arrays on `target`.

  Every process reads the whole (small) adapter file and places its devices' slices.
  """

  def place(target: Any) -> Any:
    values = read_adapters(folder, adapters)

    def one(path, leaf):
      value = values[tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)]
      value = value.astype(leaf.dtype)
      return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: value[index])

    return jax.tree_util.tree_map_with_path(one, target)

  return place


def tensors(planned: Sequence[PeftTensor], read: Any) -> Iterator[np.ndarray]:
  """Each planned tensor from `read(source_path, layer)` (one layer's A or B), as peft stores it."""
  for t in planned:
    yield to_peft(t, read(t.source, t.layer))
