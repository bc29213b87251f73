"""`train_and_evaluate(config, workdir)`: the whole run, from mesh to summary.

1. start the distributed runtime, build the mesh;
2. check the names of the task's metrics (from shapes alone), then prepare
   (process 0 first) and open the data, every host its own rows;
3. build the sharded state; resume, warm-start or init (see checkpoint.py);
4. hosts check they agree (config, shapes, layout, step) before any step;
5. the loop with its hooks; a preemption saves and stops cleanly;
6. final eval (the loss and `config.evals`), a greedy sample, the summary
   and the loss curve.

Each step is a function below; what the run sets up besides data, state
and steps is in `startup.py`, the throughput figures in `throughput.py`
and the end of the run in `summary.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from etils import epath

import spmd
from spmd import errors, multihost
from trainers import paths
from trainers.checkpoints import lora_base, peft
from trainers.checkpoints.manager import make_manager
from trainers.checkpoints.restore import restore_or_init, saved_part
from trainers.checkpoints.saver import Saver
from trainers.data.read import pipeline
from trainers.evals.encoding import run_encoder
from trainers.evals.runner import EvalRunner
from trainers.hooks import Hook, StepContext, Wrapper, load_hooks
from trainers.hooks.builtin import CheckpointSaves, Evaluations, MetricsHook, Profile
from trainers.hooks.wrapper import wrap_batches, wrap_train_step
from trainers.reporting import console, metrics, summary, tracking
from trainers.reporting.throughput import Throughput, measure_throughput
from trainers.run import startup
from trainers.run.data import open_data
from trainers.run.evaluate import evaluate_batches
from trainers.run.loop import LoopState, Preempted, train_loop
from trainers.run.out_of_memory import step_must_fit
from trainers.run.preemption import PreemptionWatch
from trainers.run.startup import save_run_files
from trainers.run.watchdog import ProgressWatchdog
from trainers.step import task_metrics, trainable
from trainers.step.eval_step import make_eval_step
from trainers.step.gradient_reduction import flat_gradient_reduction, per_device_blocker
from trainers.step.mesh import build_mesh
from trainers.step.state import StateSetup, build_model, make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import Task, make_task

__all__ = ["Preempted", "save_run_files", "train_and_evaluate"]
log = logging.getLogger(__name__)


def _check_hosts_agree(config, setup, train_batches, start_step: int) -> None:
  shapes = jax.tree.map(lambda s: [list(s.shape), str(s.dtype)], setup.abstract)
  multihost.check_agreement(
    "spmd-train start",
    {
      "config": startup.config_hash(config),
      "state": hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16],
      "data": train_batches.fingerprint,
      "rows_per_host": train_batches.layout.per_host_batch,
      "start_step": start_step,
    },
  )


# What common platforms allow between a preemption notice and the kill, for the log.
PREEMPTION_GRACE = (
  "spot and preemptible TPU/GCE VMs 30 s, Kubernetes terminationGracePeriodSeconds 30 s by default"
)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains, evaluates and summarises; returns the summary (all processes)."""
  spmd.initialize()
  started = time.perf_counter()
  # From the start: a process waiting for its peers (data preparation, restore)
  # hears of a peer's failure at once, and the first step's limit covers setup.
  watchdog = ProgressWatchdog(config.train.step_timeout_s, config.train.first_step_timeout_s)
  chief = jax.process_index() == 0
  try:
    # Finished on the way out: failed after an error, so W&B shows how the run ended.
    with tracking.open_tracker(config.wandb, workdir, config.to_dict(), chief) as tracker:
      try:
        return _train_and_evaluate(config, paths.user_path(workdir), watchdog, started, tracker)
      except Preempted:
        tracker.mark_preempting()  # a restart resumes it
        raise
  finally:
    watchdog.close()


