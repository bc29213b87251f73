"""Checkpoints: orbax, asynchronous and atomic, with the data position inside.

A checkpoint is one orbax step directory holding two items: `state` (the
sharded train state, written by every host for its own shards) and `data`
(the input pipeline's position, JSON). Orbax writes into a temporary
directory and renames it only when every host has finished, so a crash
mid-save leaves no step that could be restored half-written; leftover
temporary directories are removed when the manager starts. Nothing is pickled
or unpickled: arrays are tensorstore (zarr in OCDBT) files, everything else JSON.

What cannot be restored is a `CheckpointError` naming the step, the directory
and what is wrong, raised before any state is used (never a partial restore):
a step directory without orbax's commit marker (`commit_success.txt`, written
last, just before the rename), a checkpoint of another model (parameter
names, shapes or dtypes differ), or files that fail to read (truncated,
corrupt). A checkpoint of the same model saved on another mesh or process
count restores onto the new one: arrays are read into the target shardings.

Resume order (decided in `restore_or_init`):
  1. the latest checkpoint in the run's own checkpoint directory: everything,
     including the data position, restored into the target shardings (so a
     different mesh or process count works);
  2. else initial weights from `init_from` (another run's checkpoint
     directory): parameters only; optimizer, step and data start fresh;
  3. else a fresh initialisation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, before the final rename


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored: incomplete, damaged, or of another model."""


@dataclasses.dataclass
class Restored:
  """What `restore_or_init` found."""

  state: Any
  data_state: dict | None  # the pipeline position, when resumed
  source: str  # "checkpoint step N", "init_from PATH step N" or "fresh init"
  step: int


# orbax splits each replicated array into one slice per replica so that the
# replicas share the writing. Every slice is a separate device dispatch on the
# training thread, which for the many small arrays of a data-parallel state
# cost more than the write it spreads (lm_tiny on 4 devices: 184 slices, the
# save call 130-350 ms instead of 45-65 ms). Arrays whose per-replica slice
# would be under this size are written whole by one replica.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 1 << 20


@functools.cache
def _register_array_handler() -> None:
  ocp.type_handlers.register_type_handler(
    jax.Array,
    ocp.type_handlers.ArrayHandler(
      min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES,
      # orbax's `_sharding` file records each array's saved sharding, for
      # restores that give none. Ours always give the target's (any mesh and
      # process count), so it is never read; serializing it cost a quarter of
      # a save's CPU (lm_tiny: ~200 -> ~150 ms per save, competing with the
      # step on a CPU host; `python -m benchmarks.training`).
      enable_write_sharding_file=False,
    ),
    override=True,
  )


def make_manager(
  directory: str, every: int, keep: int, keep_period: int = 0, async_save: bool = True
) -> ocp.CheckpointManager:
  """An orbax `CheckpointManager` that keeps the last `keep` (+ every `keep_period`-th)."""
  _register_array_handler()
  options = ocp.CheckpointManagerOptions(
    save_interval_steps=max(every, 1),
    max_to_keep=keep,
    keep_period=keep_period or None,
    enable_async_checkpointing=async_save,
    cleanup_tmp_directories=True,
    create=True,
  )
  return ocp.CheckpointManager(
    os.path.abspath(directory), options=options, item_handlers=_handlers()
  )


def _handlers() -> dict[str, ocp.CheckpointHandler]:
  # Named up front (not inferred at the first save) so the saved tree's
  # metadata can be read before restoring: the model check below needs it.
  return {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}


def save(
  manager: ocp.CheckpointManager, step: int, state: Any, data_state: dict, force: bool = False
) -> bool:
  """Starts saving (returns at once when asynchronous); True if a save began."""
  return manager.save(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
    force=force,
  )


def _abstract(state_shapes: Any, shardings: Any) -> Any:
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state_shapes, shardings
  )


def _leaves(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    jax.tree_util.keystr(p, simple=True, separator="."): (tuple(x.shape), str(x.dtype))
    for p, x in flat
  }


