"""`--help` for commands that parse their flags into a fresh absl `FlagValues`.

absl's `app.run` answers `--help` only for flags in its global set; a command
that keeps its own set (so tests can call its `main` repeatedly) has to answer
it itself, or `--help` is an unknown flag.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from spmd.errors import parse_flags

HELP_FLAGS = ("--help", "-h", "-help", "--helpfull", "--helpshort")


def parse_or_help(fv: flags.FlagValues, prog: str, argv: Sequence[str], doc: str) -> bool:
  """Parses `argv` into `fv`, or prints `doc` and the flags when help is asked for.

  Returns False when it printed help (the caller exits 0), True when `fv` holds
  the parsed flags. A bad flag is a `spmd.errors.UserError` (`parse_flags`).

  >>> fv = flags.FlagValues()
  >>> _ = flags.DEFINE_integer("steps", 1, "steps to run", flag_values=fv)
  >>> parse_or_help(fv, "demo", ["--steps=3"], "Runs a demo."), fv.steps
  (True, 3)
  >>> parse_or_help(fv, "demo", ["--help"], "Runs a demo.")  # doctest: +ELLIPSIS
  Runs a demo.
  <BLANKLINE>
  flags:
  ...--steps: steps to run...
  False
  """
  if any(a in HELP_FLAGS for a in argv):
    print(doc.strip(), "", "flags:", fv.get_help(), sep="\n")
    return False
  parse_flags(fv, prog, argv)
  return True
