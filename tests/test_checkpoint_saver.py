"""`Saver`: a save holds a copy of the state taken when it started.

The train step donates its input state, so a save that kept only references
would write freed or overwritten buffers. Here every save is followed at once
by a donating update of the state, and what is restored must be the values
at the save, bit for bit, for small replicated arrays (copied whole), large
ones (spread over the devices for the copy) and sharded ones.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.mesh import create_mesh
from tests.multiprocess import assert_ok, run_worker
from trainers.checkpoints import saver as saver_lib
from trainers.checkpoints.manager import make_manager
from trainers.checkpoints.saver import Saver, _snapshot_sharding


def _state(mesh):
  replicated = NamedSharding(mesh, P())
  return {
    "small": jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4), replicated),
    "large": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32), replicated),
    "sharded": jax.device_put(
      np.arange(16 * 6, dtype=np.int32).reshape(16, 6), NamedSharding(mesh, P("data"))
    ),
    "step": jax.device_put(np.int32(7), replicated),
  }


def _restore(manager, step, like):
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
  return manager.restore(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()),
  )


def test_each_save_writes_the_state_of_its_step_although_the_next_update_donates_it(
  tmp_path, monkeypatch
):
  # "large" is 8 KB: with the threshold at 1 KB it is spread for the copy.
  monkeypatch.setattr(saver_lib, "SNAPSHOT_SPREAD_MIN_BYTES", 1024)
  mesh = create_mesh("data=-1,fsdp=1,tensor=1")
  state = _state(mesh)
  update = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
  saver = Saver(make_manager(str(tmp_path), every=1, keep=5))
  expected = {}
  try:
    for step in (1, 2, 3):
      expected[step] = jax.tree.map(np.asarray, state)
      assert saver.save(step, state, {"position": step})
      state = update(state)  # donates the buffers the save started from
      state = update(state)
    assert not saver.save(2, state, {"position": 2}), "a step before the last saved is refused"
    saver.wait()
    for step, values in expected.items():
      restored = _restore(saver.manager, step, state)
      assert restored["data"] == {"position": step}
      for name, value in values.items():
        got = restored["state"][name]
        np.testing.assert_array_equal(np.asarray(got), value, err_msg=f"{name} at step {step}")
        assert got.sharding == state[name].sharding  # restored into the target's
  finally:
    saver.close()


def test_the_snapshot_is_in_host_memory_and_one_copy_of_a_large_replicated_array(monkeypatch):
  monkeypatch.setattr(saver_lib, "SNAPSHOT_SPREAD_MIN_BYTES", 1024)
  mesh = create_mesh("data=-1,fsdp=1,tensor=1")
  state = _state(mesh)
  shardings = jax.tree.map(_snapshot_sharding, state)
  assert {s.memory_kind for s in jax.tree.leaves(shardings)} == {"pinned_host"}
  assert shardings["large"].spec == P(tuple(mesh.axis_names))  # one copy, spread
  assert shardings["small"].spec == P()  # 48 bytes: copied whole
  assert shardings["sharded"].spec == P("data")
  assert shardings["step"].spec == P()


def test_a_partly_replicated_array_is_spread_over_the_axes_it_is_replicated_on(
  tmp_path, monkeypatch
):
  # FSDP over 4 devices and 2 data-parallel replicas: each large array is
  # sharded over "fsdp" and held twice; the snapshot holds it once, each
  # device keeping part of its own block, and restores exactly.
  monkeypatch.setattr(saver_lib, "SNAPSHOT_SPREAD_MIN_BYTES", 1024)
  mesh = create_mesh("data=2,fsdp=4,tensor=1")
  fsdp = NamedSharding(mesh, P("fsdp"))
  state = {
    "rows": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32), fsdp),
    "columns": jax.device_put(np.arange(4 * 512, dtype=np.float32).reshape(4, 512), fsdp),
    "small": jax.device_put(np.arange(8 * 4, dtype=np.float32).reshape(8, 4), fsdp),
  }
  shardings = jax.tree.map(_snapshot_sharding, state)
  assert shardings["rows"].spec == P(("fsdp", "data", "tensor"))
  assert shardings["columns"].spec == P("fsdp", ("data", "tensor"))  # 4 rows: not by 8
  assert shardings["small"].spec == P("fsdp")  # 128 bytes: as it is
  for name, x in state.items():  # each device's part lies inside the block it holds
    new = shardings[name].devices_indices_map(x.shape)
    for device, index in x.sharding.devices_indices_map(x.shape).items():
      held = np.zeros(x.shape, bool)
      held[index] = True
      assert held[new[device]].all(), (name, device)
  saver = Saver(make_manager(str(tmp_path), every=1, keep=1))
  try:
    saver.save(1, state, {})
    saver.wait()
    restored = _restore(saver.manager, 1, state)["state"]
  finally:
    saver.close()
  for name, x in state.items():
    np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(x), err_msg=name)


def test_a_save_that_fails_in_the_background_is_raised_on_the_training_thread(tmp_path):
  mesh = create_mesh("data=-1,fsdp=1,tensor=1")
  saver = Saver(make_manager(str(tmp_path), every=1, keep=5))
  assert saver.save(1, _state(mesh), {"not json": object()})  # fails while writing
  with pytest.raises(TypeError, match="JSON serializable"):
    saver.close()
  assert saver.manager.latest_step() is None  # nothing half-written is a checkpoint


def test_the_snapshot_copy_is_compiled_once_per_state_layout(tmp_path):
  mesh = create_mesh("data=-1,fsdp=1,tensor=1")
  state = _state(mesh)
  saver = Saver(make_manager(str(tmp_path), every=1, keep=2))
  try:
    saver.save(1, state, {})
    copy = saver._copy[1]
    saver.save(2, jax.tree.map(lambda x: x * 2, state), {})
    assert saver._copy[1] is copy
    extra = jax.device_put(jnp.zeros(3), NamedSharding(mesh, P()))
    saver.save(3, dict(state, extra=extra), {})
    assert saver._copy[1] is not copy
  finally:
    saver.close()


@pytest.mark.multiprocess
def test_two_processes_save_while_the_training_thread_runs_collectives(tmp_path):
  result = run_worker("saver_worker", str(tmp_path), num_processes=2, devices_per_process=2)
  assert_ok(result)
  for p in result.processes:
    assert f"PASS saver process {p.process_id}\n" in p.output, result.report()
