"""A Llama run's checkpoint as a Hugging Face model folder that `transformers` loads.

  spmd-export --format=safetensors --workdir=W [--out=DIR] [--dtype=bfloat16] [--max-shard-size=5GB]

writes DIR (default `W/export/hf_step_<N>/`):

  config.json          the model's fields in HF's names; a run imported from
                       a folder keeps that folder's other fields (token ids, ...)
  model.safetensors    or, above `--max-shard-size`, `model-0000k-of-0000n.safetensors`
                       shards and `model.safetensors.index.json`
  the folder's files   every other file of the folder the run was imported
                       from, as bytes (the tokenizer's files, chat_template.jinja,
                       tokenizer.model, generation_config.json, its LICENSE, ...),
                       except its weights, its index and its config.json; a run
                       not imported from a folder: its own tokenizer.json

An export into a folder that holds an earlier export's weights removes
them first (each weight file and the index carry `WRITTEN_BY` in their
metadata), so no stale index or model.safetensors is read in place of the
new one; weights that no export wrote are an error naming them, never
removed.

A routed Llama (`model.moe_experts`) is written as Mixtral or Qwen2-MoE,
its family's, with one tensor per expert (`...experts.{e}.w1.weight`): the
Hub's layout, which transformers 4 and 5 and vLLM read. What neither
family's config.json can describe is refused before anything is written.

Tensors are written in `dtype`, by default the dtype of the files the run
was imported from (float32 for a run that was not): bf16 files imported into
float32 parameters come back bit for bit.

One process writes everything, one tensor at a time: the checkpoint's
arrays are read by index ranges (`saved_arrays.SavedWeights`), a weight of
the scanned layers in blocks of layers of at most `read_block_bytes` (1 GiB;
at least one layer), and each HF tensor is written as soon as it is made
(`safetensors_files.write_streamed`). What it holds at once: one block, one
HF tensor in the export's dtype, and the saved chunks a read touches, twice
(as read and decoded). A chunk is one device's shard of one weight as the
run saved it, and for scanned layers it spans all of them: a run saved from
one device has each weight's whole stack as one chunk (for llama3_8b in
float32 the MLP's, 7.5 GB of the model's 32 GB), one saved with FSDP over
N devices a 1/N of it. The cost in time: a read decodes the whole chunks
it touches, so a weight bigger than a block is decoded once per block.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from etils import epath

from trainers import paths
from trainers.checkpoints import saved_run
from trainers.checkpoints.export import EXPORT_DIR, flatten
from trainers.checkpoints.saved_arrays import SavedWeights
from trainers.hf import model_config
from trainers.hf.checkpoint import INDEX_FILE, SINGLE_FILE, Weights, is_hf_folder
from trainers.hf.layouts import Layout, layout_for
from trainers.hf.safetensors_files import TensorFile, write_streamed
from trainers.tasks import resolve_task_spec
from trainers.tasks.llama import llama_config

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default, "5GB"
EXPORT_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes `--dtype` takes: the floating formats transformers loads weights in."""
# A source folder's files that hold weights (any framework's) or describe
# them: the export writes its own, so these are not carried over.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_UNITS = {
  "": 1,
  "B": 1,
  "KB": 10**3,
  "MB": 10**6,
  "GB": 10**9,
  "KIB": 2**10,
  "MIB": 2**20,
  "GIB": 2**30,
}


def parse_size(text: str) -> int:
  """Bytes of "5GB", "200MB", "1GiB" or a plain number.

  >>> parse_size("5GB"), parse_size("2KiB"), parse_size("100")
  (5000000000, 2048, 100)
  """
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
  if not match:
    raise ValueError(f"size={text!r} must be a number of bytes, e.g. 5GB, 200MB or 1GiB")
  return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


