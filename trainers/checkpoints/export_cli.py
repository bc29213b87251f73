"""`spmd-export`: a run's trained weights as one plain-array file, usable with no mesh.

  spmd-export --workdir=W [--step=N] [--checkpoint=DIR] [--out=FILE]

writes `W/export/params_step_<N>.npz` (or `--out`) with `trainers.checkpoints.export.export`;
that module describes the file and loads it back (`load_params`, `load_model`).
"""

from __future__ import annotations

import sys

import numpy as np

from spmd import errors
from trainers.checkpoints import export


def main(argv: list[str] | None = None) -> int:
  """`spmd-export`: see the module docstring. 0, or 2 on a user error (`spmd.errors`)."""
  return errors.run("spmd-export", lambda: _main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> None:
  parser = errors.ArgumentParser(prog="spmd-export", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="the run's workdir")
  parser.add_argument("--step", type=int, default=None, help="default: the latest committed")
  parser.add_argument("--checkpoint", default="", help="a workdir, checkpoint or step directory")
  parser.add_argument("--out", default=None, help="default: <workdir>/export/params_step_N.npz")
  args = parser.parse_args(argv)
  with errors.user_input(ValueError, FileNotFoundError):  # the workdir, checkpoint or step given
    path = export.export(args.workdir, args.out, step=args.step, checkpoint=args.checkpoint)
  exported = export.load_export(str(path))
  count = sum(np.size(x) for x in export.flatten(exported.params).values())
  print(f"spmd-export: step {exported.step}, {count:,} parameters -> {path}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
