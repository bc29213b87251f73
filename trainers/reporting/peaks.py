"""Peak FLOP/s per device, for model FLOPs utilisation (MFU).

Accelerators get their peak from a built-in table keyed by JAX's
`device.device_kind`; CPUs (and accelerators the table does not know) get the
FLOP/s of a large jitted matmul, measured once and cached in a JSON file.

MFU follows the PaLM paper (Chowdhery et al. 2022, appendix B): the FLOPs the
model needs per step (not counting rematerialisation) over what the devices
could do in the step time at their dense peak.

Example:
  >>> table_peak("NVIDIA H100 80GB HBM3", "bfloat16")
  989000000000000.0
  >>> table_peak("TPU v5 lite", "bfloat16") == table_peak("TPU v5e", "bfloat16") == 197e12
  True
  >>> f"{mfu(4e15, step_time_s=1.0, num_devices=8, peak_per_device=989e12):.3f}"
  '0.506'
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
from etils import epath

from trainers import paths

log = logging.getLogger(__name__)

CACHE_FILE = "peak_flops.json"

# XLA:CPU options (per program, `compile(compiler_options=...)`) that hand every
# dot to oneDNN, one library call each, instead of YNNPACK (row-major 2-D dots)
# and Eigen (the rest: batched dots, one call per item). Which of the two is
# faster for a square matmul depends on the CPU, so a CPU's measured peak is the
# better of the two (`measure_matmul_peak`): MFU is never taken against a low
# peak. Train steps keep XLA's default. Wider oneDNN fusions (`LIBRARY_FUSION_TYPE_DOT`,
# a dot with its elementwise producers) fail to compile in jaxlib 0.10.2
# ("partition compile failed", then SIGILL).
ONEDNN_DOTS = {
  "xla_cpu_use_onednn": True,
  "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}


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


@dataclasses.dataclass(frozen=True)
class PeakInfo:
  """A device's peak FLOP/s and where the number came from.

  `source` is "table" or "measured on YYYY-MM-DD ..." so a reader of the run
  summary knows whether the MFU is against a vendor peak or a measured one.
  """

  flops_per_s: float
  source: str


def _normalise_kind(device_kind: str) -> str:
  return " ".join(device_kind.lower().replace("-", " ").replace("_", " ").split())


def _find_chip(device_kind: str) -> _Chip | None:
  kind = _normalise_kind(device_kind)
  for chip in _CHIPS:
    if re.search(chip.pattern, kind):
      return chip
  return None


def _dtype_name(dtype: Any) -> str:
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
  if precision in (None, "default", "fastest", "bfloat16"):
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
  mode = _matmul_mode(chip, _dtype_name(dtype))
  return None if mode is None else getattr(chip, mode)


# Memory per JAX device (bytes). TPU: the Cloud TPU system-architecture pages
# (v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB per chip). NVIDIA: datasheets
# (decimal GB, as sold). First match wins, so specific variants come first.
_GiB, _GB = 2**30, 10**9
_MEMORY: tuple[tuple[str, int], ...] = (
  (r"^tpu v4$", 32 * _GiB),
  (r"^tpu v5 ?(lite|e)$", 16 * _GiB),
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
  """HBM per device for `device_kind` (as JAX names it), or None if not in the table.

  Example:
    >>> device_memory_bytes("TPU v5 lite") / 2**30, device_memory_bytes("NVIDIA H200") / 1e9
    (16.0, 141.0)
  """
  kind = _normalise_kind(device_kind)
  return next((size for pattern, size in _MEMORY if re.search(pattern, kind)), None)


def matmul_sampler(
  dtype: Any = "float32",
  size: int | None = None,
  device: jax.Device | None = None,
  compiler_options: dict[str, Any] | None = None,
) -> Callable[[int, float], float]:
  """A function `sample(repeats, budget_s)`: FLOP/s of the best of `repeats` matmuls now.

  Builds two `size` x `size` operands on `device` once and compiles and runs
  the square matmul once (not timed); each call of the returned function
  then times up to `repeats` runs, stopping early once `budget_s` seconds
  have been spent, and returns the fastest run's FLOP/s. `compiler_options`
  go to XLA for that matmul alone (e.g. another matmul library). `size` defaults to
  2048 on CPU (large enough for the CPU's full matmul rate, small enough to
  sample between a benchmark's rounds) and 8192 elsewhere (smaller matmuls
  do not fill an accelerator). Runs no collectives, so one process
  may call it alone. Benchmarks that compare a step with the peak sample it
  between their rounds: on a shared machine the peak moves as much as the
  step does.

  Example:
    >>> sample = matmul_sampler(size=256)
    >>> sample(2, 1.0) > 0
    True
  """
  device = jax.local_devices()[0] if device is None else device
  if size is None:
    size = 2048 if device.platform == "cpu" else 8192
  if size < 1:
    raise ValueError(f"{size=} must be >= 1")
  dtype = _dtype_name(dtype)
  kx, ky = jax.random.split(jax.random.key(0))
  x = jax.device_put(jax.random.normal(kx, (size, size), dtype), device)
  y = jax.device_put(jax.random.normal(ky, (size, size), dtype), device)
  matmul = jax.jit(jnp.matmul).lower(x, y).compile(compiler_options)
  matmul(x, y).block_until_ready()  # warm caches; not timed

  def sample(repeats: int, budget_s: float) -> float:
    if repeats < 1:
      raise ValueError(f"{repeats=} must be >= 1")
    best = math.inf
    start = time.perf_counter()
    for _ in range(repeats):
      t0 = time.perf_counter()
      matmul(x, y).block_until_ready()
      best = min(best, time.perf_counter() - t0)
      if time.perf_counter() - start > budget_s:
        break
    return 2 * size**3 / best

  return sample


def measure_matmul_peak(
  dtype: Any = "float32",
  size: int | None = None,
  device: jax.Device | None = None,
  repeats: int = 10,
  budget_s: float = 2.0,
) -> float:
  """FLOP/s of a square jitted `size` x `size` matmul on one device.

  The best of up to `repeats` timed runs after a compile-and-warm-up run;
  repetitions stop early once `budget_s` seconds have been spent timing (see
  `matmul_sampler`). On CPU, the better of XLA's default matmul and the same
  matmul through oneDNN (`ONEDNN_DOTS`), each timed so; the default alone
  where this jaxlib cannot compile the oneDNN one.

  Example:
    >>> measure_matmul_peak(size=256, repeats=2) > 0
    True
  """
  return peak_sampler(dtype, size, device)(repeats, budget_s)[0]


def peak_sampler(
  dtype: Any = "float32", size: int | None = None, device: jax.Device | None = None
) -> Callable[[int, float], tuple[float, float]]:
  """`sample(repeats, budget_s)` -> (peak, XLA's default matmul) FLOP/s, as `matmul_sampler`.

  The peak is the better of XLA's default matmul and, on CPU, the same
  matmul through oneDNN (`onednn_matmul_sampler`); elsewhere, or without
  oneDNN, the two figures are the same.

  Example:
    >>> peak, default = peak_sampler(size=256)(2, 1.0)
    >>> peak >= default > 0
    True
  """
  device = jax.local_devices()[0] if device is None else device
  default = matmul_sampler(dtype, size, device)
  onednn = onednn_matmul_sampler(dtype, size, device) if device.platform == "cpu" else None

  def sample(repeats: int, budget_s: float) -> tuple[float, float]:
    rate = default(repeats, budget_s)
    return (rate if onednn is None else max(rate, onednn(repeats, budget_s))), rate

  return sample


def onednn_matmul_sampler(
  dtype: Any = "float32", size: int | None = None, device: jax.Device | None = None
) -> Callable[[int, float], float] | None:
  """`matmul_sampler` with every dot through oneDNN (`ONEDNN_DOTS`); None where it won't compile.

  Example:
    >>> sample = onednn_matmul_sampler(size=256)
    >>> sample is None or sample(2, 1.0) > 0
    True
  """
  try:
    return matmul_sampler(dtype, size, device, compiler_options=ONEDNN_DOTS)
  except Exception as e:  # a jaxlib built without oneDNN, or an option renamed
    log.info("no oneDNN matmul (%s: %s); the peak is XLA's default matmul", type(e).__name__, e)
    return None


def _cpu_count() -> int:
  # The cores this process may use (a container's cgroup may allow fewer than
  # the machine has), which is what the matmul's thread pool gets.
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def _cache_key(device: jax.Device, dtype: str) -> str:
  precision = jax.config.jax_default_matmul_precision
  parts = [device.platform, device.device_kind, dtype, f"precision={precision}"]
  if device.platform == "cpu":
    # "matmuls=xla,onednn": the better of the two (entries from before that
    # hold XLA's default alone and are measured again).
    parts += [f"cores={_cpu_count()}", "matmuls=xla,onednn"]
  parts.append(f"jaxlib={jaxlib.__version__}")  # a new XLA may be faster or slower
  return "|".join(parts)


def _read_cache(path: epath.Path) -> dict[str, Any]:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return {}
  except (OSError, ValueError) as e:
    log.warning("ignoring unreadable peak cache %s (%s); measuring again", path, e)
    return {}


def _write_cache(path: epath.Path, cache: dict[str, Any]) -> None:
  text = json.dumps(cache, indent=2, sort_keys=True)
  path.parent.mkdir(parents=True, exist_ok=True)
  if paths.is_url(path):  # an object is replaced whole: readers never see half of it
    path.write_text(text)
    return
  # Write-then-rename so a process reading the file never sees half of it.
  fd, tmp = tempfile.mkstemp(dir=os.fspath(path.parent), prefix=f".{path.name}.")
  with os.fdopen(fd, "w") as f:
    f.write(text)
  os.replace(tmp, os.fspath(path))


_MEMORY_CACHE: dict[str, dict[str, Any]] = {}


def _measured_entry(
  device: jax.Device, dtype: str, cache_dir: str | os.PathLike | None
) -> dict[str, Any]:
  key = _cache_key(device, dtype)
  if cache_dir is None:
    cache, path = _MEMORY_CACHE, None
  else:
    path = paths.user_path(cache_dir) / CACHE_FILE
    cache = _read_cache(path)
  if key not in cache:
    t0 = time.perf_counter()
    flops = measure_matmul_peak(dtype, device=device)
    seconds = time.perf_counter() - t0
    log.info("measured %s peak: %.3g FLOP/s in %.1f s", key, flops, seconds)
    cache[key] = {
      "flops_per_s": flops,
      "measured_on": datetime.date.today().isoformat(),
      "seconds": round(seconds, 2),
    }
    if path is not None:
      _write_cache(path, cache)
  return cache[key]


def peak_flops(
  device: jax.Device, dtype: Any, cache_dir: str | os.PathLike | None = None
) -> PeakInfo:
  """Peak dense FLOP/s of one `device` for matmuls of `dtype`.

  Accelerators in the table get the vendor peak (source "table"). CPUs and
  unknown kinds get `measure_matmul_peak`, measured on first use and cached
  in `cache_dir/peak_flops.json` (keyed by platform, kind, dtype, matmul
  precision, usable cores, the matmul libraries compared and jaxlib
  version); with `cache_dir=None` the
  cache lives only in this process.

  On CPU all local devices share the host's cores (one device's matmul
  already uses every core), so the per-device peak is the measured host peak
  divided by the number of local CPU devices. Several processes on one host
  each divide by their own device count only, which understates their MFU by
  the number of processes.

  Example:
    >>> import tempfile
    >>> info = peak_flops(jax.devices()[0], "float32", cache_dir=tempfile.mkdtemp())
    >>> info.flops_per_s > 0, info.source.startswith("measured on ")
    (True, True)
  """
  dtype = _dtype_name(dtype)
  if device.platform != "cpu":
    peak = table_peak(device.device_kind, dtype)
    if peak is not None:
      return PeakInfo(peak, "table")
  entry = _measured_entry(device, dtype, cache_dir)
  source = f"measured on {entry['measured_on']}"
  if device.platform != "cpu":
    return PeakInfo(entry["flops_per_s"], source)
  sharing = len(jax.local_devices(backend="cpu"))
  if sharing > 1:
    source += f" (host {entry['flops_per_s'] / 1e9:.1f} GFLOP/s shared by {sharing} CPU devices)"
  return PeakInfo(entry["flops_per_s"] / sharing, source)


def mfu(
  model_flops_per_step: float, step_time_s: float, num_devices: int, peak_per_device: float
) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak.

  A fraction (0.42 means 42%); all devices of all processes count.

  Example:
    >>> mfu(1e12, step_time_s=0.5, num_devices=4, peak_per_device=1e12)
    0.5
  """
  for name, value in (
    ("model_flops_per_step", model_flops_per_step),
    ("step_time_s", step_time_s),
    ("num_devices", num_devices),
    ("peak_per_device", peak_per_device),
  ):
    if not value > 0 or not math.isfinite(value):
      raise ValueError(f"{name}={value!r} must be a positive finite number")
  return model_flops_per_step / step_time_s / (num_devices * peak_per_device)