DEFAULT_READ_BLOCK_BYTES = 2**30
# Every weight file and index the export writes carries this in its metadata,
# so that a later export into the same folder knows them for its own.
WRITTEN_BY = {"written_by": "spmd-export"}
# The names transformers reads weights from: what an export must leave consistent.
_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors")


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
  """One HF tensor of the export: its name and shape, and the saved array (and layer) it comes from."""

  name: str
  source: str  # the saved array, `params/blocks/mlp/gate`
  layer: int | None  # its index along the source's first axis (scanned layers), or None: all of it
  layout: Layout
  shape: tuple[int, ...]
  expert: int | None = None  # a routed MLP's: its expert, along the axis after the layers'

  def piece(self, value: np.ndarray) -> np.ndarray:
    """This tensor from one layer's (or an unscanned parameter's) value: its expert's, if any."""
    return self.layout.to_hf(value if self.expert is None else value[self.expert])


class InMemoryWeights:
  """Parameters already in memory (a nested dict of arrays) read as `SavedWeights` reads a checkpoint.

  >>> weights = InMemoryWeights({"final_norm": {"scale": np.ones(4, np.float32)}})
  >>> weights.arrays, weights.read("params/final_norm/scale").tolist()
  ({'params/final_norm/scale': ((4,), dtype('float32'))}, [1.0, 1.0, 1.0, 1.0])
  """

  def __init__(self, params: Any):
    self._values = {f"params/{name}": np.asarray(v) for name, v in flatten(params).items()}
    self.arrays = {name: (v.shape, v.dtype) for name, v in self._values.items()}

  def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
    return self._values[name][index]


def hf_tensors(params: Any, dtype: np.dtype, family: str = "llama") -> dict[str, np.ndarray]:
  """Our Llama's parameters (a nested tree of arrays) as HF tensors in `dtype`, in `family`'s names."""
  weights = InMemoryWeights(params)
  planned = plan_tensors(weights.arrays, family)
  tensors = _tensors(weights, planned, np.dtype(dtype), DEFAULT_READ_BLOCK_BYTES)
  return {t.name: np.array(value) for t, value in zip(planned, tensors)}


def plan_tensors(
  arrays: dict[str, tuple[tuple[int, ...], np.dtype]], family: str = "llama"
) -> list[PlannedTensor]:
  """The HF tensors of our Llama's saved parameters, in the order they are read: array by array.

  `arrays`: saved name (`params/...`) -> (shape, dtype), `SavedWeights.arrays`;
  `family`: the config.json's `model_type`, which names a routed MLP's
  tensors (one per expert: the Hub's layout, `trainers.hf.layouts`).
  """
  params = {n.removeprefix("params/"): s for n, (s, _) in arrays.items() if n.startswith("params/")}
  scanned = not any(k.split("/")[1:2] and k.split("/")[1].isdigit() for k in params)
  planned = []
  for key in sorted(params):
    layout, shape = layout_for(key, scanned, family), params[key]
    hf_shape = layout.hf_shape(shape[layout.stacked_axes :])
    layers = range(shape[0]) if layout.per_layer else [None]
    experts = range(shape[int(layout.per_layer)]) if layout.per_expert else [None]
    for layer in layers:  # a layer's experts one after another: read a block of layers at once
      for expert in experts:
        name = layout.hf_name(layer, expert)
        planned.append(PlannedTensor(name, f"params/{key}", layer, layout, hf_shape, expert))
  return planned


