"""A Hugging Face model folder's weights, read into our Llama's sharded parameters.

A folder (local or any `etils.epath` URL, e.g. `gs://`) holds `config.json`
and `model.safetensors`, or shards named by `model.safetensors.index.json`.
`read_params` builds each parameter as a global `jax.Array` with
`jax.make_array_from_callback`: every process reads, for each of its devices,
only that device's slice of the HF tensor (whole heads, by byte ranges), one
parameter at a time, and casts it to the parameter's dtype (bf16 files into
float32 parameters exactly). No host ever holds more than its devices' share
of one parameter besides the model it is building. A parameter stacked from
many HF tensors (the scanned layers; a routed MLP's experts, one tensor
each) opens only the tensors of the slice's layers and experts, each read
only in the slice's part, so any split of either axis over the mesh reads
no more than the devices hold.

Example:
  >>> import jax, numpy as np
  >>> from flax import nnx
  >>> from trainers.hf import model_config
  >>> from trainers.models.llama import Llama, LlamaConfig
  >>> folder = "tests/fixtures/hf/llama3"
  >>> config = LlamaConfig(**model_config.llama_fields(model_config.read_config(folder)))
  >>> abstract = nnx.state(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))), nnx.Param)
  >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  >>> target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), abstract)
  >>> params = read_params(folder, target)
  >>> params["blocks"]["attn"]["query"].shape, params["blocks"]["attn"]["query"].dtype
  ((2, 64, 4, 16), dtype('float32'))
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from etils import epath

from trainers.hf.layouts import TIED_OUTPUT, Layout, layout_for
from trainers.hf.safetensors_files import TensorFile

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exports carry that are computed, not learned.
COMPUTED_BUFFERS = ("rotary_emb.inv_freq",)
# transformers 5 holds a mixture's experts as these (its save_pretrained splits them).
FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def is_hf_folder(path: str | epath.Path) -> bool:
  """Whether `path` is a Hugging Face model folder (config.json and safetensors weights).

  >>> is_hf_folder("tests/fixtures/hf/qwen2"), is_hf_folder("tests")
  (True, False)
  """
  folder = epath.Path(path)
  return (folder / "config.json").exists() and (
    (folder / SINGLE_FILE).exists() or (folder / INDEX_FILE).exists()
  )


class Weights:
  """The tensors of a folder's safetensors files, one file or shards, opened on first use."""

  def __init__(self, folder: str | epath.Path):
    self.folder = epath.Path(folder)
    index = self.folder / INDEX_FILE
    if index.exists():
      self._where: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (self.folder / SINGLE_FILE).exists():
      self._where = {name: SINGLE_FILE for name in TensorFile(self.folder / SINGLE_FILE).names()}
    else:
      raise FileNotFoundError(f"{self.folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    self._files: dict[str, TensorFile] = {}

  def names(self) -> list[str]:
    return sorted(self._where)

  def file(self, name: str) -> TensorFile:
    shard = self._where[name]
    if shard not in self._files:
      self._files[shard] = TensorFile(self.folder / shard)
    return self._files[shard]

  def dtypes(self) -> set[str]:
    """The dtypes the folder's tensors are stored in (opens every shard's header)."""
    return {str(self.file(name).dtype(name)) for name in self.names()}


def _key(path) -> str:
  """ "blocks/attn/query": dict keys and list indices; a Variable's own `.value` left out."""
  parts = []
  for entry in path:
    if isinstance(entry, jax.tree_util.DictKey):
      parts.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.SequenceKey):
      parts.append(str(entry.idx))
  return "/".join(parts)


def _stack(layout: Layout, shape: tuple, index: tuple | None = None) -> list[tuple[int, ...]]:
  """Our indices along the layout's stacked axes (layers, experts) in `index`, each one HF tensor."""
  index = index or tuple(slice(None) for _ in shape)
  ranges = [range(*index[a].indices(shape[a])) for a in range(layout.stacked_axes)]
  return list(itertools.product(*ranges))


def _check_not_fused(weights: Weights, name: str, key: str) -> None:
  """A folder with the experts fused (`experts.gate_up_proj`, transformers 5's in-memory layout) says so."""
  fused = [n for n in weights.names() if n.endswith(FUSED_EXPERTS)]
  if fused:
    raise ValueError(
      f"{weights.folder}: tensor {name!r} (our {key}) is missing, and {fused[0]!r} holds the "
      "experts fused: only the per-expert layout of the Hub's folders is read (transformers' "
      "save_pretrained writes it)"
    )


