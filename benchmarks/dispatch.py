"""sharded_jit against the equivalent hand-written jax.jit, in one run.

  python -m benchmarks.dispatch [--rounds 100] [--json out.json]

Two figures, each the median of per-round ratios; every round times both
sides back to back, in alternating order, so machine noise hits both alike:
  dispatch  a trivial function (x + 1 on a small array split over 4 devices),
            already-placed inputs: what the Python layer costs per call.
  matmuls   a chain of four 1024x1024 matmuls with the rows split over 4
            devices: the cost on real work.
The jax.jit side uses exactly the shardings sharded_jit chose, so both run
the same compiled program.
Goal (P2): dispatch <= 1.10; the matmuls show the layer costs nothing on real work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import spmd  # noqa: E402
from benchmarks import common  # noqa: E402
from spmd import PartitionSpec as P  # noqa: E402


def timed(fn, arg, calls: int) -> float:
  """Seconds per call over `calls` calls, waiting for the last result."""
  out = None
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*arg)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def compare(name: str, sjit_fn, jit_fn, args, calls: int, rounds: int) -> dict:
  """Median of per-round ratios; each round times both, in alternating order."""
  for fn in (sjit_fn, jit_fn):  # compile and warm up both
    jax.block_until_ready(fn(*args))
    timed(fn, args, calls)
  ours, theirs, ratios = [], [], []
  for i in range(rounds):
    if i % 2:
      a, b = timed(sjit_fn, args, calls), timed(jit_fn, args, calls)
    else:
      b, a = timed(jit_fn, args, calls), timed(sjit_fn, args, calls)
    ours.append(a)
    theirs.append(b)
    ratios.append(a / b)
  return {
    "figure": name,
    "sharded_jit_us": round(statistics.median(ours) * 1e6, 2),
    "jax_jit_us": round(statistics.median(theirs) * 1e6, 2),
    "ratio": round(statistics.median(ratios), 4),
    "rounds": rounds,
    "calls_per_round": calls,
  }


def trivial(x):
  return x + 1


def matmul_chain(x, w):
  for _ in range(4):
    x = jnp.tanh(x @ w)
  return x


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=100)
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args()

  results = []
  # Dispatch: a trivial function on already-placed inputs.
  s_trivial = spmd.sharded_jit(trivial, in_parts=P(4, 1), out_parts=P(4, 1))
  x_small = np.ones((8, 128), np.float32)
  sharding = s_trivial(x_small).sharding  # in_parts == out_parts here
  j_trivial = jax.jit(trivial, in_shardings=sharding, out_shardings=sharding)
  placed = (jax.device_put(x_small, sharding),)
  results.append(compare("dispatch", s_trivial, j_trivial, placed, 100, args.rounds))

  # Real work: a chain of 1024x1024 matmuls, rows split over the devices.
  s_chain = spmd.sharded_jit(matmul_chain, in_parts=(P(4, 1), None), out_parts=P(4, 1))
  rng = np.random.default_rng(0)
  x = rng.standard_normal((1024, 1024), dtype=np.float32) / 32
  w = rng.standard_normal((1024, 1024), dtype=np.float32) / 32
  out_s = s_chain(x, w).sharding  # rows split, as the first input
  in_s = [out_s, jax.sharding.NamedSharding(out_s.mesh, jax.sharding.PartitionSpec())]
  j_chain = jax.jit(matmul_chain, in_shardings=tuple(in_s), out_shardings=out_s)
  chain_args = (jax.device_put(x, in_s[0]), jax.device_put(w, in_s[1]))
  results.append(compare("matmuls", s_chain, j_chain, chain_args, 2, max(10, args.rounds // 3)))

  dispatch, matmuls = results
  common.emit(
    [
      common.row(
        "P2",
        "`sharded_jit` dispatch ÷ `jax.jit` dispatch, trivial function",
        dispatch["ratio"],
        1.10,
        True,
        f"{dispatch['sharded_jit_us']} vs {dispatch['jax_jit_us']} µs per call; on real work "
        f"(4 × 1024² matmuls) {matmuls['ratio']:.3f}",
        common.machine(f"1 process x {jax.local_device_count()} CPU devices"),
      )
    ],
    args.json,
  )


if __name__ == "__main__":
  main()
