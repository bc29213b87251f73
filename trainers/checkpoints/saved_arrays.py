"""A saved step's weights, read a block at a time: nothing is loaded until asked, and only that.

`saved_run.restore_weights` restores whole arrays (orbax's restore): a reader
on one host then holds the whole model. `SavedWeights` opens each saved array
as the tensorstore orbax wrote (zarr in OCDBT) and reads index ranges of it,
so a reader of a model bigger than the host's RAM (the safetensors export)
holds one block at a time. A read decodes the saved chunks it touches, each
one device's shard of the array as it was saved (for a scanned model, a
weight's stack over all the layers, split as the mesh split it): beside the
block it returns, a read holds such a chunk twice (as read and decoded),
not the array.

Example:
  >>> import tempfile, numpy as np, jax, orbax.checkpoint as ocp
  >>> from trainers.checkpoints.saved_run import CheckpointRef
  >>> root = epath.Path(tempfile.mkdtemp())
  >>> params = {"blocks": {"w": np.arange(24, dtype=np.float32).reshape(3, 2, 4)}}
  >>> with ocp.CheckpointManager(root) as manager:
  ...   _ = manager.save(0, args=ocp.args.Composite(
  ...     state=ocp.args.PyTreeSave({"params": params})))
  >>> saved = SavedWeights(CheckpointRef(root, 0))
  >>> saved.arrays
  {'params/blocks/w': ((3, 2, 4), dtype('float32'))}
  >>> saved.read("params/blocks/w", (slice(1, 2),)).tolist()
  [[[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from trainers.checkpoints import reading, saved_run
from trainers.checkpoints.damage import damaged, is_trouble
from trainers.checkpoints.export import flatten


class SavedWeights:
  """The parameters (and model state) of one checkpoint step, read by index ranges.

  `arrays`: each array's name (`params/blocks/mlp/gate`) -> (shape, dtype),
  from the saved metadata alone. Opening checks the step as a restore does
  (committed, not damaged, holding parameters).
  """

  def __init__(self, ref: saved_run.CheckpointRef):
    self.what = f"step {ref.step} of {ref.directory}"
    tree = saved_run.saved_weights_metadata(ref)
    self.arrays: dict[str, tuple[tuple[int, ...], np.dtype]] = {
      name: (tuple(leaf.shape), np.dtype(leaf.dtype)) for name, leaf in flatten(tree).items()
    }
    state_dir = epath.Path(ref.directory) / str(ref.step) / "state"
    leaves, infos = reading.weight_infos(state_dir)
    self._infos = {"/".join(str(key) for key, _ in path): info for path, info in zip(leaves, infos)}
    self._stores: dict[str, Any] = {}

  def _store(self, name: str) -> Any:
    if name not in self._stores:
      info = self._infos[name]
      spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=info.is_ocdbt_checkpoint)
      self._stores[name] = ts.open(spec, context=info.ts_context, read=True).result()
    return self._stores[name]

  def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
    """`name`'s saved values at `index` (leading slices; the rest whole) as numpy.

    Raises:
      KeyError: no saved weight has that name (the names are `arrays`).
      CheckpointError: the array's data is damaged or missing.
    """
    if name not in self.arrays:
      raise KeyError(f"{name!r} is not a saved weight of {self.what}; saved: {sorted(self.arrays)}")
    try:
      return np.asarray(self._store(name)[index].read().result())
    except Exception as e:  # tensorstore's errors: a missing chunk, a damaged file
      if is_trouble(e):
        e.add_note(f"while reading {name} of {self.what}")
        raise
      raise damaged(f"{self.what} ({name})", e) from e
