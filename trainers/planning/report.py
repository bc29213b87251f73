"""`spmd-plan`'s output: the plan (`trainers.planning.figures.Plan`) as a table, the compiled step as a file.

Example:
  >>> _bytes(3 * 2**30), _bytes(1536), _seconds(0.0123)
  ('3.00 GiB', '1.50 KiB', '12.3 ms')
"""

from __future__ import annotations

import json
from typing import Any

from trainers.planning.figures import Plan


def _bytes(n: float | None) -> str:
  if n is None:
    return "-"
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n:.0f} B"


def _seconds(s: float) -> str:
  return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _kv_cache_rows(plan: Plan) -> list[str]:
  kv = getattr(plan, "kv_cache", None)
  if kv is None:
    return []
  return [
    f"  kv cache         {_bytes(kv.bytes_per_device)} (decode, {kv.batch} x {kv.length}: "
    f"{_bytes(kv.total_bytes)} in all, keys and values {kv.spec}; a sampler's, not in the total)"
  ]


def _total_source(plan: Plan) -> str:
  """Where a TPU plan's total comes from: the compiler's peak, or the figure in its refusal."""
  if plan.estimated or plan.memory.total_bytes is None:
    return ""
  return " (the compiler's peak)" if plan.compiled else " (the compiler's, in its refusal)"


def _verdict(plan: Plan) -> str:
  """The verdict line: the target compiler's word where it has one, then the margin's warning."""
  m = plan.memory
  needed = m.total_bytes if m.total_bytes is not None else m.state_bytes
  by = getattr(plan, "verdict_by", "")
  if plan.fits is None:
    return "unknown (device memory not in the table)" if m.device_bytes is None else "unknown"
  if plan.compile_error and m.total_bytes is None:
    return f"DOES NOT FIT: {plan.compile_error}"
  if by == "compiler":
    if not plan.fits:
      short = needed - m.device_bytes if m.device_bytes is not None else None
      return "DOES NOT FIT: the TPU compiler refused the step" + (
        f", short by {_bytes(short)} of {_bytes(m.device_bytes)}" if short and short > 0 else ""
      )
    text = "FITS: the TPU compiler accepted the step"
    if m.device_bytes is not None and m.total_bytes is not None:
      text += f", {_bytes(m.total_bytes)} of {_bytes(m.device_bytes)}"
    if m.short_of_margin:
      text += (
        f" (warning: less than the {m.margin:.0%} margin left free; "
        "fragmentation or a larger program may not fit)"
      )
    return text
  spare = m.usable_bytes - needed
  return (
    f"FITS, {_bytes(spare)} to spare after a {m.margin:.0%} margin"
    if plan.fits
    else f"DOES NOT FIT: short by {_bytes(-spare)} (after a {m.margin:.0%} margin)"
  )


def _lora_rows(plan: Plan) -> list[str]:
  """With `config.lora`: what trains, and the state against full fine-tuning's."""
  lora = getattr(plan, "lora", None)
  if lora is None:
    return []
  m = plan.memory
  full = lora.full_params_bytes + lora.full_optimizer_bytes
  return [
    f"lora          rank {lora.rank} on {lora.targets} weights: {lora.trainable_params / 1e6:,.2f}M "
    f"parameters train ({lora.trainable_params / plan.num_params:.2%}); the rest frozen",
    f"  state per device {_bytes(m.state_bytes)} (parameters {_bytes(m.params_bytes)}, optimizer "
    f"{_bytes(m.optimizer_bytes)}); full fine-tuning: {_bytes(full)} (parameters "
    f"{_bytes(lora.full_params_bytes)}, optimizer {_bytes(lora.full_optimizer_bytes)}): "
    + (
      f"LoRA saves {_bytes(full - m.state_bytes)}"
      if full >= m.state_bytes
      else f"LoRA holds {_bytes(m.state_bytes - full)} more (adapters this large save nothing)"
    ),
  ]


