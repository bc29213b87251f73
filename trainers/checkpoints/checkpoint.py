"""Checkpoints: orbax, asynchronous and atomic, with the data position inside.

A checkpoint is one orbax step directory holding two items: `state` (the
sharded train state, written by every host for its own shards) and `data`
(the input pipeline's position, JSON). Orbax writes into a temporary
directory and renames it only when every host has finished (on an object
store, where nothing renames atomically, it writes the step in place and
its commit marker last), so a crash mid-save leaves no step that could be
restored half-written. Which step folders are checkpoints, which are the
harness's own leftovers (removed when the run starts again) and which are
another tool's (never deleted) is one decision process 0 makes and every
host acts on: `checkpoint_steps`. Nothing is pickled
or unpickled: arrays are tensorstore (zarr in OCDBT) files, everything else JSON.

Saves go through `Saver`: the training thread only starts a copy of the state
into host memory, and orbax's own work (per-array bookkeeping, transfers,
writes) runs on a worker thread, so a step that starts a checkpoint is not
held up by it.

What cannot be restored is a `CheckpointError` naming the step, the directory
and what is wrong, raised before any state is used (never a partial restore):
a step directory without orbax's commit marker (`commit_success.txt`, written
last, just before the rename), a checkpoint of another model (parameter
names, shapes or dtypes differ), or files that fail to read (truncated,
corrupt). A checkpoint of the same model saved on another mesh or process
count restores onto the new one: arrays are read into the target shardings.

Resume order (decided in `restore_or_init`):
  1. the latest checkpoint in the run's own checkpoint directory: everything,
     including the data position, restored into the target shardings (so a
     different mesh or process count works). A checkpoint saved before the
     state counted its applied updates (`updates`) resumes with the count set
     to its step;
  2. else initial weights from `init_from` (another run's workdir, its
     checkpoint directory, or one step's directory): the parameters and the
     model's other variables (`model_state`: batch statistics, a model's own
     variables) only, read by a partial restore (`restore_weights`) that never
     opens the optimizer state, so any optimizer and schedule may follow; the
     optimizer, step and data start fresh;
  3. else a fresh initialisation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import functools
import json
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd import compat, multihost
from spmd.errors import UserError
from spmd.partition import axis_names, spec_axis_names
from trainers import paths
from trainers.checkpoints import step_folders

log = logging.getLogger(__name__)

COMMIT_MARKER = step_folders.COMMIT_MARKER  # orbax writes it last, before the final rename
WEIGHTS = ("params", "model_state")  # the part of the train state a model needs
# The applied-update count (trainers/step/state.py), which older checkpoints lack.
UPDATES = "updates"


class CheckpointError(UserError):
  """A checkpoint that cannot be restored: incomplete, damaged, or of another model.

  A user error (`spmd.errors`, a `ValueError`): the same checkpoint fails the
  same way again, so a command says so in one line and launchers do not
  restart; the message names the step and what to do.
  """


@dataclasses.dataclass
class Restored:
  """What `restore_or_init` found."""

  state: Any
  data_state: dict | None  # the pipeline position, when resumed
  source: str  # "checkpoint step N", "init_from PATH step N" or "fresh init"
  step: int


# `Saver`'s snapshot of an array over this many bytes per device holds no
# replicas (`_snapshot_sharding`): it is spread over the devices that held
# copies of it, so each host writes its own part, with no extra dispatches.
# Smaller ones are copied whole and written by one replica: one fragment per
# piece costs orbax more CPU than the write.
SNAPSHOT_SPREAD_MIN_BYTES = 1 << 20


@functools.cache
def _register_array_handler() -> None:
  ocp.type_handlers.register_type_handler(
    jax.Array,
    ocp.type_handlers.ArrayHandler(
      # orbax's replica-parallel writing splits a replicated array's writing
      # across its replicas. The snapshot leaves it nothing to split (above:
      # the large arrays have no replicas, the small ones would be under its
      # threshold), so it is off rather than asked about every array of every
      # save.
      use_replica_parallel=False,
      # orbax's `_sharding` file records each array's saved sharding, for
      # restores that give none. Ours always give the target's (any mesh and
      # process count), so it is never read, and serializing it is Python
      # work per array that a CPU host takes from the step running beside
      # the save.
      enable_write_sharding_file=False,
    ),
    override=True,
  )


def _barriers_through_the_coordination_service() -> None:
  """orbax's barriers as JAX coordination-service calls, not XLA collectives.

  `Saver` runs orbax's `save` on a worker thread while the training thread
  runs steps. orbax's default barrier is a collective program
  (`sync_global_devices`); launched from another thread it is ordered
  differently against the steps' collectives on each host, and the job
  deadlocks (seen with 2 processes). The coordination service's barrier is
  an RPC, safe from any thread, and has a timeout. The switch is an orbax
  experimental flag, set through `spmd.compat`.
  """
  compat.use_coordination_service_barriers_in_orbax()


class JudgedManager(ocp.CheckpointManager):
  """orbax's `CheckpointManager`, over the step folders of one shared judgment (`steps`).

  orbax sees only the committed steps of `steps` (`checkpoint_steps`), and
  `Saver` refuses to save into a folder it judged foreign.
  """

  def __init__(self, directory: epath.Path, steps: step_folders.StepDirs, **kwargs: Any):
    super().__init__(directory, **kwargs)
    self.steps = steps


def make_manager(
  directory: str | epath.Path, every: int, keep: int, keep_period: int = 0, async_save: bool = True
) -> JudgedManager:
  """An orbax `CheckpointManager` that keeps the last `keep` (+ every `keep_period`-th).

  Every process must call it (together): process 0 judges the step folders
  there and removes the unfinished ones the harness wrote, and every process
  gets its answer (`step_folders.decide`).

  Raises:
    step_folders.ForeignStepError: a step folder the harness did not
      write lies where the run would save every `every` steps.
  """
  _register_array_handler()
  _barriers_through_the_coordination_service()
  directory = paths.user_path(directory)
  steps = step_folders.decide(directory)
  step_folders.check_schedule(steps, every)
  options = ocp.CheckpointManagerOptions(
    save_interval_steps=max(every, 1),
    max_to_keep=keep,
    keep_period=keep_period or None,
    enable_async_checkpointing=async_save,
    # Off: `step_folders.decide` has removed the unfinished steps the
    # harness wrote, once, for every host. orbax's own clean-up runs
    # asynchronously on process 0 alone (the other hosts cannot wait for it)
    # and, on an object store, deletes every folder without a commit marker,
    # another tool's included.
    cleanup_tmp_directories=False,
    # orbax lists only the committed steps of that decision: its `max_to_keep`
    # rotation never sees, so never deletes, a folder the run did not write.
    step_name_format=step_folders.JudgedNameFormat(steps.committed),
    create=True,
  )
  return JudgedManager(directory, steps, options=options, item_handlers=_handlers())


def _handlers() -> dict[str, ocp.CheckpointHandler]:
  # Named up front (not inferred at the first save) so the saved tree's
  # metadata can be read before restoring: the model check below needs it.
  return {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}


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


def _abstract(state_shapes: Any, shardings: Any) -> Any:
  return jax.tree.map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state_shapes, shardings
  )


def _leaves(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {
    jax.tree_util.keystr(p, simple=True, separator="."): (tuple(x.shape), str(x.dtype))
    for p, x in flat
  }


SAME_CONFIG_ADVICE = "Use the config it was saved with, or another workdir."


def saved_state_tree(manager: ocp.CheckpointManager, step: int, what: str) -> Any:
  """The saved state's tree of array metadata (names, shapes, dtypes); no array data is read.

  orbax opens every array's own metadata for it, the optimizer state's too
  (a warm start reads `weights_metadata` instead).
  """
  try:
    saved_tree = manager.item_metadata(step)["state"]
  except Exception as e:  # a damaged metadata file: JSON or orbax errors
    if is_trouble(e):
      e.add_note(f"while reading {what}: the checkpoint itself may be fine; nothing was restored")
      raise
    raise _damaged(what, e) from e
  if saved_tree is None:
    raise CheckpointError(f"{what} cannot be restored: it has no state metadata")
  return saved_tree


def check_same_model(
  manager: ocp.CheckpointManager,
  step: int,
  target: Any,
  what: str,
  only: tuple[str, ...] = (),
  advice: str = SAME_CONFIG_ADVICE,
  saved_tree: Any = None,
) -> None:
  """Raises `CheckpointError` unless the saved state has the target's names, shapes, dtypes.

  `only` limits the comparison to these top-level items of the state (e.g.
  `WEIGHTS` for a restore of the weights alone); empty compares all. Each
  array that differs or is on one side only is named with its shape and
  dtype (both, where both exist); `advice` ends the message. `saved_tree`:
  the saved metadata when already read (`saved_state_tree`, `weights_metadata`).
  """
  if saved_tree is None:
    saved_tree = saved_state_tree(manager, step, what)
  if only:
    saved_tree = {k: saved_tree[k] for k in only if k in saved_tree}
  saved, wanted = _leaves(saved_tree), _leaves(target)

  def order(key: str) -> tuple[bool, str]:
    return (not key.startswith("params."), key)  # the parameters first: they say the most

  def show(leaf: tuple) -> str:
    return f"{leaf[0]} {leaf[1]}"

  problems = [
    f"{k}: saved {show(saved[k])}, this config needs {show(wanted[k])}"
    for k in sorted(saved.keys() & wanted.keys(), key=order)
    if saved[k] != wanted[k]
  ]
  problems += [
    f"{k}: missing from the checkpoint, this config needs {show(wanted[k])}"
    for k in sorted(wanted.keys() - saved.keys(), key=order)
  ]
  problems += [
    f"{k}: saved {show(saved[k])}, not in this model"
    for k in sorted(saved.keys() - wanted.keys(), key=order)
  ]
  if problems:
    shown = "\n  ".join(problems[:8]) + (
      f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
    )
    raise CheckpointError(
      f"{what} holds a different model ({len(problems)} arrays differ):\n  {shown}\n{advice}"
    )


def restore_step(manager: ocp.CheckpointManager, step: int, args: Any, what: str) -> Any:
  """`manager.restore`, with a damaged checkpoint said as such (nothing is used).

  An error that says the storage or the machine is in trouble (permission,
  network, I/O, memory; see `is_trouble`) is not damage: it is raised as
  what it is, with the step and path added, and no advice to move anything.
  """
  try:
    return manager.restore(step, args=args)
  except Exception as e:  # tensorstore, JSON and orbax errors alike
    if is_trouble(e):
      e.add_note(f"while restoring {what}: the checkpoint itself may be fine; nothing was restored")
      raise
    raise _damaged(what, e) from e


def read_only_manager(directory: str | epath.Path) -> ocp.CheckpointManager:
  """A read-only `CheckpointManager` whose state item can be restored in part.

  The state is read with orbax's PyTree handler: the standard one saves
  through it (the same files), and only it restores a part of the tree
  (`restore_weights`). Nothing in `directory` is changed or cleaned up.
  """
  _register_array_handler()
  return ocp.CheckpointManager(
    paths.user_path(directory),
    item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
    options=ocp.CheckpointManagerOptions(read_only=True),
  )


# orbax's description of a saved tree (`_METADATA` beside the arrays): each
# leaf's key path and value type, but not its shape, which only the array's own
# metadata holds. Its key types: 1 a sequence index, 2 a dict key.
_TREE_METADATA_FILE = "_METADATA"
_SEQUENCE_KEY = 1


def weights_metadata(manager: ocp.CheckpointManager, step: int, what: str) -> dict[str, Any]:
  """The saved shapes and dtypes of the weights (`WEIGHTS`) of `step`.

  Only the weights' own array metadata is opened: orbax's `item_metadata`
  opens every array's, the optimizer state's included, so a warm start would
  depend on files it never restores. The leaf names come from orbax's tree
  description; the shapes from orbax's array handler, for those leaves only.
  """
  state_dir = epath.Path(manager.directory) / str(step) / "state"
  try:
    described = json.loads((state_dir / _TREE_METADATA_FILE).read_text())
    leaves = [
      [(k["key"], k.get("key_type")) for k in entry["key_metadata"]]
      for entry in described["tree_metadata"].values()
      if entry["key_metadata"][0]["key"] in WEIGHTS
      and not entry.get("value_metadata", {}).get("skip_deserialize", False)
    ]
    use_ocdbt = bool(described.get("use_ocdbt", True))
    context = ocp.type_handlers.get_ts_context(use_ocdbt=use_ocdbt)
    infos = [
      ocp.type_handlers.ParamInfo(
        name=".".join(str(key) for key, _ in path),
        parent_dir=state_dir,
        skip_deserialize=False,
        is_ocdbt_checkpoint=use_ocdbt,
        use_zarr3=bool(described.get("use_zarr3", False)),
        ts_context=context,
      )
      for path in leaves
    ]
    _register_array_handler()
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    arrays = _run_async(handler.metadata(infos)) if infos else []
  except Exception as e:  # a missing or damaged metadata file: JSON, OS or tensorstore errors
    if is_trouble(e):
      e.add_note(f"while reading {what}: the checkpoint itself may be fine; nothing was restored")
      raise
    raise _damaged(what, e) from e
  tree = _nested(zip(leaves, arrays))
  if "params" not in tree:
    raise CheckpointError(f"{what} holds no parameters")
  return tree


def _run_async(coroutine: Any) -> Any:
  """`coroutine`'s result, also from a caller already inside an event loop (a notebook)."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(coroutine)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, coroutine).result()


