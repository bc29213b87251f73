"""Plan a run ahead of time: compile the real train step for a target and read the numbers.

`make_plan(config, target)` builds the mesh, the state and the train step with
the same functions `spmd-train` uses (`build_mesh`, `make_state`,
`make_train_step`), then lowers and compiles the step against the target's
device descriptions with shape-only inputs: nothing is allocated. From the
compiled program it reads memory per device, FLOPs and the collectives; from
the compiler's log (`spmd.compiler_log`: stderr and libtpu's log folder) the
arrays XLA could only reshard by copying them whole to every device.

Targets:
  TPU slices (`tpu_target("v5p-256", num_slices=2)`): libtpu's real topology,
    so memory, FLOPs and collectives are the TPU compiler's own figures.
  GPUs (`gpu_target("h100", 16)`): no topology description exists, so the
    step compiles for as many CPU devices; sharding, parameter/optimizer bytes
    and collectives are exact, temporaries and FLOPs are the CPU compiler's,
    flagged as estimates.

The step-time range is an assumption, stated with the result: the compiled
FLOPs at a fraction of the device's dense peak (default 35-60%, the range
well-tuned LM training reaches on TPUs and H100s; the check model's step on a
v5e chip runs its matmuls at about 57%).

Example:
  >>> from configs import lm_tiny
  >>> from trainers.planning.targets import gpu_target
  >>> plan = make_plan(lm_tiny.get_config(), gpu_target("h100", 8))   # 8 CPU devices
  >>> plan.fits, plan.memory.params_bytes == plan.num_params * 4  # data parallel: replicated
  (True, True)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from spmd import compiler_log, hlo
from spmd import rules as rules_lib
from spmd.layout import data_layout
from trainers.models import attention, decode
from trainers.planning import advice
from trainers.planning.figures import Compute, KVCachePlan, LoRAPlan, Memory, Plan
from trainers.planning.targets import Target
from trainers.reporting import chips
from trainers.reporting.throughput import step_compute_dtype
from trainers.step import trainable
from trainers.step.loss import abstract_batch, batch_shardings
from trainers.step.mesh import build_mesh
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import make_task

log = logging.getLogger(__name__)


def step_bytes(stats: Any, on_tpu: bool) -> int:
  """Bytes per device a compiled step needs, from its `memory_analysis()`.

  On a TPU the compiler's own peak (`peak_memory_in_bytes`): libtpu's
  temporaries already hold the state, so adding arguments and outputs to them
  would count the state twice. XLA:CPU's peak leaves the temporaries out, so
  a program compiled for CPU stand-ins is the sum: arguments + outputs -
  donated + temporaries + code.
  """
  if on_tpu:
    return stats.peak_memory_in_bytes
  return (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
    + stats.generated_code_size_in_bytes
  )


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (the largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard = leaf.sharding.shard_shape(leaf.shape)
    total += math.prod(shard) * leaf.dtype.itemsize
  return total


def make_plan(
  config: ml_collections.ConfigDict,
  target: Target,
  efficiency: tuple[float, float] = (0.35, 0.60),
  margin: float = 0.1,
  compile_step: bool | None = None,
  keep_compiled: list | None = None,
  decode_batch: int | None = None,
  verify_suggestions: bool = True,
) -> Plan:
  """Compiles `config`'s train step for `target` and reads what it needs.

  Args:
    efficiency: (low, high) share of the dense peak the compiled FLOPs are
      assumed to run at, for the step-time and MFU range.
    margin: share of HBM kept free (runtime, fragmentation) when judging fit.
    compile_step: None compiles unless parameters and optimizer state alone
      already exceed the device's memory (compiling would only cost minutes);
      True always; False never.
    keep_compiled: if given, the compiled executable is appended to it.
    decode_batch: sequences of the KV-cache row (a decode of decode_batch x
      seq_len on the training mesh); None: `config.global_batch`.
    verify_suggestions: when activations do not fit, compile the suggested
      micro-batch counts to name one that does (a refusal costs seconds, a
      fit one more compile).
  """
  _check_plan_options(efficiency, decode_batch)
  mesh, batch_axes = build_mesh(config, target.devices)
  task = make_task(config)
  kv_cache = kv_cache_plan(task, config, mesh, decode_batch or config.global_batch)
  setup = make_state(task.model, config, mesh, batch_axes, task.optimizer)
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  layout = data_layout(mesh, config.global_batch, batch_axes)
  params_bytes = per_device_bytes(state["params"])
  optimizer_bytes = per_device_bytes({k: v for k, v in state.items() if k != "params"})
  device_bytes = chips.device_memory_bytes(target.device_kind)
  if compile_step is None:
    compile_step = device_bytes is None or params_bytes + optimizer_bytes <= device_bytes
  placement = batch_shardings(task, rules_lib.preset(config.mesh.rules), mesh, batch_axes)
  batch = abstract_batch(task, config.global_batch, placement)
  batch_bytes = per_device_bytes(batch)

  def step_for(changed: ml_collections.ConfigDict) -> Any:
    return make_train_step(setup, task, changed, mesh, batch_axes)

  compiled = refusal = None
  fallbacks: list[compiler_log.Fallback] = []
  with attention.recorded_choices() as kernels:
    if compile_step:
      # The persistent cache is off for this compile: a hit would say nothing.
      with compiler_log.capture_compiler_log() as log:
        compiled, refusal = _compile_or_refusal(step_for(config), state, batch)
      fallbacks = log.fallbacks
    if keep_compiled is not None and compiled is not None:
      keep_compiled.append(compiled)
  step = _read_step(compiled, refusal, mesh, config.train.precision)
  memory = Memory(
    params_bytes,
    optimizer_bytes,
    batch_bytes,
    step.temp_bytes,
    step.code_bytes,
    step.total_bytes,
    device_bytes,
    margin,
  )
  fits, verdict_by = _fits(memory, step.compile_error, compiled is not None, target.estimated)
  compile_total = None
  if compile_step and verify_suggestions:
    compile_total = _micro_batch_totals(config, step_for, state, batch, _on_tpu(mesh))
  suggestions = _advice(fits, memory, config, mesh, layout, compile_total)
  return Plan(
    target=target.name,
    device_kind=target.device_kind,
    num_devices=mesh.devices.size,
    num_slices=target.num_slices,
    hosts=target.hosts,
    estimated=target.estimated,
    mesh=dict(mesh.shape),
    ici=config.mesh.ici,
    dcn=config.mesh.dcn,
    num_params=sum(math.prod(p.shape) for p in jax.tree.leaves(setup.abstract["params"])),
    units_per_step=_units_per_step(task, config.global_batch),
    unit=task.unit,
    rows_per_host=_rows_per_host(layout, target),
    hosts_feeding=_hosts_feeding(layout, target),
    compiled=compiled is not None,
    memory=memory,
    compute=_compute(
      task, config, target, mesh.devices.size, efficiency, step.flops, step.computes_in
    ),
    collectives=step.collectives,
    fits=fits,
    verdict_by=verdict_by,
    suggestions=suggestions,
    kv_cache=kv_cache,
    compile_error=step.compile_error,
    fallbacks=fallbacks,
    attention=[k.describe() for k in kernels],
    lora=_lora_plan(config, task, setup, mesh, batch_axes),
  )


def _lora_plan(config, task, setup, mesh, batch_axes) -> LoRAPlan | None:
  """With `config.lora`: what trains, and the state of full fine-tuning (shapes only, no compile)."""
  if not setup.adapters:
    return None
  full_config = ml_collections.ConfigDict(config.to_dict())
  full_config.lora.targets = ""
  full = make_state(task.model, full_config, mesh, batch_axes, task.optimizer)
  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), full.abstract, full.shardings
  )
  trained = trainable.split(setup.abstract["params"], setup.trainable_paths)[0]
  return LoRAPlan(
    rank=setup.adapters[0].rank,
    targets=len(setup.adapters),
    trainable_params=sum(math.prod(p.shape) for p in jax.tree.leaves(trained)),
    full_params_bytes=per_device_bytes(state["params"]),
    full_optimizer_bytes=per_device_bytes({k: v for k, v in state.items() if k != "params"}),
  )


def _check_plan_options(efficiency: tuple[float, float], decode_batch: int | None) -> None:
  """The assumed efficiency range and the decode batch are ones a plan can use."""
  if not 0 < efficiency[0] <= efficiency[1] <= 1:
    raise ValueError(f"{efficiency=} must be 0 < low <= high <= 1")
  if decode_batch is not None and (isinstance(decode_batch, bool) or decode_batch < 1):
    raise ValueError(f"{decode_batch=} must be a positive integer (None: global_batch)")


def _compile_or_refusal(step: Any, state: Any, batch: Any) -> tuple[Any, Exception | None]:
  """The compiled step, or None and the compiler's out-of-memory refusal; other errors raise."""
  try:
    return step.lower(state, batch).compile(), None
  except jax.errors.JaxRuntimeError as e:
    # A TPU compiler that cannot fit the program refuses it, saying how much
    # its temporaries need: that is the verdict, with the figure to act on.
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return None, e


