"""The Task API: what the trainer needs to know about *your* model and data.

A `Task` is a dataclass built with keywords. `spmd-train` finds the function
that makes it from the config, `config.task`, in one of three forms:

  "lm", "llama", "classifier" a built-in task (`BUILTIN_TASKS`)
  "package.module:function"   any importable module
  "task.py:function"          a file, relative to the config file's folder

The function takes the whole (validated) config and returns a `Task`. A task
owns its config section, `config.model`: nothing else in the trainer reads
it, so the task decides its keys (`config_section` checks them for a
dataclass, naming a misspelt key and the nearest valid one).

Everything else (mesh, state, step, data order, checkpoints, hooks, the
watchdog) is the trainer's, and it holds for every task: a user's task gets
exact-once data, host agreement, preemption and bit-identical resume.

Example, a whole task for a classifier on TFDS records with `image` and
`label` features:

  >>> import jax.numpy as jnp, numpy as np, optax
  >>> from flax import nnx
  >>> def loss(model, batch, rngs, train):
  ...   logits = model(batch["image"])
  ...   ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
  ...   correct = (jnp.argmax(logits, -1) == batch["label"]) * batch["mask"]
  ...   return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"]), {"accuracy": jnp.sum(correct)}
  >>> task = Task(
  ...   model=lambda rngs: nnx.Linear(4, 3, rngs=rngs),
  ...   loss=loss,
  ...   prepare_data=lambda data_dir: "my_dataset:1.0.0",
  ...   record_template={"image": np.zeros(4, np.float32), "label": 0},
  ...   to_example=lambda r: {"image": r["image"], "label": np.int32(r["label"]),
  ...                         "mask": np.float32(1)},
  ... )
  >>> task.unit, task.example_shapes()
  ('examples', {'image': ((4,), dtype('float32')), 'label': ((), dtype('int32')), 'mask': ((), dtype('float32'))})
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

Batch = dict[str, jax.Array]
Example = dict[str, np.ndarray]
LossFn = Callable[[Any, Batch, Any, bool], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]

BUILTIN_TASKS = {
  "lm": "trainers.tasks.lm:make_task",
  "classifier": "trainers.tasks.classifier:make_task",
  "llama": "trainers.tasks.llama:make_task",
}
"""Names `config.task` may use for the built-in tasks, and where they live."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
  """What the trainer needs to know about a model and its data; the reference.

  Model:
    model: `nnx.Rngs -> nnx.Module`, building the model from the config (which
      the factory closed over) and the given key streams. Every NNX variable
      is kept: `nnx.Param`s are trained, other variables (`nnx.BatchStat`,
      your own `nnx.Variable` types) are carried in the train state, updated
      by the step, checkpointed and restored. Parameters annotated with
      logical axis names (`spmd.rules.LOGICAL_AXES`) or mesh axis names
      (`nnx.with_partitioning`) are split by `config.mesh.rules`; others by
      `config.mesh.unannotated` (replicated, or FSDP-style).
    loss: `(model, batch, rngs, train) -> (loss_sum, weight, metric_sums)`.
      `batch` is a dict of global arrays shaped `[global_batch, ...]` (the
      stacked examples); `rngs` an `nnx.Rngs` whose keys derive from the seed
      and the step (the same for any host count; draw dropout keys from it);
      `train` is True in the train step (the model is in `.train()` mode) and
      False in eval (`.eval()` mode). Return *sums* over the batch and their
      weight: the trainer divides them after adding up micro-batches and eval
      batches, so means stay exact. The reported loss is `loss_sum / weight`
      and each metric `metric_sums[k] / weight`, under the task's own names:
      `k` in the train metrics and the progress bar, `eval_k` in the evals
      and the run's summary (`{}` reports none). Names the trainer writes
      itself (`loss`, `perplexity`, `learning_rate`, ...:
      `trainers.step.task_metrics.RESERVED_METRICS`) are an error at startup.
      Padding rows (eval) carry `mask == 0` and must add nothing.
    label_classes: integer features that are class labels, by name, with
      their number of classes: `{"targets": vocab_size}`. Each host checks
      its own rows before they are placed on the devices (train and eval):
      a label outside `[0, classes)` where `mask` is not 0 stops the run
      with a `ValueError` naming the step, the row, the column and the label
      (`check_host_labels`); where the mask is 0 any label is ignored (HF's
      -100). A compiled step cannot raise (its loss is NaN there instead).
    float32_features: batch features that stay in float32 when
      `config.train.precision` casts the step to bfloat16 (weights, regression
      targets); every other floating feature is cast with the parameters, so
      the model's matmuls run in bfloat16 (`trainers.step.precision`).
    flops_per_step: optional model FLOPs of one train step (the whole global
      batch, forward and backward). Without it the trainer counts the
      compiled step's matmul FLOPs and reports them as HFU (hardware FLOPs,
      which include recomputation) instead of MFU.

  Data:
    prepare_data: `data_dir -> name`: builds the TFDS dataset in `data_dir`
      unless it is there (process 0 runs it first, the others after) and
      returns the name to open with `tfds.data_source`; or, for several
      weighted sources, a `trainers.data.read.mixture.DataMixture` naming each
      source's prepared splits (the LM tasks' `config.data.sources`).
    prepares_together: when True, `prepare_data(data_dir, group)` is called
      on every process at once (a local or mounted `data.dir`), `group` a
      `trainers.data.prepare.prepare_group.PrepareGroup`: the processes share the
      work and wait for each other through it.
    record_template: one record's features as zeros (shapes and dtypes, no
      data). Its keys are the features `to_example` reads and the only ones
      decoded; `to_example(record_template)` gives the examples' shapes. A
      feature whose length the data decides (LM tokens) may have any length
      here.
    to_example: `record -> example` (`record, window -> example` when
      `examples_per_record > 1` or `plan_records` is set): a dict of
      fixed-shape numpy arrays. Add a `mask` (1.0 for a real example) so
      that eval padding counts nothing.
    to_batch: optional `(records, windows) -> rows`, equal to stacking
      `to_example` but cheaper.
    examples_per_record: how many examples (windows) each record holds,
      when the task knows it without seeing the data.
    plan_records: optional `records -> trainers.data.records.plan.RecordPlan`,
      called once per split on every host with the opened records: how many
      examples each record holds, derived from the data (it replaces
      `examples_per_record`), and what they use of it, in the task's units,
      for the line the run logs (e.g. `lm_examples.lm_windows`).

    sequence_features: the features shaped `[rows, length, ...]`, axis 1
      the sequence (the LM tasks': inputs, targets, mask, segment_ids,
      positions). With `context` in the mesh the step puts each row of them
      in the load-balanced order (`spmd.context`) before the loss, so every
      device gets as much causal attention work as another; a loss that
      sums over tokens does not see the order. Features not named keep
      their order; with none named, sequences split over `context` in
      their own order (exact, unbalanced).

  Training:
    optimizer: optional `(config.train, schedule) -> optax.GradientTransformation`,
      replacing the optimizer named by `config.train.optimizer`. The trainer
      still clips first (`train.grad_clip_norm`) and logs `schedule` as the
      learning rate; its state is placed from its leaves' shapes
      (`trainers.step.optim.opt_state_shardings`). `trainers.step.optim.decay_mask`
      gives the default weight-decay mask.
    hooks: optional `Hook`s (`trainers.hooks`), each with its own schedule,
      run on every process after the built-in ones, and `Wrapper`s of this
      process's rows, the batch stream or the train step (a data check of
      your own, say); `config.hooks` adds more.

  Reporting:
    unit: what throughput counts: "tokens", "examples", "images", ...
    count_units: `batch -> scalar`, the real units in a batch (padding
      excluded), computed on the devices in the step; a sum over rows, so
      that per-device counts add up. Default: the sum of `batch["mask"]`,
      else the number of rows.
    units_per_batch: optional, the units a batch holds without any padding
      (e.g. `global_batch * seq_len` tokens); with it the run's summary
      reports `real_<unit>_share`, the mean share of real units per step.
    report: optional `(model, step) -> str`, called once at the end of a
      run on every process with the trained model in eval mode (e.g. a
      sample); process 0 prints it. A failing report is logged, never fatal.
    run_files: optional `() -> {name: path}`, called on process 0 once the
      data is prepared: files the run keeps in its workdir under `name`
      (e.g. the tokenizer, so the run's text decodes without its data dir).
  """

  model: Callable[[Any], Any]
  loss: LossFn
  prepare_data: Callable[..., Any]  # a TFDS name, or a DataMixture
  record_template: Mapping[str, Any]
  to_example: Callable[..., Example]
  to_batch: Callable[[Sequence[Any], np.ndarray], Example] | None = None
  examples_per_record: int = 1
  plan_records: Callable[[Sequence[Any]], Any] | None = None
  unit: str = "examples"
  count_units: Callable[[Batch], jax.Array] | None = None
  units_per_batch: float | None = None
  float32_features: tuple[str, ...] = ("mask",)
  label_classes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  flops_per_step: float | None = None
  report: Callable[[Any, int], str] | None = None
  optimizer: Callable[[ml_collections.ConfigDict, Any], Any] | None = None
  hooks: Sequence[Any] = ()
  run_files: Callable[[], Mapping[str, str]] | None = None
  prepares_together: bool = False
  sequence_features: tuple[str, ...] = ()

  def __post_init__(self):
    for name in ("model", "loss", "prepare_data", "to_example"):
      if not callable(getattr(self, name)):
        raise TypeError(f"Task.{name} must be callable, got {getattr(self, name)!r}")
    if not isinstance(self.record_template, Mapping) or not self.record_template:
      raise TypeError(f"Task.record_template={self.record_template!r} must be a non-empty dict")
    if not isinstance(self.examples_per_record, int) or self.examples_per_record < 1:
      raise ValueError(f"Task.examples_per_record={self.examples_per_record!r} must be >= 1")
    if self.plan_records is not None and not callable(self.plan_records):
      raise TypeError(f"Task.plan_records must be callable or None, got {self.plan_records!r}")
    if self.flops_per_step is not None and not self.flops_per_step > 0:
      raise ValueError(f"Task.flops_per_step={self.flops_per_step!r} must be positive or None")
    if not isinstance(self.label_classes, Mapping) or not all(
      isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n > 0
      for k, n in self.label_classes.items()
    ):
      raise TypeError(
        f"Task.label_classes={self.label_classes!r} must map feature names to class counts"
      )
    for name in ("float32_features", "sequence_features"):
      value = getattr(self, name)
      if isinstance(value, str) or not all(isinstance(n, str) for n in value):
        raise TypeError(f"Task.{name}={value!r} must be a tuple of feature names")

  def example(self) -> Example:
    """The example of the record template (window 0)."""
    if self.examples_per_record > 1 or self.plan_records is not None:
      return self.to_example(self.record_template, 0)
    return self.to_example(self.record_template)

  def example_shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each example feature's shape and dtype."""
    return {k: (np.shape(v), np.asarray(v).dtype) for k, v in self.example().items()}

  def units(self, batch: Batch) -> jax.Array:
    """The real units in `batch` (`count_units`, or its default)."""
    if self.count_units is not None:
      return jnp.asarray(self.count_units(batch), jnp.float32)
    if "mask" in batch:
      return jnp.sum(batch["mask"]).astype(jnp.float32)
    return jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)


