"""orbax's `CheckpointManager`, set up for the harness: the judged step folders, safe barriers, no pickle.

Arrays are tensorstore (zarr in OCDBT) files and everything else JSON; a
step's folder is renamed into place only when every host has finished (on an
object store, written in place with its commit marker last).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from spmd import compat
from trainers import paths
from trainers.checkpoints import step_folders


@functools.cache
def register_array_handler() -> None:
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

  orbax sees only the committed steps of `steps` (`step_folders`), and
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
  register_array_handler()
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


def read_only_manager(directory: str | epath.Path) -> ocp.CheckpointManager:
  """A read-only `CheckpointManager` whose state item can be restored in part.

  The state is read with orbax's PyTree handler: the standard one saves
  through it (the same files), and only it restores a part of the tree
  (`restore_weights`). Nothing in `directory` is changed or cleaned up.
  """
  register_array_handler()
  return ocp.CheckpointManager(
    paths.user_path(directory),
    item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()},
    options=ocp.CheckpointManagerOptions(read_only=True),
  )
