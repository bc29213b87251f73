"""The chips the harness knows: dense peak FLOP/s per matmul mode, and memory per device.

Keyed by JAX's `device.device_kind`, for MFU (`trainers.reporting.peaks`) and
for plans of hardware this machine does not have (`trainers.planning`).

Example:
  >>> table_peak("NVIDIA H100 80GB HBM3", "bfloat16")
  989000000000000.0
  >>> table_peak("TPU v5 lite", "bfloat16") == table_peak("TPU v5e", "bfloat16") == 197e12
  True
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class _Chip:
  """Dense peak FLOP/s of one chip per matmul mode; None where not known."""

  name: str
  pattern: str  # searched in the normalised (lower-case, single-spaced) device_kind
  tpu: bool
  bf16: float
  tf32: float | None = None  # NVIDIA tensor cores on float32 inputs
  fp32: float | None = None  # full float32 (no tensor cores)


# Dense (no 2:4 sparsity) vendor peaks per JAX device. On TPU v4 and later one
# JAX device is one chip (megacore), so chip peaks are device peaks.
#   TPU: cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e} system-architecture pages.
#   H100 SXM / H100 PCIe / H100 NVL: NVIDIA H100 datasheet; the datasheet's
#     tensor-core figures are "with sparsity", halved here. H200 and GH200 use
#     the H100 SXM compute die at the same clocks (H200 datasheet), H200 NVL
#     matches H100 NVL.
#   A100 (SXM4 and PCIe, 40 and 80 GB share the peaks): A100 datasheet.
# The first pattern found wins, so variants come before the plain name
# ("h100 ... pcie" before "h100"); TPU patterns are anchored so that "TPU v5"
# (v5p) is not "TPU v5 lite" (v5e) and "TPU v4 lite" (v4i) is not a v4.
_CHIPS: tuple[_Chip, ...] = (
  _Chip("TPU v4", r"^tpu v4$", tpu=True, bf16=275e12),
  _Chip("TPU v5e", r"^tpu v5 ?(lite|e)$", tpu=True, bf16=197e12),
  _Chip("TPU v5p", r"^tpu v5p?$", tpu=True, bf16=459e12),
  _Chip("TPU v6e", r"^tpu v6 ?(lite|e)$", tpu=True, bf16=918e12),
  _Chip("H100 PCIe", r"\bh100\b.*\bpcie\b", tpu=False, bf16=756e12, tf32=378e12, fp32=51.2e12),
  _Chip("H100/H200 NVL", r"\bh[12]00\b.*\bnvl\b", tpu=False, bf16=835e12, tf32=418e12, fp32=60e12),
  _Chip("H100/H200 SXM", r"\b(h100|h200|gh200)\b", tpu=False, bf16=989e12, tf32=495e12, fp32=67e12),
  _Chip("A100", r"\ba100\b", tpu=False, bf16=312e12, tf32=156e12, fp32=19.5e12),
)


def _normalise_kind(device_kind: str) -> str:
  return " ".join(device_kind.lower().replace("-", " ").replace("_", " ").split())


def _find_chip(device_kind: str) -> _Chip | None:
  kind = _normalise_kind(device_kind)
  for chip in _CHIPS:
    if re.search(chip.pattern, kind):
      return chip
  return None


def float_dtype_name(dtype: Any) -> str:
  """The dtype's name (`"bfloat16"`), or `ValueError` for what is not a floating-point dtype."""
  try:
    name = jnp.dtype(dtype).name
  except TypeError as e:
    raise ValueError(f"{dtype=} is not a dtype") from e
  if not jnp.issubdtype(name, jnp.floating):
    raise ValueError(f"{dtype=} is not a floating-point dtype; peaks are for float matmuls")
  return name


def _matmul_mode(chip: _Chip, dtype: str) -> str | None:
  """Which hardware path a dot of `dtype` takes: "bf16", "tf32", "fp32" or None.

  float32 depends on `jax_default_matmul_precision`: at the default, JAX runs
  float32 dots as one bfloat16 pass on TPU and in TF32 on NVIDIA Ampere and
  later (docs.jax.dev "Matmul precision"), so their peak is the bf16 / TF32
  one, not the much lower true-float32 one. Multi-pass TPU modes and
  algorithm presets are not in the table (None: measure instead).
  """
  if dtype == "bfloat16" or (dtype == "float16" and not chip.tpu):
    return "bf16"
  if dtype != "float32":
    return None
  precision = jax.config.jax_default_matmul_precision
  precision = None if precision is None else str(precision).lower()
  if precision in (None, "default", "bfloat16"):
    return "bf16" if chip.tpu else "tf32"
  if precision in ("high", "tensorfloat32") and not chip.tpu:
    return "tf32"
  if precision in ("highest", "float32") and not chip.tpu:
    return "fp32"
  return None


def table_peak(device_kind: str, dtype: Any) -> float | None:
  """The built-in dense peak FLOP/s for `device_kind` and `dtype`, or None.

  Example:
    >>> table_peak("NVIDIA A100-SXM4-80GB", "bfloat16")
    312000000000000.0
    >>> table_peak("TPU v4 lite", "bfloat16") is None  # v4i is not a v4
    True
  """
  chip = _find_chip(device_kind)
  if chip is None:
    return None
  mode = _matmul_mode(chip, float_dtype_name(dtype))
  return None if mode is None else getattr(chip, mode)


# Memory per JAX device (bytes) that a program may use. A TPU reserves part
# of its HBM for the runtime: of a v5e chip's 16 GiB, XLA may use what its
# `memory_stats()["bytes_limit"]` reports (about 15.75 GiB, the "available
# HBM" its compiler refuses a program against), so a plan judges against that. The other TPUs:
# the Cloud TPU system-architecture pages (v4 32 GiB, v5p 95 GiB, v6e 32 GiB
# per chip), not yet read off a device. NVIDIA: datasheets (decimal GB, as
# sold). First match wins, so specific variants come first.
_GiB, _GB = 2**30, 10**9
_MEMORY: tuple[tuple[str, int], ...] = (
  (r"^tpu v4$", 32 * _GiB),
  (r"^tpu v5 ?(lite|e)$", 16_909_336_064),  # bytes_limit, read off a v5e chip
  (r"^tpu v5p?$", 95 * _GiB),
  (r"^tpu v6 ?(lite|e)$", 32 * _GiB),
  (r"\bgh200\b.*\b144\s?gb\b", 144 * _GB),
  (r"\bgh200\b", 96 * _GB),
  (r"\bh200\b", 141 * _GB),
  (r"\bh100\b.*\bnvl\b", 94 * _GB),
  (r"\bh100\b", 80 * _GB),
  (r"\ba100\b.*\b40\s?gb\b", 40 * _GB),
  (r"\ba100\b", 80 * _GB),
)


def device_memory_bytes(device_kind: str) -> int | None:
  """HBM a program may use per device of `device_kind` (as JAX names it), or None if not in the table.

  Example:
    >>> round(device_memory_bytes("TPU v5 lite") / 2**30, 2), device_memory_bytes("NVIDIA H200") / 1e9
    (15.75, 141.0)
  """
  kind = _normalise_kind(device_kind)
  return next((size for pattern, size in _MEMORY if re.search(pattern, kind)), None)