def _outside(index: Any, label: Any, weight: Any, count: Any, shape: tuple, classes: int) -> str:
  where = ", ".join(str(int(i)) for i in np.unravel_index(int(index), shape))
  return (
    f"labels[{where}]={int(label)} is outside [0, {classes}) where the mask is "
    f"{float(weight):g} ({int(count)} such labels in this batch): a label to ignore (HF's "
    "-100) needs mask 0 there"
  )


def check_labels(labels: jax.Array, mask: jax.Array, classes: int) -> None:
  """Raises `ValueError` naming the first label outside `[0, classes)` where `mask` is not 0.

  Where the mask is 0 any label is ignored (HF's -100 among them). Concrete
  arrays are checked here. A traced program (a train step) is not: a host
  callback in the step would keep JAX from writing it to the persistent
  compilation cache, so every start would compile it again. There the
  label's loss is NaN instead; the trainer checks each host's rows before
  they reach the step (`Task.label_classes`, `check_host_labels`).

  Example:
    >>> check_labels(jnp.array([[3, -100]]), jnp.array([[1.0, 0.0]]), classes=4)
    >>> check_labels(jnp.array([[3, -100]]), jnp.array([[1.0, 1.0]]), classes=4)
    Traceback (most recent call last):
    ...
    ValueError: labels[0, 1]=-100 is outside [0, 4) where the mask is 1 (1 such labels in this batch): a label to ignore (HF's -100) needs mask 0 there
  """
  bad = (mask != 0) & ((labels < 0) | (labels >= classes))
  try:
    concrete = bool(np.any(bad))
  except jax.errors.TracerBoolConversionError:
    return  # traced: the loss is NaN there (see above)
  if concrete:
    flat = np.flatnonzero(np.asarray(bad))
    first = int(flat[0])
    at = np.unravel_index(first, bad.shape)
    found = (first, np.asarray(labels)[at], np.asarray(mask)[at], flat.size)
    raise ValueError(_outside(*found, labels.shape, classes))