def _train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: epath.Path,
  watchdog: ProgressWatchdog,
  started,
  tracker: tracking.Tracker,
) -> dict[str, Any]:
  """The steps of the module docstring, in order; `started` is when training began."""
  chief = jax.process_index() == 0
  workdir.mkdir(parents=True, exist_ok=True)  # local or a URL (gs://...): trainers/paths.py
  cache_dir = startup.use_compilation_cache(config, workdir)

  # 1-2. Mesh, task, the state's shapes and the task's metric names (checked
  # before any data is prepared), then the data.
  mesh, batch_axes = build_mesh(config)
  task = make_task(config)
  setup = make_state(task.model, config, mesh, batch_axes, task.optimizer)
  metric_names = task_metrics.loss_metric_names(setup, task, config.global_batch)
  evals = EvalRunner.build(config, setup, task, batch_axes)  # its files read, before any data
  if config.lora.init_from:  # a peft folder we cannot reproduce is refused before any data
    with errors.user_input(ValueError, FileNotFoundError):
      peft.check_folder(paths.user_path(config.lora.init_from), setup.adapters)
  train_batches, eval_batches = _open_run_data(config, task, workdir, mesh, batch_axes, watchdog)
  if evals is not None:
    # Process 0 copies the run's tokenizer into the workdir once the data is
    # open; the others read that copy, so they wait for it.
    multihost.barrier("evals/tokenizer_saved")
    evals.prepare(run_encoder(config, str(workdir)))

  # 3. State: resume, warm start or fresh (order in trainers/checkpoints/restore.py).
  manager, restored = _restore(config, workdir, setup)
  checkpointed = _checkpointed(config, setup, restored)
  if chief:
    _log_start(workdir, mesh, restored.source)

  # 4. Hosts agree before the first step.
  _check_hosts_agree(config, setup, train_batches, restored.step)

  # 5. The steps, the hooks and the loop; a preemption saves and stops cleanly.
  # A step too big for the devices fails where it compiles or first runs: in
  # measure_throughput or the loop's first step. It is said in one line.
  steps = _make_steps(setup, task, config, mesh, batch_axes)
  with step_must_fit(config, task, setup, mesh, batch_axes):
    throughput = measure_throughput(steps.train, setup, task, config, mesh, batch_axes, cache_dir)
  run = _make_hooks(
    config,
    task,
    metric_names,
    workdir,
    watchdog,
    manager,
    restored.step,
    throughput,
    steps,
    train_batches,
    eval_batches,
    tracker,
    evals,
    checkpointed,
  )
  watch = PreemptionWatch()
  loop = _loop_state(config, setup, restored.step, restored.state, mesh, workdir, throughput)
  train_step, batches = _step_and_batches(
    config, task, steps, restored, train_batches, run.wrappers
  )
  with step_must_fit(config, task, setup, mesh, batch_axes):
    first_step = _run_loop(
      config, loop, train_step, batches, run, watch, watchdog, workdir, started
    )

  # 6. Final eval, summary, loss curve, then the sample: the results are on
  # disk before the task's report runs, whatever it does.
  final_eval = _final_eval(loop, run)
  results = summary.summarize(
    loop.step,
    loop.history,
    final_eval,
    throughput,
    task=task,
    workdir=workdir,
    resumed_from=restored.source,
    started=started,
    first_step=first_step,
    extra=loop.summary_entries,  # what the hooks' ends returned
    data_sources=train_batches.sources_fed(loop.step, task.unit),  # a mixture's; else None
  )
  published = summary.publish(
    results,
    workdir,
    chief,
    lambda: summary.task_report(task, setup, loop.state, loop.step),
    own_entries=[k for k, v in loop.summary_entries.items() if results.get(k) is v],
    draw_loss_curve=config.loss_curve,
  )
  tracker.finish(published)
  # 7. Every process leaves when process 0 does: its own end (the loss curve,
  # summary.json, the tracker) can take longer, on a busy machine, than JAX's
  # shutdown barrier waits, and the others, done sooner, would time that
  # barrier out and abort a finished run.
  multihost.from_process_0("the end of the run", lambda: True, config.eval_timeout_s or None)
  return published


def _open_run_data(config, task: Task, workdir: epath.Path, mesh, batch_axes, watchdog):
  """`open_data` under the watchdog, with the run's files saved around it (process 0)."""
  chief = jax.process_index() == 0
  if chief:
    startup.save_run_files(config, workdir)
  with watchdog.phase("data preparation", 0, "none"):  # as long as it takes, the first time
    train_batches, eval_batches = open_data(config, task, workdir, mesh, batch_axes)
  if chief:
    startup.save_task_files(task, workdir)
  return train_batches, eval_batches


def _restore(config, workdir: epath.Path, setup: StateSetup):
  """(checkpoint manager, the restored or initialised state)."""
  manager = make_manager(
    workdir / "checkpoints",
    config.checkpoint.every,
    config.checkpoint.keep,
    config.checkpoint.keep_period,
  )
  restored = restore_or_init(
    manager,
    setup.abstract,
    setup.shardings,
    setup.init,
    config.checkpoint.init_from,
    setup.init_with_weights,
    setup.trainable_paths,
    peft.initial_adapters(config.lora.init_from, setup.adapters) if config.lora.init_from else None,
  )
  if config.lora.init_from and restored.data_state is None:  # not resumed: the folder's adapters
    restored.source += f", LoRA adapters from {config.lora.init_from}"
  return manager, restored


