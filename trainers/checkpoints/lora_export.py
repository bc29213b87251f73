"""A LoRA run's checkpoint out: its adapters as a peft folder, or merged into its base weights.

  spmd-export --format=peft --workdir=W [--out=DIR]
  spmd-export --format=safetensors --merge-lora --workdir=W [--out=DIR] [--dtype=D]

A LoRA checkpoint holds the adapters, not the frozen weights
(`trainers.checkpoints.lora_base`). `export_peft` writes the adapters alone in
peft's format (`trainers.checkpoints.peft`). `merged_weights` reads the
run's base (`checkpoint.init_from`, a Hugging Face folder) a tensor at a
time, adds `(alpha / rank) * A @ B` to each adapted weight in float32, and
serves the result as `SavedWeights` serves a checkpoint, so the safetensors
export (`trainers.checkpoints.hf_export`) writes it with its own guarantees
(its files marked, a previous export's removed, a block of layers at a time).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
from etils import epath
from flax import nnx

from trainers import paths
from trainers.checkpoints import peft, saved_run
from trainers.checkpoints.export import EXPORT_DIR
from trainers.checkpoints.hf_export import WRITTEN_BY, _written_by_us
from trainers.checkpoints.saved_arrays import SavedWeights
from trainers.hf import model_config
from trainers.hf.checkpoint import Weights, is_hf_folder, read_slice
from trainers.hf.layouts import layout_for
from trainers.hf.safetensors_files import write_streamed
from trainers.models import lora
from trainers.tasks import make_task, resolve_task_spec
from trainers.tasks.llama import llama_config


@dataclasses.dataclass(frozen=True)
class RunAdapters:
  """A LoRA run's adapters, from its saved config."""

  settings: lora.LoRASettings
  adapters: tuple[lora.Adapter, ...]
  scanned: bool
  base_shapes: dict[str, tuple[int, ...]]  # the base model's parameters (`blocks/attn/query`)


def run_adapters(config: Any, flag: str) -> RunAdapters:
  """The adapters of the run `config` describes; a `ValueError` for a run without any or not a Llama."""
  if resolve_task_spec(config.task) != resolve_task_spec("llama"):
    raise ValueError(f"{flag} writes Llama-family models; the run's task is {config.task!r}")
  settings = lora.settings_from_config(config.lora)
  if settings is None:
    raise ValueError(f"{flag}: the run trained no LoRA adapters (its config.lora.targets is empty)")
  task = make_task(config)
  plain = nnx.eval_shape(lambda: task.model(nnx.Rngs(0)))
  adapters = tuple(lora.find_adapters(plain, settings))
  flat = nnx.to_flat_state(nnx.state(plain, nnx.Param))
  shapes = {"/".join(map(str, k)): tuple(v.get_value().shape) for k, v in flat}
  return RunAdapters(settings, adapters, llama_config(config).scan_layers, shapes)


@dataclasses.dataclass(frozen=True)
class PeftExport:
  """What `export_peft` wrote."""

  folder: epath.Path
  step: int
  files: list[str]
  parameters: int