def _tensors(
  saved: SavedWeights | InMemoryWeights,
  planned: list[PlannedTensor],
  dtype: np.dtype,
  block_bytes: int,
) -> Iterator[np.ndarray]:
  """Each planned tensor in `dtype`, in order: a scanned weight read in blocks of its layers."""
  i = 0
  while i < len(planned):
    first = planned[i]
    if first.layer is None:  # the whole parameter (all its experts) at once
      value = saved.read(first.source)
      while i < len(planned) and planned[i].source == first.source:
        yield planned[i].piece(value).astype(dtype, copy=False)
        i += 1
      continue
    shape, saved_dtype = saved.arrays[first.source]
    layer_bytes = math.prod(shape[1:]) * saved_dtype.itemsize
    count = min(max(1, block_bytes // max(layer_bytes, 1)), shape[0] - first.layer)
    block = saved.read(first.source, (slice(first.layer, first.layer + count),))
    # The plan lists a weight's layers (and each layer's experts) one after another.
    while (
      i < len(planned)
      and planned[i].source == first.source
      and planned[i].layer < first.layer + count
    ):
      yield planned[i].piece(block[planned[i].layer - first.layer]).astype(dtype, copy=False)
      i += 1
    del block


def _shards(planned: list[PlannedTensor], itemsize: int, max_bytes: int) -> list[list[int]]:
  """The plan's positions grouped in order into files of at most `max_bytes` (a bigger tensor alone)."""
  groups: list[list[int]] = [[]]
  size = 0
  for k, tensor in enumerate(planned):
    nbytes = math.prod(tensor.shape) * itemsize
    if groups[-1] and size + nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(k)
    size += nbytes
  return groups


def _written_by_us(path: epath.Path) -> bool:
  """Whether the weight file or index at `path` carries `WRITTEN_BY` (an unreadable one does not)."""
  try:
    if path.name == INDEX_FILE:
      metadata = json.loads(path.read_text()).get("metadata") or {}
    else:
      metadata = TensorFile(path).metadata
  except (ValueError, OSError, struct.error, AttributeError):
    return False
  return all(metadata.get(k) == v for k, v in WRITTEN_BY.items())


def clear_previous_export(folder: epath.Path) -> list[str]:
  """Removes the weight files and index an earlier export left in `folder`; their names.

  The names transformers reads weights from (model.safetensors,
  model-0000k-of-0000n.safetensors, the index) are checked first: one that
  an export did not write (no `WRITTEN_BY` in its metadata) is an error
  naming it, and nothing is removed. The index goes first, so that an
  interrupted clear never leaves an index naming missing shards.

  Raises:
    ValueError: `folder` holds weights that no export wrote.
  """
  found = sorted(
    p for p in folder.iterdir() if p.name == INDEX_FILE or _WEIGHT_FILE.fullmatch(p.name)
  )
  foreign = [p.name for p in found if not _written_by_us(p)]
  if foreign:
    raise ValueError(
      f"{folder} holds {', '.join(map(repr, foreign))}, not written by spmd-export: transformers "
      "would read them beside the export's; choose another --out, or remove them"
    )
  for path in sorted(found, key=lambda p: p.name != INDEX_FILE):
    path.unlink()
  return [p.name for p in found]


def write_weights(
  folder: epath.Path,
  saved: SavedWeights | InMemoryWeights,
  dtype: np.dtype,
  max_bytes: int,
  read_block_bytes: int = DEFAULT_READ_BLOCK_BYTES,
  family: str = "llama",
) -> tuple[list[str], int]:
  """model.safetensors, or shards and their index above `max_bytes`: the files' names, the parameter count.

  A previous export's weights in `folder` are removed first (`clear_previous_export`).
  """
  folder = epath.Path(folder)
  clear_previous_export(folder)
  planned = plan_tensors(saved.arrays, family)
  groups = _shards(planned, dtype.itemsize, max_bytes)
  tensors = _tensors(saved, planned, dtype, read_block_bytes)
  names = (
    [SINGLE_FILE]
    if len(groups) == 1
    else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
  )
  for name, group in zip(names, groups):
    entries = [(planned[k].name, dtype, planned[k].shape) for k in group]
    write_streamed(folder / name, entries, tensors, metadata=WRITTEN_BY)
  count = sum(math.prod(t.shape) for t in planned)
  if len(groups) == 1:
    return names, count
  index = {
    "metadata": {"total_size": count * dtype.itemsize, **WRITTEN_BY},
    "weight_map": {planned[k].name: name for name, group in zip(names, groups) for k in group},
  }
  (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
  return [*names, INDEX_FILE], count


@dataclasses.dataclass(frozen=True)
class HFExport:
  """What `export` wrote."""

  folder: epath.Path
  step: int
  dtype: str
  files: list[str]
  parameters: int


def _source_dtype(source: epath.Path | None) -> str:
  if source is None:
    return "float32"
  dtypes = Weights(source).dtypes()
  return dtypes.pop() if len(dtypes) == 1 else "float32"


def carried_files(source: epath.Path) -> list[str]:
  """The files of `source` an export copies: all but hidden ones, weights, indexes and config.json.

  >>> carried_files(epath.Path("tests/fixtures/hf/llama3"))  # no model.safetensors, no config.json
  ['generation_config.json', 'golden_choices.json', 'golden_logits.npy', 'golden_tokens.npy', 'tokenizer.json']
  """
  return sorted(
    p.name
    for p in source.iterdir()
    if p.is_file()
    and not p.name.startswith(".")
    and p.name != "config.json"
    and not p.name.endswith((*_WEIGHT_SUFFIXES, ".index.json"))
  )


def export(
  workdir: str,
  out: str | None = None,
  *,
  step: int | None = None,
  checkpoint: str = "",
  dtype: str | None = None,
  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
  read_block_bytes: int = DEFAULT_READ_BLOCK_BYTES,
  weights_of: Callable[[Any, saved_run.CheckpointRef], Any] | None = None,
) -> HFExport:
  """Writes the Llama run's checkpoint as a Hugging Face folder (see the module docstring).

  `weights_of(config, ref)`: what to write in place of the checkpoint's
  saved weights, read as `SavedWeights` reads (a LoRA run's merged model,
  `trainers.checkpoints.lora_export.merged_weights`).

  Raises:
    ValueError: the run is not a Llama, a routed one is not one Mixtral's or
      Qwen2-MoE's config.json can describe, `dtype` is not one of
      `EXPORT_DTYPES`, or `out` holds weights no export wrote.
    FileNotFoundError: no checkpoint or no such step.
  """
  if dtype is not None and dtype not in EXPORT_DTYPES:
    raise ValueError(f"--dtype={dtype!r} must be one of {', '.join(EXPORT_DTYPES)}")
  config = saved_run.saved_config(workdir)
  if resolve_task_spec(config.task) != resolve_task_spec("llama"):
    raise ValueError(
      f"--format=safetensors writes Llama-family models; the run's task is {config.task!r}"
    )
  if weights_of is None and config.get("lora") and config.lora.targets:
    raise ValueError(
      "the run trained LoRA adapters (config.lora): --format=peft writes them as a peft "
      "folder, --merge-lora the model with them merged into its base weights"
    )
  fields = dataclasses.asdict(llama_config(config))
  init_from = config.checkpoint.init_from
  source = (
    paths.user_path(init_from) if init_from and is_hf_folder(paths.user_path(init_from)) else None
  )
  dtype = dtype or _source_dtype(source)
  np_dtype = np.dtype(jax.numpy.dtype(dtype))
  base = model_config.read_config(source) if source else None
  # Before the checkpoint is read or a file written: a routed model no
  # family's config.json can describe is refused with nothing left behind.
  hf = model_config.hf_config(fields, np_dtype.name, base)
  ref = saved_run.find_checkpoint(workdir, checkpoint, step)
  # Read a block at a time, whatever mesh saved it.
  saved = SavedWeights(ref) if weights_of is None else weights_of(config, ref)
  folder = (
    paths.user_path(out) if out else paths.user_path(workdir) / EXPORT_DIR / f"hf_step_{ref.step}"
  )
  folder.mkdir(parents=True, exist_ok=True)
  files, count = write_weights(
    folder, saved, np_dtype, max_shard_bytes, read_block_bytes, hf["model_type"]
  )
  (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  files.append("config.json")
  if source is not None:
    for name in carried_files(source):
      (folder / name).write_bytes((source / name).read_bytes())
      files.append(name)
  elif str(config.data.tokenizer).endswith(".json"):  # the run's own tokenizer file
    (folder / "tokenizer.json").write_bytes(paths.user_path(config.data.tokenizer).read_bytes())
    files.append("tokenizer.json")
  return HFExport(folder, ref.step, np_dtype.name, files, count)
