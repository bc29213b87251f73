"""Two simulated hosts feed their own rows of a matrix to one sharded_jit program.

Run:
  make sharded-jit-demo
which is:
  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      python examples/sharded_jit_demo.py

The `sharded_jit` API alone, without the trainer: a smaller companion to
`make demo`, which trains a language model on the same kind of job.

Each process builds the same global problem, keeps only its own rows, and
calls the function with just those rows. The program runs once across all
devices of all processes; each process gets back its own rows of the result
(plus a replicated column sum that needs every process's rows) and checks
them against numpy.
"""

import sys

import numpy as np

import spmd

spmd.initialize()  # reads the SPMD_* environment set by spmd-launch

import jax  # noqa: E402  (after initialize, which sets the device count)
import jax.numpy as jnp  # noqa: E402

from spmd import PartitionSpec as P  # noqa: E402


def layer(x, w):
  """One dense layer, and a statistic that needs every host's rows."""
  y = jax.nn.relu(x @ w)
  return y, jnp.sum(y, axis=0)


def main() -> int:
  pid, nproc = jax.process_index(), jax.process_count()
  local, total = jax.local_device_count(), jax.device_count()
  rows, cols, hidden = 4 * total, 16, 8
  rng = np.random.default_rng(0)  # same seed everywhere: the same global problem
  x = rng.standard_normal((rows, cols), dtype=np.float32)
  w = rng.standard_normal((cols, hidden), dtype=np.float32)
  mine = slice(pid * rows // nproc, (pid + 1) * rows // nproc)

  f = spmd.sharded_jit(
    layer,
    in_parts=(P(total, 1), None),  # rows split over every device; weights replicated
    out_parts=(P(total, 1), None),
    local_in_parts=(P(local, 1), None),  # this process's rows, split over its devices
    local_out_parts=(P(local, 1), None),
  )
  y_local, column_sums = f(x[mine], w)

  expected = np.maximum(x @ w, 0)
  ok_rows = np.allclose(np.asarray(y_local), expected[mine], atol=1e-4)
  ok_sums = np.allclose(np.asarray(column_sums), expected.sum(axis=0), atol=1e-3)
  print(
    f"process {pid}/{nproc}: {local} of {total} devices, fed rows "
    f"{mine.start}..{mine.stop - 1} of {rows}; got local result {tuple(y_local.shape)}, "
    f"first row {[round(float(v), 3) for v in np.asarray(y_local)[0, :4]]}; "
    f"rows match numpy: {ok_rows}; global column sums match numpy: {ok_sums}"
  )
  return 0 if ok_rows and ok_sums else 1


if __name__ == "__main__":
  sys.exit(main())
