"""What would make a plan that does not fit fit: more FSDP, micro-batches, or less.

Estimated from the plan's own figures; `make_plan` compiles the micro-batch
counts it suggests where it can, and reads the compiler's out-of-memory
refusal (`out_of_memory`) when it cannot.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from trainers.planning.figures import Memory


def suggestions_to_fit(
  plan_memory: Memory,
  mesh: dict[str, int],
  rules: str,
  num_devices: int,
  rows_per_device: int = 1,
  micro_batches: int = 1,
  compile_total: Callable[[int], int | None] | None = None,
) -> list[str]:
  """Mesh and config changes that would make a plan that does not fit fit.

  Estimated from the plan's own figures: state scales with the devices that
  split it, activations with the rows a device holds at once.
  `compile_total(m)`, if given, compiles the step with `m` micro-batches and
  returns its bytes per device (None when the compiler refuses it).
  """
  usable = plan_memory.usable_bytes
  if usable is None:
    return []
  fsdp = mesh.get("fsdp", 1) if rules in ("fsdp", "fsdp_tp") else 1
  # State splits over the FSDP axis (and tensor, if used); estimate what it
  # would be replicated, then at each larger FSDP size.
  replicated_state = (
    plan_memory.state_bytes * fsdp * (mesh.get("tensor", 1) if rules == "fsdp_tp" else 1)
  )
  rest = (plan_memory.total_bytes or plan_memory.state_bytes) - plan_memory.state_bytes
  gib = 2**30
  out = []
  # Only when the rest fits: activations alone over the limit need no more
  # FSDP; and one device has no others to share its state with.
  if rest < usable and num_devices > 1:
    size = 2
    while size <= num_devices:
      if size > fsdp and num_devices % size == 0 and replicated_state / size + rest <= usable:
        out.append(
          f"shard the state over more devices: --config.mesh.rules=fsdp "
          f"--config.mesh.ici=data=-1,fsdp={size},tensor=1 "
          f"(state ~{replicated_state / size / gib:.2f} GiB per device)"
        )
        break
      size *= 2
    else:
      needed = math.ceil(replicated_state / max(usable - rest, 1))
      out.append(
        f"even FSDP over all {num_devices} devices leaves {replicated_state / num_devices / gib:.1f} GiB "
        f"of state per device; it needs at least {needed} devices of this kind "
        f"({replicated_state / gib:.0f} GiB of parameters and optimizer state in all), or a smaller model"
      )
  # What grows with the rows a device holds: all the step needs beyond its
  # state and batch (the compiler's temporaries where no total is known).
  inputs = plan_memory.state_bytes + (plan_memory.batch_bytes or 0)
  total = plan_memory.total_bytes
  activations = total - inputs if total is not None else plan_memory.temp_bytes
  if activations and activations > usable / 2:
    room = usable - inputs  # what activations may take
    split = micro_batches_to_fit(activations, room, rows_per_device, micro_batches)
    # Activations shrink less than in proportion (some do not depend on the
    # rows), so an estimate may be short: where the plan can compile, it tries
    # the estimate and larger counts, and names the first that fits.
    checked = None
    if split and compile_total is not None:
      for m in range(split, rows_per_device + 1):
        if rows_per_device % m == 0:
          needs = compile_total(m)
          if needs is not None and needs <= usable:
            checked = (m, needs)
            break
      else:
        split = None
    if checked:
      out.append(
        f"activations take {activations / gib:.1f} GiB: --config.train.micro_batches={checked[0]} "
        f"fits (compiled: {checked[1] / gib:.2f} GiB in all per device), "
        "as a smaller global_batch would"
      )
    elif split:
      out.append(
        f"activations take {activations / gib:.1f} GiB and {room / gib:.1f} GiB is left for them: "
        f"--config.train.micro_batches={split} divides them roughly by "
        f"{split / micro_batches:g} (~{activations * micro_batches / split / gib:.1f} GiB), "
        "as a smaller global_batch would"
      )
    else:
      out.append(
        f"activations take {activations / gib:.1f} GiB and {room / gib:.1f} GiB is left for them, "
        f"more than micro-batches of one row each save: a shorter seq_len, "
        "--config.model.remat_policy=full, or more tensor parallelism"
      )
  return out


def micro_batches_to_fit(
  temp: float, room: float, rows_per_device: int, micro_batches: int
) -> int | None:
  """The fewest micro-batches (dividing the device's rows) whose activations fit in `room`.

  `rows_per_device` is the device's share of the whole step's batch.
  Activations grow with the rows a device holds at once, so `m` micro-batches
  of the same rows take about `micro_batches / m` of today's temporaries.

  Example:
    >>> micro_batches_to_fit(24.7, 13.9, rows_per_device=4, micro_batches=1)
    2
    >>> micro_batches_to_fit(24.7, 5.0, rows_per_device=4, micro_batches=1) is None
    True
  """
  for m in range(micro_batches + 1, rows_per_device + 1):
    if rows_per_device % m == 0 and temp * micro_batches / m <= room:
      return m
  return None


# libtpu's refusals of a program that does not fit its HBM, in XLA's
# human-readable sizes (powers of 1024), e.g.
#   "the total memory required for HLO temporaries (24.73G) exceeds available HBM (15.75G)"
#   "Ran out of memory in memory space hbm. Used 16.34G of 15.75G hbm."
_REFUSALS = (
  re.compile(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
  re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
)


def _size(number: str, unit: str) -> float:
  return float(number) * 1024 ** " KMGT".index(unit or " ")


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
  """What the TPU compiler's refusal says: the bytes it needs per device, and the device's."""

  required_bytes: float
  available_bytes: float


def out_of_memory(error: BaseException | str) -> OutOfMemory | None:
  """The bytes a refused program needs and the device has, from the TPU compiler's refusal.

  The figure is the compiler's whole requirement of the device (libtpu's
  temporaries hold the state as well): what the step is short by is the
  difference. None when the error gives no figures.

  Example:
    >>> e = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
    ...   "required for HLO temporaries (24.73G) exceeds available HBM (15.75G).")
    >>> oom = out_of_memory(e)
    >>> round(oom.required_bytes / 2**30, 2), round(oom.available_bytes / 2**30, 2)
    (24.73, 15.75)
    >>> oom = out_of_memory("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
    ...   "memory in memory space hbm. Used 16.34G of 15.75G hbm. Exceeded hbm capacity by 603.59M.")
    >>> round(oom.required_bytes / 2**30, 2)
    16.34
    >>> out_of_memory("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB") is None
    True
  """
  text = str(error)
  for pattern in _REFUSALS:
    match = pattern.search(text)
    if match:
      return OutOfMemory(_size(*match.group(1, 2)), _size(*match.group(3, 4)))
  return None


def step_does_not_fit(
  error: BaseException | str,
  plan_memory: Memory,
  mesh: dict[str, int],
  rules: str,
  num_devices: int,
  rows_per_device: int,
  micro_batches: int = 1,
) -> str:
  """One line for a step its devices refused for memory: the rows, the bytes, what would fit.

  `plan_memory` holds the state's and batch's bytes per device and the
  device's HBM (`total_bytes` is ignored: the refusal's figure replaces it).

  Example:
    >>> gib = 2**30
    >>> memory = Memory(2 * gib, 4 * gib, 2**20, None, None, None, int(15.75 * gib), 0.1)
    >>> print(step_does_not_fit(
    ...   "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    ...   "temporaries (19.14G) exceeds available HBM (15.75G).",
    ...   memory, {"data": 1}, "dp", 1, rows_per_device=12))  # doctest: +ELLIPSIS
    the step does not fit in device memory: 12 rows per device need 19.14 GiB of the 15.75 GiB \
a device has (the compiler's figures); ... --config.train.micro_batches=2 ...
  """
  first_line = " ".join(str(error).strip().splitlines()[0].split()) if str(error).strip() else ""
  oom = out_of_memory(error)
  if oom is None:
    return (
      f"the step does not fit in device memory at {rows_per_device} rows per device "
      f"({first_line}); spmd-plan with this config and the slice's --topology says what would fit"
    )
  memory = dataclasses.replace(
    plan_memory, total_bytes=oom.required_bytes, device_bytes=oom.available_bytes
  )
  advice = suggestions_to_fit(memory, mesh, rules, num_devices, rows_per_device, micro_batches)
  gib = 2**30
  return "; ".join(
    [
      f"the step does not fit in device memory: {rows_per_device} rows per device need "
      f"{oom.required_bytes / gib:.2f} GiB of the {oom.available_bytes / gib:.2f} GiB a device "
      "has (the compiler's figures)",
      *advice,
    ]
  )
