"""spmd: the core of spmd-harness. No Flax, no optax, no data sets.

The public API is what `__all__` names: `sharded_jit` and
`with_sharding_constraint`, `PartitionSpec` (counts per dimension),
`AgreementError` (processes disagree about a call), `initialize` (JAX's
distributed runtime) and `device_order` (the one global device order).
`spmd._jit` holds `sharded_jit`'s internals: not API, they may change.

Example:
  >>> import numpy as np, spmd
  >>> f = spmd.sharded_jit(lambda x: x + 1, in_parts=spmd.PartitionSpec(1),
  ...                      out_parts=spmd.PartitionSpec(1))
  >>> f(np.zeros(4)).tolist()
  [1.0, 1.0, 1.0, 1.0]
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING

# The API's names, by the module that defines each. They are imported on first
# use (PEP 562), so `spmd.errors` or `spmd.env_names` alone does not import
# JAX: the launchers, which only start processes, start in a fraction of the
# time.
_API = {
  "AgreementError": "spmd.multihost",
  "PartitionSpec": "spmd.partition",
  "device_order": "spmd.mesh",
  "initialize": "spmd.distributed",
  "sharded_jit": "spmd.sharded_jit",
  "with_sharding_constraint": "spmd.sharded_jit",
}

__all__ = [
  "AgreementError",
  "PartitionSpec",
  "device_order",
  "initialize",
  "sharded_jit",
  "with_sharding_constraint",
]

if TYPE_CHECKING:
  from spmd.distributed import initialize
  from spmd.mesh import device_order
  from spmd.multihost import AgreementError
  from spmd.partition import PartitionSpec
  from spmd.sharded_jit import sharded_jit, with_sharding_constraint


def __getattr__(name: str):
  if name in _API:
    value = getattr(importlib.import_module(_API[name]), name)
  else:  # a submodule, as `import spmd; spmd.mesh` found it when this file imported them all
    try:
      value = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
      if e.name != f"{__name__}.{name}":
        raise
      raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
  globals()[name] = value
  return value


class _Package(types.ModuleType):
  """Keeps `spmd.sharded_jit` the function once its module is imported.

  Importing a submodule binds it to the package's attribute of that name; an
  API name is left to `__getattr__`, which gives the function.
  """

  def __setattr__(self, name: str, value: object) -> None:
    if name in _API and isinstance(value, types.ModuleType):
      return
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
