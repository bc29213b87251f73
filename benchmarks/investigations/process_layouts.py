"""Found: 2 processes cost more than 1 even without the input pipeline or loop: the cost is XLA:CPU's, not the harness's.

  python -m benchmarks.investigations.process_layouts [--layouts=1x2,2x1,2x1u] [--rounds=2] [--steps=100]

Each layout is `PROCESSESxDEVICES` (devices per process), with a trailing `p`
for `--pin-cpus` (a disjoint share of the CPUs per process) or `u` for
`--no-pin-cpus`; without either, `spmd-launch local`'s default (pinned when
there are several processes). Every layout
runs the trainer's real step (`trainers.step.train_step.make_train_step`) of
`--config` on one placed random batch of the config's global batch, as a
job of `spmd-launch local` processes: no input pipeline, no logging, no
trainer loop. So a difference between layouts is the runtime's (XLA:CPU's
collectives across processes, its thread pools sharing the cores), not
the harness's. Rounds run the layouts in turn, reversed every other round.
Prints each layout's median step time over the rounds (the median of each
round's per-step median) and its ratio to the first layout. What is left
between layouts is XLA:CPU's gloo all-reduce and the processes' thread
pools sharing the cores; the runs are in docs/engineering-log.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAYOUT = re.compile(r"^(\d+)x(\d+)([pu]?)$")


def parse_layout(text: str) -> tuple[int, int, bool | None]:
  """`"2x1p"` -> (processes, devices per process, pinned: True, False or None = default).

  Example:
    >>> parse_layout("2x1p"), parse_layout("2x1u"), parse_layout("1x2")
    ((2, 1, True), (2, 1, False), (1, 2, None))
    >>> parse_layout("2x")
    Traceback (most recent call last):
    ValueError: layout '2x' is not PROCESSESxDEVICES[p|u], e.g. 2x1, 2x1p or 2x1u
  """
  m = _LAYOUT.match(text)
  if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
    raise ValueError(f"layout {text!r} is not PROCESSESxDEVICES[p|u], e.g. 2x1, 2x1p or 2x1u")
  return int(m.group(1)), int(m.group(2)), {"p": True, "u": False}.get(m.group(3))


def worker(config_path: str, steps: int) -> None:
  import spmd

  spmd.initialize()
  import jax

  from benchmarks import common
  from spmd.mesh import create_mesh
  from trainers.step.train_step import make_train_step
  from trainers.tasks import make_task

  config = common.load_config(config_path)
  mesh = create_mesh("data=-1")
  setup, _, batch = common.transformer_setup(config, mesh)
  step = make_train_step(setup, make_task(config), config, mesh, ("data",))
  state = setup.init()
  for _ in range(5):  # compile and warm up
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  if jax.process_index() == 0:
    print(json.dumps({"median_s": statistics.median(times)}), flush=True)


def run_layout(layout: str, config: str, steps: int) -> float:
  """Median step seconds of one job in `layout`; raises with the job's report if it fails."""
  from launch import local

  processes, devices, pinned = parse_layout(layout)
  command = [sys.executable, "-m", "benchmarks.investigations.process_layouts", "--worker"]
  command += [f"--config={config}", f"--steps={steps}"]
  result = local.run_local(
    command,
    num_processes=processes,
    devices_per_process=devices,
    timeout_s=600,
    echo=False,
    cwd=ROOT,
    env={"PYTHONPATH": ROOT},
    pin_cpus=pinned,
  )
  if not result.ok:
    raise RuntimeError(f"layout {layout} failed:\n{result.report()}")
  [line] = [x for x in result.processes[0].output.splitlines() if x.startswith("{")]
  return json.loads(line)["median_s"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layouts", default="1x2,2x1,2x1u")
  parser.add_argument("--config", default="configs/lm_tiny_bytes.py")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--steps", type=int, default=100, help="timed steps per job")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args.config, args.steps)
    return
  layouts = args.layouts.split(",")
  for layout in layouts:
    parse_layout(layout)  # fail before running anything
  times: dict[str, list[float]] = {layout: [] for layout in layouts}
  for r in range(args.rounds):
    for layout in layouts if r % 2 == 0 else layouts[::-1]:
      times[layout].append(run_layout(layout, args.config, args.steps))
  first = statistics.median(times[layouts[0]])
  name = os.path.basename(args.config)
  print(f"{name}, fixed batch, {args.rounds} rounds of {args.steps} steps")
  print(f"| layout | median step ms | ÷ {layouts[0]} | rounds (ms) |")
  print("|---|---|---|---|")
  for layout in layouts:
    ms = statistics.median(times[layout]) * 1e3
    rounds = ", ".join(f"{t * 1e3:.1f}" for t in times[layout])
    print(f"| {layout} | {ms:.1f} | {ms / 1e3 / first:.3f} | {rounds} |")


if __name__ == "__main__":
  main()
