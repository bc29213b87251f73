"""What a plan reports: memory and compute per device, the KV cache, and the plan itself.

`make_plan` (`plan.py`) fills them in; `advice.py` and `report.py` read them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spmd import compiler_log, hlo


@dataclasses.dataclass(frozen=True)
class Memory:
  """Bytes per device. State sizes come from the shardings; the rest from the compiler."""

  params_bytes: int
  optimizer_bytes: int  # optimizer state plus the step counters
  batch_bytes: int | None
  temp_bytes: int | None  # activations and other temporaries
  code_bytes: int | None
  # TPU: the compiler's peak (`plan.step_bytes`), or the requirement its refusal
  # names; CPU stand-ins: arguments + outputs - donated + temporaries + code.
  total_bytes: int | None
  device_bytes: (
    int | None
  )  # the HBM a program may use, as the device reports it (None: not in the table)
  margin: float  # share of HBM a plan wants free: a warning for compiled TPU steps, the rule for estimates

  @property
  def state_bytes(self) -> int:
    return self.params_bytes + self.optimizer_bytes

  @property
  def usable_bytes(self) -> float | None:
    """HBM less the margin."""
    return None if self.device_bytes is None else self.device_bytes * (1 - self.margin)

  @property
  def short_of_margin(self) -> bool:
    """The compiled total leaves less than the margin of HBM free."""
    usable = self.usable_bytes
    return usable is not None and self.total_bytes is not None and self.total_bytes > usable


@dataclasses.dataclass(frozen=True)
class Compute:
  """FLOPs per device per step, and the step time they imply at an assumed efficiency."""

  compiled_flops: float | None  # the compiled program's dots and convolutions, loops included
  model_flops: float  # 6N per token + attention (the MFU numerator), per device
  peak_flops_per_s: float | None  # dense peak of the device for the compute dtype
  efficiency: tuple[float, float]  # assumed share of peak the compiled FLOPs run at
  step_time_s: tuple[float, float] | None  # (fast, slow)
  mfu: tuple[float, float] | None


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
  """The KV cache of a decode of `batch` sequences of `length` tokens, on the training mesh."""

  batch: int
  length: int
  bytes_per_device: int  # keys and values, the largest shard (`trainers.models.decode`)
  total_bytes: int  # before sharding
  spec: str  # the keys' and values' PartitionSpec [layers, batch, kv_heads, length, head_dim]


@dataclasses.dataclass(frozen=True)
class LoRAPlan:
  """`config.lora`'s saving: what trains, and the state full fine-tuning would hold, per device."""

  rank: int
  targets: int  # weights with adapters
  trainable_params: int  # the adapters' A and B
  full_params_bytes: int  # every parameter in its stored dtype, as full fine-tuning holds it
  full_optimizer_bytes: int  # the optimizer's state over every parameter, plus the counters


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything `spmd-plan` reports."""

  target: str
  device_kind: str
  num_devices: int
  num_slices: int
  hosts: int
  estimated: bool
  mesh: dict[str, int]
  ici: str
  dcn: str
  num_params: int
  units_per_step: int
  unit: str
  rows_per_host: int
  hosts_feeding: int  # distinct row blocks (hosts that are replicas feed the same rows)
  compiled: bool
  memory: Memory
  compute: Compute
  collectives: list[hlo.Collective]
  fits: bool | None
  suggestions: list[str]
  # What gave `fits`: "compiler" (the target's compiler compiled or refused
  # the step), "estimate" (the total against HBM less the margin, for CPU
  # stand-ins), "state" (not compiled; the state alone) or "" (unknown).
  verdict_by: str = ""
  kv_cache: KVCachePlan | None = None  # None: the model has no KV-cache decoder
  compile_error: str | None = None  # the compiler's refusal, when it ran out of memory
  # Arrays the SPMD partitioner could not reshard cheaply, so it copies them
  # whole onto every device ("Involuntary full rematerialization"), read from
  # the compile's log (stderr and libtpu's log folder).
  fallbacks: list[compiler_log.Fallback] = dataclasses.field(default_factory=list)
  attention: list[str] = dataclasses.field(default_factory=list)  # the kernels the step traced
  lora: LoRAPlan | None = None  # None: no config.lora

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["memory"]["state_bytes"] = self.memory.state_bytes
    return out
