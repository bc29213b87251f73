"""Found: building a batch's rows at once (`lm_examples.lm_batch`) takes less host CPU than row by row, for equal batches.

  python -m benchmarks.investigations.input_cpu [--config=configs/lm_tiny.py] [--rounds=40] [--batches=100]

One process, 4 CPU devices, as `benchmarks.training` runs lm_tiny. Times
`GlobalBatches.global_batch_arrays` (positions, records, rows, the copy to
the devices: what the prefetch thread does for every step) in CPU seconds
(`time.process_time`, so XLA's copy threads count too), in alternating
rounds of `--batches` consecutive steps:
  to_batch     the task's builder of all rows at once (`lm_examples.lm_batch`),
               as `spmd-train` runs it
  row by row   the same pipeline without it: `to_example` for every row,
               then `np.stack`
Prints the median CPU per batch of each and the median of per-round ratios.
On a host with few cores this CPU comes out of the step's compute threads,
which is why the pipeline's cost is counted in CPU, not wall time; the
batches are checked to be equal first. The runs are in
docs/engineering-log.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from benchmarks import common  # noqa: E402
from trainers.run.data import open_data  # noqa: E402
from trainers.step.mesh import build_mesh  # noqa: E402
from trainers.tasks import make_task  # noqa: E402


def cpu_ms_per_batch(batches, first_step: int, count: int) -> float:
  """CPU milliseconds (all threads) per `global_batch_arrays` call, each waited for."""
  start = time.process_time()
  for step in range(first_step, first_step + count):
    jax.block_until_ready(batches.global_batch_arrays(step))
  return (time.process_time() - start) / count * 1e3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_tiny.py")
  parser.add_argument("--rounds", type=int, default=40)
  parser.add_argument("--batches", type=int, default=100, help="steps per round and side")
  parser.add_argument("--workdir", default="workdir/bench/training")
  args = parser.parse_args()
  absl_logging.set_verbosity(absl_logging.WARNING)
  config = common.load_config(args.config)
  mesh, batch_axes = build_mesh(config)
  task = make_task(config)
  if task.to_batch is None:
    parser.error(f"{args.config}: its task builds batches row by row only")
  workdir = os.path.abspath(args.workdir)
  sides = {
    name: open_data(config, t, workdir, mesh, batch_axes)[0]
    for name, t in (("to_batch", task), ("row by row", dataclasses.replace(task, to_batch=None)))
  }
  for step in (0, 1, config.global_batch):  # the same rows either way
    a, b = (jax.device_get(s.global_batch_arrays(step)) for s in sides.values())
    for key in a:
      np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at {step=}")
  cpu = {name: [] for name in sides}
  for r in range(args.rounds):
    for name in sides if r % 2 == 0 else list(sides)[::-1]:
      cpu[name].append(cpu_ms_per_batch(sides[name], 1000 + r * args.batches, args.batches))
  print(f"{os.path.basename(args.config)}, {args.rounds} rounds of {args.batches} batches")
  print("| rows built | CPU ms per batch (median) | ÷ row by row (median of rounds) |")
  print("|---|---|---|")
  for name, times in cpu.items():
    ratio = statistics.median(a / b for a, b in zip(times, cpu["row by row"]))
    print(f"| {name} | {statistics.median(times):.3f} | {ratio:.3f} |")


if __name__ == "__main__":
  main()
