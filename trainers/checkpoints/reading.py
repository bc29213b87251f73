"""Reading a checkpoint: its saved tree, the check that it holds this model, the weights alone.

Nothing is restored before the check: what cannot be restored is a
`CheckpointError` naming the step and what is wrong (`damage.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from trainers.checkpoints.damage import CheckpointError, damaged, is_trouble
from trainers.checkpoints.manager import register_array_handler

WEIGHTS = ("params", "model_state")  # the part of the train state a model needs


def _leaves(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    jax.tree_util.keystr(p, simple=True, separator="."): (tuple(x.shape), str(x.dtype))
    for p, x in flat
  }


SAME_CONFIG_ADVICE = "Use the config it was saved with, or another workdir."


def saved_state_tree(manager: ocp.CheckpointManager, step: int, what: str) -> Any:
  """The saved state's tree of array metadata (names, shapes, dtypes); no array data is read.

  orbax opens every array's own metadata for it, the optimizer state's too
  (a warm start reads `weights_metadata` instead).
  """
  try:
    saved_tree = manager.item_metadata(step)["state"]
  except Exception as e:  # a damaged metadata file: JSON or orbax errors
    if is_trouble(e):
      e.add_note(f"while reading {what}: the checkpoint itself may be fine; nothing was restored")
      raise
    raise damaged(what, e) from e
  if saved_tree is None:
    raise CheckpointError(f"{what} cannot be restored: it has no state metadata")
  return saved_tree


def check_same_model(
  manager: ocp.CheckpointManager,
  step: int,
  target: Any,
  what: str,
  only: tuple[str, ...] = (),
  advice: str = SAME_CONFIG_ADVICE,
  saved_tree: Any = None,
) -> None:
  """Raises `CheckpointError` unless the saved state has the target's names, shapes, dtypes.

  `only` limits the comparison to these top-level items of the state (e.g.
  `WEIGHTS` for a restore of the weights alone); empty compares all. Each
  array that differs or is on one side only is named with its shape and
  dtype (both, where both exist); `advice` ends the message. `saved_tree`:
  the saved metadata when already read (`saved_state_tree`, `weights_metadata`).
  """
  if saved_tree is None:
    saved_tree = saved_state_tree(manager, step, what)
  if only:
    saved_tree = {k: saved_tree[k] for k in only if k in saved_tree}
  saved, wanted = _leaves(saved_tree), _leaves(target)

  def order(key: str) -> tuple[bool, str]:
    return (not key.startswith("params."), key)  # the parameters first: they say the most

  def show(leaf: tuple) -> str:
    return f"{leaf[0]} {leaf[1]}"

  problems = [
    f"{k}: saved {show(saved[k])}, this config needs {show(wanted[k])}"
    for k in sorted(saved.keys() & wanted.keys(), key=order)
    if saved[k] != wanted[k]
  ]
  problems += [
    f"{k}: missing from the checkpoint, this config needs {show(wanted[k])}"
    for k in sorted(wanted.keys() - saved.keys(), key=order)
  ]
  problems += [
    f"{k}: saved {show(saved[k])}, not in this model"
    for k in sorted(saved.keys() - wanted.keys(), key=order)
  ]
  if problems:
    shown = "\n  ".join(problems[:8]) + (
      f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
    )
    raise CheckpointError(
      f"{what} holds a different model ({len(problems)} arrays differ):\n  {shown}\n{advice}"
    )


def restore_step(manager: ocp.CheckpointManager, step: int, args: Any, what: str) -> Any:
  """`manager.restore`, with a damaged checkpoint said as such (nothing is used).

  An error that says the storage or the machine is in trouble (permission,
  network, I/O, memory; see `is_trouble`) is not damage: it is raised as
  what it is, with the step and path added, and no advice to move anything.
  """
  try:
    return manager.restore(step, args=args)
  except Exception as e:  # tensorstore, JSON and orbax errors alike
    if is_trouble(e):
      e.add_note(f"while restoring {what}: the checkpoint itself may be fine; nothing was restored")
      raise
    raise damaged(what, e) from e


# orbax's description of a saved tree (`_METADATA` beside the arrays): each
# leaf's key path and value type, but not its shape, which only the array's own
# metadata holds. Its key types: 1 a sequence index, 2 a dict key.
_TREE_METADATA_FILE = "_METADATA"
_SEQUENCE_KEY = 1


def weight_infos(state_dir: epath.Path) -> tuple[list[list[tuple[str, Any]]], list[Any]]:
  """The weights' (`WEIGHTS`) key paths in a saved state and orbax's `ParamInfo` of each.

  Read from orbax's tree description (`_METADATA`) alone; no array is opened.
  A `ParamInfo` names the array for orbax's handler and for its tensorstore
  spec (`ocp.type_handlers.get_json_tspec_read`).
  """
  described = json.loads((state_dir / _TREE_METADATA_FILE).read_text())
  leaves = [
    [(k["key"], k.get("key_type")) for k in entry["key_metadata"]]
    for entry in described["tree_metadata"].values()
    if entry["key_metadata"][0]["key"] in WEIGHTS
    and not entry.get("value_metadata", {}).get("skip_deserialize", False)
  ]
  use_ocdbt = bool(described.get("use_ocdbt", True))
  context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
  infos = [
    ocp.type_handlers.ParamInfo(
      name=".".join(str(key) for key, _ in path),
      parent_dir=state_dir,
      skip_deserialize=False,
      is_ocdbt_checkpoint=use_ocdbt,
      use_zarr3=bool(described.get("use_zarr3", False)),
      ts_context=context,
    )
    for path in leaves
  ]
  return leaves, infos


def weights_metadata(manager: ocp.CheckpointManager, step: int, what: str) -> dict[str, Any]:
  """The saved shapes and dtypes of the weights (`WEIGHTS`) of `step`.

  Only the weights' own array metadata is opened: orbax's `item_metadata`
  opens every array's, the optimizer state's included, so a warm start would
  depend on files it never restores. The leaf names come from orbax's tree
  description; the shapes from orbax's array handler, for those leaves only.
  """
  state_dir = epath.Path(manager.directory) / str(step) / "state"
  try:
    leaves, infos = weight_infos(state_dir)
    register_array_handler()
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    arrays = _run_async(handler.metadata(infos)) if infos else []
  except Exception as e:  # a missing or damaged metadata file: JSON, OS or tensorstore errors
    if is_trouble(e):
      e.add_note(f"while reading {what}: the checkpoint itself may be fine; nothing was restored")
      raise
    raise damaged(what, e) from e
  tree = _nested(zip(leaves, arrays))
  if "params" not in tree:
    raise CheckpointError(f"{what} holds no parameters")
  return tree


def _run_async(coroutine: Any) -> Any:
  """`coroutine`'s result, also from a caller already inside an event loop (a notebook)."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(coroutine)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, coroutine).result()


