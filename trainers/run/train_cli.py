"""`spmd-train`: flags -> config -> `train_and_evaluate`.

  spmd-train --config=configs/lm_tiny.py --workdir=workdir/lm_tiny [--config.train.steps=50]

The same command runs single-process and under any launcher: it calls
`spmd.initialize()` itself, which reads the launcher's environment or the
cluster's own.

  spmd-train --mode=eval --workdir=workdir/lm_tiny [--step=N] [--checkpoint=DIR] [--eval_batches=0]

evaluates a saved checkpoint instead (`trainers/run/evaluate.py`); `--config` is
optional there (default: the run's own `<workdir>/config.json`).
"""

from __future__ import annotations

import sys
import time
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from spmd import multihost, startup_gc
from spmd.errors import EXIT_USER_ERROR, UserError, one_line, parse_flags, run, user_input

FLAGS = flags.FLAGS
_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file")
_WORKDIR = flags.DEFINE_string("workdir", None, "where checkpoints, metrics and logs go")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "eval"], "train, or evaluate a checkpoint")
_STEP = flags.DEFINE_integer("step", None, "--mode=eval: the step (default: the latest committed)")
_CHECKPOINT = flags.DEFINE_string(
  "checkpoint", "", "--mode=eval: a workdir, checkpoint or step directory to read instead"
)
_EVAL_BATCHES = flags.DEFINE_integer(
  "eval_batches", None, "--mode=eval: replaces config.eval_batches (0: the whole eval split)"
)
PUBLISH_WAIT_S = 3.0  # publish_failure's default wait; the exit's wait shares it


def _main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise UserError(f"unexpected arguments: {argv[1:]}; flags are --name=value")
  evaluating = _MODE.value == "eval"
  if _WORKDIR.value is None or (_CONFIG.value is None and not evaluating):
    raise UserError("--workdir is required, and --config unless --mode=eval")
  eval_flags = {
    "step": _STEP.value,
    "checkpoint": _CHECKPOINT.value,
    "eval_batches": _EVAL_BATCHES.value,
  }
  if not evaluating and any(v not in (None, "") for v in eval_flags.values()):
    raise UserError(f"--step, --checkpoint and --eval_batches need --mode=eval; got {eval_flags}")
  if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
    # orbax and tfds log every file they touch at INFO; keep the console for
    # the progress bar and what matters unless asked otherwise.
    logging.set_verbosity(logging.WARNING)
  # Here, not at the top: --help and a bad flag answer without importing the
  # trainer (Flax, orbax, TFDS), which takes seconds.
  from trainers.config import resolve
  from trainers.run.train import Preempted, train_and_evaluate
  from trainers.run.watchdog import EXIT_PEER_FAILED, leave, peer_failed_first, publish_failure

  startup_gc.freeze_and_resume()  # the imports are done: the run's own objects from here

  try:
    # Checked once, up front: keys, types and values, before any data or restore.
    config = None
    if _CONFIG.value is not None:
      with user_input(ValueError, FileNotFoundError):  # the config given
        config = resolve(_CONFIG.value, config_flags.get_config_filename(FLAGS["config"]))
    if evaluating:
      from trainers.run.evaluate import evaluate_run  # as above

      with user_input(ValueError, FileNotFoundError):  # the workdir, checkpoint or step given
        evaluate_run(_WORKDIR.value, config, **eval_flags)
    else:
      train_and_evaluate(config, _WORKDIR.value)
  except Preempted as e:
    print(f"spmd-train: {e}; resume with the same command", flush=True)
    sys.exit(0)
  except UserError as e:
    if not _multi_process():
      raise  # `main` prints it as one line and exits 2
    # Each process that meets it says so and exits 2, and tells the others
    # (they stop too, naming it): a launcher does not restart an input error.
    print(f"spmd-train: {one_line(e)}", file=sys.stderr, flush=True)
    publish_failure(e)
    leave(EXIT_USER_ERROR)
  except Exception as e:
    if getattr(e, "every_host", False) and _multi_process():
      # An agreed stop: every host raises this same error at the same point,
      # so each says it itself and all exit alike; nobody is told by a peer.
      traceback.print_exc()
      leave(1)
    echo = peer_failed_first(e)
    if echo:  # this error is the echo of another process's failure: report that
      print(f"spmd-train: {echo}", file=sys.stderr, flush=True)
      leave(EXIT_PEER_FAILED)
    started = time.monotonic()
    if not publish_failure(e):  # the other processes stop too, naming this one and its error
      raise
    traceback.print_exc()
    # Now, not after JAX's shutdown barrier, which would wait for the processes
    # this one has just stopped: the launcher names the process that ends first.
    # The coordinator's wait for its peers shares the bound of publish_failure's.
    leave(1, wait_s=max(0.5, PUBLISH_WAIT_S - (time.monotonic() - started)))


def _multi_process() -> bool:
  if multihost.runtime_client() is None:  # before the distributed runtime: no backend started
    return False
  import jax

  return jax.process_count() > 1


def main() -> int:
  """`spmd-train`; a user error (bad flag, value, config key or path) is one line and exit 2."""
  startup_gc.pause_collection()  # until `_main` has imported the trainer
  return run("spmd-train", lambda: app.run(_main, flags_parser=_parse))


def _parse(argv: list[str]) -> list[str]:
  return parse_flags(FLAGS, "spmd-train", argv[1:])


if __name__ == "__main__":
  sys.exit(main())
