"""Each target's log-probability under a language model: on one device, or on the run's mesh.

`token_logprobs(hidden, unembed, targets)` is `log_softmax(hidden @ unembed)`
at each target, in float32, formed a chunk of the sequence at a time (the
chunk from `trainers.tasks.losses.default_chunk`), so a batch's whole logits
never exist: at a 128k vocabulary they would be one of the largest buffers
of a forward pass.

`mesh_scorer(setup, task)` compiles that for the run's state on the run's
mesh: the model rebuilt from the parameters in the run's precision policy
(the loss eval's path, `trainers.step.loss`), the batch's rows split over
the batch axes, every target's log-probability gathered to every process
(a replicated output: each host reads the whole [rows, length] array).

`model_logprobs(model, batch)` is the same for a model in hand (one device,
no policy): what the golden test and notebooks call.

Example:
  >>> from flax import nnx
  >>> from trainers.models import llama
  >>> model = llama.Llama(llama.LlamaConfig(seq_len=8, num_layers=1, d_model=16, num_heads=2,
  ...                                       num_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
  >>> batch = {"inputs": np.ones((2, 8), np.int32), "targets": np.ones((2, 8), np.int32),
  ...          "segment_ids": np.ones((2, 8), np.int32),
  ...          "positions": np.tile(np.arange(8, dtype=np.int32), (2, 1))}
  >>> lp = model_logprobs(model, batch)
  >>> lp.shape, bool(np.all(lp < 0))
  ((2, 8), True)
  >>> full = jax.nn.log_softmax(model(jnp.asarray(batch["inputs"])), axis=-1)[..., 1]
  >>> bool(np.allclose(lp, full, atol=1e-5))
  True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import spmd
from spmd import context
from spmd import rules as rules_lib
from spmd.partition import NamedSpec
from spmd.rules import constrain
from trainers.step.eval_step import eval_inputs
from trainers.step.loss import model_weights, specs_of
from trainers.step.precision import Precision
from trainers.step.state import StateSetup, build_model
from trainers.tasks import Task
from trainers.tasks.losses import blocked, default_chunk

FEATURES = ("inputs", "targets", "segment_ids", "positions")


def token_logprobs(
  hidden: jax.Array, unembed: jax.Array, targets: jax.Array, rows_per_device: int = 1
) -> jax.Array:
  """float32 [batch, length]: log p(target) at each slot, from hidden states [batch, length, d_model].

  `unembed` is the output projection [d_model, vocab] as stored; it is
  multiplied in `hidden`'s dtype with float32 accumulation (as the loss's).
  With the sequence split over `context`, the chunks are of each device's
  own slice (rows of [shards * batch, length / shards], as the loss takes them).
  """
  shards = context.active_shards()
  if shards == 1:
    return _chunked_logprobs(hidden, unembed, targets, rows_per_device, "batch")
  batch, length = targets.shape
  hidden, targets = blocked(hidden, shards), blocked(targets, shards)
  out = _chunked_logprobs(hidden, unembed, targets, rows_per_device, ("length", "batch"))
  return jnp.swapaxes(out.reshape(shards, batch, -1), 0, 1).reshape(batch, length)


def _chunked_logprobs(hidden, unembed, targets, rows_per_device: int, rows) -> jax.Array:
  batch, length, _ = hidden.shape
  vocab = unembed.shape[1]
  chunk = default_chunk(length, vocab, rows_per_device)
  pad = -length % chunk
  if pad:  # no good divisor: padded slots, dropped at the end
    hidden = jnp.pad(hidden, [(0, 0), (0, pad), (0, 0)])
    targets = jnp.pad(targets, [(0, 0), (0, pad)])
  projection = constrain(unembed.astype(hidden.dtype), (None, "vocab"))

  def one_chunk(_, i):
    h = jax.lax.dynamic_slice_in_dim(hidden, i * chunk, chunk, axis=1)
    t = jax.lax.dynamic_slice_in_dim(targets, i * chunk, chunk, axis=1)
    logits = jnp.dot(h, projection, preferred_element_type=jnp.float32)
    logits = constrain(logits, (rows, "length", "vocab"))
    # The target's logit by comparison with the vocabulary's iota, not a
    # gather: one fused reduction, and a vocabulary split over devices stays split.
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t[..., None]
    chosen = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    return None, chosen - jax.nn.logsumexp(logits, axis=-1)

  _, out = jax.lax.scan(one_chunk, None, jnp.arange(hidden.shape[1] // chunk))
  return jnp.moveaxis(out, 0, 1).reshape(batch, -1)[:, :length]


def _logprobs(model, batch, rows_per_device: int = 1) -> jax.Array:
  hidden = model.hidden_states(batch["inputs"], batch["segment_ids"], batch["positions"])
  return token_logprobs(hidden, model.unembedding(), batch["targets"], rows_per_device)


@nnx.jit
def _model_logprobs(model, batch):
  return _logprobs(model, batch)


def model_logprobs(model: nnx.Module, batch: dict[str, np.ndarray]) -> np.ndarray:
  """`token_logprobs` of a model in hand (a `Llama` or `TransformerLM`), on the host."""
  model.eval()
  return np.asarray(_model_logprobs(model, {k: jnp.asarray(batch[k]) for k in FEATURES}))


def check_model(model: nnx.Module, where: str) -> None:
  """Raises `TypeError` unless the model gives hidden states and an output projection."""
  if not (hasattr(model, "hidden_states") and hasattr(model, "unembedding")):
    raise TypeError(
      f"{where}: {type(model).__name__} has no hidden_states()/unembedding(): evals score "
      "language models (the llama and lm tasks, or a model with those two methods)"
    )


def mesh_scorer(
  setup: StateSetup, task: Task, batch_axes: tuple[str, ...], rows: int
) -> Callable[[dict, dict[str, np.ndarray]], jax.Array]:
  """`(eval_inputs(state), batch) -> log-probabilities [rows, length]`, dispatched, not fetched.

  `batch` holds the whole batch's rows as numpy on every process; each
  process places its own devices' rows only. The result is replicated:
  `jax.device_get` reads it whole on every process (fetch several at once:
  one wait for all of them).
  """
  policy = Precision(setup.precision, task.float32_features)
  mesh = setup.mesh
  shards = math.prod(mesh.shape[a] for a in batch_axes) if mesh is not None else 1

  def score(inputs, batch):
    # As the train step builds it: adapters merged (where the model does not
    # add them itself) before the policy's cast, not after it.
    weights = model_weights(setup, policy, inputs["params"])
    model = build_model(setup, weights, inputs.get("model_state"), merged=True)
    policy.reach_modules(model)
    model.eval()
    active = rules_lib.activation_rules(setup.rules, mesh) if mesh is not None else nullcontext()
    with active:
      return _logprobs(model, batch, max(1, rows // shards))

  batch_spec = NamedSpec(batch_axes if batch_axes else None)
  compiled = spmd.sharded_jit(
    score,
    in_parts=(specs_of(eval_inputs(setup.shardings)), batch_spec),
    out_parts=NamedSpec(),  # every process reads the whole array
    mesh=mesh,
  )
  row_sharding = jax.sharding.NamedSharding(mesh, batch_spec)

  def run(inputs: dict, batch: dict[str, np.ndarray]) -> jax.Array:
    placed = {
      k: jax.make_array_from_callback(batch[k].shape, row_sharding, lambda i, k=k: batch[k][i])
      for k in FEATURES
    }
    return compiled(inputs, placed)

  return run
