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

from spmd.distributed import initialize
from spmd.mesh import device_order
from spmd.multihost import AgreementError
from spmd.partition import PartitionSpec
from spmd.sharded_jit import sharded_jit, with_sharding_constraint

__all__ = [
  "AgreementError",
  "PartitionSpec",
  "device_order",
  "initialize",
  "sharded_jit",
  "with_sharding_constraint",
]
