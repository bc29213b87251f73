"""The accelerator check: the bf16 Llama's measured MFU on one GPU beside the plan's, and cuDNN against XLA.

  benchmarks/accelerator_check.sh [--steps=8] [--out=FILE]   # one command, a few minutes

On the one local GPU it
  1. compares cuDNN's fused attention with XLA's on the same inputs (causal,
     grouped-query, bf16): the forward pass and the three gradients;
  2. compares the Llama's logits and loss with `attention="cudnn"` and
     `attention="xla"` on the same parameters;
  3. plans the train step of `configs/llama_gpu_check.py` for one H200 the way
     `spmd-plan --gpu=h200 --num_gpus=1` does (compiled for this host's CPU)
     and reads its predicted MFU and memory;
  4. compiles and times the real train step (`trainers.step.train_step`) on
     synthetic in-memory batches, and reports tokens/s, MFU against the chip
     table's dense bf16 peak and the device's peak memory. A batch that does
     not fit is halved until one does, and the table says so.

Only jax (with its GPU plugin), flax, optax, numpy, absl, etils and
ml_collections are needed: no dataset, TFDS, grain or array_record. Prints a
table and writes the figures as JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import llama_gpu_check  # noqa: E402
from spmd.layout import batch_sharding  # noqa: E402
from trainers.config import resolve  # noqa: E402
from trainers.planning.plan import make_plan  # noqa: E402
from trainers.planning.targets import gpu_target  # noqa: E402
from trainers.reporting import chips  # noqa: E402
from trainers.step.loss import abstract_batch  # noqa: E402
from trainers.step.mesh import build_mesh  # noqa: E402
from trainers.step.state import build_model, make_state  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402


def _relative(a, b) -> float:
  """||a - b|| / ||b||, in float32."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def attention_numerics(batch=2, length=2048, heads=16, kv_heads=4, head_dim=128) -> dict:
  """cuDNN's and XLA's `jax.nn.dot_product_attention`, causal and grouped-query, in bf16."""
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, length, heads, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), jnp.bfloat16)
  cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)

  def run(implementation):
    def attend(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    out, pullback = jax.vjp(jax.jit(attend), q, k, v)
    return (out, *pullback(cotangent))

  if jax.default_backend() != "gpu":
    return {"skipped": f"no GPU ({jax.default_backend()})"}
  try:
    cudnn = run("cudnn")
  except Exception as e:  # no cuDNN fused attention here: say so, keep going
    return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
  xla = run("xla")
  names = ("out", "dq", "dk", "dv")
  return {
    f"{name}_rel_err": _relative(c, x) for name, c, x in zip(names, cudnn, xla, strict=True)
  } | {
    "out_max_abs_err": float(jnp.max(jnp.abs(cudnn[0].astype(jnp.float32) - xla[0]))),
    "shape": [batch, length, heads, kv_heads, head_dim],
  }


# `--tiny`: the same check at a size a CPU runs in seconds (its own test).
TINY = {
  "num_layers": 2,
  "d_model": 64,
  "num_heads": 4,
  "num_kv_heads": 2,
  "d_ff": 128,
  "vocab_size": 512,
  "seq_len": 128,
}
_SIZES: dict = {}


def _config(global_batch: int, attention: str | None = None):
  config = llama_gpu_check.get_config()
  config.model.update(_SIZES)
  config.global_batch = global_batch
  if attention is not None and "attention" in config.model:
    config.model.attention = attention
  return resolve(config, ROOT / "configs" / "llama_gpu_check.py")


def _synthetic_batch(task, global_batch: int, vocab: int, sharding) -> dict:
  rng = np.random.default_rng(0)
  out = {}
  for name, shape in abstract_batch(task, global_batch).items():
    if jnp.issubdtype(shape.dtype, jnp.integer):
      value = rng.integers(0, vocab, shape.shape).astype(shape.dtype)
    else:
      value = np.ones(shape.shape, shape.dtype)  # the mask: every token counts
    out[name] = jax.device_put(value, sharding)
  return out


def model_numerics(global_batch: int = 2) -> dict:
  """The Llama's logits and loss with cuDNN attention against XLA's, on the same weights."""
  if jax.default_backend() != "gpu":
    return {"skipped": f"no GPU ({jax.default_backend()})"}
  results = {}
  for attention in ("cudnn", "xla"):
    config = _config(global_batch, attention)
    if "attention" not in config.model:
      return {"error": "this Llama has no attention option"}
    config.model.num_layers = 2  # the kernel's numerics, not the depth's
    task = make_task(config)
    mesh, axes = build_mesh(config)
    setup = make_state(task.model, config, mesh, axes, task.optimizer)
    state = setup.init()
    model = build_model(setup, state["params"], state.get("model_state"))
    batch = _synthetic_batch(task, global_batch, config.model.vocab_size, None)
    logits = jax.jit(lambda m, x: m(x))(model, batch["inputs"])
    results[attention] = np.asarray(logits, np.float32)
  return {"logits_rel_err": _relative(results["cudnn"], results["xla"])}


def planned(global_batch: int) -> dict:
  """What `spmd-plan --gpu=h200 --num_gpus=1` predicts for the step (compiled for a CPU device)."""
  config = _config(global_batch, "xla")  # the plan compiles on CPU, where cuDNN does not exist
  plan = make_plan(config, gpu_target("h200", 1))
  compute, memory = plan.compute, plan.memory
  return {
    "mfu_range": list(compute.mfu) if compute.mfu else None,
    "step_time_s_range": list(compute.step_time_s) if compute.step_time_s else None,
    "total_gib": memory.total_bytes / 2**30 if memory.total_bytes else None,
    "fits": plan.fits,
  }


def measure_step(global_batch: int, steps: int, warmup: int) -> dict:
  """The real train step on this GPU: tokens/s, MFU and peak memory; halves the batch until it fits."""
  while True:
    config = _config(global_batch)
    task = make_task(config)
    mesh, axes = build_mesh(config)
    setup = make_state(task.model, config, mesh, axes, task.optimizer)
    step = make_train_step(setup, task, config, mesh, axes)
    batch = _synthetic_batch(
      task, global_batch, config.model.vocab_size, batch_sharding(mesh, axes)
    )
    try:
      state = setup.init()
      started = time.perf_counter()
      for _ in range(warmup):  # the first compiles
        state, metrics = step(state, batch)
      jax.block_until_ready(state)
      compile_s = time.perf_counter() - started
      started = time.perf_counter()
      for _ in range(steps):
        state, metrics = step(state, batch)
      jax.block_until_ready(state)
      step_s = (time.perf_counter() - started) / steps
      break
    except Exception as e:
      if "RESOURCE_EXHAUSTED" not in str(e) or global_batch <= 1:
        raise
      print(f"global_batch={global_batch} does not fit ({str(e)[:120]}); halving", flush=True)
      global_batch //= 2
  device = jax.local_devices()[0]
  peak = chips.table_peak(device.device_kind, "bfloat16")
  stats = device.memory_stats() or {}
  tokens = global_batch * config.model.seq_len
  return {
    "device_kind": device.device_kind,
    "global_batch": global_batch,
    "tokens_per_step": tokens,
    "step_s": step_s,
    "first_steps_s": compile_s,
    "tokens_per_s": tokens / step_s,
    "mfu": task.flops_per_step / step_s / peak if peak else None,
    "peak_flops_per_s": peak,
    "loss": float(metrics["loss"]),
    "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
    "device_memory_gib": stats.get("bytes_limit", 0) / 2**30,
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=8, help="timed steps after the warm-up")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--global_batch", type=int, default=llama_gpu_check.get_config().global_batch)
  parser.add_argument("--out", default=os.environ.get("OUT", ".") + "/accelerator_check.json")
  parser.add_argument("--skip_plan", action="store_true")
  parser.add_argument("--tiny", action="store_true", help="a CPU-sized model (the check's test)")
  args = parser.parse_args(argv)
  if args.tiny:
    _SIZES.update(TINY)
  report = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
  print(f"jax {jax.__version__} on {report['devices']}", flush=True)
  started = time.perf_counter()
  report["attention"] = attention_numerics()
  print("attention, cuDNN vs XLA:", report["attention"], flush=True)
  report["model"] = model_numerics()
  print("Llama logits, cuDNN vs XLA:", report["model"], flush=True)
  if not args.skip_plan:
    report["plan"] = planned(args.global_batch)
    print("plan (spmd-plan --gpu=h200 --num_gpus=1):", report["plan"], flush=True)
  report["measured"] = measure_step(args.global_batch, args.steps, args.warmup)
  print("measured:", report["measured"], flush=True)
  report["wall_s"] = time.perf_counter() - started
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(report, indent=1))
  measured, plan = report["measured"], report.get("plan", {})
  mfu_range = plan.get("mfu_range")
  print("\naccelerator check")
  print(f"  device          : {measured['device_kind']} (jax {jax.__version__})")
  print(
    f"  rows x tokens   : {measured['global_batch']} x {measured['tokens_per_step'] // measured['global_batch']}"
  )
  print(
    f"  step            : {measured['step_s'] * 1e3:.1f} ms, {measured['tokens_per_s']:,.0f} tokens/s"
  )
  if measured["mfu"] is not None:
    print(
      f"  MFU measured    : {100 * measured['mfu']:.1f}% of {measured['peak_flops_per_s'] / 1e12:.0f} TFLOP/s"
    )
  if mfu_range:
    print(f"  MFU planned     : {100 * mfu_range[0]:.1f}-{100 * mfu_range[1]:.1f}%")
  print(
    f"  memory measured : {measured['peak_memory_gib']:.1f} of {measured['device_memory_gib']:.1f} GiB"
  )
  if plan.get("total_gib"):
    print(f"  memory planned  : {plan['total_gib']:.1f} GiB (CPU compiler's temporaries)")
  print(f"  written to      : {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
