"""The TPU check's Llama step: its config, and the step compiled, measured and timed on this machine's device.

`benchmarks/tpu_check.py` (P9, PL1, PL2), `benchmarks/tpu_tuning.py` (the
knob sweep) and `benchmarks/tpu_llama.py` (P11) all measure this step; it
lives here, below the three, so none of them imports another to reach it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import tpu_profile  # noqa: E402
from configs import llama_tpu_check  # noqa: E402
from spmd.layout import batch_sharding  # noqa: E402
from trainers.config import resolve  # noqa: E402
from trainers.planning import plan as plan_lib  # noqa: E402
from trainers.reporting import chips  # noqa: E402
from trainers.step.loss import abstract_batch  # noqa: E402
from trainers.step.mesh import build_mesh  # noqa: E402
from trainers.step.state import make_state  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402

# `--tiny`: the same check at a size a CPU compiles in seconds (its own test).
TINY = {
  "num_layers": 2,
  "d_model": 128,
  "num_heads": 4,
  "num_kv_heads": 2,
  "d_ff": 256,
  "vocab_size": 512,
  "seq_len": 256,
}


def check_config(rows: int, tiny: bool = False):
  """`configs/llama_tpu_check.py` with `rows` rows a step (`--tiny`: CPU-sized)."""
  config = llama_tpu_check.get_config()
  if tiny:
    config.model.update(TINY)
  config.global_batch = rows
  return resolve(config, ROOT / "configs" / "llama_tpu_check.py")


def _synthetic_batch(task, rows: int, vocab: int, sharding) -> dict:
  rng = np.random.default_rng(0)
  out = {}
  for name, shape in abstract_batch(task, rows).items():
    if jnp.issubdtype(shape.dtype, jnp.integer):
      value = rng.integers(0, vocab, shape.shape).astype(shape.dtype)
    else:
      value = np.ones(shape.shape, shape.dtype)  # the mask: every token counts
    out[name] = jax.device_put(value, sharding)
  return out


def on_device(config, steps: int, warmup: int, trace_steps: int = 0) -> dict:
  """The step compiled for this machine's device: its memory analysis, then its time.

  With `trace_steps`, that many more steps are traced and their top ops named
  (`tpu_profile.profile`).
  """
  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes, task.optimizer)
  step = make_train_step(setup, task, config, mesh, axes)
  sharding = batch_sharding(mesh, axes)
  state_shapes = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  started = time.perf_counter()
  try:
    compiled = step.lower(
      state_shapes, abstract_batch(task, config.global_batch, sharding)
    ).compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return {"compiled": False, "refusal": " ".join(str(e).split())[:400]}
  compile_s = time.perf_counter() - started
  stats = compiled.memory_analysis()
  out = {
    "compiled": True,
    "compile_s": compile_s,
    "total_bytes": plan_lib._total_bytes(stats),
    "temp_bytes": stats.temp_size_in_bytes,
    "argument_bytes": stats.argument_size_in_bytes,
    "output_bytes": stats.output_size_in_bytes,
    "alias_bytes": stats.alias_size_in_bytes,
    "code_bytes": stats.generated_code_size_in_bytes,
  }
  batch = _synthetic_batch(task, config.global_batch, config.model.vocab_size, sharding)
  state = setup.init()
  for _ in range(warmup):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(state)
  started = time.perf_counter()
  for _ in range(steps):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(state)
  step_s = (time.perf_counter() - started) / steps
  device = jax.local_devices()[0]
  peak = chips.table_peak(device.device_kind, config.train.precision)
  memory = device.memory_stats() or {}
  out.update(
    step_s=step_s,
    tokens_per_s=config.global_batch * config.model.seq_len / step_s,
    mfu=task.flops_per_step / step_s / peak if peak else None,
    loss=float(metrics["loss"]),
    peak_bytes_in_use=memory.get("peak_bytes_in_use"),
    bytes_limit=memory.get("bytes_limit"),
  )
  if trace_steps:
    out["profile"], state = tpu_profile.profile(
      compiled, state, batch, trace_steps, compiled.as_text()
    )
  return out
