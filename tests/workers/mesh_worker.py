"""One process of a multi-process mesh/layout test; checks its own results.

Usage: mesh_worker.py  (run by tests/test_mesh_multiprocess.py)
"""

import numpy as np

import spmd

spmd.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from spmd import layout, rules  # noqa: E402
from spmd.mesh import create_mesh  # noqa: E402

pid, nproc = jax.process_index(), jax.process_count()
L = jax.local_device_count()


def check_mesh(name, mesh):
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  model = [i for i, n in enumerate(mesh.axis_names) if n not in ("data", "fsdp")]
  size = int(np.prod([mesh.devices.shape[i] for i in model]))
  groups = np.moveaxis(procs, model, range(-len(model), 0)).reshape(-1, size)
  assert all(len(set(g)) == 1 for g in groups), f"{name}: model group spans processes"

  global_batch, features, hidden = 8 * nproc, 16, 8
  lay = layout.data_layout(mesh, global_batch)
  mine = lay.host()
  assert mine.process_index == pid and lay.num_shards == nproc, lay
  rng = np.random.default_rng(0)
  x = rng.standard_normal((global_batch, features), dtype=np.float32)
  w = rng.standard_normal((features, hidden), dtype=np.float32)
  # Each process reads only its own rows, as the input pipeline will.
  gx = jax.make_array_from_process_local_data(
    lay.sharding, x[mine.rows.start : mine.rows.stop], x.shape
  )
  w_sharding = rules.logical_to_sharding(("embed", "mlp"), mesh, rules.FSDP_TP)
  gw = (
    jax.device_put(w, w_sharding)
    if w_sharding.is_fully_addressable
    else (jax.make_array_from_callback(w.shape, w_sharding, lambda idx: w[idx]))
  )
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out = jax.jit(lambda x, w: jnp.sum(jax.nn.relu(x @ w), axis=0), out_shardings=replicated)(gx, gw)
  got = np.asarray(out.addressable_data(0))
  expected = np.maximum(x @ w, 0).sum(axis=0)
  assert np.allclose(got, expected, atol=1e-3), (got, expected)
  for device_id, rows in mine.device_rows:
    shard = next(s for s in gx.addressable_shards if s.device.id == device_id)
    assert np.array_equal(np.asarray(shard.data), x[rows.start : rows.stop])
  print(f"PASS {name}", flush=True)


check_mesh("ici mesh data x tensor", create_mesh("data=-1,tensor=2"))
check_mesh("dcn over processes", create_mesh("data=-1,tensor=2", dcn=f"data={nproc}"))
check_mesh("fsdp x tensor", create_mesh("data=1,fsdp=-1,tensor=2"))
print("WORKER DONE", flush=True)
