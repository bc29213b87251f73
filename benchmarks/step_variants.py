"""What one design choice of the train step costs: the same step under config variants, alternating.

  python -m benchmarks.step_variants [--variants=branch,select,stacked] [--rounds=30]

One process, `BENCH_DEVICES` CPU devices (default 1, as P3), lm_tiny at
width 512 (P3's model). Each variant is the trainer's real step with one
setting changed:
  branch   the default: a non-finite step keeps the old state through
           `lax.cond` (`train.nonfinite_guard="branch"`)
  select   `jnp.where(finite, new, old)` over every leaf instead, which makes
           XLA:CPU copy each donated optimizer moment first ("select")
  stacked  lm_tiny's former layout: its two blocks stacked and run as a fully
           unrolled scan, without remat (`model.scan_layers=True`)
Rounds of `--steps` steps, each step timed alone (it waits for its result),
the variants in turn and in reverse order every other round. Prints each
variant's min, 10th percentile and median step time, and the median of its
per-round ratios to the first variant. On this shared 2-core machine one
round's ratio swings by 15 % or more; the min and 10th percentile are what
interference cannot lower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# One device unless told: benchmarks.trainer (imported below for P3's model)
# sets up `BENCH_DEVICES` CPU devices, 4 by default.
os.environ.setdefault("BENCH_DEVICES", "1")

import jax

jax.config.update("jax_platforms", "cpu")

from benchmarks import common  # noqa: E402
from benchmarks.trainer import model_config_for  # noqa: E402
from spmd.mesh import create_mesh  # noqa: E402
from trainers.step import make_train_step  # noqa: E402


def _branch(config):
  config.train.nonfinite_guard = "branch"


def _select(config):
  config.train.nonfinite_guard = "select"


def _stacked(config):
  config.model.scan_layers = True
  config.model.scan_unroll = config.model.num_layers
  config.model.remat_policy = "none"


VARIANTS = {"branch": _branch, "select": _select, "stacked": _stacked}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variants", default="branch,select,stacked")
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--steps", type=int, default=2, help="steps per round and variant")
  parser.add_argument("--global-batch", type=int)
  parser.add_argument("--seq-len", type=int)
  parser.add_argument("--num-layers", type=int)
  args = parser.parse_args()
  names = args.variants.split(",")
  if unknown := [n for n in names if n not in VARIANTS]:
    parser.error(f"variants {unknown} are not among {sorted(VARIANTS)}")
  mesh = create_mesh("data=-1")
  runs = []
  for name in names:
    config = model_config_for(
      argparse.Namespace(
        model="lm_tiny_512",
        **{k: getattr(args, k) for k in ("global_batch", "seq_len", "num_layers")},
      )
    )
    VARIANTS[name](config)
    setup, _, batch = common.transformer_setup(config, mesh)
    runs.append(
      {
        "step": make_train_step(setup, config, mesh, ("data",)),
        "state": setup.init(),
        "batch": batch,
        "times": [],
        "means": [],
      }
    )

  def one_round(run: dict, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      run["state"], metrics = run["step"](run["state"], run["batch"])
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
    return times

  for run in runs:  # compile and warm up
    one_round(run, 2)
  for r in range(args.rounds):
    for run in runs if r % 2 == 0 else runs[::-1]:
      times = one_round(run, args.steps)
      run["times"] += times
      run["means"].append(statistics.mean(times))
  devices = mesh.devices.size
  print(f"lm_tiny at width 512, {devices} CPU device(s), {args.rounds} rounds of {args.steps}")
  print("| variant | min ms | p10 ms | median ms | ÷ first (median of rounds) |")
  print("|---|---|---|---|---|")
  for name, run in zip(names, runs):
    times = sorted(run["times"])
    ratio = statistics.median(a / b for a, b in zip(run["means"], runs[0]["means"]))
    p10 = times[len(times) // 10]
    print(
      f"| {name} | {times[0] * 1e3:.1f} | {p10 * 1e3:.1f} | "
      f"{statistics.median(times) * 1e3:.1f} | {ratio:.3f} |"
    )


if __name__ == "__main__":
  main()
