"""What a run leaves behind, read back: its resolved config and its checkpoints' weights.

`spmd-train --mode=eval` and `spmd-export` start from a workdir, not from a
config file: the run wrote `<workdir>/config.json` (the resolved config) and,
for a file task, `<workdir>/code/` (the task's files) when it started.

  * `saved_config(workdir)`: that JSON as a checked `ConfigDict`. JSON has no
    tuples, so lists come back as tuples (what configs use); a file task
    (`config.task = "/abs/task.py:fn"`) is imported from the run's own copy
    in `code/` when there is one (what the run trained with, even if the
    original has changed or gone since), else from the original path.
  * `find_checkpoint(workdir, checkpoint, step)`: which orbax step to read;
    errors name the path and the steps that exist.
  * `restore_weights(ref, target)`: the parameters (and model state) only,
    into `target`'s shardings (any mesh and process count) or as numpy
    arrays; the optimizer state is never read.

Example:
  >>> import json, tempfile
  >>> from configs import lm_tiny
  >>> workdir = epath.Path(tempfile.mkdtemp())
  >>> _ = (workdir / "config.json").write_text(lm_tiny.get_config().to_json())
  >>> config = saved_config(workdir)
  >>> config.task, config.mesh.batch_axes
  ('trainers.tasks.lm:make_task', ('data', 'fsdp', 'expert'))
  >>> find_checkpoint(workdir)  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  FileNotFoundError: no checkpoint in .../checkpoints: it does not exist (--workdir=...)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from spmd import multihost
from trainers import paths
from trainers.checkpoints import lora_base, reading, step_folders
from trainers.checkpoints.damage import CheckpointError
from trainers.checkpoints.manager import read_only_manager
from trainers.checkpoints.restore import checked_step, initial_state
from trainers.checkpoints.step_folders import COMMIT_MARKER, step_of
from trainers.config import resolve
from trainers.step import trainable
from trainers.step.precision import PRECISIONS
from trainers.tasks import BUILTIN_TASKS

CONFIG_FILE = "config.json"
CODE_DIR = "code"
WEIGHTS = reading.WEIGHTS  # the part of the train state a model needs


def _tuples(value: Any) -> Any:
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(_tuples(v) for v in value)
  return value


def _task_from_copy(spec: str, workdir: epath.Path, instead: str = "") -> str:
  """A file task's spec pointed at the run's own copy in `code/`, when it has one."""
  module, _, function = spec.rpartition(":")
  if not module.endswith(".py"):
    return spec
  code = workdir / CODE_DIR
  if paths.is_url(code):  # tasks import from local files: stage the copy on this host
    if not code.exists():
      return spec
    local = paths.local_cache("code", code)
    paths.copy_tree(code, epath.Path(local))
    code = epath.Path(local)
  copy = code / epath.Path(module).name
  if copy.exists():
    return f"{copy}:{function}"
  if not epath.Path(module).exists():
    raise FileNotFoundError(
      f"config.task={spec!r}: the task file is gone and {workdir / CODE_DIR} holds no copy of it"
      + (f", {instead}" if instead else "")
    )
  return spec


def _tokenizer_from_copy(spec: str, workdir: epath.Path) -> str:
  """A tokenizer file's spec pointed at the run's own copy, when the original is gone.

  The run keeps its tokenizer beside its config (`Task.run_files`); the copy
  has the same bytes, so the same identity and packed data.
  """
  if spec in ("", "bytes", "bpe") or epath.Path(spec).exists():
    return spec
  copy = workdir / ("tokenizer" + (epath.Path(spec).suffix or ".json"))
  return str(copy) if copy.exists() else spec


def _from_before_the_policy(config: dict[str, Any]) -> dict[str, Any]:
  """A config saved before `train.precision` existed, in today's settings.

  Such a run named its compute dtype as `model.dtype`, which the built-in
  models now take from `train.precision` (and refuse as a setting): the run
  meant that precision, so it becomes `train.precision`. A file task keeps
  its `model.dtype` too, since its own code may read it.
  """
  model, train = config.get("model") or {}, config.get("train") or {}
  if "dtype" not in model or "precision" in train:
    return config
  if model["dtype"] not in PRECISIONS:
    raise ValueError(
      f"config.json: model.dtype={model['dtype']!r} (a run from before train.precision) is not "
      f"one of {PRECISIONS}, the precisions a run can compute in"
    )
  config.setdefault("train", {})["precision"] = model["dtype"]
  if config.get("task") in (*BUILTIN_TASKS, *BUILTIN_TASKS.values()):
    del model["dtype"]
  return config


def config_from_json(
  text: str, workdir: str | epath.Path | None = None, instead: str = ""
) -> ml_collections.ConfigDict:
  """A resolved config saved as JSON, checked again as `trainers.config.resolve` checks a file.

  `workdir`, when given, is where to look for a file task's copy (`code/`);
  `instead` as in `saved_config`. A config from before `train.precision`
  (its compute dtype as `model.dtype`) opens as the precision it named.
  """
  config = ml_collections.ConfigDict(_tuples(_from_before_the_policy(json.loads(text))))
  if workdir is not None:
    config.task = _task_from_copy(config.task, paths.user_path(workdir), instead)
    if "tokenizer" in config.get("data", {}):
      config.data.tokenizer = _tokenizer_from_copy(config.data.tokenizer, paths.user_path(workdir))
  return resolve(config)  # the task spec is absolute already: no config file needed


def saved_config(workdir: str | epath.Path, instead: str = "") -> ml_collections.ConfigDict:
  """`<workdir>/config.json`, the config the run resolved, as a checked `ConfigDict`.

  `instead`: the calling command's own way to give the config otherwise (its
  flag, e.g. "or pass the run's config file with --config"), added to the
  errors; empty for commands that have none, so no error names a flag the
  command lacks.
  """
  workdir = paths.user_path(workdir)
  path = workdir / CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(
      f"--workdir={workdir} has no {CONFIG_FILE} (a run writes it when it starts): "
      "give the workdir of a run that has started" + (f", {instead}" if instead else "")
    )
  return config_from_json(path.read_text(), workdir, instead)


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
  """One checkpoint step: the orbax directory (holding step folders) and the step."""

  directory: epath.Path
  step: int

  @property
  def path(self) -> epath.Path:
    return self.directory / str(self.step)


def _look(workdir: str | epath.Path, checkpoint_path: str) -> dict[str, Any]:
  """What `find_checkpoint` decides from: the checkpoint directory, a step it names, its steps."""
  base = (
    paths.user_path(checkpoint_path)
    if checkpoint_path
    else paths.user_path(workdir) / "checkpoints"
  )
  named = None
  if (base / "checkpoints").is_dir():  # a workdir
    base = base / "checkpoints"
  elif step_of(base.name) is not None and (base / "state").is_dir():  # one step's directory
    base, named = base.parent, int(base.name)
  return {
    "base": str(base),
    "named": named,
    "exists": base.exists(),
    "steps": step_folders.list_steps(base).to_json(),
  }


def find_checkpoint(
  workdir: str | epath.Path, checkpoint_path: str = "", step: int | None = None
) -> CheckpointRef:
  """The step to read: `step` (default: the latest committed) of the run's checkpoints.

  `checkpoint_path`, when given, replaces `<workdir>/checkpoints`: another
  run's workdir, its checkpoint directory, or one step's directory
  (`.../checkpoints/200`). Nothing is changed on disk (a training run may be
  writing there). Steps are judged by `checkpoint_steps`; with many
  processes, process 0 reads the directory and every process decides from
  what it read (all must call this), so a step committed meanwhile cannot
  split them.

  Raises:
    FileNotFoundError: no such step or no checkpoint at all; names the
      directory and the committed steps there.
    CheckpointError: the step exists but its save never finished.
  """
  given = f"--checkpoint={checkpoint_path}" if checkpoint_path else f"--workdir={workdir}"
  seen = multihost.from_process_0("find_checkpoint", lambda: _look(workdir, checkpoint_path))
  base, named = paths.user_path(seen["base"]), seen["named"]
  if named is not None:
    if step is not None and step != named:
      raise ValueError(f"--step={step} contradicts {given}, which is step {named}")
    step = named
  steps = step_folders.StepDirs.from_json(seen["steps"])
  done = list(steps.committed)
  mine = {step_of(n) for n in steps.unfinished} - set(done)
  others = {step_of(n) for n in steps.foreign} - set(done) - mine
  if not done and not mine and not others:
    why = "it does not exist" if not seen["exists"] else "it holds no step directories"
    raise FileNotFoundError(f"no checkpoint in {base}: {why} ({given})")
  if step is None:
    if not done:
      raise FileNotFoundError(
        f"no committed checkpoint in {base}: steps {sorted(mine | others)} never finished "
        f"saving or were not written by this harness ({given})"
      )
    return CheckpointRef(base, done[-1])
  if step in mine:
    raise CheckpointError(
      f"--step={step}: checkpoint step {step} in {base} has no commit marker "
      f"({COMMIT_MARKER}): that save never finished; committed steps: {done}"
    )
  if step in others:
    raise CheckpointError(
      f"--step={step}: {base / str(step)} was not written by this harness (not in "
      f"{step_folders.LEDGER}, and not a committed checkpoint of its items "
      f"{step_folders.ITEMS}); committed steps: {done}"
    )
  if step not in done:
    raise FileNotFoundError(f"--step={step}: {base} has no step {step}; committed steps: {done}")
  return CheckpointRef(base, step)


def _manager(directory: epath.Path) -> ocp.CheckpointManager:
  # Read only, the state restorable in part: the one reader warm starts use too.
  return read_only_manager(directory)


def saved_weights_metadata(ref: CheckpointRef) -> dict[str, Any]:
  """The saved shapes and dtypes of the parameters (and model state), read from the step."""
  with _manager(ref.directory) as manager:
    what = checked_step(manager, str(ref.directory), ref.step)
    return reading.weights_metadata(manager, ref.step, what)


def weights_target(abstract: dict[str, Any], shardings: dict[str, Any]) -> dict[str, Any]:
  """`restore_weights`' target from a train state's abstract arrays and shardings: its `WEIGHTS` only.

  Example:
    >>> import jax, numpy as np
    >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> abstract = {"params": {"w": jax.ShapeDtypeStruct((2,), np.float32)}, "step": None}
    >>> weights_target(abstract, {"params": {"w": sharding}, "step": None})["params"]["w"].shape
    (2,)
  """
  return {
    k: jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract[k], shardings[k]
    )
    for k in WEIGHTS
    if k in abstract
  }


def restore_weights(ref: CheckpointRef, target: dict[str, Any] | None = None) -> dict[str, Any]:
  """The parameters (and model state) of `ref`; nothing else is read.

  `target`: `{"params": ..., "model_state": ...}` of `jax.ShapeDtypeStruct`s
  with shardings: the arrays come back as global `jax.Array`s in those
  shardings, whatever mesh saved them (every process must call this), after
  a check that the saved names, shapes and dtypes are the target's. None:
  numpy arrays on this host alone, shaped as saved (no devices, no mesh).
  The same partial restore as a warm start's (`reading.restore_weights`).

  Raises:
    CheckpointError: the step is unfinished, damaged or of another model,
      or holds LoRA adapters without their base weights.
  """
  _refuse_lora(ref)
  with _manager(ref.directory) as manager:
    what = checked_step(manager, str(ref.directory), ref.step)
    return reading.restore_weights(manager, ref.step, target, what)


def _lora_record(ref: CheckpointRef) -> dict | None:
  """The base weights a LoRA checkpoint names (`lora_base`), or None for a whole model's."""
  record = ref.path / "data" / "metadata"
  return json.loads(record.read_text()).get(lora_base.KEY) if record.exists() else None


