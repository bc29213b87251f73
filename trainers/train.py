"""`train_and_evaluate(config, workdir)`: the whole run, from mesh to summary.

1. start the distributed runtime, build the mesh;
2. prepare (process 0 first) and open the data, every host its own rows;
3. build the sharded state; resume, warm-start or init (see checkpoint.py);
4. hosts check they agree (config, shapes, layout, step) before any step;
5. the loop with its hooks; a preemption saves and stops cleanly;
6. final eval, a greedy sample, the summary and the loss curve.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import spmd
from spmd import multihost
from spmd.mesh import create_mesh
from trainers import checkpoint, metrics, peaks
from trainers.data import pipeline
from trainers.loop import (
  CheckpointHook,
  EvalHook,
  LoopState,
  MetricsHook,
  Preempted,
  ProfileHook,
  train_loop,
)
from trainers.models import logical_axes
from trainers.models import transformer as lm
from trainers.preemption import PreemptionWatch
from trainers.state import make_state, model_from_params
from trainers.step import make_eval_step, make_train_step
from trainers.tasks import Task, make_task
from trainers.watchdog import ProgressWatchdog

__all__ = ["Preempted", "train_and_evaluate"]
log = logging.getLogger(__name__)


def config_hash(config: ml_collections.ConfigDict) -> str:
  return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]


def state_hash(state: dict) -> str:
  """SHA-256 of the parameters and optimizer state, gathered to every host."""
  from jax.experimental import multihost_utils

  digest = hashlib.sha256()
  for leaf in jax.tree.leaves({"params": state["params"], "opt_state": state["opt_state"]}):
    digest.update(np.asarray(multihost_utils.process_allgather(leaf, tiled=True)).tobytes())
  return digest.hexdigest()


def build_mesh(
  config: ml_collections.ConfigDict, devices=None
) -> tuple[jax.sharding.Mesh, tuple[str, ...]]:
  """The run's mesh and the mesh axes that split the batch (also `spmd-plan`'s)."""
  mesh = create_mesh(config.mesh.ici, config.mesh.dcn or None, devices=devices)
  return mesh, tuple(a for a in config.mesh.batch_axes if a in mesh.shape)


def open_data(config: ml_collections.ConfigDict, task: Task, workdir: str, mesh, batch_axes):
  """(train batches, eval batches); process 0 prepares the data first."""
  data_dir = config.data.dir or os.path.join(os.path.dirname(workdir), "data")
  # Process 0 builds; the others wait, then find it built (no race on files).
  if jax.process_index() == 0:
    name = task.prepare(data_dir)
  multihost.barrier("data_prepared", timeout_s=3600)
  if jax.process_index() != 0:
    name = task.prepare(data_dir)
  common = dict(
    global_batch=config.global_batch,
    mesh=mesh,
    batch_axes=batch_axes,
    examples_per_record=task.examples_per_record,
    features=tuple(task.record_template),  # decode only what the task reads
    shuffle_block=config.data.shuffle_block,
    to_batch=task.to_batch,
  )
  train = pipeline.open_global_batches(
    name, config.data.train_split, data_dir, task.to_example, seed=config.seed, train=True, **common
  )
  evaluation = pipeline.open_global_batches(
    name, config.data.eval_split, data_dir, task.to_example, train=False, **common
  )
  return train, evaluation


def _check_hosts_agree(config, setup, train_batches, start_step: int) -> None:
  shapes = jax.tree.map(lambda s: [list(s.shape), str(s.dtype)], setup.abstract)
  multihost.check_agreement(
    "spmd-train start",
    {
      "config": config_hash(config),
      "state": hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16],
      "data": train_batches.fingerprint,
      "rows_per_host": train_batches.layout.per_host_batch,
      "start_step": start_step,
    },
  )


def _evaluate(eval_step, batches: pipeline.GlobalBatches, params, max_batches: int) -> dict:
  steps = batches.steps_per_epoch if max_batches <= 0 else min(max_batches, batches.steps_per_epoch)
  sums = [eval_step(params, batch) for _, batch in batches.iterator(0, prefetch=1, num_steps=steps)]
  totals = jax.device_get(sums)  # one transfer for the whole eval
  loss = sum(float(t["loss_sum"]) for t in totals)
  count = max(sum(float(t["count"]) for t in totals), 1.0)
  correct = sum(float(t["correct"]) for t in totals)
  return {
    "eval_loss": loss / count,
    "eval_accuracy": correct / count,
    "eval_perplexity": float(np.exp(min(loss / count, 50.0))),
    "eval_tokens": count,
  }


def _sample(setup, params, prompt: bytes, num_tokens: int, seq_len: int) -> str:
  prompt_tokens = jnp.asarray(np.frombuffer(prompt, np.uint8).astype(np.int32)[None, :])
  num_tokens = min(num_tokens, seq_len - prompt_tokens.shape[1])
  out = lm.generate(model_from_params(setup, params), prompt_tokens, num_tokens)
  tokens = np.asarray(jax.device_get(out))[0]
  return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class _AtStep:
  """Fault injection for tests: wraps the `(step, batch)` iterator and lets
  `act(item, batches)` replace the item of one step."""

  def __init__(self, batches, step: int, act: Callable):
    self._batches, self._step, self._act = batches, step, act

  def __next__(self):
    item = next(self._batches)
    return self._act(item, self._batches) if item[0] == self._step else item

  def close(self):
    self._batches.close()


def _stall(item, batches):
  log.warning("spmd-train: injected stall at step %d (train.inject_stall)", item[0])
  threading.Event().wait()  # alive, heartbeating, and never coming back


def _skip(item, batches):
  log.warning("spmd-train: injected skip of the batch of step %d", item[0])
  return next(batches)


def _batches_with_faults(
  train_batches: pipeline.GlobalBatches, start: Callable[[], Any], config
) -> Any:
  """`start()`'s `(step, batch)` iterator, with the faults tests inject on this process.

  `train.inject_stall=(process, step)` hangs that process in Python at that
  step. `train.inject_bad_batch=(process, step, kind)` feeds a bad batch:
  kind `shape` drops a row and `dtype` sends float inputs, at the source (the
  per-step check must catch them); `step` skips a batch, so the process feeds
  the next step's batch (the loop's step check must catch it).
  """
  me = jax.process_index()
  stall, bad = config.train.inject_stall, config.train.inject_bad_batch
  skip_at = None
  if bad:
    kind = str(bad[2])
    if kind not in ("shape", "dtype", "step"):
      raise ValueError(f"train.inject_bad_batch={bad!r}: kind {kind!r} is not shape, dtype or step")
  if bad and int(bad[0]) == me:
    bad_step = int(bad[1])
    if kind == "step":
      skip_at = bad_step
    else:
      host_batch = train_batches.host_batch

      def bad_host_batch(step: int):
        out = host_batch(step)
        if step == bad_step:
          log.warning("spmd-train: injected bad batch %s at step %d", kind, step)
          if kind == "shape":
            out = {k: v[:-1] for k, v in out.items()}
          else:
            out = dict(out, inputs=out["inputs"].astype(np.float32))
        return out

      # Before start(): the iterator's prefetch thread builds batches at once.
      train_batches.host_batch = bad_host_batch
  batches = start()
  if skip_at is not None:
    batches = _AtStep(batches, skip_at, _skip)
  if stall and int(stall[0]) == me:
    batches = _AtStep(batches, int(stall[1]), _stall)
  return batches


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains, evaluates and summarises; returns the summary (all processes)."""
  spmd.initialize()
  workdir = os.path.abspath(workdir)
  chief = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  started = time.perf_counter()
  # The config, else JAX's own variable (as documented in configs/default.py), else beside the run.
  cache_dir = (
    config.get("compilation_cache_dir", "")
    or os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    or os.path.join(os.path.dirname(workdir), ".jax_cache")
  )
  jax.config.update("jax_compilation_cache_dir", cache_dir)

  # 1-2. Mesh and data.
  mesh, batch_axes = build_mesh(config)
  task = make_task(config)
  train_batches, eval_batches = open_data(config, task, workdir, mesh, batch_axes)

  # 3. State: resume, warm start or fresh (order in trainers/checkpoint.py).
  setup = make_state(task.model_fn, logical_axes, config, mesh)
  manager = checkpoint.make_manager(
    os.path.join(workdir, "checkpoints"),
    config.checkpoint.every,
    config.checkpoint.keep,
    config.checkpoint.keep_period,
  )
  restored = checkpoint.restore_or_init(
    manager, setup.abstract, setup.shardings, setup.init, config.checkpoint.init_from
  )
  start = restored.step
  data_start: int | pipeline.PipelineState = start
  if restored.data_state is not None:
    data_start = pipeline.PipelineState.from_dict(restored.data_state)
  if chief:
    log.warning(
      "spmd-train: %s on %d processes x %d devices, mesh %s; state from %s",
      os.path.basename(workdir),
      jax.process_count(),
      jax.local_device_count(),
      dict(mesh.shape),
      restored.source,
    )

  # 4. Hosts agree before the first step.
  _check_hosts_agree(config, setup, train_batches, start)

  train_step = make_train_step(setup, config, mesh, batch_axes)
  eval_step = make_eval_step(setup, mesh, batch_axes)
  # Only process 0 reports MFU; the others skip the (measured, on CPU) peak.
  peak = (
    peaks.peak_flops(jax.local_devices()[0], config.model.dtype, cache_dir=cache_dir)
    if chief
    else peaks.PeakInfo(0.0, "not measured on this process")
  )
  writer = metrics.MetricsWriter(workdir, enabled=chief)
  progress = metrics.Progress(config.train.steps, initial=start, enabled=chief)

  saver = checkpoint.Saver(manager)

  def save(step, state):
    return saver.save(step, state, train_batches.state(step).to_dict())

  def evaluate(params):
    return _evaluate(eval_step, eval_batches, params, config.eval_batches)

  rate = f"{task.unit}_per_s"
  hooks = [
    MetricsHook(
      config.log_every,
      writer.write,
      lambda step, row: progress.update(step, loss=row["loss"], **{rate: row[rate]}),
      task.units_per_step,
      config.train.max_bad_steps,
      task.flops_per_step,
      peak.flops_per_s * jax.device_count(),
      task.unit,
    ),
    EvalHook(config.eval_every, evaluate, writer.write),
    CheckpointHook(config.checkpoint.every, save, saver.wait),
    ProfileHook(
      config.profile.start_step, config.profile.num_steps, os.path.join(workdir, "profile")
    ),
  ]
  watch = PreemptionWatch()
  watchdog = ProgressWatchdog(config.train.step_timeout_s, config.train.first_step_timeout_s)
  stop = config.train.stop_at_step or config.train.steps
  loop = LoopState(restored.state, start, min(stop, config.train.steps), last_fetch_step=start)
  batches = _batches_with_faults(
    train_batches, lambda: train_batches.iterator(data_start, prefetch=config.data.prefetch), config
  )
  guard = config.get("transfer_guard", "") or "allow"
  first_step: dict[str, float] = {}

  def on_progress(step: int) -> None:
    watchdog.progress(step)
    if not first_step:
      # Once, so restarts can be timed: the first step has really finished
      # (not only been dispatched) when its state is ready.
      jax.block_until_ready(loop.state)
      first_step["at"] = time.time()
      first_step["s"] = time.perf_counter() - started

  try:
    with jax.transfer_guard(guard):
      train_loop(loop, train_step, batches, hooks, watch.reached, on_progress)
  except Preempted:
    if chief:
      log.warning("spmd-train: preempted; checkpoint saved at step %d", loop.step)
    raise Preempted(
      f"preempted at step {loop.step}; checkpoint saved in {os.path.join(workdir, 'checkpoints')}"
    ) from None
  finally:
    batches.close()
    watch.close()
    watchdog.close()
    progress.close()

  # 6. Final eval, sample, summary, loss curve.
  final_eval = evaluate(loop.state["params"])
  writer.write(loop.step, final_eval)
  sample = ""
  if config.get("sample_tokens", 0) and task.language_model:
    sample = _sample(
      setup, loop.state["params"], b"def ", config.sample_tokens, config.model.seq_len
    )
  writer.close()
  saver.close()
  last = loop.history[-1] if loop.history else {}
  rates = [h[rate] for h in loop.history[1:]] or [last.get(rate, 0.0)]
  summary = {
    "steps": loop.step,
    "train_loss": last.get("loss"),
    "eval_loss": final_eval["eval_loss"],
    "eval_accuracy": final_eval["eval_accuracy"],
    rate: float(np.median(rates)) if rates else None,
    "mfu": float(np.median([h.get("mfu", 0.0) for h in loop.history])) if loop.history else None,
    "peak_source": peak.source,
    "wall_time_s": time.perf_counter() - started,
    "first_step_s": first_step.get("s"),  # from the start of training (imports excluded)
    "first_step_at": first_step.get("at"),  # Unix time, for timing from outside
    "workdir": workdir,
    "checkpoints": os.path.join(workdir, "checkpoints"),
    "metrics": os.path.join(workdir, "metrics.jsonl"),
    "sample": sample,
    "resumed_from": restored.source,
    "loss_history": [(h["step"], h["loss"]) for h in loop.history],
  }
  if config.report_param_hash:
    summary["param_hash"] = state_hash(loop.state)
  if chief:
    summary["loss_curve"] = metrics.plot_loss_curve(
      os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "loss.png")
    )
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({k: v for k, v in summary.items() if k != "sample"}, f, indent=1, default=str)
    print(metrics.format_summary(summary), flush=True)
    if sample:
      print(f"sample (greedy, prompt 'def '):\n{sample}", flush=True)
  return summary
