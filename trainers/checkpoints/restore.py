"""Resume, warm start or fresh: the train state a run starts from.

Resume order (decided in `restore_or_init`):
  1. the latest checkpoint in the run's own checkpoint directory: everything,
     including the data position, restored into the target shardings (so a
     different mesh or process count works). A checkpoint saved before the
     state counted its applied updates (`updates`) resumes with the count set
     to its step;
  2. else initial weights from `init_from`: a Hugging Face model folder
     (config.json and safetensors, `trainers.hf.checkpoint`: each host reads
     its devices' slices), or another run's workdir, its
     checkpoint directory, or one step's directory: the parameters and the
     model's other variables (`model_state`: batch statistics, a model's own
     variables) only, read by a partial restore (`reading.restore_weights`)
     that never opens the optimizer state, so any optimizer and schedule may
     follow; the optimizer, step and data start fresh;
  3. else a fresh initialisation.

With LoRA (`trainable_paths`, the adapters' A and B) a checkpoint holds the
adapters, their optimizer state and the counters, not the frozen weights:
step 1 restores those and takes the frozen weights from step 2 or 3 (the
same `init_from`, or the seed), and the run then checks that they are the
ones the adapters were trained on (`trainers.checkpoints.lora_base`). In
step 2 the adapters start from `initial_adapters` where given (a peft
folder, `config.lora.init_from`), else A random and B zero.

What cannot be restored is a `CheckpointError` naming the step, the directory
and what is wrong, raised before any state is used (never a partial restore):
a step directory without orbax's commit marker (`commit_success.txt`, written
last), a checkpoint of another model (parameter names, shapes or dtypes
differ), or files that fail to read (truncated, corrupt).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from spmd import multihost
from trainers import paths
from trainers.checkpoints import step_folders
from trainers.checkpoints.damage import CheckpointError
from trainers.checkpoints.manager import read_only_manager
from trainers.checkpoints.reading import (
  WEIGHTS,
  check_same_model,
  restore_step,
  restore_weights,
  saved_state_tree,
)
from trainers.hf import checkpoint as hf_checkpoint
from trainers.step import trainable

log = logging.getLogger(__name__)

COMMIT_MARKER = step_folders.COMMIT_MARKER  # orbax writes it last, before the final rename
# The applied-update count (trainers/step/state.py), which older checkpoints lack.
UPDATES = "updates"


@dataclasses.dataclass
class Restored:
  """What `restore_or_init` found."""

  state: Any
  data_state: dict | None  # the pipeline position, when resumed
  source: str  # "checkpoint step N", "init_from PATH step N" or "fresh init"
  step: int


def _abstract(state_shapes: Any, shardings: Any) -> Any:
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state_shapes, shardings
  )


def latest_committed_step(manager: ocp.CheckpointManager) -> int | None:
  """The newest committed step of the run's own, or None.

  The manager of `make_manager` lists only the committed steps of the
  judgment every host shares (`step_folders.decide`, which also removed
  the unfinished steps the harness wrote), so this is orbax's latest step.
  """
  return manager.latest_step()


def checked_step(manager: ocp.CheckpointManager, directory: str, step: int) -> str:
  what = f"checkpoint step {step} in {directory}"
  if not step_folders.is_committed(directory, step):  # init_from: another run's, read only
    raise CheckpointError(
      f"{what} has no commit marker ({COMMIT_MARKER}): that save never finished; "
      f"it is not restored (steps there: {list(manager.all_steps())})."
    )
  return what


WARM_START_ADVICE = (
  "A warm start (checkpoint.init_from) needs the same parameter and model-state names, "
  "shapes and dtypes; the optimizer and schedule may differ. Use a model config that "
  "matches the checkpoint, or another checkpoint."
)


def init_from_directory(init_from: str) -> tuple[epath.Path, int | None]:
  """(the orbax directory, the step or None for its latest) that `init_from` names.

  `init_from` is another run's workdir (its `checkpoints/` is used), its
  checkpoint directory, or one step's directory (`.../checkpoints/200`).
  """
  directory = paths.user_path(init_from)
  if (directory / "checkpoints").is_dir():
    return directory / "checkpoints", None
  if directory.name.isdigit() and (directory / "state").is_dir():
    return directory.parent, int(directory.name)
  return directory, None


def restore_or_init(
  manager: ocp.CheckpointManager,
  abstract_state: Any,
  shardings: Any,
  init: Callable[[], Any],
  init_from: str = "",
  init_with_weights: Callable[[dict[str, Any]], Any] | None = None,
  trainable_paths: frozenset[tuple[str, ...]] | None = None,
  initial_adapters: Callable[[Any], Any] | None = None,
) -> Restored:
  """Resumes, warm-starts or initialises, in the order in the module docstring.

  `initial_adapters(target)`: with LoRA, the adapters a warm start begins
  with, as global arrays shaped, typed and sharded as `target` (the
  adapters' part of the parameters); None: A random, B zero.

  `init_with_weights(weights)`, for a warm start, is the initial state built
  around the restored weights (`trainers.step.state.StateSetup.init_with_weights`:
  the optimizer initialised from them); None initialises fresh (`init`) and
  puts the weights in.

  Raises:
    CheckpointError: the checkpoint to restore is incomplete, damaged or of
      another model (see the module docstring).
  """
  full_target = _abstract(abstract_state, shardings)
  target = saved_part(full_target, trainable_paths)
  # 1. Our own latest finished checkpoint: everything, data position included
  # (with LoRA, everything but the frozen weights, taken from 2 or 3).
  step = latest_committed_step(manager)
  if step is not None:
    what = checked_step(manager, str(manager.directory), step)
    # A checkpoint from before the state counted its updates: everything
    # else restored, the count set to the step (exact unless that run skipped
    # non-finite steps; then the logged learning rate stays ahead by those).
    saved_tree = saved_state_tree(manager, step, what)
    counted = UPDATES not in target or UPDATES in saved_tree
    wanted = target if counted else {k: v for k, v in target.items() if k != UPDATES}
    check_same_model(manager, step, wanted, what, saved_tree=saved_tree)
    restored = restore_step(
      manager,
      step,
      ocp.args.Composite(state=ocp.args.StandardRestore(wanted), data=ocp.args.JsonRestore()),
      what,
    )
    state = restored["state"]
    if not counted:
      log.warning("%s has no update count (saved by an older version): set to its step", what)
      state = dict(state, **{UPDATES: _replicated_scalar(step, target[UPDATES])})
    if trainable_paths is not None:
      # The frozen weights only: the adapters are the checkpoint's.
      initial = initial_state(full_target, init, init_from, init_with_weights, trainable_paths)
      _, frozen = trainable.split(initial.state["params"], trainable_paths)
      state = dict(state, params=trainable.join(state["params"], frozen))
      log.info("frozen weights from %s", initial.source)
    return Restored(state, dict(restored["data"]), f"checkpoint step {step}", step)
  return initial_state(
    full_target, init, init_from, init_with_weights, trainable_paths, initial_adapters
  )


def saved_part(state: Any, trainable_paths: frozenset[tuple[str, ...]] | None) -> Any:
  """What a checkpoint holds of the state: all of it, or (LoRA) all but the frozen weights."""
  if trainable_paths is None:
    return state
  return dict(state, params=trainable.split(state["params"], trainable_paths)[0])


def initial_state(
  target: Any,
  init: Callable[[], Any],
  init_from: str,
  init_with_weights: Callable[[dict[str, Any]], Any] | None,
  trainable_paths: frozenset[tuple[str, ...]] | None,
  initial_adapters: Callable[[Any], Any] | None = None,
) -> Restored:
  """Steps 2 and 3 of the module docstring: a warm start or a fresh state."""
  # The weights to read are the model's own: a LoRA run's adapters are new
  # (or read by `initial_adapters`).
  params_target = target["params"]
  if trainable_paths is not None:
    adapters_target, params_target = trainable.split(params_target, trainable_paths)

  def with_adapters(weights: dict[str, Any]) -> dict[str, Any]:
    if initial_adapters is None:
      return weights
    adapters = initial_adapters(adapters_target)
    return dict(weights, params=trainable.join(adapters, weights["params"]))

  # 2. Initial weights from a Hugging Face folder or another run: parameters
  # and model state only.
  if init_from and hf_checkpoint.is_hf_folder(paths.user_path(init_from)):
    if "model_state" in target:
      raise ValueError(
        f"checkpoint.init_from={init_from!r} is a Hugging Face folder, which holds parameters "
        "only, but the model has other variables (model_state)"
      )
    weights = {"params": hf_checkpoint.read_params(paths.user_path(init_from), params_target)}
    weights = with_adapters(weights)
    state = init_with_weights(weights) if init_with_weights else dict(init(), **weights)
    return Restored(state, None, f"init_from {init_from} (Hugging Face)", 0)
  if init_from:
    directory, other_step = init_from_directory(init_from)
    with read_only_manager(directory) as other:
      if other_step is None:
        # The newest committed step of the harness's own: orbax's listing
        # would take another tool's digit-named folder for a checkpoint.
        # Process 0 reads it for every host, so all warm-start from one step.
        other_step = multihost.from_process_0(
          "init_from step", lambda: step_folders.list_steps(directory).latest
        )
      if other_step is None:
        raise FileNotFoundError(
          f"checkpoint.init_from={init_from!r} holds no checkpoint (give a run's workdir, "
          "its checkpoints directory, or one step's directory)"
        )
      what = "checkpoint.init_from " + checked_step(other, str(directory), other_step)
      wanted = {k: target[k] for k in WEIGHTS if k in target}
      wanted["params"] = params_target
      weights = with_adapters(restore_weights(other, other_step, wanted, what, WARM_START_ADVICE))
    if init_with_weights is not None:
      state = init_with_weights(weights)
    else:
      state = dict(init(), **weights)
    return Restored(state, None, f"init_from {init_from} step {other_step}", 0)
  # 3. Fresh.
  return Restored(init(), None, "fresh init", 0)


def _replicated_scalar(value: int, like: jax.ShapeDtypeStruct) -> jax.Array:
  """`value` as a global array shaped, typed and sharded as `like` (every process calls this)."""
  host = np.asarray(value, like.dtype).reshape(like.shape)
  return jax.make_array_from_callback(like.shape, like.sharding, lambda index: host[index])
