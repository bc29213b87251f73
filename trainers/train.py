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
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

import spmd
from spmd import multihost
from spmd.mesh import create_mesh
from trainers import checkpoint, metrics, paths, peaks
from trainers.data import pipeline
from trainers.hooks import Hook, load_hooks
from trainers.loop import (
  CheckpointSaves,
  Evaluations,
  LoopState,
  MetricsHook,
  Preempted,
  Profile,
  train_loop,
)
from trainers.preemption import PreemptionWatch
from trainers.state import StateSetup, build_model, make_state
from trainers.step import (
  abstract_batch,
  eval_inputs,
  flat_gradient_reduction,
  make_eval_step,
  make_train_step,
  per_device_blocker,
)
from trainers.tasks import Task, make_task, task_files
from trainers.watchdog import ProgressWatchdog

__all__ = ["Preempted", "train_and_evaluate"]
log = logging.getLogger(__name__)


def config_hash(config: ml_collections.ConfigDict) -> str:
  return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]


def build_mesh(
  config: ml_collections.ConfigDict, devices=None
) -> tuple[jax.sharding.Mesh, tuple[str, ...]]:
  """The run's mesh and the mesh axes that split the batch (also `spmd-plan`'s)."""
  mesh = create_mesh(config.mesh.ici, config.mesh.dcn or None, devices=devices)
  return mesh, tuple(a for a in config.mesh.batch_axes if a in mesh.shape)


def open_data(config: ml_collections.ConfigDict, task: Task, workdir, mesh, batch_axes):
  """(train batches, eval batches); process 0 prepares the data first.

  A remote `data.dir` (`gs://...`): process 0 prepares the dataset in its
  local cache and uploads it; every host then copies `data.dir` to its own
  local cache (`paths.local_cache`) and reads from there, since ArrayRecord
  reads local files only. Files already there with the same size are kept.
  """
  data_dir = paths.user_path(config.data.dir or paths.user_path(workdir).parent / "data")
  local = data_dir if not paths.is_url(data_dir) else paths.local_cache("data", data_dir)
  # Process 0 builds; the others wait, then find it built (no race on files).
  if jax.process_index() == 0:
    if local != data_dir and data_dir.exists():
      paths.copy_tree(data_dir, epath.Path(local))
    name = task.prepare_data(str(local))
    if local != data_dir:
      uploaded = paths.copy_tree(epath.Path(local), data_dir)
      log.warning(
        "spmd-train: data prepared in %s; %d files uploaded to %s", local, uploaded, data_dir
      )
  multihost.barrier("data_prepared", timeout_s=3600)
  if jax.process_index() != 0:
    if local != data_dir:
      paths.copy_tree(data_dir, epath.Path(local))
    name = task.prepare_data(str(local))
  data_dir = local
  common = dict(
    global_batch=config.global_batch,
    mesh=mesh,
    batch_axes=batch_axes,
    examples_per_record=task.examples_per_record,
    plan_records=task.plan_records,  # windows per record from the data itself
    features=tuple(task.record_template),  # decode only what the task reads
    shuffle_block=config.data.shuffle_block,
    to_batch=task.to_batch,
  )
  train = pipeline.open_global_batches(
    name,
    config.data.train_split,
    str(data_dir),
    task.to_example,
    seed=config.seed,
    train=True,
    **common,
  )
  evaluation = pipeline.open_global_batches(
    name, config.data.eval_split, str(data_dir), task.to_example, train=False, **common
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


def evaluate_batches(eval_step, batches: pipeline.GlobalBatches, state, max_batches: int) -> dict:
  """Exact means over the eval batches: the task's sums, divided by their total weight."""
  steps = batches.steps_per_epoch if max_batches <= 0 else min(max_batches, batches.steps_per_epoch)
  inputs = eval_inputs(state)
  sums = [eval_step(inputs, batch) for _, batch in batches.iterator(0, prefetch=1, num_steps=steps)]
  totals = jax.device_get(sums)  # one transfer for the whole eval
  added = {k: sum(float(t[k]) for t in totals) for k in totals[0]}
  weight = max(added.pop("weight"), 1e-9)
  loss = added.pop("loss_sum") / weight
  out = {"eval_loss": loss, "eval_perplexity": float(np.exp(min(loss, 50.0)))}
  out.update({f"eval_{k}": v / weight for k, v in added.items()})
  out["eval_weight"] = weight
  return out


def _report(task: Task, setup: StateSetup, state, step: int) -> str:
  """The task's end-of-run report; a failure is logged, never fatal (the run is done)."""
  if task.report is None:
    return ""
  try:
    model = build_model(setup, state["params"], state.get("model_state"))
    model.eval()
    return task.report(model, step)
  except Exception as e:  # the summary and loss curve are already written
    log.warning("spmd-train: the task's report failed: %s: %s", type(e).__name__, e)
    return ""


# What common platforms allow between a preemption notice and the kill, for the log.
PREEMPTION_GRACE = (
  "spot and preemptible TPU/GCE VMs 30 s, Kubernetes terminationGracePeriodSeconds 30 s by default"
)
_PLACEMENT_ROWS = 8  # variables without names listed by path; the rest are counted


def _log_placement(setup: StateSetup) -> None:
  """Which variables took which rule: a count per rule, and the ones without names."""
  by_rule: dict[str, int] = {}
  for _, _, why in setup.placement:
    rule = why.split(" (")[0] if not why.startswith("names") else "by their names"
    by_rule[rule] = by_rule.get(rule, 0) + 1
  log.warning(
    "spmd-train: variable placement: %s",
    ", ".join(f"{n} {rule}" for rule, n in sorted(by_rule.items())),
  )
  unnamed = [row for row in setup.placement if not row[2].startswith("names")]
  for path, spec, why in unnamed[:_PLACEMENT_ROWS]:
    log.warning("spmd-train:   %s -> %s: %s", path, spec, why)
  if len(unnamed) > _PLACEMENT_ROWS:
    log.warning("spmd-train:   ... and %d more without names", len(unnamed) - _PLACEMENT_ROWS)


def _compiled_flops(train_step, setup: StateSetup, task: Task, config, mesh, batch_axes) -> float:
  """The compiled train step's matmul FLOPs over all devices (hardware FLOPs)."""
  from spmd import hlo
  from spmd.layout import batch_sharding

  state = jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract, setup.shardings
  )
  batch = abstract_batch(task, config.global_batch, batch_sharding(mesh, batch_axes))
  text = train_step.lower(state, batch).compile().as_text()
  return float(hlo.matmul_flops(text)) * mesh.devices.size


