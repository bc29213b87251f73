"""Every `spmd-*` command answers a user error with one line on stderr and exit 2.

Each command runs with a bad input: a bad value, an unknown flag one typo
from a real one, a missing file or checkpoint. The line names the flag or
path, names only flags the command has (taken from its own `--help`, which
runs as the installed console script, a real process of its own), and no
traceback is printed. All of these fail before JAX starts a backend, so
each command's cases run in children forked from one process that loaded
its installed entry point (`tests/workers/console_script_cases.py`): the
same `sys.exit(main())` as the script, without an interpreter start and the
package's imports per case; the commands run side by side.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.multiprocess  # every test here starts the commands as processes

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = str(ROOT / "configs" / "mlp.py")
HELP = {  # how to list each command's flags
  "spmd-train": ["--helpfull"],
  "spmd-launch": ["local", "--help"],
  "spmd-plan": ["--help"],
  "spmd-mesh": ["--help"],
  "spmd-export": ["--help"],
  "spmd-sample": ["--help"],
}
FLAG = re.compile(r"(?<![\w-])--(?:\[no\])?([A-Za-z][\w-]*)")  # absl shows --[no]json


def _cases(tmp: Path) -> list[tuple[str, list[str], str]]:
  """(command, arguments, what its one line must say)."""
  empty = tmp / "empty_workdir"  # a workdir with no run in it
  empty.mkdir(exist_ok=True)
  missing = str(tmp / "missing" / "config.py")
  return [
    # The six.
    ("spmd-plan", [f"--config={CONFIG}", "--topology=v9z-7"], "unknown TPU slice 'v9z-7'"),
    ("spmd-export", [f"--workdir={empty}"], f"no checkpoint in {empty}/checkpoints"),
    ("spmd-mesh", ["--ici=data=2"], "--ici is not a flag of spmd-mesh; its flags: "),
    ("spmd-sample", [f"--workdir={empty}", "--prompt=x"], f"--workdir={empty} has no config.json"),
    (
      "spmd-train",
      [f"--config={CONFIG}", f"--workdir={tmp / 'w'}", "--config.model.nope=3"],
      "--config.model.nope: config.model has no setting 'nope'",
    ),
    (
      "spmd-train",
      [f"--config={CONFIG}", f"--workdir={tmp / 'w'}", "--config.train.steps=many"],
      "--config.train.steps=many: invalid literal",
    ),
    # An unknown flag one typo from a real one: the real one is named.
    (
      "spmd-train",
      [f"--confg={CONFIG}", f"--workdir={tmp / 'w'}"],
      "--confg is not a flag of spmd-train (did you mean '--config'?)",
    ),
    (
      "spmd-launch",
      ["local", "--max-restrats", "2", "--", "true"],
      "--max-restrats is not a flag of spmd-launch (did you mean '--max-restarts'?)",
    ),
    (
      "spmd-plan",
      [f"--config={CONFIG}", "--topolgy=v5p-8"],
      "--topolgy is not a flag of spmd-plan (did you mean '--topology'?)",
    ),
    (
      "spmd-mesh",
      ["--mseh=data=-1"],
      "--mseh is not a flag of spmd-mesh (did you mean '--mesh'?)",
    ),
    (
      "spmd-export",
      [f"--workdir={empty}", "--stpe=3"],
      "--stpe is not a flag of spmd-export (did you mean '--step'?)",
    ),
    (
      "spmd-sample",
      [f"--workdir={empty}", "--promt=x"],
      "--promt is not a flag of spmd-sample (did you mean '--prompt'?)",
    ),
    # A mesh the trainer cannot build: an axis it has no rule for, sizes that are not the devices'.
    (
      "spmd-train",
      [f"--config={CONFIG}", f"--workdir={tmp / 'w'}", "--config.mesh.ici=data=1,bogus=2"],
      "'bogus' is not a mesh axis of the trainer; its axes: data, fsdp, expert, context, tensor",
    ),
    (
      "spmd-train",
      [f"--config={CONFIG}", f"--workdir={tmp / 'w'}", "--config.mesh.ici=data=3,fsdp=1"],
      "config.mesh.ici='data=3,fsdp=1': ICI axes {'data': 3, 'fsdp': 1} multiply to 3, but there",
    ),
    # A missing path.
    ("spmd-train", [f"--config={missing}", f"--workdir={tmp / 'w'}"], f"no such file {missing!r}"),
    ("spmd-plan", [f"--config={missing}", "--topology=v5p-8"], f"no such file {missing!r}"),
    ("spmd-mesh", [f"--config={missing}"], f"no such file {missing!r}"),
    (
      "spmd-train",
      ["--mode=eval", f"--workdir={empty}"],
      f"--workdir={empty} has no config.json",
    ),
    (
      "spmd-sample",
      [f"--workdir={tmp / 'nothing'}", "--prompt=x"],
      f"--workdir={tmp / 'nothing'} has no config.json",
    ),
    (
      "spmd-export",
      [f"--workdir={empty}", f"--checkpoint={tmp / 'nothing'}"],
      f"no checkpoint in {tmp / 'nothing'}: it does not exist",
    ),
    (
      "spmd-launch",
      ["local", "--num-processes", "1", "--", str(tmp / "nothing" / "prog")],
      f"'{tmp / 'nothing' / 'prog'}' (after --) is not a program",
    ),
    (
      "spmd-launch",
      ["slurm", "--nodes", "1", "--script", str(tmp / "nothing" / "job.sbatch"), "--", "true"],
      f"--script={tmp / 'nothing' / 'job.sbatch'}: No such file or directory",
    ),
  ]


def _run(command: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  return subprocess.run(
    [str(BIN / command), *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
  )


def _run_cases(command: str, cases: list[list[str]], cwd: Path) -> list[SimpleNamespace]:
  """Each argument list of `cases` run as `command` (forked from one process): exit, stderr."""
  out = cwd / f"cases_{command}"
  out.mkdir()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  worker = [sys.executable, "-m", "tests.workers.console_script_cases", command, str(out)]
  done = subprocess.run(
    [*worker, json.dumps(cases)], capture_output=True, text=True, timeout=240, cwd=cwd, env=env
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return [
    SimpleNamespace(
      returncode=int((out / f"{k}.code").read_text()), stderr=(out / f"{k}.err").read_text()
    )
    for k in range(len(cases))
  ]


def _flags_of(help_text: str) -> set[str]:
  return set(FLAG.findall(help_text))


def test_each_command_answers_bad_input_with_one_line_and_exit_2(tmp_path):
  cases = _cases(tmp_path)
  by_command = {c: [args for command, args, _ in cases if command == c] for c in HELP}
  with ThreadPoolExecutor(max_workers=4) as pool:
    helps = dict(zip(HELP, pool.map(lambda c: _run(c, HELP[c], tmp_path), HELP)))
    ran = dict(zip(HELP, pool.map(lambda c: _run_cases(c, by_command[c], tmp_path), HELP)))
  done = [ran[command].pop(0) for command, _, _ in cases]  # back in the cases' order
  for command, shown in helps.items():
    assert _flags_of(shown.stdout + shown.stderr), (command, shown)  # absl exits 1 on help
  problems = []
  for (command, args, expected), result in zip(cases, done):
    ours = [line for line in result.stderr.splitlines() if line.startswith(f"{command}:")]
    help_text = helps[command].stdout + helps[command].stderr
    named = set(FLAG.findall(ours[-1])) if ours else set()
    # A flag the command lacks may appear only as what the user typed.
    typed = {a.lstrip("-").split("=", 1)[0].split(".", 1)[0] for a in args if a[:2] == "--"}
    unknown = named - _flags_of(help_text) - typed
    if (
      result.returncode != 2
      or "Traceback" in result.stderr
      or len(ours) != 1
      or ours[-1] != result.stderr.strip().splitlines()[-1]
      or expected not in ours[-1]
      or unknown
    ):
      problems.append(
        f"{command} {' '.join(args)}: exit {result.returncode}, flags it lacks {unknown}, "
        f"stderr:\n{result.stderr[-3000:]}"
      )
  assert not problems, "\n\n".join(problems)


def test_spmd_sample_and_export_never_advise_a_config_flag_they_lack(tmp_path):
  empty = tmp_path / "run"
  empty.mkdir()
  (empty / "checkpoints" / "5").mkdir(parents=True)  # a step, but no config.json
  result = _run("spmd-sample", [f"--workdir={empty}", "--prompt=x"], tmp_path)
  assert result.returncode == 2 and "--config" not in result.stderr, result.stderr


def test_spmd_launch_does_not_restart_a_job_that_failed_on_a_user_error(tmp_path):
  """Two real spmd-train processes, each with a misspelt config key: one attempt only."""
  result = _run(
    "spmd-launch",
    [
      *("local", "--num-processes", "2", "--max-restarts", "2", "--grace", "5", "--"),
      *(str(BIN / "spmd-train"), f"--config={CONFIG}", f"--workdir={tmp_path / 'w'}"),
      "--config.train.warmup_step=3",
    ],
    tmp_path,
  )
  out = result.stdout + result.stderr
  assert result.returncode == 2, out
  for p in (0, 1):  # each process said it once, in one line: one attempt
    said = [line for line in out.splitlines() if line.startswith(f"[p{p}] spmd-train:")]
    assert len(said) == 1 and "(did you mean 'warmup_steps'?)" in said[0], out
  assert "not restarting" in out and "restarting (" not in out, out
  assert "Traceback" not in out, out


def test_a_checkpoint_of_another_model_stops_every_process_with_exit_2_and_no_restart(tmp_path):
  """A user error met after the processes have joined (restoring): each says it once, exits 2."""
  common = [f"--config={CONFIG}", f"--workdir={tmp_path / 'w'}", "--config.eval_every=0"]
  common += ["--config.checkpoint.every=2", "--config.log_every=2"]
  first = _run("spmd-train", [*common, "--config.train.steps=2"], tmp_path)
  assert first.returncode == 0, first.stderr[-3000:]
  result = _run(
    "spmd-launch",
    [
      *("local", "--num-processes", "2", "--max-restarts", "1", "--timeout", "240", "--"),
      *(str(BIN / "spmd-train"), *common, "--config.train.steps=4"),
      "--config.model.hidden_sizes=(32,)",  # another model than the checkpoint's
    ],
    tmp_path,
  )
  out = result.stdout + result.stderr
  assert result.returncode == 2, out[-4000:]
  for p in (0, 1):
    said = [line for line in out.splitlines() if line.startswith(f"[p{p}] spmd-train:")]
    assert len(said) == 1 and "holds a different model" in said[0], out[-4000:]
  assert "not restarting" in out and "Traceback" not in out, out[-4000:]