def check_host_labels(
  step: int, rows: Mapping[str, np.ndarray], label_classes: Mapping[str, int], first_row: int = 0
) -> None:
  """Raises `ValueError` naming a label of this host's `rows` outside `[0, classes)` under mask 1.

  `rows` are one step's rows of this host as numpy arrays, before placement;
  `first_row` is the global row of the first (named in the error). Where
  `rows["mask"]` (if any) is 0 the label is ignored. One vectorized
  comparison per label feature: the cost of a step's rows is negligible.

  Example:
    >>> rows = {"targets": np.array([[3, -100], [4, 1]]), "mask": np.array([[1.0, 0.0], [1.0, 1.0]])}
    >>> check_host_labels(7, rows, {"targets": 4}, first_row=16)
    Traceback (most recent call last):
    ...
    ValueError: step 7: targets[17, 0]=4 is outside [0, 4) where the mask is 1 (1 such labels in this host's rows): a label to ignore (HF's -100) needs mask 0 there
  """
  for name, classes in label_classes.items():
    labels = np.asarray(rows[name])
    bad = (labels < 0) | (labels >= classes)
    if "mask" in rows:
      bad &= np.asarray(rows["mask"]) != 0
    if not bad.any():
      continue
    flat = np.flatnonzero(bad)
    at = np.unravel_index(flat[0], bad.shape)
    weight = np.asarray(rows["mask"])[at] if "mask" in rows else 1.0
    where = ", ".join(str(int(i) + (first_row if d == 0 else 0)) for d, i in enumerate(at))
    raise ValueError(
      f"step {step}: {name}[{where}]={int(labels[at])} is outside [0, {classes}) where the mask "
      f"is {float(weight):g} ({flat.size} such labels in this host's rows): a label to ignore "
      "(HF's -100) needs mask 0 there"
    )