def _checkpointed(config, setup: StateSetup, restored) -> Callable:
  """`(state, data position) -> (what a checkpoint saves of them)`.

  Everything, or with LoRA the state less its frozen weights, and the data
  record naming those weights (`lora_base`), whose hash is taken here, once a
  run. A resume checks that the checkpoint's adapters were trained on them.
  """
  if not setup.adapters:
    return lambda state, data: (state, data)
  frozen = trainable.split(restored.state["params"], setup.trainable_paths)[1]
  source = config.checkpoint.init_from or f"fresh init (seed {config.seed})"
  base = lora_base.BaseWeights(source, lora_base.content_hash(frozen))
  log.info("LoRA base weights: %s", base)
  if restored.data_state is not None:  # resumed from our own checkpoint
    lora_base.check_same_base(restored.data_state.get(lora_base.KEY), base, restored.source)

  def checkpointed(state, data):
    return saved_part(state, setup.trainable_paths), dict(data, **{lora_base.KEY: base.to_dict()})

  return checkpointed


def _log_start(workdir: epath.Path, mesh, source: str) -> None:
  log.warning(
    "spmd-train: %s on %d processes x %d devices, mesh %s; state from %s",
    workdir.name,
    jax.process_count(),
    jax.local_device_count(),
    dict(mesh.shape),
    source,
  )


@dataclasses.dataclass(frozen=True)
class _Steps:
  """The compiled steps, and how to build the train step for another task (`StepContext.build`)."""

  train: Callable
  eval: Callable
  train_for: Callable[[Task], Callable]


def _make_steps(setup: StateSetup, task: Task, config, mesh, batch_axes) -> _Steps:
  """The train and eval steps; process 0 logs the variable placement and the flat reduction."""
  blocker = per_device_blocker(setup, task, config.global_batch)
  flat_reduce = flat_gradient_reduction(setup, config, batch_axes, blocker)
  if jax.process_index() == 0:
    startup.log_placement(setup)
    if blocker and config.train.flat_grad_reduce == "auto":
      log.warning("spmd-train: train.flat_grad_reduce is off for this model: %s", blocker)
    if note := startup.context_without_sequences(task, setup):
      log.warning(note)

  def train_for(t: Task) -> Callable:
    return make_train_step(setup, t, config, mesh, batch_axes, flat_reduce)

  return _Steps(train_for(task), make_eval_step(setup, task, mesh, batch_axes), train_for)


@dataclasses.dataclass(frozen=True)
class _RunHooks:
  """The loop's hooks, and what the end of the run reads back from them."""

  hooks: list[Hook]
  wrappers: list[Wrapper]  # the task's and the config's (`trainers.hooks.Wrapper`)
  writer: metrics.MetricsWriter
  progress: console.Progress
  saver: Saver
  evaluations: Evaluations
  saves: CheckpointSaves
  evaluate: Callable[[Any, int], dict]


def _make_hooks(
  config,
  task: Task,
  metric_names: task_metrics.MetricNames,
  workdir: epath.Path,
  watchdog: ProgressWatchdog,
  manager,
  start: int,
  throughput: Throughput,
  steps: _Steps,
  train_batches: pipeline.GlobalBatches,
  eval_batches: pipeline.GlobalBatches,
  tracker: tracking.Tracker,
  evals: EvalRunner | None = None,
  checkpointed: Callable = lambda state, data: (state, data),
) -> _RunHooks:
  """The built-in hooks (metrics, eval, checkpoints, profile), then the task's and the config's, and their wrappers."""
  chief = jax.process_index() == 0
  writer = metrics.MetricsWriter(workdir, enabled=chief, tracker=tracker)
  progress = console.Progress(config.train.steps, initial=start, enabled=chief)
  saver = Saver(manager)
  save_budget = (
    f"a checkpoint save to {workdir / 'checkpoints'}",
    config.checkpoint.save_timeout_s,
    "checkpoint.save_timeout_s",
  )

  # Saves and evals are timed by their own budgets, not by the step limit.
  def save(step, state):
    with watchdog.phase(*save_budget):
      return saver.save(step, *checkpointed(state, train_batches.state(step).to_dict()))

  def wait_for_saves():
    with watchdog.phase(*save_budget):
      saver.wait()

  def evaluate(state, step: int):
    with watchdog.phase("an eval", config.eval_timeout_s, "eval_timeout_s"):
      found = evaluate_batches(steps.eval, eval_batches, state, config.eval_batches)
      if evals is not None:  # config.evals, beside the loss eval and under its time limit
        found.update(evals(state, step, str(workdir)))
      return found

  # The bar shows the loss, the rate and the task's own train metrics, by their names.
  shown = ("loss", throughput.rate, *metric_names.train)
  metrics_hook = MetricsHook(
    writer.write,
    lambda step, row: progress.update(step, **{k: row[k] for k in shown if k in row}),
    config.train.max_bad_steps,
  )
  evaluations = Evaluations(evaluate, writer.write)
  saves = CheckpointSaves(save, wait_for_saves)
  hooks = [
    Hook(metrics_hook, every=config.log_every, metrics=True, end=metrics_hook.end, name="metrics"),
    Hook(evaluations, every=config.eval_every, name="eval"),
    Hook(saves, every=config.checkpoint.every, end=saves.end, name="checkpoint"),
    Profile(config.profile.start_step, config.profile.num_steps, str(workdir / "profile")).hook(),
  ]
  loaded = load_hooks(config, task.hooks)
  hooks += [h for h in loaded if isinstance(h, Hook)]
  wrappers = [w for w in loaded if isinstance(w, Wrapper)]
  return _RunHooks(hooks, wrappers, writer, progress, saver, evaluations, saves, evaluate)


