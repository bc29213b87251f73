"""User errors: a wrong input is one line on stderr and exit 2; any other error is a bug.

Every `spmd-*` command runs its body through `run`: a `UserError` (a bad
flag or value, a missing file or checkpoint, an unknown config key) prints
`spmd-NAME: <message>` and the command exits `EXIT_USER_ERROR`, with no
traceback, since the message names the input and what to do. Any other
exception keeps its traceback: it is a bug to report, not an input to fix.

Flags are parsed through `parse_flags` (absl and ml_collections config
flags) or `ArgumentParser` (argparse), which turn their errors into
`UserError`s; an unknown flag gets the command's nearest real one. Launchers
never restart a job whose processes exited `EXIT_USER_ERROR`: it would fail
the same way again.

Example:
  >>> def body():
  ...   raise UserError("--steps=-1 must be at least 1")
  >>> run("spmd-demo", body)  # stderr: spmd-demo: --steps=-1 must be at least 1
  2
  >>> nearest("--stpes", ["--steps", "--seed"])
  " (did you mean '--steps'?)"
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

EXIT_USER_ERROR = 2  # the shell's "usage" status: what argparse and absl's usage use
# A process that stops because another failed first exits with this, so that
# the launcher names the other as the cause (`launch.processes.watch`).
EXIT_PEER_FAILED = 87


class UserError(ValueError):
  """An input the user gave is wrong; the message names it and says what to do."""


def nearest(name: str, choices: Iterable[str]) -> str:
  """` (did you mean 'X'?)` for the choice closest to `name`, or '' when none is close."""
  found = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
  return f" (did you mean {found[0]!r}?)" if found else ""


def unknown_flag(prog: str, flag: str, known: Iterable[str]) -> str:
  """What to say of `flag`, which `prog` lacks: its nearest flag, or its flags when few.

  >>> unknown_flag("spmd-x", "--stpes", ["--steps", "--seed"])
  "--stpes is not a flag of spmd-x (did you mean '--steps'?)"
  >>> unknown_flag("spmd-x", "--ici", ["--mesh", "--dcn"])
  '--ici is not a flag of spmd-x; its flags: --dcn, --mesh'
  """
  known = sorted(set(known))
  bare = {k.lstrip("-"): k for k in known}  # the shared "--" would make any two look alike
  found = difflib.get_close_matches(flag.lstrip("-"), list(bare), n=1, cutoff=0.6)
  if found:
    return f"{flag} is not a flag of {prog} (did you mean {bare[found[0]]!r}?)"
  if len(known) <= 16:
    return f"{flag} is not a flag of {prog}; its flags: {', '.join(known)}"
  return f"{flag} is not a flag of {prog}; {prog} --help lists them"


def one_line(error: BaseException) -> str:
  """The error's message on one line."""
  return " ".join(str(error).split()) or type(error).__name__