@dataclasses.dataclass(frozen=True)
class _StepReading:
  """What the compiled step (or the compiler's refusal) says; None where it says nothing."""

  temp_bytes: float | None = None
  code_bytes: int | None = None
  total_bytes: float | None = None
  flops: float | None = None
  collectives: list[hlo.Collective] = dataclasses.field(default_factory=list)
  compile_error: str | None = None
  computes_in: str | None = None  # the dtype its matmuls take (`step_compute_dtype`)


def _read_step(
  compiled: Any,
  refusal: Exception | None,
  mesh: jax.sharding.Mesh,
  precision: str = "float32",
) -> _StepReading:
  """Memory, matmul FLOPs and collectives of the compiled step, or what its refusal tells."""
  if refusal is not None:
    oom = advice.out_of_memory(refusal)
    return _StepReading(
      # The refusal's figure is the compiler's whole requirement, state included.
      total_bytes=None if oom is None else oom.required_bytes,
      compile_error=str(refusal).strip().splitlines()[0],
    )
  if compiled is None:
    return _StepReading()
  stats = compiled.memory_analysis()
  text = compiled.as_text()
  slices = [getattr(d, "slice_index", 0) or 0 for d in mesh.devices.flat]
  return _StepReading(
    temp_bytes=stats.temp_size_in_bytes,
    code_bytes=stats.generated_code_size_in_bytes,
    total_bytes=step_bytes(stats, on_tpu=_on_tpu(mesh)),
    # Not XLA's cost analysis: it counts a loop body once, so with the layers
    # in a scan it would report about one layer's worth.
    flops=hlo.matmul_flops(text) or None,
    collectives=hlo.collectives(text, slices),
    # A program compiled for CPU stand-ins (a GPU plan) is widened by XLA:CPU:
    # only a program for the real chips tells what they multiply in.
    computes_in=step_compute_dtype(precision, text) if _on_tpu(mesh) else None,
  )


