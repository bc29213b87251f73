"""Found: XLA:CPU runs one gloo collective per all-reduce operand, so the step reduces one flat vector.

  python -m benchmarks.investigations.allreduce_operands [--mib=2] [--calls=30]

Starts 2 simulated hosts (`spmd-launch local`'s `run_local`), each with one
CPU device. Each host all-reduces the same number of bytes, split into 1, 4
or 20 arrays, in one jitted call. XLA combines the reductions into one
all-reduce instruction with that many operands, and XLA:CPU runs one gloo
collective per operand, so the cost grows with the number of arrays, not
only with the bytes. That is why the train step, on CPU across processes,
reduces its gradients as one raveled vector (`trainers/step/train_step.py`,
`flat_gradient_reduction`) instead of one array per parameter. Prints the
median milliseconds per call for each split; the runs are in
docs/engineering-log.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def worker(mib: float, calls: int) -> None:
  import jax

  import spmd

  spmd.initialize()
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), ("hosts",))
  split = NamedSharding(mesh, P("hosts"))
  floats = int(mib * 2**20 / 4)
  for arrays in (1, 4, 20):
    xs = [
      jax.make_array_from_process_local_data(split, np.ones((1, floats // arrays), np.float32))
      for _ in range(arrays)
    ]
    reduce_all = jax.jit(
      lambda xs: [jnp.sum(x, axis=0) for x in xs], out_shardings=NamedSharding(mesh, P())
    )
    jax.block_until_ready(reduce_all(xs))
    times = []
    for _ in range(calls):
      start = time.perf_counter()
      jax.block_until_ready(reduce_all(xs))
      times.append(time.perf_counter() - start)
    if jax.process_index() == 0:
      ms = statistics.median(times) * 1e3
      print(f"{arrays:3d} arrays, {mib:g} MiB in all: {ms:.2f} ms per all-reduce", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mib", type=float, default=2.0)
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args.mib, args.calls)
    return
  from launch import local

  command = [sys.executable, "-m", "benchmarks.investigations.allreduce_operands", "--worker"]
  command += [f"--mib={args.mib}", f"--calls={args.calls}"]
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  result = local.run_local(command, num_processes=2, timeout_s=300, echo=False, cwd=root)
  print(result.processes[0].output.strip() if result.ok else result.report())


if __name__ == "__main__":
  main()