def _nested(leaves: Any) -> dict[str, Any]:
  """A tree from `(key path, value)` pairs, as orbax rebuilds a saved one.

  A level whose keys are sequence indices becomes a list.
  """
  root: dict = {}
  sequences: set[int] = set()  # id() of the levels keyed by sequence indices
  for path, value in leaves:
    level = root
    for depth, (key, kind) in enumerate(path):
      if kind == _SEQUENCE_KEY:
        key = int(key)
        sequences.add(id(level))
      if depth == len(path) - 1:
        level[key] = value
      else:
        level = level.setdefault(key, {})

  def build(level: Any) -> Any:
    if not isinstance(level, dict):
      return level
    if id(level) in sequences:
      return [build(level[i]) for i in sorted(level)]
    return {k: build(v) for k, v in level.items()}

  return build(root)


def restore_weights(
  manager: ocp.CheckpointManager,
  step: int,
  target: dict[str, Any] | None,
  what: str,
  advice: str = SAME_CONFIG_ADVICE,
) -> dict[str, Any]:
  """The parameters and model state of `step` by a partial restore: nothing else is read.

  `manager` comes from `read_only_manager`. The optimizer state and the rest
  of the train state are never opened (their files may be damaged or of
  another optimizer), so memory holds only the weights.

  `target`: `{"params": ..., "model_state": ...}` (the latter only for models
  that have one) of `jax.ShapeDtypeStruct`s with shardings: the arrays come
  back as global `jax.Array`s in those shardings, whatever mesh or process
  count saved them (every process must call this), after a check that the
  saved weights have the target's names, shapes and dtypes (`advice` ends
  that error). None: numpy arrays on this host alone, shaped as saved.

  Raises:
    CheckpointError: the weights are damaged, or of another model.
  """
  saved = weights_metadata(manager, step, what)
  if target is None:
    item = saved
    restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
      item,
      is_leaf=lambda x: hasattr(x, "shape"),
    )
  else:
    item = target
    check_same_model(manager, step, target, what, only=WEIGHTS, advice=advice, saved_tree=saved)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
  restored = restore_step(manager, step, ocp.args.Composite(state=args), what)
  return dict(restored["state"])