def _nested(leaves: Any) -> dict[str, Any]:
  """A tree from `(key path, value)` pairs, as orbax rebuilds a saved one.

  A level whose keys are sequence indices becomes a list.
  """
  root: dict = {}
  sequences: set[int] = set()  # id() of the levels keyed by sequence indices
  for path, value in leaves:
    level = root
    for depth, (key, kind) in enumerate(path):
      if kind == _SEQUENCE_KEY:
        key = int(key)
        sequences.add(id(level))
      if depth == len(path) - 1:
        level[key] = value
      else:
        level = level.setdefault(key, {})

  def build(level: Any) -> Any:
    if not isinstance(level, dict):
      return level
    if id(level) in sequences:
      return [build(level[i]) for i in sorted(level)]
    return {k: build(v) for k, v in level.items()}

  return build(root)


def restore_weights(
  manager: ocp.CheckpointManager,
  step: int,
  target: dict[str, Any] | None,
  what: str,
  advice: str = SAME_CONFIG_ADVICE,
) -> dict[str, Any]:
  """The parameters and model state of `step` by a partial restore: nothing else is read.

  `manager` comes from `read_only_manager`. The optimizer state and the rest
  of the train state are never opened (their files may be damaged or of
  another optimizer), so memory holds only the weights.

  `target`: `{"params": ..., "model_state": ...}` (the latter only for models
  that have one) of `jax.ShapeDtypeStruct`s with shardings: the arrays come
  back as global `jax.Array`s in those shardings, whatever mesh or process
  count saved them (every process must call this), after a check that the
  saved weights have the target's names, shapes and dtypes (`advice` ends
  that error). None: numpy arrays on this host alone, shaped as saved.

  Raises:
    CheckpointError: the weights are damaged, or of another model.
  """
  saved = weights_metadata(manager, step, what)
  if target is None:
    item = saved
    restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
      item,
      is_leaf=lambda x: hasattr(x, "shape"),
    )
  else:
    item = target
    check_same_model(manager, step, target, what, only=WEIGHTS, advice=advice, saved_tree=saved)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
  restored = restore_step(manager, step, ocp.args.Composite(state=args), what)
  return dict(restored["state"])