def run(prog: str, body: Callable[[], int | None]) -> int:
  """`body()`'s exit status (None: 0); a `UserError` is printed as one line and gives 2."""
  try:
    return body() or 0
  except UserError as e:
    print(f"{prog}: {one_line(e)}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


@contextlib.contextmanager
def user_input(*types: type[BaseException]) -> Iterator[None]:
  """Inside, an error of `types` comes from the user's input: raised again as a `UserError`.

  For calls that only check what the user gave (a config, a path, a
  checkpoint to read), so their library errors stay what they are elsewhere.
  """
  try:
    yield
  except UserError:
    raise
  except types as e:
    raise UserError(one_line(e)) from e


# absl and ml_collections flags.


def parse_flags(fv, prog: str, argv: Sequence[str]) -> list[str]:
  """Parses `argv` into the absl `FlagValues` `fv`; returns what is left (program name first).

  Raises `UserError` for an unknown flag (naming the nearest real one), a bad
  value, a missing config file, or a `--config.x.y` override of a key the
  config does not have (naming the keys that are there).
  """
  from absl import flags

  config_names = _config_flag_names(fv)
  _check_config_files(fv, config_names, argv)
  try:
    return fv([prog, *argv])
  except flags.UnrecognizedFlagError as e:
    raise UserError(unknown_flag(prog, f"--{e.flagname}", [f"--{n}" for n in fv])) from None
  except flags.Error as e:
    raise UserError(_flag_error_text(e)) from None
  except (AttributeError, KeyError) as e:
    # ml_collections, applying `--config.a.b=v` to a config without `a.b`.
    overrides = [a for a in argv if any(a.startswith(f"--{n}.") for n in config_names)]
    if not overrides:
      raise
    raise UserError(_override_error(fv, config_names, argv, overrides, e)) from None


def _config_flag_names(fv) -> list[str]:
  """The flags that load a config file (`config_flags.DEFINE_config_file`)."""
  from ml_collections.config_flags import config_flags

  return [n for n in fv if isinstance(fv[n].parser, config_flags.ConfigFileFlagParser)]


def _flag_value(name: str, argv: Sequence[str]) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _check_config_files(fv, names: Sequence[str], argv: Sequence[str]) -> None:
  # ml_collections defers a missing file's error to the config's first use.
  for name in names:
    value = _flag_value(name, argv)
    if value is None:
      continue
    path = value.split(":", 1)[0]
    if not os.path.isfile(path):
      raise UserError(f"--{name}={value}: no such file {os.path.abspath(path)!r}")


def _flag_error_text(error: Exception) -> str:
  text = str(error)
  if "Traceback" not in text:
    return one_line(error)
  # A config file that raised: its own last line, and where.
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  where = [line for line in lines if line.startswith("File ")]
  flag = text.split(":", 1)[0]
  return f"{flag}: the config file failed: {lines[-1]}" + (f" ({where[-1]})" if where else "")


def _override_error(fv, names, argv, overrides, error: Exception) -> str:
  from ml_collections.config_flags import config_flags

  for name in names:
    value = _flag_value(name, argv)
    if value is None:
      continue
    try:
      config = config_flags.ConfigFileFlagParser(name).parse(value)
    except Exception:  # the file itself fails: ml_collections' message is all there is
      continue
    for override in overrides:
      if not override.startswith(f"--{name}."):
        continue
      path = override[2:].split("=", 1)[0]
      node, walked = config, name
      for part in path.split(".")[1:]:
        keys = list(node.keys()) if hasattr(node, "keys") else []
        if part not in keys:
          hint = nearest(part, map(str, keys))
          shown = hint or f"; its settings: {', '.join(sorted(map(str, keys))) or 'none'}"
          return f"--{path}: {walked} has no setting {part!r}{shown}"
        node, walked = node[part], f"{walked}.{part}"
  return f"{' '.join(overrides)}: {one_line(error)}"


# argparse.


class ArgumentParser(argparse.ArgumentParser):
  """`argparse.ArgumentParser` whose errors are `UserError`s naming the nearest real flag."""

  _given: Sequence[str] = ()

  def parse_known_args(self, args=None, namespace=None):
    self._given = list(sys.argv[1:] if args is None else args)
    return super().parse_known_args(args, namespace)

  def error(self, message: str):  # argparse's hook for every bad argument
    known = list(_option_strings(self))
    unknown = []
    if message.startswith("unrecognized arguments:"):
      unknown = [a.split("=", 1)[0] for a in message.split(":", 1)[1].split() if a[:1] == "-"]
    elif message.startswith("the following arguments are required"):
      # argparse checks for missing flags first: a misspelt one is the likelier cause.
      given = self._given[: self._given.index("--")] if "--" in self._given else self._given
      unknown = [
        flag
        for flag in (a.split("=", 1)[0] for a in given if a.startswith("--"))
        if not any(k.startswith(flag) for k in known)  # argparse takes unique prefixes
      ]
    if unknown:
      raise UserError(unknown_flag(self.prog, unknown[0], known))
    raise UserError(f"{message}; {self.prog} --help lists the flags")


def _option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
  for action in parser._actions:  # argparse keeps its actions here, and nowhere public
    yield from (s for s in action.option_strings if s.startswith("--"))
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values():
        yield from _option_strings(sub)
