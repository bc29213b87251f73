"""P4 and P5: what the input pipeline and async checkpoints cost a training step.

  python -m benchmarks.training [--config=configs/lm_tiny.py] [--rounds=6] [--json=out.json]

One process, 4 CPU devices, the real train step of `--config`:
  P4  step time fed by the real input pipeline (records read, windows cut,
      copied to the devices, `data.prefetch` batches ahead, as `spmd-train`
      runs it) ÷ step time on the same batch already on the devices.
      Alternating rounds, median of per-round ratios. Goal <= 1.03.
  P5  time of the steps that start an asynchronous checkpoint (the step plus
      `checkpoint.save`, which copies the state off the devices and hands the
      writing to a background thread) ÷ ordinary steps. Every step here waits
      for its result so each is timed alone. Goal <= 1.15. The step after a
      save is reported too: on two cores the background writer competes with
      it for the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")

from absl import logging as absl_logging  # noqa: E402

from benchmarks import common  # noqa: E402
from spmd.mesh import create_mesh  # noqa: E402
from trainers import checkpoint  # noqa: E402
from trainers.models import logical_axes  # noqa: E402
from trainers.state import make_state  # noqa: E402
from trainers.step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402
from trainers.train import open_data  # noqa: E402


def pipeline_cost(step_fn, state, train, prefetch: int, steps: int, rounds: int):
  """(P4 ratio, fed ms, placed ms, state): real input pipeline vs a batch already placed."""
  feed = train.iterator(0, prefetch=prefetch)
  _, placed = next(feed)
  holder = {"state": state}

  def fed_round() -> float:
    def one():
      _, batch = next(feed)
      holder["state"], metrics = step_fn(holder["state"], batch)
      return metrics

    return common.seconds_per_call(one, steps)

  def placed_round() -> float:
    def one():
      holder["state"], metrics = step_fn(holder["state"], placed)
      return metrics

    return common.seconds_per_call(one, steps)

  try:
    fed_round()  # warm up both (the step is compiled already)
    placed_round()
    ratio, fed, on_device = common.alternate(fed_round, placed_round, rounds)
  finally:
    feed.close()
  return ratio, fed * 1e3, on_device * 1e3, holder["state"]


def checkpoint_cost(step_fn, state, batch, data_state: dict, every: int, saves: int):
  """(P5 ratio, save-step ms, ordinary ms, step-after-save ms): steps timed one by one."""
  with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as directory:
    manager = checkpoint.make_manager(directory, every=1, keep=2)
    saving, after, ordinary = [], [], []
    try:
      for i in range(1, every * saves + 1):
        start = time.perf_counter()
        state, metrics = step_fn(state, batch)
        if i % every == 0:
          checkpoint.save(manager, i, state, data_state, force=True)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - start
        if i % every == 0:
          saving.append(seconds)
        elif i % every == 1 and i > 1:
          after.append(seconds)
        elif i > 2:  # the first steps still warm caches
          ordinary.append(seconds)
      manager.wait_until_finished()
    finally:
      manager.close()
  normal = statistics.median(ordinary)
  return (
    statistics.median(saving) / normal,
    statistics.median(saving) * 1e3,
    normal * 1e3,
    statistics.median(after) * 1e3,
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_tiny.py")
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--steps", type=int, default=10, help="steps per round and side (P4)")
  parser.add_argument("--saves", type=int, default=12, help="checkpoints started (P5)")
  parser.add_argument("--workdir", default="workdir/bench/training")
  parser.add_argument("--json")
  args = parser.parse_args()
  absl_logging.set_verbosity(absl_logging.WARNING)
  config = common.load_config(args.config)
  mesh = create_mesh(config.mesh.ici)
  batch_axes = tuple(a for a in config.mesh.batch_axes if a in mesh.shape)
  task = make_task(config)
  train, _ = open_data(config, task, os.path.abspath(args.workdir), mesh, batch_axes)
  setup = make_state(task.model_fn, logical_axes, config, mesh)
  state = setup.init()
  step_fn = make_train_step(setup, config, mesh, batch_axes)
  batch = train.global_batch_arrays(0)
  for _ in range(2):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics)

  machine = common.machine("1 process x 4 CPU devices")
  name = os.path.basename(args.config)
  p4, fed_ms, placed_ms, state = pipeline_cost(
    step_fn, state, train, config.data.prefetch, args.steps, args.rounds
  )
  p5, save_ms, normal_ms, after_ms = checkpoint_cost(
    step_fn, state, batch, train.state(0).to_dict(), every=4, saves=args.saves
  )
  common.emit(
    [
      common.row(
        "P4",
        "step fed by the input pipeline ÷ step on a placed batch",
        p4,
        1.03,
        True,
        f"{name}, prefetch {config.data.prefetch}: {fed_ms:.1f} vs {placed_ms:.1f} ms",
        machine,
      ),
      common.row(
        "P5",
        "step that starts an async checkpoint ÷ ordinary step",
        p5,
        1.15,
        True,
        f"{name}: {save_ms:.1f} vs {normal_ms:.1f} ms; the step after a save {after_ms:.1f} ms",
        machine,
      ),
    ],
    args.json,
  )


if __name__ == "__main__":
  main()
