"""One process of the multi-process `Saver` test; checks its own results.

Usage: saver_worker.py DIRECTORY  (run by tests/test_checkpoint_saver.py)

Every save is followed at once by donating updates and by steps with
cross-process collectives, while orbax works on the worker thread (its
barriers must not be collectives, or the hosts deadlock). Each restored step
must hold that step's values, bit for bit, on every process.
"""

import sys

import numpy as np

import spmd

spmd.initialize()

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from spmd.mesh import create_mesh  # noqa: E402
from trainers.checkpoints import saver as saver_lib  # noqa: E402
from trainers.checkpoints.manager import make_manager  # noqa: E402
from trainers.checkpoints.saver import Saver  # noqa: E402

saver_lib.SNAPSHOT_SPREAD_MIN_BYTES = 1024  # "large" (8 KB) is spread for the copy
mesh = create_mesh("data=-1,fsdp=1,tensor=1")
replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
values = {
  "small": np.arange(12, dtype=np.float32).reshape(3, 4),
  "large": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
  "sharded": np.arange(16 * 6, dtype=np.int32).reshape(16, 6),
}
shardings = {"small": replicated, "large": replicated, "sharded": rows}
state = {
  k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i])
  for k, v in values.items()
}
update = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
total = jax.jit(lambda s: s["sharded"].sum(), out_shardings=replicated)  # an all-reduce

saver = Saver(make_manager(sys.argv[1], every=1, keep=5))
expected = {}
for step in (1, 2, 3):
  expected[step] = {k: v + 2 * (step - 1) for k, v in values.items()}
  assert saver.save(step, state, {"position": step})
  for _ in range(2):
    state = update(state)
    int(total(state))  # collectives on the training thread while orbax works
saver.wait()

target = {
  k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in values.items()
}
for step, want in expected.items():
  restored = saver.manager.restore(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()),
  )
  assert restored["data"] == {"position": step}, restored["data"]
  for k, v in want.items():
    for shard in restored["state"][k].addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index], err_msg=f"{k} {step}")
saver.close()
print(f"PASS saver process {jax.process_index()}", flush=True)
