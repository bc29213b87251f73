"""Asynchronous saves that cost the training thread one host copy of the state."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.partition import axis_names, spec_axis_names
from trainers.checkpoints import step_folders

# `Saver`'s snapshot of an array over this many bytes per device holds no
# replicas (`_snapshot_sharding`): it is spread over the devices that held
# copies of it, so each host writes its own part, with no extra dispatches.
# Smaller ones are copied whole and written by one replica: one fragment per
# piece costs orbax more CPU than the write.
SNAPSHOT_SPREAD_MIN_BYTES = 1 << 20


class Saver:
  """Asynchronous saves that cost the training thread one host copy of the state.

  orbax's own `save` blocks its caller until every array is copied off the
  devices and its Python bookkeeping per array is done (replica slices,
  transfers, tensorstore specs: time that grows with the number of arrays),
  and only the file writes run in the background. Here
  `save` only starts one batched, asynchronous copy of the state into host
  memory (`pinned_host`, so no device memory is held) and queues it; a
  worker thread waits for the copy and hands it to orbax, so the step after
  `save` is dispatched at once. The data position is passed by value.

  At most one copy waits for the worker: a `save` that finds the previous one
  not yet taken by orbax waits for it (the memory bound is one host copy of
  the state plus orbax's own). A save that failed in the worker raises from
  the next `save`, `wait` or `close`, on the training thread.

  Which steps to save is the caller's decision (the loop's checkpoint hook);
  the only step refused is one not after the last saved, as orbax would.
  Every process must call `save` for the same steps, as with orbax.

  Example:
    >>> import tempfile
    >>> import jax.numpy as jnp
    >>> from trainers.checkpoints.manager import make_manager
    >>> saver = Saver(make_manager(tempfile.mkdtemp(), every=1, keep=1))
    >>> saver.save(1, {"w": jnp.ones(3)}, {"position": 1})
    True
    >>> saver.close()
    >>> saver.manager.latest_step()
    1
  """

  def __init__(self, manager: ocp.CheckpointManager):
    self.manager = manager
    self._last = manager.latest_step()
    self._worker: threading.Thread | None = None
    self._error: BaseException | None = None
    self._copy: tuple[Any, Callable[[Any], Any]] | None = None

  def save(self, step: int, state: Any, data_state: dict) -> bool:
    """Starts saving `state` at `step`; returns at once. False if `step` is not new.

    Raises:
      step_folders.ForeignStepError: a folder the harness did not write
        holds `step` (it is never written into).
    """
    if self._last is not None and step <= self._last:
      return False
    steps = getattr(self.manager, "steps", None)
    if steps is not None and steps.foreign_at(step):  # the same answer on every host
      raise step_folders.foreign_error(steps, step, f"the save of step {step}")
    self._take_pending()
    snapshot = self._copy_for(state)(state)
    # A daemon thread: after an error elsewhere (a host gone, the run
    # failing) the process must be able to exit even while orbax waits for
    # the other hosts; an unfinished save is never committed, so nothing is lost.
    self._worker = threading.Thread(
      target=self._orbax_save,
      args=(step, snapshot, dict(data_state)),
      name="checkpoint",
      daemon=True,
    )
    self._worker.start()
    self._last = step
    return True

  def _copy_for(self, state: Any) -> Callable[[Any], Any]:
    # One compiled copy of the whole state (one dispatch; `jax.device_put`
    # of a tree copies array by array), rebuilt only if the state's layout
    # changes.
    layout = (
      jax.tree.structure(state),
      tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state)),
    )
    if self._copy is None or self._copy[0] != layout:
      shardings = jax.tree.map(_snapshot_sharding, state)
      # jnp.copy: an output is never the input itself, even where the
      # sharding is unchanged (the next step donates the input).
      copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=shardings)
      self._copy = layout, copy
    return self._copy[1]

  def wait(self) -> None:
    """Blocks until every started save is written and committed."""
    self._take_pending()
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._noted(e, f"the save of step {self._last}") from None

  def _noted(self, error: BaseException, which: str) -> BaseException:
    # The store's own error says what failed, not where: name the directory,
    # and that what was committed before is intact (a restart resumes there).
    error.add_note(
      f"a checkpoint save to {self.manager.directory} failed ({which}); the steps "
      "committed before it are intact and a restart resumes from the last of them"
    )
    return error

  def close(self) -> None:
    """Waits for the saves started, then closes the manager."""
    try:
      self.wait()
    finally:
      self.manager.close()

  def _take_pending(self) -> None:
    worker, self._worker = self._worker, None
    if worker is not None:
      worker.join()
    error, self._error = self._error, None
    if error is not None:
      raise error  # a failed save, re-raised here on the training thread

  def _orbax_save(self, step: int, state: Any, data_state: dict) -> None:
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
    )
    try:
      # orbax's Python work per array starts once the copy is in host
      # memory, which is after the step it follows: begun at once it would
      # compete with the end of that step for the host's cores and the GIL,
      # and make the saving step slower than the others.
      jax.block_until_ready(state)
      # Before orbax creates anything for the step (its folder is made on
      # process 0, after this, behind its barrier): so a folder a kill leaves
      # is known to be the harness's own at the next start.
      step_folders.record_save(self.manager.directory, step, self.manager.all_steps())
      # force: the caller decided the step (orbax's interval check would
      # otherwise decide a second time, in another thread).
      self.manager.save(step, args=args, force=True)
    except BaseException as e:  # kept for the training thread to raise
      self._error = self._noted(e, f"step {step}, or the save before it")


def _snapshot_sharding(x: jax.Array) -> jax.sharding.Sharding:
  """Where the snapshot of `x` lives: host memory, and one copy, not one per replica.

  An array over `SNAPSHOT_SPREAD_MIN_BYTES` per device that is replicated
  over some mesh axes (all of them, or those its spec leaves out) is spread
  over those axes too, on the first dimension that divides evenly: the copy
  costs 1/replicas of copying every replica, each device keeps a part of what
  it already holds (no data moves between devices), and each host writes its
  part. Small ones stay as they are: each piece is one more file fragment for
  orbax to write, which costs more CPU than copying a small array a few times.
  """
  sharding = x.sharding
  if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
    if x.nbytes // sharding.mesh.size >= SNAPSHOT_SPREAD_MIN_BYTES:
      sharding = _without_replicas(sharding, x.shape)
  return _in_host_memory(sharding)


def _without_replicas(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
  """`sharding` with the mesh axes its spec leaves out added to one dimension, where one divides."""
  mesh = sharding.mesh
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  used = spec_axis_names(spec)
  spare = tuple(a for a in mesh.axis_names if a not in used)
  if math.prod(mesh.shape[a] for a in spare) == 1:
    return sharding
  for dim, axes in enumerate(map(axis_names, spec)):
    # After the dimension's own axes: each device's new block lies inside
    # the block it holds now.
    if shape[dim] % math.prod(mesh.shape[a] for a in axes + spare) == 0:
      new = [*spec[:dim], axes + spare, *spec[dim + 1 :]]
      while new and new[-1] is None:  # P("a", None) != P("a")
        new.pop()
      return NamedSharding(mesh, P(*new))
  return sharding


@functools.lru_cache(maxsize=4096)
def _in_host_memory(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """`sharding` in host memory (`pinned_host`) where its devices have it."""
  kinds = {m.kind for d in sharding.addressable_devices for m in d.addressable_memories()}
  # Without a host memory space the copy stays on the devices: still one
  # batched copy, and still off the training thread's critical path.
  return sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else sharding
