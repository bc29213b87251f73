"""Context parallelism: every sequence split over the mesh axis `context`, in a balanced order.

With `length` mapped to `context` (every preset does) on a mesh where it has
`C > 1` devices, device i holds one slice of every sequence. Causal
attention makes late tokens cost more than early ones (a query reads every
key before it), so slicing the sequence in order would give the last device
most of the work. The load-balanced order (MaxText's, for its context
parallelism) cuts the sequence into `2C` chunks and gives device i chunks
i and `2C - 1 - i`: one early and one late, the same work on every device.

The train and eval steps put each sequence feature of the batch
(`Task.sequence_features`) into that order on entry (`to_balanced`) and
never undo it: the loss is a sum over tokens, which no order changes. Inside,
`token_index(length)` says which token of the original sequence each
position holds, so attention masks by the original places and a model's
default positions stay what they were (`order`, entered by the step). Outside
it the order is the natural one, and a sequence split over `context` in
that order is still exact, only unbalanced.

Example:
  >>> balanced_order(8, 2).tolist()  # chunks 0, 3 on device 0 and 1, 2 on device 1
  [0, 1, 6, 7, 2, 3, 4, 5]
  >>> with order(2):
  ...   token_index(8).tolist()
  [0, 1, 6, 7, 2, 3, 4, 5]
  >>> token_index(4).tolist()
  [0, 1, 2, 3]
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from spmd.rules import active_rules, logical_to_spec

_active = threading.local()


def _chunks(shards: int) -> np.ndarray:
  """The chunk each position-chunk holds: device i gets chunks i and 2 * shards - 1 - i."""
  first = np.arange(shards)
  return np.stack([first, 2 * shards - 1 - first], axis=1).reshape(-1)


def check_length(length: int, shards: int) -> None:
  """A `ValueError` when `length` does not cut into `2 * shards` equal chunks.

  Example:
    >>> check_length(12, 4)
    Traceback (most recent call last):
    ...
    ValueError: a sequence of length=12 split over context=4 devices must be a multiple of 8 (2 chunks per device, one early and one late)
  """
  if shards < 1 or length % (2 * shards):
    raise ValueError(
      f"a sequence of {length=} split over context={shards} devices must be a multiple of "
      f"{2 * shards} (2 chunks per device, one early and one late)"
    )


def balanced_order(length: int, shards: int) -> np.ndarray:
  """int32 [length]: the original place of the token at each position of the balanced order."""
  check_length(length, shards)
  size = length // (2 * shards)
  return (_chunks(shards)[:, None] * size + np.arange(size)).reshape(-1).astype(np.int32)


def to_balanced(x: jax.Array, shards: int, axis: int = 1) -> jax.Array:
  """`x` with its `axis` (the sequence) in the balanced order for `shards` devices.

  Example:
    >>> to_balanced(jnp.arange(8)[None], 2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
  """
  length = x.shape[axis]
  check_length(length, shards)
  chunked = x.reshape(*x.shape[:axis], 2 * shards, length // (2 * shards), *x.shape[axis + 1 :])
  return jnp.take(chunked, _chunks(shards), axis=axis).reshape(x.shape)


@contextlib.contextmanager
def order(shards: int) -> Iterator[None]:
  """While inside (this thread), sequences are in the balanced order for `shards` devices.

  The step enters it where it puts the batch in that order; `token_index`
  reads it. Like `spmd.rules.activation_rules`, it matters while tracing.
  """
  stack = _active.__dict__.setdefault("stack", [])
  stack.append(int(shards))
  try:
    yield
  finally:
    stack.pop()


def token_index(length: int) -> np.ndarray:
  """int32 [length]: each position's place in the original sequence under the active `order`.

  The natural order (0..length-1) outside any. Attention masks causally by
  it; a model's default RoPE or learned positions read it (for packed rows
  the batch's `positions` already hold each token's place in its document).
  """
  stack = getattr(_active, "stack", None)
  if not stack or stack[-1] == 1:
    return np.arange(length, dtype=np.int32)
  return balanced_order(length, stack[-1])


def shards_of(rules, mesh) -> int:
  """How many devices the `rules` split a sequence (`length`) into on `mesh`."""
  spec = logical_to_spec(("length",), rules, mesh)
  entry = spec[0] if len(spec) else None
  axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh.shape[a] for a in axes)


def active_shards() -> int:
  """`shards_of` the active `spmd.rules.activation_rules`; 1 outside them or inside a shard_map.

  A model flattens [batch, length] into one token axis only when this is 1:
  with the sequence split too, each device's tokens are not one contiguous
  block of the flattened axis, and XLA would all-gather the activation.
  """
  active = active_rules()
  if active is None or jax.sharding.get_abstract_mesh().manual_axes:
    return 1
  return shards_of(*active)


def causal_blocks(length: int, shards: int, balanced: bool, block: int) -> list[int]:
  """Per device: the (query block, key block) pairs of causal attention with any unmasked entry.

  Blocks of `block` positions of each device's slice (queries) and of the
  whole gathered sequence (keys), masked by the tokens' original places: the
  work a block-sparse kernel (splash) does on each device.

  Example:
    >>> causal_blocks(16, 2, balanced=False, block=2), causal_blocks(16, 2, balanced=True, block=2)
    ([10, 26], [18, 18])
  """
  index = balanced_order(length, shards) if balanced else np.arange(length)
  per_device = length // shards
  if per_device % block:
    raise ValueError(f"{block=} must divide the {per_device} positions each device holds")
  # The earliest and latest original place in each block, for queries and keys.
  blocks = index.reshape(-1, block)
  first, last = blocks.min(axis=1), blocks.max(axis=1)
  # A pair has an unmasked entry when some key's place is at most some query's.
  live = first[None, :] <= last[:, None]  # [query block, key block]
  per = per_device // block
  return [int(live[i * per : (i + 1) * per].sum()) for i in range(shards)]