def check_same_model(manager: ocp.CheckpointManager, step: int, target: Any, what: str) -> None:
  """Raises `CheckpointError` unless the saved state has the target's names, shapes, dtypes."""
  try:
    saved_tree = manager.item_metadata(step)["state"]
  except Exception as e:  # a damaged metadata file: JSON or orbax errors
    raise _damaged(what, e) from e
  if saved_tree is None:
    raise CheckpointError(f"{what} cannot be restored: it has no state metadata")
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
    f"{k}: missing from the checkpoint" for k in sorted(wanted.keys() - saved.keys(), key=order)
  ]
  problems += [
    f"{k}: in the checkpoint, not in this model"
    for k in sorted(saved.keys() - wanted.keys(), key=order)
  ]
  if problems:
    shown = "\n  ".join(problems[:8]) + (
      f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
    )
    raise CheckpointError(
      f"{what} holds a different model ({len(problems)} arrays differ):\n  {shown}\n"
      "Use the config it was saved with, or another workdir."
    )


def _restore(manager: ocp.CheckpointManager, step: int, args: Any, what: str) -> Any:
  """`manager.restore`, with a damaged checkpoint said as such (nothing is used)."""
  try:
    return manager.restore(step, args=args)
  except Exception as e:  # tensorstore, JSON and orbax errors alike
    raise _damaged(what, e) from e


def _damaged(what: str, e: Exception) -> CheckpointError:
  detail = " ".join(str(e).split())
  if len(detail) > 400:
    detail = detail[:400] + " ..."
  return CheckpointError(
    f"{what} cannot be restored: it is damaged or incomplete ({type(e).__name__}: {detail}). "
    "Nothing was restored; move that step directory away to resume from an earlier one."
  )


def _checked_step(manager: ocp.CheckpointManager, directory: str, step: int) -> str:
  what = f"checkpoint step {step} in {directory}"
  if not os.path.exists(os.path.join(directory, str(step), COMMIT_MARKER)):
    raise CheckpointError(
      f"{what} has no commit marker ({COMMIT_MARKER}): it was never finished, or was "
      "copied or damaged after; it is not restored. Move it away to resume from an earlier step "
      f"(all steps here: {list(manager.all_steps())})."
    )
  return what


def restore_or_init(
  manager: ocp.CheckpointManager,
  abstract_state: Any,
  shardings: Any,
  init: Callable[[], Any],
  init_from: str = "",
) -> Restored:
  """Resumes, warm-starts or initialises, in the order in the module docstring.

  Raises:
    CheckpointError: the checkpoint to restore is incomplete, damaged or of
      another model (see the module docstring).
  """
  target = _abstract(abstract_state, shardings)
  # 1. Our own latest checkpoint: everything, data position included.
  step = manager.latest_step()
  if step is not None:
    what = _checked_step(manager, str(manager.directory), step)
    check_same_model(manager, step, target, what)
    restored = _restore(
      manager,
      step,
      ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()),
      what,
    )
    return Restored(restored["state"], dict(restored["data"]), f"checkpoint step {step}", step)
  state = init()
  # 2. Initial weights from another run: parameters only.
  if init_from:
    with ocp.CheckpointManager(
      os.path.abspath(init_from),
      item_handlers=_handlers(),
      options=ocp.CheckpointManagerOptions(read_only=True),
    ) as other:
      other_step = other.latest_step()
      if other_step is None:
        raise FileNotFoundError(f"checkpoint.init_from={init_from!r} holds no checkpoint")
      what = "checkpoint.init_from " + _checked_step(other, os.path.abspath(init_from), other_step)
      check_same_model(other, other_step, target, what)
      restored = _restore(
        other, other_step, ocp.args.Composite(state=ocp.args.StandardRestore(target)), what
      )
    state = dict(state, params=restored["state"]["params"])
    return Restored(state, None, f"init_from {init_from} step {other_step}", 0)
  # 3. Fresh.
  return Restored(state, None, "fresh init", 0)