def save_run_files(config: ml_collections.ConfigDict, workdir: epath.Path) -> None:
  """The resolved config (JSON) and the task's own files, so the run stands alone.

  A resume or eval needs no original folder: `--config=<workdir>/code/config.py`
  (a copy of the config file, when it sat beside the task) runs the same task.
  """
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=1, sort_keys=True))
  files = sorted({f for spec in (config.task, *config.get("hooks", ())) for f in task_files(spec)})
  if files:
    code = workdir / "code"
    code.mkdir(parents=True, exist_ok=True)
    for path in files:
      target = code / path.name
      if paths.is_url(target) or not (target.exists() and os.path.samefile(path, target)):
        target.write_bytes(path.read_bytes())  # not when a run starts from its own copy


def save_task_files(task: Task, workdir: epath.Path) -> None:
  """The files the task made while preparing data (`Task.run_files`), into the workdir."""
  if task.run_files is None:
    return
  for name, path in task.run_files().items():
    target = workdir / name
    data = epath.Path(path).read_bytes()
    if not (target.exists() and target.read_bytes() == data):
      target.write_bytes(data)


def real_unit_share(task: Task, history: list[dict]) -> dict[str, float]:
  """`{"real_<unit>_share": mean units per step / Task.units_per_batch}`, when the task says.

  The units are the step's own sum (already fetched with the metrics), so
  this costs no transfer.
  """
  if not task.units_per_batch or not history:
    return {}
  unit = task.unit[:-1] if task.unit.endswith("s") else task.unit
  share = float(np.mean([h.get("units", 0.0) for h in history])) / task.units_per_batch
  return {f"real_{unit}_share": share}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains, evaluates and summarises; returns the summary (all processes)."""
  spmd.initialize()
  started = time.perf_counter()
  # From the start: a process waiting for its peers (data preparation, restore)
  # hears of a peer's failure at once, and the first step's limit covers setup.
  watchdog = ProgressWatchdog(config.train.step_timeout_s, config.train.first_step_timeout_s)
  try:
    return _train_and_evaluate(config, paths.user_path(workdir), watchdog, started)
  finally:
    watchdog.close()


def _train_and_evaluate(
  config: ml_collections.ConfigDict, workdir: epath.Path, watchdog: ProgressWatchdog, started
) -> dict[str, Any]:
  chief = jax.process_index() == 0
  workdir.mkdir(parents=True, exist_ok=True)  # local or a URL (gs://...): trainers/paths.py
  # The config, else JAX's own variable (as documented in configs/default.py), else beside the run.
  cache_dir = str(
    paths.user_path(
      config.get("compilation_cache_dir", "")
      or os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
      or workdir.parent / ".jax_cache"
    )
  )
  jax.config.update("jax_compilation_cache_dir", cache_dir)

  # 1-2. Mesh, task and data.
  mesh, batch_axes = build_mesh(config)
  task = make_task(config)
  if chief:
    save_run_files(config, workdir)
  with watchdog.phase("data preparation", 0, "none"):  # as long as it takes, the first time
    train_batches, eval_batches = open_data(config, task, workdir, mesh, batch_axes)
  if chief:
    save_task_files(task, workdir)

  # 3. State: resume, warm start or fresh (order in trainers/checkpoint.py).
  setup = make_state(task.model, config, mesh, batch_axes, task.optimizer)
  manager = checkpoint.make_manager(
    workdir / "checkpoints",
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
      workdir.name,
      jax.process_count(),
      jax.local_device_count(),
      dict(mesh.shape),
      restored.source,
    )

  # 4. Hosts agree before the first step.
  _check_hosts_agree(config, setup, train_batches, start)

  blocker = per_device_blocker(setup, task, config.global_batch)
  flat_reduce = flat_gradient_reduction(setup, config, batch_axes, blocker)
  if chief:
    _log_placement(setup)
    if blocker and config.train.flat_grad_reduce == "auto":
      log.warning("spmd-train: train.flat_grad_reduce is off for this model: %s", blocker)
  train_step = make_train_step(setup, task, config, mesh, batch_axes, flat_reduce)
  eval_step = make_eval_step(setup, task, mesh, batch_axes)
  # Only process 0 reports MFU; the others skip the (measured, on CPU) peak.
  peak = (
    peaks.peak_flops(jax.local_devices()[0], task.compute_dtype, cache_dir=cache_dir)
    if chief
    else peaks.PeakInfo(0.0, "not measured on this process")
  )
  # The others wait: a CPU peak measured while a peer compiles beside it on
  # the same cores would come out low (once; it is cached after).
  multihost.barrier("peak_measured", timeout_s=600)
  flops_metric, flops_per_step = "mfu", task.flops_per_step
  if flops_per_step is None:
    # Every process lowers the same signature: a lowering checks that hosts agree.
    flops_metric = "hfu"
    flops_per_step = _compiled_flops(train_step, setup, task, config, mesh, batch_axes)
  writer = metrics.MetricsWriter(workdir, enabled=chief)
  progress = metrics.Progress(config.train.steps, initial=start, enabled=chief)

  saver = checkpoint.Saver(manager)
  save_budget = (
    f"a checkpoint save to {workdir / 'checkpoints'}",
    config.checkpoint.save_timeout_s,
    "checkpoint.save_timeout_s",
  )

  # Saves and evals are timed by their own budgets, not by the step limit.
  def save(step, state):
    with watchdog.phase(*save_budget):
      return saver.save(step, state, train_batches.state(step).to_dict())

  def wait_for_saves():
    with watchdog.phase(*save_budget):
      saver.wait()

  def evaluate(state):
    with watchdog.phase("an eval", config.eval_timeout_s, "eval_timeout_s"):
      return evaluate_batches(eval_step, eval_batches, state, config.eval_batches)

  rate = f"{task.unit}_per_s"
  peak_total = peak.flops_per_s * jax.device_count()

  def annotate(row: dict) -> None:
    row[rate] = row.get("units", 0.0) / row["step_time_s"]  # real units, padding excluded
    if flops_per_step and peak_total:
      row[flops_metric] = flops_per_step / row["step_time_s"] / peak_total

  # The built-in hooks, then the task's and the config's, all on the same footing.
  metrics_hook = MetricsHook(
    writer.write,
    lambda step, row: progress.update(step, loss=row["loss"], **{rate: row[rate]}),
    config.train.max_bad_steps,
  )
  evaluations = Evaluations(evaluate, writer.write)
  saves = CheckpointSaves(save, wait_for_saves)
  hooks = [
    Hook(metrics_hook, every=config.log_every, metrics=True, end=metrics_hook.end, name="metrics"),
    Hook(evaluations, every=config.eval_every, name="eval"),
    Hook(saves, every=config.checkpoint.every, end=saves.end, name="checkpoint"),
    Profile(config.profile.start_step, config.profile.num_steps, str(workdir / "profile")).hook(),
    *load_hooks(config, task.hooks),
  ]

  def eval_model(state):
    model = build_model(setup, state["params"], state.get("model_state"))
    model.eval()
    return model

  watch = PreemptionWatch()
  stop = config.train.stop_at_step or config.train.steps
  loop = LoopState(
    restored.state,
    start,
    min(stop, config.train.steps),
    mesh=mesh,
    workdir=workdir,
    model=eval_model,
    annotate=annotate,
    last_fetch_step=start,
  )
  injected = None
  if "debug" in config:  # only test configs have the section: fault injection
    from trainers import debug

    injected = debug.inject(
      config.debug,
      task=task,
      train_step=train_step,
      make_step=lambda t: make_train_step(setup, t, config, mesh, batch_axes, flat_reduce),
      first_step=start,
      train_batches=train_batches,
      start_batches=lambda: train_batches.iterator(data_start, prefetch=config.data.prefetch),
    )
    train_step, batches = injected.train_step, injected.batches
  else:
    batches = train_batches.iterator(data_start, prefetch=config.data.prefetch)
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
      log.warning(
        "spmd-train: preempted; checkpoint saved at step %d; the final save took %.1f s "
        "(time allowed after the notice: %s)",
        loop.step,
        saves.final_save_s,
        PREEMPTION_GRACE,
      )
    raise Preempted(
      f"preempted at step {loop.step}; checkpoint saved in {workdir / 'checkpoints'}"
    ) from None
  finally:
    batches.close()
    watch.close()
    watchdog.close()
    progress.close()

  # 6. Final eval, summary, loss curve, then the sample: the results are on
  # disk before the task's report runs, whatever it does.
  final_eval = evaluations.results.get(loop.step)  # the eval hook's, when it ran at the end
  if final_eval is None:
    final_eval = evaluate(loop.state)
    writer.write(loop.step, final_eval)
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
    flops_metric: (
      float(np.median([h.get(flops_metric, 0.0) for h in loop.history])) if loop.history else None
    ),
    "peak_source": peak.source,
    "wall_time_s": time.perf_counter() - started,
    "first_step_s": first_step.get("s"),  # from the start of training (imports excluded)
    "first_step_at": first_step.get("at"),  # Unix time, for timing from outside
    "workdir": str(workdir),
    "checkpoints": str(workdir / "checkpoints"),
    "metrics": str(workdir / "metrics.jsonl"),
    "resumed_from": restored.source,
    "loss_history": [(h["step"], h["loss"]) for h in loop.history],
    **real_unit_share(task, loop.history),
    **(injected.summary(loop.state) if injected else {}),  # the test configs' param hash
  }
  if chief:
    summary["loss_curve"] = str(
      metrics.plot_loss_curve(workdir / "metrics.jsonl", workdir / "loss.png")
    )
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
  summary["report"] = report = _report(task, setup, loop.state, loop.step)
  if chief:
    print(metrics.format_summary(summary), flush=True)
    if report:
      print(report, flush=True)
  return summary
