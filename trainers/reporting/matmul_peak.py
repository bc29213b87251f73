"""The FLOP/s of a large jitted matmul, measured: the peak of a CPU, or of a chip the table lacks.

Example:
  >>> sample = matmul_sampler(size=256)
  >>> sample(2, 1.0) > 0
  True
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from spmd import compiler_log
from trainers.reporting.chips import float_dtype_name

log = logging.getLogger(__name__)

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
  dtype = float_dtype_name(dtype)
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
    # With the persistent cache off: JAX cannot write a program with oneDNN's
    # fusions to it, and would warn "Error writing persistent compilation
    # cache entry" at every run that measures the peak.
    with compiler_log.without_persistent_cache():
      return matmul_sampler(dtype, size, device, compiler_options=ONEDNN_DOTS)
  except Exception as e:  # a jaxlib built without oneDNN, or an option renamed
    log.info("no oneDNN matmul (%s: %s); the peak is XLA's default matmul", type(e).__name__, e)
    return None