# Status names (gRPC's, which tensorstore and XLA use in their messages) and
# phrases that mean the storage or the machine failed, not the checkpoint.
_TROUBLE_MARKERS = (
  "PERMISSION_DENIED",
  "UNAUTHENTICATED",
  "UNAVAILABLE",
  "DEADLINE_EXCEEDED",
  "RESOURCE_EXHAUSTED",
  "ABORTED",
  "Permission denied",
  "Connection refused",
  "Connection reset",
  "timed out",
  "Out of memory",
  "out of memory",
  "No space left",
)
# OS errors that say nothing about the files' contents.
_TROUBLE_ERRNOS = {
  errno.EACCES,
  errno.EPERM,
  errno.EIO,
  errno.ENOMEM,
  errno.ENOSPC,
  errno.ETIMEDOUT,
  errno.ECONNREFUSED,
  errno.ECONNRESET,
  errno.EHOSTUNREACH,
  errno.ENETUNREACH,
}


def is_trouble(error: BaseException) -> bool:
  """Whether `error` (or an error it was raised from) is storage or machine trouble.

  Example:
    >>> is_trouble(PermissionError(13, "Permission denied"))
    True
    >>> is_trouble(ValueError("Error reading: UNAVAILABLE: connection to storage lost"))
    True
    >>> is_trouble(ValueError("Error decoding chunk: unexpected end of data"))
    False
  """
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, MemoryError | PermissionError | ConnectionError | TimeoutError):
      return True
    if isinstance(error, OSError) and error.errno in _TROUBLE_ERRNOS:
      return True
    text = str(error)
    if any(marker in text for marker in _TROUBLE_MARKERS):
      return True
    error = error.__cause__ or error.__context__
  return False


