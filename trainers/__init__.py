"""Training on top of `spmd`: Flax NNX models through the Task API, one subpackage per job.

  tasks/        the Task API (`trainers.tasks.Task`) and the built-in tasks
  hooks/        periodic work on a schedule (`trainers.hooks.Hook`), the built-in hooks
  config/       the defaults, and the checks every config passes up front
  data/         prepare/ (sources to records), read/ (records to batches), records/ (the format)
  models/       the built-in NNX models
  step/         the mesh, the sharded state, the optimizer, the compiled steps
  checkpoints/  saving, restoring, warm starts, step folders, export
  reporting/    metrics files, progress, throughput and MFU, the summary
  run/          `spmd-train`: the run, its loop, the watchdog, preemption
  planning/     `spmd-plan`: the real step compiled for a pod, ahead of time
  sampling/     `spmd-sample`: text from a trained run
  paths.py      local paths and `gs://` URLs, one type everywhere

Nothing is imported here, so importing one part does not pay for the others.
"""