def _check_shape(weights: Weights, layout: Layout, key: str, shape: tuple) -> list[str]:
  """The HF tensors of our `key`, each checked to be there with the shape ours needs."""
  ours = shape[layout.stacked_axes :]
  names = [layout.hf_name_at(stack) for stack in _stack(layout, shape)]
  for name in names:
    if name not in weights._where and layout.per_expert:
      _check_not_fused(weights, name, key)
    if name not in weights._where:
      raise ValueError(
        f"{weights.folder}: tensor {name!r} (our {key}) is missing: is the model config the "
        "checkpoint's (its config.json)?"
      )
    have, want = weights.file(name).shape(name), layout.hf_shape(ours)
    if have != want:
      raise ValueError(
        f"{weights.folder}: tensor {name!r} has shape {have}, but our {key} of shape "
        f"{shape} needs {want}: the model config disagrees with the checkpoint's config.json"
      )
  return names


def read_slice(weights: Weights, layout: Layout, shape: tuple, index: tuple) -> np.ndarray:
  """Our slice `index` (a slice per axis) of a parameter of `shape`, in the files' dtype.

  Only the HF tensors of the slice's layers and experts are opened, each read
  only in the slice's part (whole heads).
  """
  depth = layout.stacked_axes
  one, rest = shape[depth:], index[depth:]
  parts = []
  for stack in _stack(layout, shape, index):
    name = layout.hf_name_at(stack)
    part = weights.file(name).read(name, layout.hf_index(one, rest))
    parts.append(layout.to_ours(part, one, rest))
  if not depth:
    return parts[0]
  counts = tuple(len(range(*index[a].indices(shape[a]))) for a in range(depth))
  return np.stack(parts).reshape(*counts, *parts[0].shape)


def _slice_key(index: tuple, shape: tuple) -> tuple:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _reader(
  weights: Weights, layout: Layout, shape: tuple, dtype, sharding, counted: list[int]
) -> Callable:
  """`make_array_from_callback`'s callback: our slice `index`, read from the HF tensor(s).

  `counted[0]` grows by the bytes read from the files.
  """
  # Devices of one host that hold the same slice read it once; it is kept
  # only until the last of them has it, not for the whole parameter.
  uses = collections.Counter(
    _slice_key(index, shape) for index in sharding.addressable_devices_indices_map(shape).values()
  )
  done: dict[tuple, np.ndarray] = {}

  def read(index: tuple[slice, ...]) -> np.ndarray:
    key = _slice_key(index, shape)
    index = tuple(slice(*k) for k in key)
    if key not in done:
      value = read_slice(weights, layout, shape, index)
      counted[0] += value.nbytes
      done[key] = value.astype(dtype)
    uses[key] -= 1
    return done.pop(key) if uses[key] <= 0 else done[key]

  return read


def read_params(folder: str | epath.Path, target: Any) -> Any:
  """Our parameters from the HF folder, as global arrays shaped, typed and sharded as `target`.

  `target`: the parameter state (an `nnx.State` or nested dict) of
  `jax.ShapeDtypeStruct`s with shardings. Every process must call this.

  Raises:
    ValueError: a tensor is missing, has another shape than the model's, or
      the folder holds tensors the model has no place for (all named).
  """
  weights = Weights(folder)
  config = weights.folder / "config.json"
  family = json.loads(config.read_text()).get("model_type") if config.exists() else "llama"
  leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  keys = [_key(path) for path, _ in leaves]
  scanned = not any(k.split("/")[1:2] and k.split("/")[1].isdigit() for k in keys)
  used: set[str] = set()
  arrays = []
  counted = [0]
  for key, (_, leaf) in zip(keys, leaves):
    layout = layout_for(key, scanned, family)
    shape = tuple(leaf.shape)
    used.update(_check_shape(weights, layout, key, shape))
    arrays.append(
      jax.make_array_from_callback(
        shape, leaf.sharding, _reader(weights, layout, shape, leaf.dtype, leaf.sharding, counted)
      )
    )
  tied = "unembed" not in keys
  extra = [
    n
    for n in weights.names()
    if n not in used and not (tied and n == TIED_OUTPUT) and not n.endswith(COMPUTED_BUFFERS)
  ]
  if extra:
    raise ValueError(
      f"{weights.folder}: tensors {extra[:8]} have no place in the model (it has "
      f"{len(keys)} parameters): is the model config the checkpoint's (its config.json)?"
    )
  total = sum(weights.file(n).nbytes(n) for n in used)
  log.warning(
    "hf import: process %d read %.2f MiB of the %.2f MiB of %s (its devices' slices)",
    jax.process_index(),
    counted[0] / 2**20,
    total / 2**20,
    weights.folder,
  )
  return jax.tree_util.tree_unflatten(treedef, arrays)
