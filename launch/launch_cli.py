"""`spmd-launch`: start a job's processes and watch them.

Example:
  spmd-launch local --num-processes 2 --devices-per-process 2 -- python examples/sharded_jit_demo.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from launch import local, slurm
from launch.processes import stop_on_signals
from spmd import errors


def build_parser() -> argparse.ArgumentParser:
  parser = errors.ArgumentParser(prog="spmd-launch", description=__doc__.splitlines()[0])
  targets = parser.add_subparsers(dest="target", required=True)
  _local_arguments(targets.add_parser("local", help="N simulated hosts on this machine"))
  _slurm_arguments(targets.add_parser("slurm", help="write (and --submit) an sbatch script"))
  # The TPU and Kubernetes targets' modules are imported where they are used:
  # they bring in more (the TPU setup, YAML) than a local job needs at start-up.
  from launch import tpu

  tpu.add_arguments(
    targets.add_parser("tpu", help="every worker of a Cloud TPU VM slice, over gcloud ssh")
  )
  from launch import k8s

  k8s.add_arguments(
    targets.add_parser("k8s", help="write (and --apply) a Kubernetes JobSet manifest")
  )
  return parser


def _local_arguments(loc: argparse.ArgumentParser) -> None:
  """The flags of `spmd-launch local` (`launch.local.run_with_restarts`)."""
  loc.add_argument("-n", "--num-processes", type=int, default=2)
  loc.add_argument("--devices-per-process", type=int, default=1)
  loc.add_argument(
    "--timeout",
    type=float,
    default=0,
    help="seconds for the whole job, then every process is killed (default 0: no limit)",
  )
  loc.add_argument(
    "--grace", type=float, default=5.0, help="seconds the others get after a failure before SIGKILL"
  )
  loc.add_argument("--heartbeat-timeout", type=float, default=5.0)
  loc.add_argument(
    "--max-restarts",
    type=int,
    default=0,
    help="restart the whole job this many times after a failure; the "
    "command resumes from its checkpoints",
  )
  loc.add_argument("--log-dir", default=None, help="also write process_N.log files here")
  loc.add_argument(
    "--term-grace",
    type=float,
    default=60.0,
    help="after Ctrl-C/SIGTERM: seconds the job may take to save, then SIGKILL",
  )
  loc.add_argument(
    "--platform",
    default="cpu",
    help="JAX_PLATFORMS for the processes ('' keeps the environment's); with cuda, process i "
    "gets GPUs i*D ... i*D+D-1 (D: --devices-per-process) of those CUDA_VISIBLE_DEVICES or "
    "nvidia-smi -L lists, as its CUDA_VISIBLE_DEVICES",
  )
  loc.add_argument(
    "--share-gpus",
    action="store_true",
    help="with cuda: when there are fewer GPUs than processes x D, share them round-robin "
    "(each process then preallocates its share of 75%% of a GPU) instead of failing",
  )
  loc.add_argument(
    "--pin-cpus",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="give each process its own share of this machine's CPUs, as separate hosts have "
    "(default: on for several processes where `taskset` works)",
  )
  loc.add_argument(
    "--no-tcmalloc",
    dest="tcmalloc",
    action="store_false",
    help="do not preload TCMalloc into the processes (by default it is, where installed)",
  )
  loc.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")


def _slurm_arguments(slurm: argparse.ArgumentParser) -> None:
  """The flags of `spmd-launch slurm` (`launch.slurm.sbatch_script`)."""
  slurm.add_argument("--nodes", type=int, required=True)
  slurm.add_argument("--tasks-per-node", type=int, default=1)
  slurm.add_argument("--gpus-per-node", type=int, default=0)
  slurm.add_argument("--time", default="")
  slurm.add_argument("--partition", default="")
  slurm.add_argument("--job-name", default="spmd")
  slurm.add_argument("--script", default="spmd_job.sbatch", help="where to write the script")
  slurm.add_argument("--submit", action="store_true", help="run sbatch on it")
  slurm.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")


def main(argv: list[str] | None = None) -> int:
  """`spmd-launch`'s exit status: 0, 1 when the job failed, 2 on a user error (its or the job's)."""
  return errors.run("spmd-launch", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
  args = build_parser().parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    print("spmd-launch: give the command after --", file=sys.stderr)
    return 2
  if args.target == "k8s":
    from launch import k8s

    return k8s.main(args, command)
  if args.target == "tpu":
    from launch import tpu

    return tpu.main(args, command)
  if args.target == "slurm":
    return _write_sbatch(args, command)
  return _run_local(args, command)


def _write_sbatch(args: argparse.Namespace, command: list[str]) -> int:
  script = slurm.sbatch_script(
    command,
    args.nodes,
    args.tasks_per_node,
    args.gpus_per_node,
    args.time,
    args.job_name,
    args.partition,
  )
  try:
    done = slurm.write_and_maybe_submit(script, args.script, args.submit)
  except OSError as e:  # the script's folder is missing or not writable
    raise errors.UserError(f"--script={args.script}: {e.strerror or e}") from e
  print(f"spmd-launch: {done}")
  return 0


def _run_local(args: argparse.Namespace, command: list[str]) -> int:
  if shutil.which(command[0]) is None:  # each process would fail to start, alike
    raise errors.UserError(f"{command[0]!r} (after --) is not a program on PATH or a file")
  if args.log_dir:
    try:
      os.makedirs(args.log_dir, exist_ok=True)
    except OSError as e:
      raise errors.UserError(f"--log-dir={args.log_dir}: {e.strerror or e}") from e
  # Forwarded to the job as SIGTERM: spmd-train saves at an agreed step.
  saving = f"asking the job to save and stop (SIGKILL in {args.term_grace:g}s)"
  with stop_on_signals(saving) as stop:
    try:
      attempts = local.run_with_restarts(
        command,
        args.num_processes,
        max_restarts=args.max_restarts,
        stop=stop,
        devices_per_process=args.devices_per_process,
        timeout_s=args.timeout,
        grace_s=args.grace,
        heartbeat_timeout_s=args.heartbeat_timeout,
        platform=args.platform or None,
        log_dir=args.log_dir,
        term_grace_s=args.term_grace,
        pin_cpus=args.pin_cpus,
        tcmalloc=args.tcmalloc,
        share_gpus=args.share_gpus,
      )
    except ValueError as e:  # a job these flags cannot start, such as too few GPUs
      print(f"spmd-launch: {e}", file=sys.stderr)
      return 2
  result = attempts[-1]
  if len(attempts) > 1:
    print(f"spmd-launch: {len(attempts)} attempts ({len(attempts) - 1} restarts)", file=sys.stderr)
  print(f"spmd-launch: {result.summary()}", file=sys.stderr if not result.ok else sys.stdout)
  if result.ok:
    return 0
  # A job that failed on its input tells a script around it not to retry either.
  return errors.EXIT_USER_ERROR if local.user_error(result) is not None else 1


if __name__ == "__main__":
  sys.exit(main())
