"""Peak FLOP/s per device, for model FLOPs utilisation (MFU).

Accelerators get their peak from a built-in table keyed by JAX's
`device.device_kind`; CPUs (and accelerators the table does not know) get the
FLOP/s of a large jitted matmul, measured once and cached in a JSON file.

MFU follows the PaLM paper (Chowdhery et al. 2022, appendix B): the FLOPs the
model needs per step (not counting rematerialisation) over what the devices
could do in the step time at their dense peak.

The table is `chips.py`; the measurement `matmul_peak.py`.

Example:
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
import tempfile
import time
from typing import Any

import jax
import jaxlib
from etils import epath

from trainers import paths
from trainers.reporting.chips import float_dtype_name, table_peak
from trainers.reporting.matmul_peak import measure_matmul_peak

log = logging.getLogger(__name__)

CACHE_FILE = "peak_flops.json"


@dataclasses.dataclass(frozen=True)
class PeakInfo:
  """A device's peak FLOP/s and where the number came from.

  `source` is "table" or "measured on YYYY-MM-DD ..." so a reader of the run
  summary knows whether the MFU is against a vendor peak or a measured one.
  """

  flops_per_s: float
  source: str


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
  dtype = float_dtype_name(dtype)
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
