"""P4 and P5: what the input pipeline and async checkpoints cost a training step.

  python -m benchmarks.training [--config=configs/lm_tiny.py] [--rounds=120] [--json=out.json]

One process, 4 CPU devices, the real train step of `--config`:
  P4  step time fed by the real input pipeline (records read, windows cut,
      copied to the devices, `data.prefetch` batches ahead, as `spmd-train`
      runs it) ÷ step time on the same batch already on the devices.
      Alternating rounds, median of per-round ratios. Goal <= 1.03. The
      pipeline's CPU is a small fraction of a step, far smaller than one
      round's ratio swings on a shared machine, so the rounds are short (2
      steps, each round next to its pair in time) and many (120): few long
      rounds leave the median at the mercy of whatever else ran during them.
  P5  time of the steps that start an asynchronous checkpoint (the step plus
      `Saver.save`, as the trainer's checkpoint hook calls it) ÷
      steps of rounds without checkpoints, alternating rounds. Every step
      waits for its result so each is timed alone. Goal <= 1.15. Reported
      too: the step after a save, and the whole cost of saving every 4 steps
      (rounds with saves, waiting for the last to be written, ÷ rounds
      without). On two cores orbax's background work competes with the
      following steps for the CPU; on an accelerator host it would not.
      48 saves (16 pairs of rounds): a ratio from a dozen saves lands on
      either side of the goal by chance, as resampling one run's rounds
      shows; from 48 it rarely does.
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
from trainers.checkpoints.manager import make_manager  # noqa: E402
from trainers.checkpoints.saver import Saver  # noqa: E402
from trainers.run.data import open_data  # noqa: E402
from trainers.step.mesh import build_mesh  # noqa: E402
from trainers.step.state import make_state  # noqa: E402
from trainers.step.train_step import make_train_step  # noqa: E402
from trainers.tasks import make_task  # noqa: E402


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
  """P5 figures from rounds with a save every `every` steps, alternating with rounds without.

  Steps are timed one by one (each waits for its result). Returns a dict:
  `ratio` (median saving step ÷ median step of the rounds without saves),
  `saving_ms`, `ordinary_ms`, `after_ms` (the step after a save) and
  `interval` (a round with saves, plus waiting for its last save to be
  written, ÷ the same number of steps without saves: what checkpointing
  every `every` steps costs in all, background work included).
  """
  per_round = 3
  rounds = max(saves // per_round, 1)
  holder = {"state": state, "step": 0}
  saving, after, ordinary, intervals = [], [], [], []
  with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as directory:
    saver = Saver(make_manager(directory, every=1, keep=2))

    def one_round(save: bool) -> list[float]:
      times = []
      for i in range(every * per_round):
        start = time.perf_counter()
        holder["state"], metrics = step_fn(holder["state"], batch)
        if save and i % every == 0:
          holder["step"] += 1
          saver.save(holder["step"], holder["state"], data_state)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
      if save:
        start = time.perf_counter()
        saver.wait()  # the last save's background work belongs to this round
        times.append(time.perf_counter() - start)
      return times

    try:
      one_round(False)  # warm up both
      one_round(True)
      for r in range(rounds):
        first, second = (True, False) if r % 2 else (False, True)
        times = {first: one_round(first), second: one_round(second)}
        with_saves, without = times[True], times[False]
        saving += with_saves[0:-1:every]
        after += with_saves[1:-1:every]
        ordinary += without
        intervals.append(sum(with_saves) / sum(without))
    finally:
      saver.close()
  normal = statistics.median(ordinary)
  return {
    "ratio": statistics.median(saving) / normal,
    "saving_ms": statistics.median(saving) * 1e3,
    "ordinary_ms": normal * 1e3,
    "after_ms": statistics.median(after) * 1e3,
    "interval": statistics.median(intervals),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_tiny.py")
  parser.add_argument("--rounds", type=int, default=120, help="alternating rounds (P4)")
  parser.add_argument("--steps", type=int, default=2, help="steps per round and side (P4)")
  parser.add_argument("--saves", type=int, default=48, help="checkpoints started (P5)")
  parser.add_argument("--workdir", default="workdir/bench/training")
  parser.add_argument("--json")
  args = parser.parse_args()
  absl_logging.set_verbosity(absl_logging.WARNING)
  config = common.load_config(args.config)
  mesh, batch_axes = build_mesh(config)
  task = make_task(config)
  train, _ = open_data(config, task, os.path.abspath(args.workdir), mesh, batch_axes)
  setup = make_state(task.model, config, mesh, batch_axes)
  state = setup.init()
  step_fn = make_train_step(setup, task, config, mesh, batch_axes)
  batch = train.global_batch_arrays(0)
  for _ in range(2):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(metrics)

  machine = common.machine("1 process x 4 CPU devices")
  name = os.path.basename(args.config)
  p4, fed_ms, placed_ms, state = pipeline_cost(
    step_fn, state, train, config.data.prefetch, args.steps, args.rounds
  )
  p5 = checkpoint_cost(step_fn, state, batch, train.state(0).to_dict(), every=4, saves=args.saves)
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
        p5["ratio"],
        1.15,
        True,
        f"{name}: {p5['saving_ms']:.1f} vs {p5['ordinary_ms']:.1f} ms; the step after a save "
        f"{p5['after_ms']:.1f} ms; saving every 4 steps costs {p5['interval']:.3f}x in all",
        machine,
      ),
    ],
    args.json,
  )


if __name__ == "__main__":
  main()
