"""Found: XLA:CPU's batched dots of small items (the attention core's) run far below a 2-D matmul and gain nothing from a second core.

  python -m benchmarks.investigations.batched_matmul [--rounds=30]

Times, on one CPU device, the same FLOPs multiplied four ways:
  attention     256 items of 64 x 64 x 64: the shape of each of the attention
                core's six batched matmuls in lm_tiny's step at width 512
                (batch 32 x 8 heads, seq_len 64, head_dim 64)
  32 items      32 items of 512 x 64 x 64
  one 2-D       one [16384, 64] x [64, 64] matmul
  square        square 2048 matmuls (what the matmul peak samples),
                reported as the best of 3 per round
and the attention shape and the square matmul again compiled with
`matmul_peak.ONEDNN_DOTS` (every dot one oneDNN call; by default XLA:CPU hands a
batched dot to Eigen one item at a time), rows "... (oneDNN)".
Once with every core and once in a child process pinned to one core
(`os.sched_setaffinity` before JAX starts, so XLA:CPU sizes its thread pool
to it). Prints GFLOP/s, the median over `--rounds` rounds of 5 calls.

What it showed: the one 2-D matmul of the same FLOPs and the square matmul
gain from the second core, the small batched items do not (XLA:CPU hands a
batched dot to Eigen one item at a time; handing each thread whole items
would help), and oneDNN dots run the attention shape faster than the
default. The runs are in docs/engineering-log.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def measure(rounds: int) -> dict[str, float]:
  """GFLOP/s of each way, in this process (on whatever cores it may use)."""
  import jax
  import jax.numpy as jnp

  jax.config.update("jax_platforms", "cpu")
  flops = 2 * 256 * 64**3
  key = jax.random.key(0)
  a, b = (jax.random.normal(k, (256, 64, 64)) for k in jax.random.split(key))
  from benchmarks import common
  from trainers.reporting import matmul_peak  # after the platform is set

  batched = jax.jit(lambda x, y: jnp.einsum("nqs,nsd->nqd", x, y))
  ways = {
    "attention": (batched, (a, b)),
    "attention (oneDNN)": (batched.lower(a, b).compile(matmul_peak.ONEDNN_DOTS), (a, b)),
    "32 items": (batched, (a.reshape(32, 512, 64), b[:32])),
    "one 2-D": (jax.jit(jnp.matmul), (a.reshape(-1, 64), b[0])),
  }
  squares = {
    "square": matmul_peak.matmul_sampler("float32"),
    "square (oneDNN)": matmul_peak.matmul_sampler(
      "float32", compiler_options=matmul_peak.ONEDNN_DOTS
    ),
  }
  times: dict[str, list[float]] = {name: [] for name in ways}
  square_rates: dict[str, list[float]] = {name: [] for name in squares}
  for fn, args in ways.values():
    jax.block_until_ready(fn(*args))  # compile; not timed
  for _ in range(rounds):
    for name, (fn, args) in ways.items():
      times[name].append(common.seconds_per_call(lambda f=fn, a=args: f(*a), 5))
    for name, sample in squares.items():
      square_rates[name].append(sample(3, 1.0))
  rates = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
  rates.update({name: statistics.median(r) / 1e9 for name, r in square_rates.items()})
  return rates


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=30)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:  # pinned by the parent: measure and hand the figures back
    print(json.dumps(measure(args.rounds)))
    return
  cores = len(os.sched_getaffinity(0))
  one_core = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.investigations.batched_matmul",
      "--child",
      f"--rounds={args.rounds}",
    ],
    capture_output=True,
    text=True,
    check=True,
    timeout=600,
    preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
  )
  pinned = json.loads(one_core.stdout.strip().splitlines()[-1])
  every = measure(args.rounds)
  print(f"GFLOP/s, median of {args.rounds} rounds")
  print(f"| way | {cores} cores | 1 core | {cores} cores ÷ 1 core |")
  print("|---|---|---|---|")
  for name, rate in every.items():
    print(f"| {name} | {rate:.1f} | {pinned[name]:.1f} | {rate / pinned[name]:.2f} |")


if __name__ == "__main__":
  main()