def _loop_state(
  config, setup: StateSetup, start: int, state, mesh, workdir: epath.Path, throughput: Throughput
) -> LoopState:
  """The loop's bookkeeping from `start` to `train.stop_at_step` (else `train.steps`)."""

  def eval_model(state):
    model = build_model(setup, state["params"], state.get("model_state"))
    model.eval()
    return model

  stop = config.train.stop_at_step or config.train.steps
  return LoopState(
    state,
    start,
    min(stop, config.train.steps),
    mesh=mesh,
    workdir=workdir,
    model=eval_model,
    annotate=throughput.annotate,
    last_fetch_step=start,
  )


def _step_and_batches(
  config, task: Task, steps: _Steps, restored, train_batches, wrappers: list[Wrapper]
):
  """(train step, `(step, batch)` iterator), with the wrappers of the task and config applied."""
  data_start: int | pipeline.PipelineState = restored.step
  if restored.data_state is not None:
    data_start = pipeline.PipelineState.from_dict(restored.data_state)
  # Before the iterator starts: its prefetch thread builds batches at once.
  for wrapper in wrappers:
    if wrapper.host_rows is not None:
      train_batches.wrap_host_rows(wrapper.host_rows)
  batches = train_batches.iterator(data_start, prefetch=config.data.prefetch)
  context = StepContext(task=task, build=steps.train_for, first_step=restored.step)
  return wrap_train_step(steps.train, context, wrappers), wrap_batches(batches, wrappers)


def _run_loop(
  config,
  loop: LoopState,
  train_step: Callable,
  batches,
  run: _RunHooks,
  watch: PreemptionWatch,
  watchdog: ProgressWatchdog,
  workdir: epath.Path,
  started: float,
) -> dict[str, float]:
  """Runs the loop to its end; returns when the first step finished (`at`, and `s` from `started`).

  A preemption is logged (process 0) and raised again as `Preempted` naming
  the checkpoint; the batches, the watches and the progress bar are closed
  whatever happens.
  """
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
      train_loop(
        loop,
        train_step,
        batches,
        run.hooks,
        watch.reached,
        on_progress,
        # The end (the last metrics, the final save, the hooks' summary
        # entries) is timed like an eval, not by the step limit.
        end_phase=lambda: watchdog.phase(
          "the end of the run (the hooks' ends)", config.eval_timeout_s, "eval_timeout_s"
        ),
      )
  except Preempted:
    if jax.process_index() == 0:
      log.warning(
        "spmd-train: preempted; checkpoint saved at step %d; the final save took %.1f s "
        "(time allowed after the notice: %s)",
        loop.step,
        run.saves.final_save_s,
        PREEMPTION_GRACE,
      )
    raise Preempted(
      f"preempted at step {loop.step}; checkpoint saved in {workdir / 'checkpoints'}"
    ) from None
  finally:
    batches.close()
    watch.close()
    watchdog.close()
    run.progress.close()
  return first_step


def _final_eval(loop: LoopState, run: _RunHooks) -> dict:
  """The eval at the last step (the eval hook's, when it ran there); closes writer and saver."""
  final_eval = run.evaluations.results.get(loop.step)
  if final_eval is None:
    final_eval = run.evaluate(loop.state, loop.step)
    run.writer.write(loop.step, final_eval)
  run.writer.close()
  run.saver.close()
  return final_eval