def cross_entropy_sums(
  logits: jax.Array, labels: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """A classifier's `Task.loss` result: summed cross-entropy, its weight, correct predictions.

  `logits` are `[..., classes]`, `labels` integers `[...]`, `mask` 1.0 for
  what counts (0.0 for padding). Next-token prediction is the same with a
  sequence axis. Where the mask is 0 the label is ignored, whatever it is
  (HF's -100); a label outside `[0, classes)` where it is not is an error
  naming it (`check_labels`).

  Example:
    >>> loss_sum, weight, sums = cross_entropy_sums(
    ...   jnp.array([[2.0, 0.0], [0.0, 2.0]]), jnp.array([0, -100]), jnp.array([1.0, 0.0]))
    >>> float(weight), float(sums["accuracy"]), round(float(loss_sum), 4)
    (1.0, 1.0, 0.1269)
  """
  import optax

  classes = logits.shape[-1]
  check_labels(labels, mask, classes)
  inside = (labels >= 0) & (labels < classes)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(inside, labels, 0))
  # NaN where a label outside counts (the check has raised), nothing where it is masked.
  ce = jnp.where(mask != 0, jnp.where(inside, ce, jnp.nan) * mask, 0.0)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return jnp.sum(ce), jnp.sum(mask), {"accuracy": jnp.sum(correct * mask)}


def resolve_task_spec(spec: str, config_dir: str | Path | None = None) -> str:
  """`config.task` as an absolute spec: a built-in name's module, or a file's full path.

  Example:
    >>> resolve_task_spec("lm")
    'trainers.tasks.lm:make_task'
    >>> resolve_task_spec("task.py:make_task", "/home/me/cnn")
    '/home/me/cnn/task.py:make_task'
    >>> resolve_task_spec("my_task")
    Traceback (most recent call last):
    ...
    ValueError: config.task='my_task' is not a built-in task (['classifier', 'llama', 'lm']), 'package.module:function' or 'file.py:function'
  """
  if spec in BUILTIN_TASKS:
    return BUILTIN_TASKS[spec]
  module, sep, function = spec.rpartition(":")
  if not sep or not module or not function.isidentifier():
    raise ValueError(
      f"config.task={spec!r} is not a built-in task ({sorted(BUILTIN_TASKS)}), "
      "'package.module:function' or 'file.py:function'"
    )
  if module.endswith(".py"):
    path = Path(module)
    if not path.is_absolute():
      if config_dir is None:
        raise ValueError(f"config.task={spec!r} names a relative file but no config file is known")
      path = Path(config_dir) / path
    return f"{path.resolve()}:{function}"
  return spec


