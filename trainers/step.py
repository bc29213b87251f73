"""The train and eval steps: one `sharded_jit` each, shardings from the mesh and rules.

The train step is donated (the old state's buffers are reused) and decides
inside itself whether the update is finite, so every host takes the same
decision: a non-finite loss or gradient norm keeps the old parameters and
optimizer state and counts a bad step; the loop stops after
`train.max_bad_steps` in a row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.flatten_util import ravel_pytree

import spmd
from spmd.partition import NamedSpec
from trainers.state import StateSetup, model_from_params


def _specs(shardings: Any) -> Any:
  return jax.tree.map(lambda s: s.spec, shardings)


def _sums(setup: StateSetup, params: Any, batch: dict) -> tuple[jax.Array, dict]:
  """Summed next-token cross-entropy over the unmasked targets, and counts."""
  logits = model_from_params(setup, params)(batch["inputs"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["mask"]
  correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
  return jnp.sum(ce * mask), {"count": jnp.sum(mask), "correct": jnp.sum(correct * mask)}


def flat_gradient_reduction(
  setup: StateSetup, config: ml_collections.ConfigDict, batch_axes: tuple[str, ...]
) -> bool:
  """Whether the train step sums its gradients across hosts as one flat buffer.

  XLA combines the gradient reductions into all-reduce instructions of many
  operands, and XLA:CPU runs one gloo collective per operand. lm_tiny's step
  has 28 of them; across 2 processes that costs 75-95 ms a step
  (`python -m benchmarks.allreduce_operands`: 2 MiB in 1 array 4 ms, in 20
  arrays 26 ms). So on CPU across processes, with parameters replicated (pure
  data parallelism), each device's gradient sums are raveled into one vector
  and reduced by one `psum`, as PyTorch DDP's buckets do. Elsewhere GSPMD's
  reductions stay: on TPU and GPU XLA overlaps each layer's all-reduce with
  the backward pass. `train.flat_grad_reduce` ("auto", "on", "off") overrides.
  """
  mode = config.train.get("flat_grad_reduce", "auto")
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"train.flat_grad_reduce={mode!r} must be 'auto', 'on' or 'off'")
  shardings = jax.tree.leaves(setup.shardings["params"])
  mesh = shardings[0].mesh
  shards = math.prod(mesh.shape[axis] for axis in batch_axes)
  possible = (
    bool(batch_axes)
    and all(s.is_fully_replicated for s in shardings)
    and config.global_batch % (shards * config.train.micro_batches) == 0
  )
  if mode == "on" and not possible:
    raise ValueError(
      "train.flat_grad_reduce='on' needs replicated parameters, batch axes, and a "
      f"global_batch={config.global_batch} divisible by {shards} batch shards x "
      f"train.micro_batches={config.train.micro_batches}"
    )
  if mode == "auto":
    cpu = mesh.devices.flat[0].platform == "cpu"
    return possible and cpu and jax.process_count() > 1
  return mode == "on"


def branch_on_nonfinite(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> bool:
  """Whether a non-finite step keeps the old state through `lax.cond` (else a select).

  A select (`jnp.where(finite, new, old)` over every leaf) makes XLA:CPU copy
  each donated optimizer moment before updating it in place, since the
  parameter update still reads the old moment: 31 copies a step for
  lm_tiny, and the optimizer part of the width-512 step took 55-60 ms
  against 38-43 with a branch (the whole step 0.94-1.0x: the copies partly
  run beside the matmuls; `python -m benchmarks.step_variants`). A branch
  also skips a bad step's update. But XLA:GPU runs a conditional by copying
  its predicate to the host and blocking the host until the stream is done,
  every step, which stops the host from queueing the next step ahead; so on
  GPU the select stays. TPUs branch on the device. `train.nonfinite_guard`
  ("auto", "branch", "select") overrides.
  """
  mode = config.train.get("nonfinite_guard", "auto")
  if mode not in ("auto", "branch", "select"):
    raise ValueError(f"train.nonfinite_guard={mode!r} must be 'auto', 'branch' or 'select'")
  if mode == "auto":
    return mesh.devices.flat[0].platform != "gpu"
  return mode == "branch"


def make_train_step(
  setup: StateSetup,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  batch_axes: tuple[str, ...],
) -> Callable:
  """`(state, batch) -> (state, metrics)`, jitted over the mesh, state donated."""
  micro = config.train.micro_batches
  poisoned = tuple(int(s) for s in config.train.get("inject_nonfinite_at", ()))
  poison = config.train.get("inject_nonfinite_value", "nan")
  if poison not in ("nan", "inf", "-inf"):
    raise ValueError(f"train.inject_nonfinite_value={poison!r} must be 'nan', 'inf' or '-inf'")
  value_and_grad = jax.value_and_grad(lambda p, b: _sums(setup, p, b), has_aux=True)
  branch = branch_on_nonfinite(config, mesh)

  def sums_and_grads(params, batch):
    if micro == 1:
      (loss_sum, aux), grads = value_and_grad(params, batch)
      return loss_sum, aux, grads
    # Gradient accumulation: add up the summed-loss gradients of the micro-
    # batches, so the result equals one big batch (up to addition order).
    split = jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]), batch)

    def body(carry, mb):
      (loss_sum, aux), grads = value_and_grad(params, mb)
      return jax.tree.map(jnp.add, carry, (loss_sum, aux, grads)), None

    zeros = (
      jnp.zeros(()),
      {"count": jnp.zeros(()), "correct": jnp.zeros(())},
      jax.tree.map(jnp.zeros_like, params),
    )
    return jax.lax.scan(body, zeros, split)[0]

  if flat_gradient_reduction(setup, config, batch_axes):
    device_sums_and_grads = sums_and_grads  # inside shard_map: over this device's rows

    def local_sums(params, batch):
      # This device's sums over its rows; then one all-reduce of one vector.
      flat, unravel = ravel_pytree(device_sums_and_grads(params, batch))
      return unravel(jax.lax.psum(flat, batch_axes))

    sums_and_grads = jax.shard_map(
      local_sums,
      mesh=mesh,
      in_specs=(jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(batch_axes)),
      out_specs=jax.sharding.PartitionSpec(),
      axis_names=set(batch_axes),
      check_vma=False,
    )

  def train_step(state, batch):
    params, opt_state = state["params"], state["opt_state"]
    loss_sum, aux, grads = sums_and_grads(params, batch)
    count = jnp.maximum(aux["count"], 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    loss = loss_sum / count
    if poisoned:  # fault injection for tests: non-finite gradients at these steps
      bad = jnp.isin(state["step"], jnp.asarray(poisoned))
      grads = jax.tree.map(lambda g: jnp.where(bad, float(poison), g), grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(operands):
      grads, opt_state, params = operands
      updates, new_opt = setup.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), new_opt

    def keep(operands):
      return operands[2], operands[1]

    operands = (grads, opt_state, params)
    if branch:  # see branch_on_nonfinite
      new_params, new_opt = jax.lax.cond(finite, update, keep, operands)
    else:
      new = update(operands)
      new_params, new_opt = jax.tree.map(
        lambda n, o: jnp.where(finite, n, o), new, (params, opt_state)
      )
    new_state = {
      "params": new_params,
      "opt_state": new_opt,
      "step": state["step"] + 1,
      "bad_steps": jnp.where(finite, 0, state["bad_steps"] + 1).astype(jnp.int32),
    }
    metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "learning_rate": setup.schedule(state["step"]),
      "finite": finite,
      "bad_steps": new_state["bad_steps"],
      "tokens": aux["count"],
      "accuracy": aux["correct"] / count,
    }
    return new_state, metrics

  state_specs = _specs(setup.shardings)
  batch_spec = NamedSpec(batch_axes if batch_axes else None)
  return spmd.sharded_jit(
    train_step,
    in_parts=(state_specs, batch_spec),
    # Metrics come out as global, replicated arrays (every process can read
    # them), not as local copies: with every input and output global, a call
    # across processes goes straight to the compiled jax.jit, with no
    # per-step conversion of the 7 metrics (about 1.7 ms a step on 2 CPU
    # processes) or walk over the state's leaves.
    out_parts=(state_specs, NamedSpec()),
    mesh=mesh,
    donate_argnums=0,
  )


def make_eval_step(
  setup: StateSetup, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...]
) -> Callable:
  """`(params, batch) -> sums` of loss, unmasked tokens and correct predictions."""

  def eval_step(params, batch):
    loss_sum, aux = _sums(setup, params, batch)
    return {"loss_sum": loss_sum, **aux}

  batch_spec = NamedSpec(batch_axes if batch_axes else None)
  # Global replicated sums, as the train step's metrics: every call takes
  # the fast path, and `jax.device_get` reads them on every process.
  return spmd.sharded_jit(
    eval_step,
    in_parts=(_specs(setup.shardings["params"]), batch_spec),
    out_parts=NamedSpec(),
    mesh=mesh,
  )