def _on_tpu(mesh: jax.sharding.Mesh) -> bool:
  """The mesh's devices are TPUs (real ones or libtpu's descriptions), not CPU stand-ins."""
  return mesh.devices.flat[0].platform != "cpu"


def _compute(
  task: Any,
  config: ml_collections.ConfigDict,
  target: Target,
  num_devices: int,
  efficiency: tuple[float, float],
  flops: float | None,
  computes_in: str | None = None,
) -> Compute:
  """The step's FLOPs per device, and the step time and MFU they give at `efficiency` of peak.

  The peak is that of the dtype the compiled step multiplies in
  (`computes_in`), the policy's when nothing compiled.
  """
  peak = chips.table_peak(target.device_kind, computes_in or config.train.precision)
  # Without the task's model FLOPs, the compiled (hardware) FLOPs stand in.
  model_flops = (task.flops_per_step or (flops or 0.0) * num_devices) / num_devices
  step_time = achieved = None
  if peak and (flops or model_flops):
    work = flops or model_flops
    step_time = (work / (peak * efficiency[1]), work / (peak * efficiency[0]))
    achieved = (model_flops / (peak * step_time[1]), model_flops / (peak * step_time[0]))
  return Compute(flops, model_flops, peak, efficiency, step_time, achieved)


def _fits(
  memory: Memory, compile_error: str | None, compiled: bool, estimated: bool
) -> tuple[bool | None, str]:
  """The verdict, and what gave it: "compiler", "estimate" or "state" ("" when unknown).

  For a TPU target the compiler is libtpu's own, which refuses a program
  whose buffers exceed the chip's HBM: a step it compiles fits, one it
  refuses does not. The margin is no part of that verdict (the report warns
  beside it when less than the margin is left). A step compiled for CPU
  stand-ins (GPUs) has estimated temporaries, so there the total must leave
  the margin free. Not compiled: only a state too big for the device is a
  verdict.
  """
  if compile_error is not None:
    return False, "compiler"
  if compiled and not estimated:
    return True, "compiler"
  usable = memory.usable_bytes
  if usable is None:
    return None, ""
  if memory.total_bytes is not None:
    return memory.total_bytes <= usable, "estimate"
  return (False, "state") if memory.state_bytes > usable else (None, "")