def export_peft(
  workdir: str, out: str | None = None, *, step: int | None = None, checkpoint: str = ""
) -> PeftExport:
  """Writes the LoRA run's adapters as a peft folder (`trainers.checkpoints.peft`).

  Raises:
    ValueError: the run trained no adapters or is not a Llama, or `out`
      holds an adapter_model.safetensors no export wrote.
    FileNotFoundError: no checkpoint or no such step.
  """
  config = saved_run.saved_config(workdir)
  run = run_adapters(config, "--format=peft")
  ref = saved_run.find_checkpoint(workdir, checkpoint, step)
  folder = (
    paths.user_path(out) if out else paths.user_path(workdir) / EXPORT_DIR / f"peft_step_{ref.step}"
  )
  folder.mkdir(parents=True, exist_ok=True)
  target = folder / peft.WEIGHTS_FILE
  if target.exists() and not _written_by_us(target):
    raise ValueError(f"{target} was not written by spmd-export: choose another --out, or remove it")
  saved = SavedWeights(ref)
  planned = peft.plan(run.adapters)

  def read(source: tuple[str, ...], layer: int | None) -> np.ndarray:
    name = "params/" + "/".join(source)
    return saved.read(name) if layer is None else saved.read(name, (slice(layer, layer + 1),))[0]

  entries = [(t.name, np.dtype(np.float32), t.shape) for t in planned]
  write_streamed(target, entries, peft.tensors(planned, read), metadata=WRITTEN_BY)
  settings = peft.adapter_config(run.settings, run.adapters, config.checkpoint.init_from)
  (folder / peft.CONFIG_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
  count = sum(math.prod(t.shape) for t in planned)
  return PeftExport(folder, ref.step, [peft.WEIGHTS_FILE, peft.CONFIG_FILE], count)


class MergedWeights:
  """The base folder's weights plus each adapter's `scale * A @ B`, read as `SavedWeights` reads.

  `arrays`: our base parameters (`params/blocks/attn/query`) -> (shape,
  float32). A read of a block of layers reads those layers' HF tensors and
  the adapters' A and B of them, nothing else.
  """

  def __init__(self, source: epath.Path, saved: SavedWeights, run: RunAdapters):
    self._weights = Weights(source)
    # It names a mixture's expert tensors (Mixtral's and Qwen2-MoE's differ).
    self._family = model_config.read_config(source).get("model_type")
    self._saved = saved
    self._run = run
    self._adapters = {"/".join(a.path): a for a in run.adapters}
    self.arrays = {
      f"params/{key}": (shape, np.dtype(np.float32)) for key, shape in run.base_shapes.items()
    }

  def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
    key = name.removeprefix("params/")
    shape = self.arrays[name][0]
    layout = layout_for(key, self._run.scanned, self._family)
    rows = index[:1] if layout.per_layer else ()  # the block's layers, of W and of A and B
    part = (*rows, *(slice(None),) * (len(shape) - len(rows)))
    value = read_slice(self._weights, layout, shape, part).astype(np.float32)
    adapter = self._adapters.get(key)
    if adapter is not None:
      a, b = (
        self._saved.read("params/" + "/".join(p), rows).astype(np.float32)
        for p in (adapter.a_path, adapter.b_path)
      )
      value = value + _delta(adapter, a, b)
    return value if layout.per_layer else value[index]


def _delta(adapter: lora.Adapter, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """`scale * A @ B` in W's shape (a block of its layers), float32, as `lora.Adapter.delta`."""
  stack = a.shape[: adapter.stack]
  n_in = math.prod(adapter.shape[adapter.stack : adapter.stack + adapter.inputs])
  outputs = adapter.shape[adapter.stack + adapter.inputs :]
  product = np.matmul(
    a.reshape(*stack, n_in, adapter.rank), b.reshape(*stack, adapter.rank, math.prod(outputs))
  )
  inputs = adapter.shape[adapter.stack : adapter.stack + adapter.inputs]
  return (np.float32(adapter.scale) * product).reshape(*stack, *inputs, *outputs)


def merged_weights(config: Any, ref: saved_run.CheckpointRef) -> MergedWeights:
  """The merged model of a LoRA run's checkpoint (see `MergedWeights`).

  Raises:
    ValueError: the run trained no adapters, or its base is not a Hugging Face folder.
  """
  run = run_adapters(config, "--merge-lora")
  init_from = config.checkpoint.init_from
  if not init_from or not is_hf_folder(paths.user_path(init_from)):
    raise ValueError(
      f"--merge-lora reads the base weights from the run's checkpoint.init_from, a Hugging Face "
      f"folder; this run's is {init_from!r}"
    )
  return MergedWeights(paths.user_path(init_from), SavedWeights(ref), run)
