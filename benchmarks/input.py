"""Input pipeline headroom: what one process can feed vs what the trainer eats.

  python benchmarks/input.py [--config=configs/lm_tiny.py] [--steps=200] [--json=out.json]

In one process with 4 CPU devices (the demo's global batch, one host):
  * pipeline: global batches per second built by `GlobalBatches` from the
    default corpus (read records, cut windows, copy to devices), no prefetch;
  * trainer: steady-state train steps per second of the same config with a
    batch already on the devices.
Both run in this one process; the ratio pipeline / trainer is the headroom
(goal: >= 5). Each host of a multi-host job feeds only its own rows, so its
headroom is at least this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")


from absl import logging as absl_logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from spmd.mesh import create_mesh  # noqa: E402
from trainers.models import logical_axes  # noqa: E402
from trainers.state import make_state  # noqa: E402
from trainers.step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402
from trainers.train import open_data  # noqa: E402


def load_config(path: str):
  from absl import flags

  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", path, flag_values=fv)
  fv(["input"])
  return fv.config


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_tiny.py")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--workdir", default="workdir/bench_input")
  parser.add_argument("--json")
  args = parser.parse_args()
  absl_logging.set_verbosity(absl_logging.WARNING)
  config = load_config(args.config)
  workdir = os.path.abspath(args.workdir)
  mesh = create_mesh(config.mesh.ici)
  batch_axes = tuple(a for a in config.mesh.batch_axes if a in mesh.shape)
  task = make_task(config)
  train, _ = open_data(config, task, workdir, mesh, batch_axes)

  # Pipeline: build global batches back to back.
  jax.block_until_ready(train.global_batch_arrays(0))
  start = time.perf_counter()
  for step in range(1, args.steps + 1):
    batch = train.global_batch_arrays(step)
  jax.block_until_ready(batch)
  pipeline_s = (time.perf_counter() - start) / args.steps

  # Trainer: the real train step on a batch already on the devices.
  setup = make_state(task.model_fn, logical_axes, config, mesh)
  state = setup.init()
  step_fn = make_train_step(setup, config, mesh, batch_axes)
  for _ in range(3):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics)
  n = max(20, args.steps // 5)
  start = time.perf_counter()
  for _ in range(n):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - start) / n

  tokens = config.global_batch * config.model.seq_len
  result = {
    "date": datetime.date.today().isoformat(),
    "machine": f"{platform.machine()}, {os.cpu_count()} cores, 4 CPU devices, jax {jax.__version__}",
    "config": args.config,
    "pipeline_rows_per_s": config.global_batch / pipeline_s,
    "pipeline_tokens_per_s": tokens / pipeline_s,
    "trainer_tokens_per_s": tokens / step_s,
    "pipeline_ms_per_step": pipeline_s * 1e3,
    "trainer_ms_per_step": step_s * 1e3,
    "headroom": step_s / pipeline_s,
  }
  print(f"input pipeline vs trainer ({result['date']}, {result['machine']}, {args.config})")
  print("| figure | value |\n|---|---|")
  print(f"| pipeline rows/s | {result['pipeline_rows_per_s']:,.0f} |")
  print(f"| pipeline tokens/s | {result['pipeline_tokens_per_s']:,.0f} |")
  print(f"| trainer tokens/s (steady state) | {result['trainer_tokens_per_s']:,.0f} |")
  print(f"| headroom (pipeline ÷ trainer) | {result['headroom']:.1f}× (goal ≥ 5×) |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
