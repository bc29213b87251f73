"""What a run sets up once, before its first step, besides data, state and steps.

Where compiled programs are cached, the files that let the workdir stand
alone (the resolved config, the task's code, the files the task made), and
the log of which variables took which placement rule.

Example:
  >>> import tempfile
  >>> from configs import default
  >>> from etils import epath
  >>> workdir = epath.Path(tempfile.mkdtemp()) / "run"
  >>> config = default.get_config()
  >>> config.compilation_cache_dir = str(workdir.parent / "cache")
  >>> compilation_cache_dir(config, workdir) == str(workdir.parent / "cache")
  True
"""

from __future__ import annotations

import hashlib
import logging
import os

import jax
import ml_collections
from etils import epath

from spmd import context
from trainers import paths
from trainers.step.state import StateSetup
from trainers.tasks import Task, task_files

log = logging.getLogger(__name__)

_PLACEMENT_ROWS = 8  # variables without names listed by path; the rest are counted


def compilation_cache_dir(config: ml_collections.ConfigDict, workdir: epath.Path) -> str:
  """The config's cache folder, else JAX's own variable (as configs/default.py documents), else beside the run."""
  return str(
    paths.user_path(
      config.get("compilation_cache_dir", "")
      or os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
      or workdir.parent / ".jax_cache"
    )
  )


def use_compilation_cache(config: ml_collections.ConfigDict, workdir: epath.Path) -> str:
  """Points JAX's persistent compilation cache at `compilation_cache_dir`; returns it."""
  cache_dir = compilation_cache_dir(config, workdir)
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  return cache_dir


def save_run_files(config: ml_collections.ConfigDict, workdir: epath.Path) -> None:
  """The resolved config (JSON) and the task's own files, so the run stands alone.

  A resume or eval needs no original folder: `--config=<workdir>/code/config.py`
  (a copy of the config file, when it sat beside the task) runs the same task.
  """
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=1, sort_keys=True))
  files = sorted({f for spec in (config.task, *config.get("hooks", ())) for f in task_files(spec)})
  if files:
    code = workdir / "code"
    code.mkdir(parents=True, exist_ok=True)
    for path in files:
      target = code / path.name
      if paths.is_url(target) or not (target.exists() and os.path.samefile(path, target)):
        target.write_bytes(path.read_bytes())  # not when a run starts from its own copy


def save_task_files(task: Task, workdir: epath.Path) -> None:
  """The files the task made while preparing data (`Task.run_files`), into the workdir."""
  if task.run_files is None:
    return
  for name, path in task.run_files().items():
    target = workdir / name
    data = epath.Path(path).read_bytes()
    if not (target.exists() and target.read_bytes() == data):
      target.write_bytes(data)


def log_placement(setup: StateSetup) -> None:
  """Which variables took which rule: a count per rule, and the ones without names."""
  by_rule: dict[str, int] = {}
  for _, _, why in setup.placement:
    rule = why.split(" (")[0] if not why.startswith("names") else "by their names"
    by_rule[rule] = by_rule.get(rule, 0) + 1
  log.warning(
    "spmd-train: variable placement: %s",
    ", ".join(f"{n} {rule}" for rule, n in sorted(by_rule.items())),
  )
  unnamed = [row for row in setup.placement if not row[2].startswith("names")]
  for path, spec, why in unnamed[:_PLACEMENT_ROWS]:
    log.warning("spmd-train:   %s -> %s: %s", path, spec, why)
  if len(unnamed) > _PLACEMENT_ROWS:
    log.warning("spmd-train:   ... and %d more without names", len(unnamed) - _PLACEMENT_ROWS)


def context_without_sequences(task: Task, setup: StateSetup) -> str | None:
  """What to tell a user whose mesh splits sequences over `context` for a task that names none.

  None unless the rules split `length` over more than one device and the
  task declares no `sequence_features`: then every context device is fed
  its rows whole, and only what the model itself names `length` is split
  (a model with no sequence, a CNN say, computes the same thing on each).
  """
  shards = context.shards_of(setup.rules, setup.mesh) if setup.mesh is not None else 1
  if shards == 1 or task.sequence_features:
    return None
  return (
    f"spmd-train: the mesh splits sequences over {shards} context devices, but the task names "
    "no sequence_features: each of them gets its rows whole, and only the activations the "
    "model names 'length' are split (a model without a sequence computes the same thing on "
    f"each); set the task's sequence_features, or put those {shards} devices on data or fsdp"
  )


def config_hash(config: ml_collections.ConfigDict) -> str:
  """A short hash of the resolved config, which every host must agree on before a step."""
  return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]