def _damaged(what: str, e: Exception) -> CheckpointError:
  detail = " ".join(str(e).split())
  if len(detail) > 400:
    detail = detail[:400] + " ..."
  return CheckpointError(
    f"{what} cannot be restored: it is damaged or incomplete ({type(e).__name__}: {detail}). "
    "Nothing was restored; move that step directory away to resume from an earlier one."
  )


def latest_committed_step(manager: ocp.CheckpointManager) -> int | None:
  """The newest committed step of the run's own, or None.

  The manager of `make_manager` lists only the committed steps of the
  judgment every host shares (`step_folders.decide`, which also removed
  the unfinished steps the harness wrote), so this is orbax's latest step.
  """
  return manager.latest_step()


def checked_step(manager: ocp.CheckpointManager, directory: str, step: int) -> str:
  what = f"checkpoint step {step} in {directory}"
  if not step_folders.is_committed(directory, step):  # init_from: another run's, read only
    raise CheckpointError(
      f"{what} has no commit marker ({COMMIT_MARKER}): that save never finished; "
      f"it is not restored (steps there: {list(manager.all_steps())})."
    )
  return what


WARM_START_ADVICE = (
  "A warm start (checkpoint.init_from) needs the same parameter and model-state names, "
  "shapes and dtypes; the optimizer and schedule may differ. Use a model config that "
  "matches the checkpoint, or another checkpoint."
)


