"""`spmd-plan`: will this config fit and how fast will it go on a pod, asked from a laptop.

  spmd-plan --config=configs/lm_small.py --topology=v5p-256
  spmd-plan --config=configs/lm_small.py --topology=v5e-256 --num_slices=2 --json
  spmd-plan --config=configs/lm_small.py --gpu=h100 --num_gpus=16   # estimates, see below
  spmd-plan --config=configs/lm_small.py --topology=v5p-256 \\
      --config.mesh.ici=data=-1,fsdp=8,tensor=1 --save_executable=/tmp/step.xla

Compiles the real train step ahead of time for the target (`trainers.planning.plan`)
and prints (`trainers.planning.report`) memory per device against the device's
HBM, FLOPs, the expected step time and MFU under a stated efficiency
assumption, the collectives per step and whether they cross DCN, the
per-host data layout, and a warning row for each array XLA can only
reshard by copying it whole to every device (read from stderr and from
libtpu's log folder: a fresh one per run, unless `TPU_LOG_DIR` names one).
For a decoder with a KV-cache sampler (`trainers.models.decode`) it also gives the cache's memory per device for a
decode of `--decode_batch` (default global_batch) sequences of seq_len tokens
on the same mesh, from the cache's shapes and shardings (nothing extra is
compiled). TPU targets need the `tpu` extra (libtpu); nothing runs on, or
needs, an accelerator.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags, logging

from spmd import errors, startup_gc
from spmd.cli_help import parse_or_help
from trainers.planning.report import format_plan, save_executable


def _flags(argv: list[str]) -> flags.FlagValues | None:
  """Parses `argv` into a fresh flag set (spmd-train's flags live in the global one).

  None when `argv` asks for help, which has then been printed.
  """
  from ml_collections import config_flags

  fv = flags.FlagValues()
  config_flags.DEFINE_config_file(
    "config", None, "experiment config file", flag_values=fv, sys_argv=["spmd-plan", *argv]
  )
  flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p-256, v5e-16, v4:2x2x4", flag_values=fv)
  flags.DEFINE_integer("num_slices", 1, "TPU slices joined over DCN", flag_values=fv)
  flags.DEFINE_string(
    "gpu", None, "GPU type instead of a TPU: h100, h200, a100-80gb, ...", flag_values=fv
  )
  flags.DEFINE_integer("num_gpus", 8, "GPUs in all (with --gpu)", flag_values=fv)
  flags.DEFINE_integer("gpus_per_host", 8, "GPUs per node (with --gpu)", flag_values=fv)
  flags.DEFINE_string(
    "efficiency",
    "0.35,0.6",
    "assumed low,high share of peak FLOP/s for the step-time range",
    flag_values=fv,
  )
  flags.DEFINE_float("margin", 0.1, "share of HBM kept free when judging fit", flag_values=fv)
  flags.DEFINE_enum(
    "compile",
    "auto",
    ["auto", "always", "never"],
    "auto: skip when the state alone cannot fit",
    flag_values=fv,
  )
  flags.DEFINE_integer(
    "decode_batch",
    None,
    "sequences of the KV-cache row (a decode of this many x seq_len); default global_batch",
    flag_values=fv,
  )
  flags.DEFINE_bool("json", False, "print JSON instead of the table", flag_values=fv)
  flags.DEFINE_string(
    "save_executable",
    None,
    "write the compiled step's serialized executable (and a .json beside)",
    flag_values=fv,
  )
  return fv if parse_or_help(fv, "spmd-plan", argv, __doc__) else None


def main(argv: list[str] | None = None) -> int:
  """Returns 0 when the plan fits (or fit is unknown), 3 when it does not, 2 on a user error."""
  startup_gc.pause_collection()  # until `_main` has imported the planner
  return errors.run("spmd-plan", lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
  fv = _flags(argv)
  if fv is None:
    return 0
  if fv.config is None:
    raise errors.UserError("--config is required")
  if (fv.topology is None) == (fv.gpu is None):
    raise errors.UserError("give exactly one of --topology (TPU) or --gpu")
  if fv.decode_batch is not None and fv.decode_batch < 1:
    raise errors.UserError(f"--decode_batch={fv.decode_batch} must be >= 1")
  try:
    efficiency = tuple(float(x) for x in fv.efficiency.split(","))
  except ValueError:
    efficiency = ()
  if len(efficiency) != 2:
    raise errors.UserError(f"--efficiency={fv.efficiency!r}: give low,high, e.g. 0.35,0.6")
  if not any(a.startswith(("--verbosity", "-v")) for a in argv):
    logging.set_verbosity(logging.WARNING)
  import jax

  # Planning never runs anything: compile for descriptions, not for hardware.
  jax.config.update("jax_platforms", "cpu")
  if fv.gpu:
    jax.config.update("jax_num_cpu_devices", max(fv.num_gpus, 1))
  from ml_collections import config_flags

  # Here, not at the top: --help and a bad flag answer without importing the
  # trainer (Flax, the models, TFDS), which takes seconds.
  from trainers.config import resolve
  from trainers.planning import plan as plan_lib
  from trainers.planning import targets

  startup_gc.freeze_and_resume()
  with errors.user_input(ValueError, TypeError, FileNotFoundError):  # the config given
    config = resolve(fv.config, config_flags.get_config_filename(fv["config"]))
  compiled: list = []
  # libtpu logs the compiler's warnings to its folder: one of the plan's own.
  with targets.own_libtpu_log_folder():
    with errors.user_input(ValueError):  # the target given: --topology or --gpu
      target = (
        targets.gpu_target(fv.gpu, fv.num_gpus, fv.gpus_per_host)
        if fv.gpu
        else targets.tpu_target(fv.topology, fv.num_slices)
      )
    plan = plan_lib.make_plan(
      config,
      target,
      efficiency=efficiency,
      margin=fv.margin,
      compile_step={"auto": None, "always": True, "never": False}[fv.compile],
      keep_compiled=compiled,
      decode_batch=fv.decode_batch,
    )
  saved = ""
  if fv.save_executable:
    saved = (
      save_executable(compiled[0], fv.save_executable, plan, config)
      if compiled
      else "not saved: the step was not compiled"
    )
  if fv.json:
    out = plan.to_dict()
    if saved:
      out["executable"] = saved
    print(json.dumps(out, indent=1))
  else:
    config_name = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "config")
    print(format_plan(plan, os.path.basename(config_name)))
    if saved:
      print(f"executable: {saved}")
  # Scripts can tell "does not fit" (3) from success and from errors.
  return 3 if plan.fits is False else 0


if __name__ == "__main__":
  sys.exit(main())
