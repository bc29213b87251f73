"""A Llama run's checkpoint as a Hugging Face model folder that `transformers` loads.

  spmd-export --format=safetensors --workdir=W [--out=DIR] [--dtype=bfloat16] [--max-shard-size=5GB]

writes DIR (default `W/export/hf_step_<N>/`):

  config.json          the model's fields in HF's names; a run imported from
                       a folder keeps that folder's other fields (token ids, ...)
  model.safetensors    or, above `--max-shard-size`, `model-0000k-of-0000n.safetensors`
                       shards and `model.safetensors.index.json`
  tokenizer files      the imported folder's (tokenizer.json, tokenizer_config.json,
                       special_tokens_map.json, generation_config.json), else the
                       run's own tokenizer.json

Tensors are written in `dtype`, by default the dtype of the files the run
was imported from (float32 for a run that was not): bf16 files imported into
float32 parameters come back bit for bit.

One process writes everything: the checkpoint's parameters are restored to
numpy on this host (`saved_run.restore_weights`, any saving mesh), so its
RAM holds the whole model in the checkpoint's dtype (4 bytes a parameter for
float32) plus one shard being written.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jax
import numpy as np
from etils import epath

from trainers import paths
from trainers.checkpoints import saved_run
from trainers.checkpoints.export import EXPORT_DIR
from trainers.hf import model_config
from trainers.hf.checkpoint import INDEX_FILE, SINGLE_FILE, Weights, is_hf_folder
from trainers.hf.layouts import layout_for
from trainers.hf.safetensors_files import write_file
from trainers.tasks import resolve_task_spec
from trainers.tasks.llama import llama_config

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default, "5GB"
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "generation_config.json",
)
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


def _key(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def hf_tensors(params: Any, dtype: np.dtype) -> dict[str, np.ndarray]:
  """Our Llama's parameters (a nested tree of arrays) as HF tensors in `dtype`, in HF's names."""
  flat = {_key(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  scanned = not any(k.split("/")[1:2] and k.split("/")[1].isdigit() for k in flat)
  tensors = {}
  for key, value in flat.items():
    layout = layout_for(key, scanned)
    if layout.per_layer:
      for i in range(value.shape[0]):
        tensors[layout.hf_name(i)] = layout.to_hf(value[i]).astype(dtype)
    else:
      tensors[layout.hf_name(None)] = layout.to_hf(value).astype(dtype)
  return tensors


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[list[str]]:
  """Tensor names grouped in order into files of at most `max_bytes` (a bigger tensor alone)."""
  groups: list[list[str]] = [[]]
  size = 0
  for name in sorted(tensors):
    nbytes = tensors[name].nbytes
    if groups[-1] and size + nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += nbytes
  return groups


def write_weights(folder: epath.Path, tensors: dict[str, np.ndarray], max_bytes: int) -> list[str]:
  """model.safetensors, or shards and their index above `max_bytes`; the files' names."""
  groups = _shards(tensors, max_bytes)
  if len(groups) == 1:
    write_file(folder / SINGLE_FILE, tensors)
    return [SINGLE_FILE]
  names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
  for name, group in zip(names, groups):
    write_file(folder / name, {t: tensors[t] for t in group})
  index = {
    "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
    "weight_map": {t: name for name, group in zip(names, groups) for t in group},
  }
  (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
  return [*names, INDEX_FILE]


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


def export(
  workdir: str,
  out: str | None = None,
  *,
  step: int | None = None,
  checkpoint: str = "",
  dtype: str | None = None,
  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> HFExport:
  """Writes the Llama run's checkpoint as a Hugging Face folder (see the module docstring).

  Raises:
    ValueError: the run is not a Llama, or `dtype` has no safetensors name.
    FileNotFoundError: no checkpoint or no such step.
  """
  config = saved_run.saved_config(workdir)
  if resolve_task_spec(config.task) != resolve_task_spec("llama"):
    raise ValueError(
      f"--format=safetensors writes Llama-family models; the run's task is {config.task!r}"
    )
  fields = dataclasses.asdict(llama_config(config))
  init_from = config.checkpoint.init_from
  source = (
    paths.user_path(init_from) if init_from and is_hf_folder(paths.user_path(init_from)) else None
  )
  dtype = dtype or _source_dtype(source)
  np_dtype = np.dtype(jax.numpy.dtype(dtype))
  ref = saved_run.find_checkpoint(workdir, checkpoint, step)
  params = saved_run.restore_weights(ref)["params"]  # numpy on this host: any saving mesh
  tensors = hf_tensors(params, np_dtype)
  del params
  folder = (
    paths.user_path(out) if out else paths.user_path(workdir) / EXPORT_DIR / f"hf_step_{ref.step}"
  )
  folder.mkdir(parents=True, exist_ok=True)
  files = write_weights(folder, tensors, max_shard_bytes)
  base = model_config.read_config(source) if source else None
  (folder / "config.json").write_text(
    json.dumps(model_config.hf_config(fields, np_dtype.name, base), indent=2) + "\n"
  )
  files.append("config.json")
  if source is not None:
    for name in TOKENIZER_FILES:
      if (source / name).exists():
        (folder / name).write_bytes((source / name).read_bytes())
        files.append(name)
  elif str(config.data.tokenizer).endswith(".json"):  # the run's own tokenizer file
    (folder / "tokenizer.json").write_bytes(paths.user_path(config.data.tokenizer).read_bytes())
    files.append("tokenizer.json")
  count = sum(t.size for t in tensors.values())
  return HFExport(folder, ref.step, np_dtype.name, files, count)