def init_from_directory(init_from: str) -> tuple[epath.Path, int | None]:
  """(the orbax directory, the step or None for its latest) that `init_from` names.

  `init_from` is another run's workdir (its `checkpoints/` is used), its
  checkpoint directory, or one step's directory (`.../checkpoints/200`).
  """
  directory = paths.user_path(init_from)
  if (directory / "checkpoints").is_dir():
    return directory / "checkpoints", None
  if directory.name.isdigit() and (directory / "state").is_dir():
    return directory.parent, int(directory.name)
  return directory, None


def restore_or_init(
  manager: ocp.CheckpointManager,
  abstract_state: Any,
  shardings: Any,
  init: Callable[[], Any],
  init_from: str = "",
  init_with_weights: Callable[[dict[str, Any]], Any] | None = None,
) -> Restored:
  """Resumes, warm-starts or initialises, in the order in the module docstring.

  `init_with_weights(weights)`, for a warm start, is the initial state built
  around the restored weights (`trainers.step.state.StateSetup.init_with_weights`:
  the optimizer initialised from them); None initialises fresh (`init`) and
  puts the weights in.

  Raises:
    CheckpointError: the checkpoint to restore is incomplete, damaged or of
      another model (see the module docstring).
  """
  target = _abstract(abstract_state, shardings)
  # 1. Our own latest finished checkpoint: everything, data position included.
  step = latest_committed_step(manager)
  if step is not None:
    what = checked_step(manager, str(manager.directory), step)
    # A checkpoint from before the state counted its updates: everything
    # else restored, the count set to the step (exact unless that run skipped
    # non-finite steps; then the logged learning rate stays ahead by those).
    saved_tree = saved_state_tree(manager, step, what)
    counted = UPDATES not in target or UPDATES in saved_tree
    wanted = target if counted else {k: v for k, v in target.items() if k != UPDATES}
    check_same_model(manager, step, wanted, what, saved_tree=saved_tree)
    restored = restore_step(
      manager,
      step,
      ocp.args.Composite(state=ocp.args.StandardRestore(wanted), data=ocp.args.JsonRestore()),
      what,
    )
    state = restored["state"]
    if not counted:
      log.warning("%s has no update count (saved by an older version): set to its step", what)
      state = dict(state, **{UPDATES: _replicated_scalar(step, target[UPDATES])})
    return Restored(state, dict(restored["data"]), f"checkpoint step {step}", step)
  # 2. Initial weights from another run: parameters and model state only.
  if init_from:
    directory, other_step = init_from_directory(init_from)
    with read_only_manager(directory) as other:
      if other_step is None:
        # The newest committed step of the harness's own: orbax's listing
        # would take another tool's digit-named folder for a checkpoint.
        # Process 0 reads it for every host, so all warm-start from one step.
        other_step = multihost.from_process_0(
          "init_from step", lambda: step_folders.list_steps(directory).latest
        )
      if other_step is None:
        raise FileNotFoundError(
          f"checkpoint.init_from={init_from!r} holds no checkpoint (give a run's workdir, "
          "its checkpoints directory, or one step's directory)"
        )
      what = "checkpoint.init_from " + checked_step(other, str(directory), other_step)
      wanted = {k: target[k] for k in WEIGHTS if k in target}
      weights = restore_weights(other, other_step, wanted, what, WARM_START_ADVICE)
    if init_with_weights is not None:
      state = init_with_weights(weights)
    else:
      state = dict(init(), **weights)
    return Restored(state, None, f"init_from {init_from} step {other_step}", 0)
  # 3. Fresh.
  return Restored(init(), None, "fresh init", 0)


def _replicated_scalar(value: int, like: jax.ShapeDtypeStruct) -> jax.Array:
  """`value` as a global array shaped, typed and sharded as `like` (every process calls this)."""
  host = np.asarray(value, like.dtype).reshape(like.shape)
  return jax.make_array_from_callback(like.shape, like.sharding, lambda index: host[index])