def format_plan(plan: Plan, config_name: str = "") -> str:
  """The plan as a table for people."""
  m, c = plan.memory, plan.compute
  est = " (estimate: compiled for CPU stand-ins)" if plan.estimated else ""
  lines = [
    f"spmd-plan: {config_name or 'config'} on {plan.target}: {plan.num_devices} x "
    f"{plan.device_kind}, {plan.hosts} hosts, {plan.num_slices} slice(s)",
    f"mesh          {' '.join(f'{k}={v}' for k, v in plan.mesh.items())}"
    f"   (ici {plan.ici}; dcn {plan.dcn or '-'})",
    f"model         {plan.num_params / 1e6:,.1f}M parameters, {plan.units_per_step:,} "
    f"{plan.unit} per step",
    f"data          {plan.hosts_feeding} distinct row blocks, {plan.rows_per_host} rows per host"
    + (" (estimate)" if plan.estimated else ""),
    *(f"attention     {line}" for line in getattr(plan, "attention", [])),
    *_lora_rows(plan),
    "memory per device"
    + (
      ""
      if plan.compiled
      else " (the compiler refused the step: out of memory)"
      if plan.compile_error
      else " (step not compiled: state alone)"
    ),
    f"  parameters       {_bytes(m.params_bytes)}",
    f"  optimizer state  {_bytes(m.optimizer_bytes)}",
    f"  batch            {_bytes(m.batch_bytes)}",
    f"  temporaries      {_bytes(m.temp_bytes)}{est if m.temp_bytes is not None else ''}",
    f"  code             {_bytes(m.code_bytes)}",
    *_kv_cache_rows(plan),
    f"  total            {_bytes(m.total_bytes if m.total_bytes is not None else m.state_bytes)}"
    f" of {_bytes(m.device_bytes)} HBM{_total_source(plan)}",
  ]
  verdict = _verdict(plan)
  fallbacks = getattr(plan, "fallbacks", [])
  if fallbacks:
    verdict += (
      f"; but XLA copies {len(fallbacks)} array{'s' if len(fallbacks) > 1 else ''} whole "
      "to every device (see the warnings)"
    )
  lines.append(f"  verdict          {verdict}")
  if plan.compile_error and m.total_bytes is not None:
    lines.append(f"  compiler         {plan.compile_error}")
  lines.append("compute per device per step")
  if c.compiled_flops is not None:
    # A fused attention kernel is a custom call: its matmuls are not HLO dots.
    fused = sorted({a.split()[0] for a in getattr(plan, "attention", [])} & {"splash", "cudnn"})
    lines.append(
      f"  compiled FLOPs   {c.compiled_flops / 1e12:.3f} TFLOP{est} (the program's matmuls, "
      "recomputation included"
      + (f"; not those inside the {' and '.join(fused)} kernel" if fused else "")
      + ")"
    )
  lines.append(f"  model FLOPs      {c.model_flops / 1e12:.3f} TFLOP (6N per token + attention)")
  if c.peak_flops_per_s:
    lines.append(
      f"  peak             {c.peak_flops_per_s / 1e12:.0f} TFLOP/s (dense, vendor table)"
    )
  if c.step_time_s:
    lo, hi = c.efficiency
    lines.append(
      f"  step time        {_seconds(c.step_time_s[0])} to {_seconds(c.step_time_s[1])}, "
      f"assuming the step's FLOPs run at {lo:.0%}-{hi:.0%} of peak"
    )
    lines.append(f"  MFU              {c.mfu[0]:.0%}-{c.mfu[1]:.0%} under that assumption")
  else:
    lines.append("  step time        - (no peak FLOP/s for this device and dtype)")
  if plan.collectives:
    lines.append("collectives per step, per device")
    lines.append(f"  {'kind':<20}{'count':>6}{'bytes':>12}{'group':>7}  crosses DCN")
    for coll in plan.collectives:
      dcn = {True: "yes", False: "no", None: "?"}[coll.crosses_dcn]
      lines.append(
        f"  {coll.kind:<20}{coll.count:>6}{_bytes(coll.bytes):>12}"
        # Group size 0: the slices of a DCN send, or groups the HLO did not spell out.
        f"{coll.group_size or ('slices' if coll.crosses_dcn else '?'):>7}  {dcn}"
      )
  elif plan.compiled:
    lines.append("collectives per step: none")
  for fallback in fallbacks:
    lines.append(
      f"warning: XLA copies {fallback.operation} {fallback.shape} whole to every device "
      "(Involuntary full rematerialization): "
      + (f"from {fallback.source}, " if fallback.source else f"HLO %{fallback.name}, ")
      + f"sharding {fallback.from_sharding} -> {fallback.to_sharding}"
    )
  for s in plan.suggestions:
    lines.append(f"suggestion: {s}")
  return "\n".join(lines)


def save_executable(compiled: Any, path: str, plan: Plan, config: Any) -> str:
  """Writes the executable's PJRT serialization (as JAX's compilation cache stores it)."""
  import jax

  try:
    payload = compiled.runtime_executable().serialize()
  except Exception as e:  # backends that cannot serialize say why
    return f"not saved: this backend cannot serialize executables ({e})"
  with open(path, "wb") as f:
    f.write(payload)
  meta = {
    "target": plan.target,
    "device_kind": plan.device_kind,
    "mesh": plan.mesh,
    "jax": jax.__version__,
    "config": json.loads(config.to_json(sort_keys=True)),
    "format": "PJRT serialized executable (jax backend.deserialize_executable)",
  }
  with open(path + ".json", "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True)
  return f"saved {len(payload):,} bytes to {path} (+ {path}.json)"
