"""A run's trained weights as one plain-array file, usable with no mesh.

  spmd-export --workdir=W [--step=N] [--checkpoint=DIR] [--out=FILE]

(trainers/checkpoints/export_cli.py) calls `export`, which writes
`W/export/params_step_<N>.npz` (or `--out`): one array per parameter,
keyed by its path joined with '/' and prefixed with `params/` (and
`model_state/...` for models with batch statistics or other variables), plus
`__meta__`, a JSON string with the step, the checkpoint and the run's
resolved config. Plain numpy: read with `np.load(path, allow_pickle=False)`,
no pickle, no JAX needed. Arrays in dtypes numpy's format cannot name
(bfloat16) are stored as float32; `build_model` casts them back.

Any checkpoint works, whatever mesh and process count saved it: the arrays
are read with orbax's numpy restore on this one host (a plain orbax restore
without a target fails with "Sharding of jax.Array cannot be None", as the
trainer does not store shardings), and the optimizer state is never read.

Then, in any Python process (one CPU device, no `jax.distributed`):

  >>> from trainers.checkpoints import export
  >>> params = export.load_params("W/export/params_step_200.npz")  # doctest: +SKIP
  >>> params["token_embed"].shape  # doctest: +SKIP
  (256, 128)
  >>> model = export.load_model("W/export/params_step_200.npz")  # doctest: +SKIP
  >>> logits = model(tokens)  # [batch, seq] int32 -> [batch, seq, vocab]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

from spmd.mesh import parse_axes
from trainers import paths
from trainers.checkpoints import saved_run
from trainers.step.state import build_model as merge_model
from trainers.step.state import make_state
from trainers.tasks import make_task

META_KEY = "__meta__"
EXPORT_DIR = "export"
_NATIVE_KINDS = "biufc"  # numpy's own dtypes; others (ml_dtypes' bfloat16) are stored as float32


def _key_name(key: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def flatten(tree: Any) -> dict[str, Any]:
  """`{"a/b/c": leaf}` for a nested tree (dicts, lists, `nnx.State`).

  Example:
    >>> flatten({"blocks": [{"w": 1}], "b": 2})
    {'b': 2, 'blocks/0/w': 1}
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  """The nested dict of `flatten`'s keys; all-digit parts become ints (list indices, as NNX's).

  Example:
    >>> unflatten({"b": 2, "blocks/0/w": 1})
    {'b': 2, 'blocks': {0: {'w': 1}}}
  """
  out: dict[Any, Any] = {}
  for key, value in flat.items():
    parts = [int(p) if p.isdigit() else p for p in key.split("/")]
    node = out
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = value
  return out


@dataclasses.dataclass
class Exported:
  """What an export file holds."""

  params: dict[str, Any]  # nested, numpy arrays
  model_state: dict[str, Any] | None  # nested, numpy arrays; None if the model has none
  step: int
  checkpoint: str  # the step directory it came from
  config_json: str  # the run's resolved config ("" when the run had none saved)


def export(
  workdir: str, out: str | None = None, *, step: int | None = None, checkpoint: str = ""
) -> epath.Path:
  """Writes a checkpoint's parameters (and model state) to one `.npz` file; returns its path.

  Args:
    workdir: the run's workdir (its `checkpoints/` and `config.json`).
    out: the file to write; default `<workdir>/export/params_step_<N>.npz`.
    step: the checkpoint step; None: the latest committed one.
    checkpoint: read this checkpoint location instead (another run's
      workdir, its checkpoint directory, or one step's directory).

  Raises:
    FileNotFoundError: no checkpoint or no such step (names the committed steps).
    CheckpointError: the step is unfinished or damaged.
  """
  ref = saved_run.find_checkpoint(workdir, checkpoint, step)
  weights = saved_run.restore_weights(ref)  # numpy, on this host: any saving mesh
  arrays: dict[str, np.ndarray] = {}
  stored_as: dict[str, str] = {}
  for section, tree in weights.items():
    for key, value in flatten(tree).items():
      value = np.asarray(value)
      name = f"{section}/{key}"
      if value.dtype.kind not in _NATIVE_KINDS:
        stored_as[name] = str(value.dtype)
        value = value.astype(np.float32)
      arrays[name] = value
  config_path = paths.user_path(workdir) / saved_run.CONFIG_FILE
  meta = {
    "step": ref.step,
    "checkpoint": str(ref.path),
    "saved_dtypes": stored_as,  # arrays stored as float32, and their dtype in the checkpoint
    "config": config_path.read_text() if config_path.exists() else "",
  }
  arrays[META_KEY] = np.array(json.dumps(meta))  # a unicode array: no pickle to read it
  target = (
    paths.user_path(out)
    if out
    else (paths.user_path(workdir) / EXPORT_DIR / f"params_step_{ref.step}.npz")
  )
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  target.parent.mkdir(parents=True, exist_ok=True)
  target.write_bytes(buffer.getvalue())  # local or a URL alike
  return target


