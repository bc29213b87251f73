"""Runs one console script's cases, each in a child forked from one loaded interpreter.

  python -m tests.workers.console_script_cases COMMAND OUT_DIR ARGS_JSON

ARGS_JSON is a list of argument lists. The installed entry point of COMMAND
(`console_scripts`) is loaded once; each case then runs in a forked child as
the installed script would run it (`sys.argv[0]` its path, `sys.exit(main())`),
with stdout and stderr going to OUT_DIR/<k>.out and OUT_DIR/<k>.err and its
exit status to OUT_DIR/<k>.code. Forking saves each case the interpreter's
start and the package's imports (seconds each), which every case shares; the
cases fail before JAX starts a backend, so no child inherits one.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import sys
import traceback
from pathlib import Path

CASE_TIMEOUT_S = 60  # a child that hangs (a lock held at fork, say) is killed by its alarm


def _exit_status(main, argv: list[str]) -> int:
  """What `sys.exit(main())` in the installed script exits with, printing as the interpreter would."""
  sys.argv = argv
  try:
    sys.exit(main())
  except SystemExit as e:
    if e.code is None:
      return 0
    if isinstance(e.code, int):
      return e.code
    print(e.code, file=sys.stderr)
    return 1
  except BaseException:  # the interpreter prints an uncaught exception's traceback, exits 1
    traceback.print_exc()
    return 1


def _run_case(main, argv: list[str], out: Path, k: int) -> int:
  """Forks a child that runs one case; its process id."""
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid:
    return pid
  code = 1
  try:
    signal.alarm(CASE_TIMEOUT_S)
    for fd, suffix in ((1, "out"), (2, "err")):
      target = os.open(out / f"{k}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
      os.dup2(target, fd)
      os.close(target)
    code = _exit_status(main, argv)
    (out / f"{k}.code").write_text(str(code))
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never back into the parent's loop


def main() -> None:
  command, out, cases = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
  (entry,) = importlib.metadata.entry_points(group="console_scripts", name=command)
  script_main = entry.load()
  script = str(Path(sys.executable).parent / command)
  for k, args in enumerate(cases):  # one at a time: a case may write into a shared folder
    pid = _run_case(script_main, [script, *args], out, k)
    _, status = os.waitpid(pid, 0)
    if not (out / f"{k}.code").exists():  # killed before it wrote its status
      (out / f"{k}.code").write_text(str(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else 1))


if __name__ == "__main__":
  main()
