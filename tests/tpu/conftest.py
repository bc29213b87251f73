"""Tests that mean something only on a TPU: they run on the chip, and skip elsewhere.

`make test-tpu` runs them in one process with `--confcutdir=tests/tpu`, so the
suite's own conftest.py (which pins JAX to 8 CPU devices) is not loaded and
JAX takes the chip. In the CPU suite (`make test`, CI) JAX is pinned to the
CPU before these are collected: every test here skips at once, saying so,
without starting a backend.
"""

from __future__ import annotations

import jax
import pytest


def _why_not_tpu() -> str | None:
  """None on a TPU; else the reason to skip, found without starting a backend where it can be."""
  pinned = jax.config.jax_platforms
  if pinned and "tpu" not in pinned.split(","):
    return f"needs a TPU; JAX is pinned to {pinned!r} (make test-tpu runs these on the chip)"
  try:
    backend = jax.default_backend()
  except RuntimeError as e:  # no backend at all: nothing to test here
    return f"needs a TPU; JAX found none ({e})"
  if backend != "tpu":
    return f"needs a TPU; JAX's backend is {backend!r} (make test-tpu runs these on the chip)"
  return None


def pytest_collection_modifyitems(config, items):
  here = [item for item in items if "tests/tpu/" in str(item.path).replace("\\", "/")]
  if not here:
    return
  why = _why_not_tpu()
  if why is not None:
    for item in here:
      item.add_marker(pytest.mark.skip(reason=why))