def _refuse_lora(ref: CheckpointRef) -> None:
  """A LoRA checkpoint holds adapters, not a model: a reader of whole weights alone cannot use it."""
  base = _lora_record(ref)
  if base is not None:
    raise CheckpointError(
      f"checkpoint step {ref.step} in {ref.directory} holds LoRA adapters, not a whole model "
      f"(its base weights: {lora_base.BaseWeights(**base)}); --format=npz and spmd-sample --cpu "
      "cannot read it: spmd-export --format=peft or --merge-lora, spmd-sample on the run's "
      "mesh and --mode=eval can"
    )


def restore_run_weights(ref: CheckpointRef, setup: Any, config: ml_collections.ConfigDict) -> Any:
  """`ref`'s weights on `setup`'s mesh (`trainers.step.state.StateSetup`): what evals and sampling read.

  A whole model's checkpoint: `restore_weights` into the setup's shardings.
  With LoRA (`setup.adapters`): the checkpoint's adapters, and the frozen
  weights from where the run took them (`checkpoint.init_from`, or the
  seed), checked against the base the checkpoint names (its content hash,
  `lora_base`), as a resume checks them.

  Raises:
    CheckpointError: as `restore_weights`, or the base weights are not the
      ones the adapters were trained on.
  """
  target = weights_target(setup.abstract, setup.shardings)
  if not setup.adapters:
    return restore_weights(ref, target)
  paths = setup.trainable_paths
  with _manager(ref.directory) as manager:
    what = checked_step(manager, str(ref.directory), ref.step)
    part = dict(target, params=trainable.split(target["params"], paths)[0])
    adapters = reading.restore_weights(manager, ref.step, part, what)
  full = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  init_from = config.checkpoint.init_from
  initial = initial_state(full, setup.init, init_from, setup.init_with_weights, paths)
  frozen = trainable.split(initial.state["params"], paths)[1]
  source = init_from or f"fresh init (seed {config.seed})"
  lora_base.check_same_base(
    _lora_record(ref), lora_base.BaseWeights(source, lora_base.content_hash(frozen)), what
  )
  return dict(adapters, params=trainable.join(adapters["params"], frozen))