def _advice(
  fits: bool | None,
  memory: Memory,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  layout: Any,
  compile_total: Callable[[int], int | None] | None,
) -> list[str]:
  """`advice.suggestions_to_fit` for a plan that does not fit; none for one that fits or may."""
  if fits is not False:
    return []
  return advice.suggestions_to_fit(
    memory,
    dict(mesh.shape),
    config.mesh.rules,
    mesh.devices.size,
    rows_per_device=max(1, config.global_batch // layout.data_parallel),
    micro_batches=config.train.micro_batches,
    compile_total=compile_total,
  )


def _micro_batch_totals(
  config: ml_collections.ConfigDict,
  step_for: Callable[[ml_collections.ConfigDict], Any],
  state: Any,
  batch: Any,
  on_tpu: bool,
) -> Callable[[int], int | None]:
  """Bytes per device of the step with N micro-batches; None when the compiler refuses it."""

  def compile_total(micro_batches: int) -> int | None:
    changed = config.copy_and_resolve_references()
    changed.train.micro_batches = micro_batches
    compiled, _ = _compile_or_refusal(step_for(changed), state, batch)
    return None if compiled is None else step_bytes(compiled.memory_analysis(), on_tpu)

  return compile_total


def kv_cache_plan(
  task, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, batch: int
) -> KVCachePlan | None:
  """The KV cache of a decode of `batch` x seq_len, sharded by `config.mesh.rules` on `mesh`.

  Arithmetic on the cache's abstract arrays and their shardings: nothing is
  compiled. None when the task's model has no cached decoder.

  Raises:
    ValueError: `batch` (or the key/value heads) does not divide over the
      mesh axes the rules split it over.
  """
  from flax import nnx

  model = nnx.eval_shape(lambda: task.model(nnx.Rngs(0)))
  shape = decode.cache_shape(getattr(model, "config", None))
  if shape is None:
    return None
  length = model.config.seq_len
  try:
    cache = decode.abstract_cache(shape, batch, length, mesh, rules_lib.preset(config.mesh.rules))
  except ValueError as e:
    raise ValueError(f"the KV cache of a decode of {batch=} x {length}: {e}") from None
  return KVCachePlan(
    batch=batch,
    length=length,
    bytes_per_device=decode.cache_bytes_per_device(cache),
    total_bytes=shape.bytes(batch, length),
    spec=str(cache.keys.sharding.spec),
  )


def _units_per_step(task, global_batch: int) -> int:
  """The most units a step holds: the task's own count, else a full batch of template examples.

  A template example can be all padding (a packed window of zeros), so the
  task's `units_per_batch`, when it gives one, is the answer.
  """
  if task.units_per_batch:
    return int(task.units_per_batch)
  example = task.example()
  batch = {k: np.stack([np.asarray(v)] * global_batch) for k, v in example.items()}
  return int(task.units(batch))


def _rows_per_host(layout, target: Target) -> int:
  if not target.estimated:
    return layout.per_host_batch
  # Stand-in CPU devices all belong to this process: hosts own contiguous
  # blocks of the data axes (create_mesh's order), so a host of
  # `devices_per_host` devices feeds that share of the batch, replicas aside.
  per_device = layout.global_batch // layout.data_parallel
  return per_device * min(target.devices_per_host, layout.data_parallel)


def _hosts_feeding(layout, target: Target) -> int:
  if not target.estimated:
    return layout.num_shards
  return max(1, layout.data_parallel // target.devices_per_host)