def load_task_factory(spec: str) -> Callable[[ml_collections.ConfigDict], Task]:
  """The factory a resolved spec names (see `resolve_task_spec`).

  A file is imported as a module named after it, with its folder first on
  `sys.path`, so it can import its sibling modules (`import cnn`) wherever
  the folder lives, with no `PYTHONPATH`.
  """
  module_name, _, function = spec.rpartition(":")
  if module_name.endswith(".py"):
    path = Path(module_name)
    if not path.is_file():
      raise FileNotFoundError(f"config.task: the task file {str(path)!r} does not exist")
    folder = str(path.parent)
    if folder not in sys.path:
      sys.path.insert(0, folder)
    module = sys.modules.get(path.stem)
    if module is None or Path(getattr(module, "__file__", "") or "").resolve() != path:
      file_spec = importlib.util.spec_from_file_location(path.stem, path)
      module = importlib.util.module_from_spec(file_spec)
      sys.modules[path.stem] = module
      file_spec.loader.exec_module(module)
  else:
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      raise ValueError(f"config.task={spec!r}: cannot import {module_name!r} ({e})") from None
  factory = getattr(module, function, None)
  if not callable(factory):
    raise ValueError(f"config.task={spec!r}: {module_name!r} has no function {function!r}")
  return factory


def model_section(cls: type, config: ml_collections.ConfigDict):
  """A built-in model's `config.model`, computing in the dtype `config.train.precision` names.

  The built-in models cast their parameters to their `dtype` for compute; the
  policy (`trainers.step.precision`) sets it, so that one setting decides
  what every model computes in, and `config.model.dtype` is an error.

  Example:
    >>> from configs import lm_tiny
    >>> from trainers.models.transformer import TransformerConfig
    >>> config = lm_tiny.get_config()
    >>> config.train.precision = "bfloat16"
    >>> model_section(TransformerConfig, config).dtype
    'bfloat16'
  """
  if "dtype" in config.model:
    raise ValueError(
      f"config.model.dtype={config.model.dtype!r} is not a setting: what every model computes "
      "in is config.train.precision ('float32' or 'bfloat16'); set that instead"
    )
  train = config.get("train") or {}
  return dataclasses.replace(
    config_section(cls, config.model), dtype=train.get("precision", "float32")
  )


def make_task(config: ml_collections.ConfigDict) -> Task:
  """The task `config.task` names, built from `config` (resolved by `trainers.config`).

  Example:
    >>> from configs import lm_tiny
    >>> task = make_task(lm_tiny.get_config())
    >>> task.unit, task.float32_features
    ('tokens', ('mask',))
  """
  task = load_task_factory(resolve_task_spec(config.task))(config)
  if not isinstance(task, Task):
    raise TypeError(f"config.task={config.task!r} returned {type(task).__name__}, not a Task")
  return task


def task_files(spec: str) -> list[Path]:
  """The files to keep with a run for a file task: the `.py` files of its folder."""
  module_name = spec.rpartition(":")[0]
  if not module_name.endswith(".py"):
    return []
  return sorted(Path(module_name).parent.glob("*.py"))


def config_section(cls: type, section: ml_collections.ConfigDict | Mapping, name: str = "model"):
  """`cls(**section)` for a dataclass, naming a misspelt key and the nearest valid one.

  Example:
    >>> @dataclasses.dataclass(frozen=True)
    ... class Sizes:
    ...   width: int = 8
    >>> config_section(Sizes, {"width": 16})
    Sizes(width=16)
    >>> config_section(Sizes, {"widht": 16})
    Traceback (most recent call last):
    ...
    ValueError: config.model.widht is not a setting of Sizes (did you mean 'width'?); valid: ['width']
  """
  values = dict(section.items()) if hasattr(section, "items") else dict(section)
  valid = [f.name for f in dataclasses.fields(cls)]
  for key in values:
    if key not in valid:
      near = difflib.get_close_matches(key, valid, n=1)
      hint = f" (did you mean {near[0]!r}?)" if near else ""
      raise ValueError(
        f"config.{name}.{key} is not a setting of {cls.__name__}{hint}; valid: {valid}"
      )
  return cls(**values)
