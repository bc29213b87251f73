"""P6 and P8: whole `spmd-train` runs started through `spmd-launch local`.

  python -m benchmarks.launches [--config=configs/lm_tiny_bytes.py] [--rounds=3] [--json=out.json]

  P6  2 processes x 1 device ÷ 1 process x 2 devices: median steady-state
      step time (the trainer's own `step_time_s`, first logging window left
      out) of the same config and global batch. Rounds alternate the order.
      Goal <= 1.25: what simulated hosts cost over one host (gloo collectives
      between processes instead of in-process ones). Both run as
      `spmd-launch local` runs them by default, so the 2 processes get a
      core each (`--pin-cpus`); their time unpinned (`--no-pin-cpus`) is
      reported beside it.
  P8  seconds from starting the job to the first finished train step, with a
      warm persistent compilation cache ÷ with an empty one. Each round uses
      a fresh cache directory: a cold run fills it, a warm run reuses it.
      Goal <= 0.5.

Every run gets a fresh workdir (nothing to resume) and shares the data
directory, which a first, untimed run prepares.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from benchmarks import common
from launch.local import cpu_shares

BIN = os.path.dirname(sys.executable)
LOG_EVERY = 10  # steps per logged window of the P6 runs


def run_training(
  workdir: str,
  config: str,
  processes: int,
  devices: int,
  overrides: list[str],
  timeout_s: float = 600,
  pin_cpus: bool | None = None,
) -> tuple[dict, float]:
  """(summary.json of the run, Unix time it was started); raises if the run fails."""
  shutil.rmtree(workdir, ignore_errors=True)
  command = [
    os.path.join(BIN, "spmd-launch"),
    "local",
    "-n",
    str(processes),
    "--devices-per-process",
    str(devices),
    "--timeout",
    str(timeout_s),
    *({True: ["--pin-cpus"], False: ["--no-pin-cpus"], None: []}[pin_cpus]),
    "--",
    os.path.join(BIN, "spmd-train"),
    f"--config={config}",
    f"--workdir={workdir}",
    *overrides,
  ]
  started = time.time()
  done = subprocess.run(
    ["timeout", "-k", "10", str(timeout_s + 30), *command],
    capture_output=True,
    text=True,
  )
  if done.returncode != 0:
    raise RuntimeError(f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f), started


def steady_step_s(workdir: str, log_every: int) -> float:
  """Median `step_time_s` of the logging windows after the first (which holds the compile).

  `metrics.jsonl` has a row per step, and every row of a window carries that
  window's mean step time, so each window counts once: by its last row.

  Example:
    >>> import json, tempfile
    >>> workdir = tempfile.mkdtemp()
    >>> times = [9.0] * 3 + [1.0] * 3 + [2.0] * 3 + [1.5] * 2  # windows of 3 steps
    >>> with open(f"{workdir}/metrics.jsonl", "w") as f:
    ...   for step, t in enumerate(times, 1):
    ...     _ = f.write(json.dumps({"step": step, "step_time_s": t}) + "\\n")
    >>> steady_step_s(workdir, log_every=3)
    1.5
  """
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if "step_time_s" in r]
  last = rows[-1]["step"] if rows else 0
  windows = [r["step_time_s"] for r in rows if r["step"] % log_every == 0 or r["step"] == last]
  if len(windows) < 2:
    raise RuntimeError(f"no step times after the first window in {workdir}/metrics.jsonl")
  return statistics.median(windows[1:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/lm_tiny_bytes.py")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=120, help="train steps per P6 run")
  parser.add_argument("--workdir", default="workdir/bench/launches")
  parser.add_argument("--json")
  args = parser.parse_args()
  root = os.path.abspath(args.workdir)
  quiet = [
    "--config.eval_every=100000",
    "--config.checkpoint.every=100000",
    f"--config.log_every={LOG_EVERY}",
    f"--config.data.dir={os.path.join(root, 'data')}",
    f"--config.compilation_cache_dir={os.path.join(root, 'cache_shared')}",
  ]
  # Untimed: prepares the data and fills the shared cache.
  run_training(os.path.join(root, "prepare"), args.config, 1, 2, [*quiet, "--config.train.steps=2"])

  steps = [*quiet, f"--config.train.steps={args.steps}"]

  def layout(processes: int, devices: int, pin_cpus: bool | None):
    def one_round() -> float:
      suffix = {True: "_pinned", False: "_unpinned", None: ""}[pin_cpus]
      workdir = os.path.join(root, f"p6_{processes}x{devices}{suffix}")
      run_training(workdir, args.config, processes, devices, steps, pin_cpus=pin_cpus)
      return steady_step_s(workdir, LOG_EVERY)

    return one_round

  p6, multi_s, single_s = common.alternate(layout(2, 1, None), layout(1, 2, None), args.rounds)
  unpinned_s = statistics.median(layout(2, 1, False)() for _ in range(args.rounds))

  first_step = {"cold": [], "warm": []}

  def start_to_first_step(kind: str, cache: str):
    def one_round() -> float:
      if kind == "cold":
        shutil.rmtree(cache, ignore_errors=True)
      overrides = [
        *quiet[:-1],
        f"--config.compilation_cache_dir={cache}",
        "--config.train.steps=1",
      ]
      summary, started = run_training(
        os.path.join(root, f"p8_{kind}"), args.config, 1, 4, overrides
      )
      seconds = summary["first_step_at"] - started
      first_step[kind].append(seconds)
      return seconds

    return one_round

  ratios = []
  for i in range(args.rounds):
    cache = os.path.join(root, f"cache_{i}")
    cold = start_to_first_step("cold", cache)()
    ratios.append(start_to_first_step("warm", cache)() / cold)
  p8 = statistics.median(ratios)
  cold_s, warm_s = statistics.median(first_step["cold"]), statistics.median(first_step["warm"])

  name = os.path.basename(args.config)
  cpus_each = len(cpu_shares(2)[0])
  machine = common.machine("CPU devices as stated")
  common.emit(
    [
      common.row(
        "P6",
        "2 processes × 1 device ÷ 1 process × 2 devices, same global batch",
        p6,
        1.25,
        True,
        f"{name}: step {multi_s * 1e3:.1f} vs {single_s * 1e3:.1f} ms "
        f"(pinned, {cpus_each} CPU{'s' if cpus_each > 1 else ''} each; "
        f"unpinned, `--no-pin-cpus`: {unpinned_s * 1e3:.1f} ms)",
        machine,
      ),
      common.row(
        "P8",
        "start to first finished step, warm compilation cache ÷ cold",
        p8,
        0.5,
        True,
        f"{name}, 1 process × 4 devices: {warm_s:.1f} vs {cold_s:.1f} s",
        machine,
      ),
    ],
    args.json,
  )


if __name__ == "__main__":
  main()
