"""Device assignment on real TPU slice descriptions (libtpu, no TPU needed).

For each slice and mesh: hosts own contiguous blocks of the data axes, model
axes stay inside a host when they fit, only data axes cross slices, the data
layout feeds every row once per replica from the host that owns it, and a
sharded step compiles for the slice.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd import layout, mesh_cli, rules
from spmd.mesh import create_mesh
from spmd.topology import libtpu_available, topology_devices

pytestmark = pytest.mark.skipif(
  not libtpu_available(), reason="needs libtpu: pip install -e '.[tpu]' (CI installs it)"
)

SLICES = [("v4-32", 1), ("v5e-16", 1), ("v5e-256", 1), ("v5p-64", 1), ("v5e-16", 2)]
MESHES = ["data=-1", "data=-1,fsdp=4", "data=-1,tensor=4", "data=-1,fsdp=2,tensor=8"]


def _attr(mesh, name):
  return np.vectorize(lambda d: getattr(d, name, 0) or 0)(mesh.devices)


@pytest.mark.parametrize("ici", MESHES)
@pytest.mark.parametrize("slice_name,num_slices", SLICES)
def test_device_assignment_invariants(slice_name, num_slices, ici):
  devices = topology_devices(slice_name, num_slices)
  mesh = create_mesh(ici, devices=devices)
  assert mesh.devices.size == len(devices)
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
  procs, slices = _attr(mesh, "process_index"), _attr(mesh, "slice_index")
  names = mesh.axis_names
  model = [i for i, n in enumerate(names) if n not in ("data", "fsdp")]
  per_host = len(devices) // len(set(procs.flat))

  # Model axes stay inside a host when they fit, and never cross slices.
  model_size = math.prod(mesh.devices.shape[i] for i in model)
  if model:
    groups_p = np.moveaxis(procs, model, range(-len(model), 0)).reshape(-1, model_size)
    groups_s = np.moveaxis(slices, model, range(-len(model), 0)).reshape(-1, model_size)
    if model_size <= per_host:
      assert all(len(set(g)) == 1 for g in groups_p), f"{ici}: a model group spans hosts"
    assert all(len(set(g)) == 1 for g in groups_s), f"{ici}: a model group spans slices"

  # The data layout: contiguous per host, every row once per replica, owned.
  global_batch = 4 * math.prod(mesh.shape[a] for a in ("data", "fsdp") if a in mesh.shape)
  lay = layout.data_layout(mesh, global_batch)
  owner = {}
  for host in lay.hosts:
    for device_id, rows in host.device_rows:
      assert rows.start >= host.rows.start and rows.stop <= host.rows.stop
      owner[device_id] = host.process_index
  by_id = {d.id: d for d in devices}
  assert all(by_id[i].process_index == p for i, p in owner.items())
  blocks = sorted({(h.rows.start, h.rows.stop) for h in lay.hosts})
  assert [r for b in blocks for r in range(*b)] == list(range(global_batch))
  replicas = len(lay.hosts) // lay.num_shards
  assert all(sum(h.shard == s for h in lay.hosts) == replicas for s in range(lay.num_shards))


@pytest.mark.parametrize("slice_name,num_slices", SLICES)
def test_only_data_axes_cross_slices_and_a_step_compiles(slice_name, num_slices):
  devices = topology_devices(slice_name, num_slices)
  mesh = create_mesh("data=-1,fsdp=2,tensor=4", devices=devices)
  slices = _attr(mesh, "slice_index")
  # Moving along fsdp or tensor never changes slice; along data it may.
  for axis in (1, 2):
    moved = np.moveaxis(slices, axis, -1).reshape(-1, mesh.devices.shape[axis])
    assert all(len(set(row)) == 1 for row in moved)
  assert len(set(slices.flat)) == num_slices

  # A sharded training-like step compiles against the slice.
  shardings = rules.logical_to_sharding(
    {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}, mesh, rules.FSDP_TP
  )
  batch = layout.batch_sharding(mesh)
  b = 2 * math.prod(mesh.shape[a] for a in ("data", "fsdp"))
  x = jax.ShapeDtypeStruct((b, 512), jnp.bfloat16, sharding=batch)
  params = {
    "w1": jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16, sharding=shardings["w1"]),
    "w2": jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16, sharding=shardings["w2"]),
  }

  def loss(p, x):
    return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]).astype(jnp.float32) ** 2)

  step = jax.jit(
    lambda p, x: jax.tree.map(lambda w, g: w - 0.1 * g, p, jax.grad(loss)(p, x)),
    out_shardings=shardings,
  )
  compiled = step.lower(params, x).compile()
  assert compiled.memory_analysis() is not None


def test_dcn_request_that_does_not_divide_the_slices():
  devices = topology_devices("v5e-16", 2)
  with pytest.raises(ValueError, match="multiply to 4, but there are 2 slices"):
    create_mesh("data=-1", dcn="data=4", devices=devices)


def test_spmd_mesh_cli_on_a_v5p_64(capsys):
  assert mesh_cli.main(["--mesh=data=-1,tensor=4", "--topology=v5p-64", "--global_batch=256"]) == 0
  out = capsys.readouterr().out
  assert "mesh on v5p-64: 32 devices (TPU v5), 8 hosts, 1 slice(s)" in out
  assert "data=0 tensor=0..3" in out and "224..255" in out


def test_sharded_jit_compiles_for_a_tpu_slice():
  # The same sharded_jit, ahead of time, for the 16 chips and 4 hosts of a v5e-16.
  import spmd

  mesh = create_mesh("data=-1,tensor=2", devices=topology_devices("v5e-16"))
  rows, cols = jax.sharding.PartitionSpec("data", None), jax.sharding.PartitionSpec(None, "tensor")
  f = spmd.sharded_jit(
    lambda x, w: jax.nn.relu(x @ w),
    in_parts=(rows, cols),
    out_parts=jax.sharding.PartitionSpec("data", "tensor"),
    mesh=mesh,
  )
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
  compiled = f.lower(x, w).compile()
  assert compiled.input_shardings[0][0].mesh.devices.flat[0].device_kind == "TPU v5 lite"
  assert compiled.output_shardings.spec == jax.sharding.PartitionSpec("data", "tensor")
  assert compiled.memory_analysis().argument_size_in_bytes == (256 * 512 // 8 + 512 * 1024 // 2) * 2