def load_export(path: str) -> Exported:
  """Reads an export file (plain numpy, `allow_pickle=False`)."""
  with np.load(io.BytesIO(paths.user_path(path).read_bytes()), allow_pickle=False) as data:
    if META_KEY not in data.files:
      raise ValueError(f"{path!r} is not an spmd-export file: it has no {META_KEY!r} entry")
    meta = json.loads(str(data[META_KEY]))
    sections: dict[str, dict[str, np.ndarray]] = {}
    for name in data.files:
      if name != META_KEY:
        section, _, key = name.partition("/")
        sections.setdefault(section, {})[key] = data[name]
  if "params" not in sections:
    raise ValueError(f"{path!r} holds no parameters (entries: {sorted(sections)})")
  model_state = sections.get("model_state")
  return Exported(
    params=unflatten(sections["params"]),
    model_state=unflatten(model_state) if model_state else None,
    step=int(meta["step"]),
    checkpoint=meta["checkpoint"],
    config_json=meta.get("config", ""),
  )


def load_params(path: str) -> dict[str, Any]:
  """An export file's parameters: a nested dict of numpy arrays (list indices as ints).

  Example:
    >>> params = load_params("W/export/params_step_200.npz")  # doctest: +SKIP
    >>> sorted(params)[:2]  # doctest: +SKIP
    ['blocks', 'final_norm']
  """
  return load_export(path).params


def _single_device_mesh(config: ml_collections.ConfigDict) -> jax.sharding.Mesh:
  """The config's mesh axes, each of size 1, on this host's first CPU device."""
  names = list(
    dict.fromkeys(n for n, _ in parse_axes(config.mesh.ici) + parse_axes(config.mesh.dcn or None))
  )
  device = jax.devices("cpu")[0]
  return jax.sharding.Mesh(np.array([device]).reshape((1,) * len(names)), tuple(names))


def _matched(what: str, given: Mapping[str, Any], abstract: Any, shardings: Any) -> Any:
  """`given` (flat or nested) as arrays shaped like `abstract`, on `shardings`; checked."""
  want = flatten(abstract)
  have = flatten(given)
  missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
  wrong = [
    f"{k}: given {tuple(np.shape(have[k]))}, the model has {tuple(want[k].shape)}"
    for k in sorted(want.keys() & have.keys())
    if tuple(np.shape(have[k])) != tuple(want[k].shape)
  ]
  if missing or extra or wrong:
    raise ValueError(
      f"{what} do not fit the model the config builds: missing {missing[:8]}, "
      f"not in the model {extra[:8]}, shapes {wrong[:8]}"
    )
  placed = {
    k: jax.device_put(np.asarray(have[k]).astype(want[k].dtype), s)
    for k, s in flatten(shardings).items()
  }
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  keys = ["/".join(_key_name(p) for p in path) for path, _ in leaves]
  return jax.tree.unflatten(treedef, [placed[k] for k in keys])


def build_model(
  config: ml_collections.ConfigDict,
  params: Mapping[str, Any],
  model_state: Mapping[str, Any] | None = None,
) -> Any:
  """The run's NNX model with these weights, on one CPU device, in eval mode.

  `config` is the run's resolved config (`trainers.checkpoints.saved_run.saved_config`,
  or `config_from_json` of an export's); `params` (and `model_state`) nested
  or '/'-keyed dicts of arrays, e.g. `load_params`' result. The model is
  built from the task the config names, exactly as the trainer builds it,
  so `model(inputs)` computes what the trained model computes.

  Raises:
    ValueError: the arrays do not fit the model (names the keys and shapes).
  """
  mesh = _single_device_mesh(config)
  batch_axes = tuple(a for a in config.mesh.batch_axes if a in mesh.shape)
  setup = make_state(make_task(config).model, config, mesh, batch_axes)
  weights = _matched("params", params, setup.abstract["params"], setup.shardings["params"])
  rest = None
  if setup.has_model_state:
    if model_state is None:
      raise ValueError("the model has non-parameter variables (model_state) and none were given")
    rest = _matched(
      "model_state", model_state, setup.abstract["model_state"], setup.shardings["model_state"]
    )
  model = merge_model(setup, weights, rest)
  model.eval()
  return model


def load_model(
  path: str, config: ml_collections.ConfigDict | None = None, workdir: str | None = None
) -> Any:
  """The NNX model of an export file, on one CPU device, ready for `model(inputs)`.

  `config` defaults to the run's config saved in the file; a file task is
  imported from `<workdir>/code/` when `workdir` is given, else from where
  the run found it.
  """
  exported = load_export(path)
  if config is None:
    if not exported.config_json:
      raise ValueError(f"{path!r} holds no config (its run saved none): pass config=")
    config = saved_run.config_from_json(exported.config_json, workdir)
  return build_model(config, exported.params, exported.model_state)
