"""Which base weights a LoRA checkpoint's adapters were trained on: a source and a content hash.

A LoRA checkpoint holds the adapters, not the frozen weights (see
`trainers.checkpoints.restore`), so a resume takes them again from where the
run started (`checkpoint.init_from`, or the seed). Adapters on other weights
would train on without a sign of it, so each checkpoint names its base
(`BaseWeights`: the source and a hash of the frozen weights' contents) and a
resume whose base hashes otherwise is refused, naming both.

The hash is computed once per run, on the devices, where the weights are:
each array's bits, mixed with their positions, are summed modulo 2**32 (two
sums of differently mixed words). Integer addition modulo 2**32 gives the
same result in any order, so the hash does not depend on the mesh, the
sharding or the number of hosts; the arrays' paths, shapes and dtypes and
their sums are then hashed on the host (sha256).

Example:
  >>> import jax.numpy as jnp
  >>> a = content_hash({"w": jnp.ones((4, 3), jnp.bfloat16)})
  >>> a == content_hash({"w": jnp.ones((4, 3), jnp.bfloat16)}), len(a)
  (True, 16)
  >>> a == content_hash({"w": jnp.ones((4, 3), jnp.bfloat16).at[2, 1].set(2)})
  False
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd import compile_meeting
from trainers.checkpoints.damage import CheckpointError

KEY = "lora_base"  # where a checkpoint's data record keeps it


def _word_sums(x: jax.Array) -> jax.Array:
  """Two uint32 sums of `x`'s bits mixed with their flat positions (order-free)."""
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
  bits = jax.lax.bitcast_convert_type(x.reshape(-1), width).astype(jnp.uint32)
  index = jnp.arange(bits.shape[0], dtype=jnp.uint32)
  h = bits * jnp.uint32(0x9E3779B1) + index * jnp.uint32(0x85EBCA6B) + jnp.uint32(0x27D4EB2F)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x2C1B3C6D)
  h = h ^ (h >> 12)
  return jnp.stack([jnp.sum(h, dtype=jnp.uint32), jnp.sum(h * (index | 1), dtype=jnp.uint32)])


def content_hash(weights: Any) -> str:
  """16 hex digits that name `weights`' contents (a nested dict of arrays, global or local).

  Every process must call it (the sums are one computation over the mesh).
  """
  leaves = jax.tree_util.tree_leaves_with_path(weights)
  arrays = [x for _, x in leaves]
  sums_of = jax.jit(lambda xs: [_word_sums(x) for x in xs])
  sums = compile_meeting.compile_together("the base weights' content hash", sums_of, arrays)(arrays)
  digest = hashlib.sha256()
  for (path, x), s in zip(leaves, sums):
    # Fully replicated results: every process reads its own copy.
    value = np.asarray(s.addressable_data(0)) if hasattr(s, "addressable_data") else np.asarray(s)
    digest.update(f"{jax.tree_util.keystr(path)} {x.shape} {x.dtype} ".encode())
    digest.update(value.astype("<u4").tobytes())
  return digest.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class BaseWeights:
  """The frozen weights a LoRA run trains adapters on: where they came from, and their hash."""

  source: str  # checkpoint.init_from, or "fresh init (seed N)"
  hash: str

  def __str__(self) -> str:
    return f"{self.source} (content hash {self.hash})"

  def to_dict(self) -> dict[str, str]:
    return {"source": self.source, "hash": self.hash}


def check_same_base(saved: dict | None, current: BaseWeights, what: str) -> None:
  """Raises `CheckpointError` when `what`'s adapters were trained on other base weights.

  Example:
    >>> check_same_base({"source": "a", "hash": "1"}, BaseWeights("b", "2"), "checkpoint step 3")
    Traceback (most recent call last):
    ...
    trainers.checkpoints.damage.CheckpointError: checkpoint step 3 holds LoRA adapters trained on the base weights a (content hash 1), but this run's base weights are b (content hash 2); resume with the checkpoint.init_from it was trained from, or start a new workdir
  """
  if saved is None:
    raise CheckpointError(
      f"{what} names no LoRA base weights (saved without config.lora?), but this run trains "
      f"LoRA adapters on {current}"
    )
  if saved["hash"] != current.hash:
    raise CheckpointError(
      f"{what} holds LoRA adapters trained on the base weights "
      f"{BaseWeights(saved['source'], saved['hash'])}, but this run's base weights are "
      f"{current}; resume with the checkpoint.init_from it was trained from, or start a new "
      "workdir"
    )
