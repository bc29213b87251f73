"""Fault 11: the launch layer. Nothing outside this host reaches a local job's coordinator,
and shell metacharacters in run names, paths, arguments and environment values arrive as
plain text on every launch path (local, TPU over ssh, Kubernetes, SLURM), never run.
"""

import ast
import json
import os
import subprocess
import sys

import pytest

from launch.slurm import sbatch_script
from tests.fake_tpu import ECHO_ARGV, fake_tpu
from tests.multiprocess import ROOT, run_worker
from tests.test_launch_k8s import run_pods, write_manifest

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]

PY = sys.executable


def evil(where) -> list[str]:
  """Arguments that would create files under `where` if any shell ever ran them."""
  return [
    f"--run-name=x; touch {where}/pwned1",
    f"$(touch {where}/pwned2)",
    f"`touch {where}/pwned3`",
    f"--workdir={where}/run && touch {where}/pwned4",
    'it\'s "quoted" \\ $HOME * ~ | > <',
    "two\nlines",
    "",
  ]


@pytest.fixture
def fake(tmp_path):
  yield from fake_tpu(tmp_path)


def test_the_local_coordinator_listens_on_loopback_and_refuses_other_addresses(record):
  result = run_worker("init_worker", num_processes=2, devices_per_process=3)
  out = result.processes[0].output
  ok = (
    result.ok
    and "coordinator listens on loopback only" in out
    and "tried " in out
    and all("devices 6 local 3 processes 2" in p.output for p in result.processes)
  )
  tried = int(out.split("tried ", 1)[1].split()[0]) if "tried " in out else 0
  record("11. local coordinator reached from this host's other addresses", tried, tried * ok)
  assert ok, result.report()


def test_spmd_launch_local_passes_arguments_paths_and_environment_as_text(tmp_path, record):
  code = (
    "import json, os, sys; print('ARGV', json.dumps(sys.argv[1:])); "
    "print('ENV', json.dumps(os.environ['RUN_NAME']))"
  )
  log_dir = tmp_path / "logs; touch pwned5 $(touch pwned6)"
  env_value = f"x; touch {tmp_path}/pwned7 $(touch {tmp_path}/pwned8)"
  args = evil(tmp_path)
  done = subprocess.run(
    [
      PY,
      "-m",
      "launch.launch_cli",
      "local",
      "-n",
      "2",
      "--log-dir",
      str(log_dir),
      "--",
      PY,
      "-c",
      code,
      *args,
    ],
    env={**os.environ, "RUN_NAME": env_value, "PYTHONPATH": str(ROOT)},
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=60,
  )
  ok = (
    done.returncode == 0
    and all(f"[p{p}] ARGV {json.dumps(args)}" in done.stdout for p in range(2))
    and all(f"[p{p}] ENV {json.dumps(env_value)}" in done.stdout for p in range(2))
    and (log_dir / "process_1.log").exists()
    and not list(tmp_path.rglob("pwned*"))
  )
  record("11. metacharacters through spmd-launch local", 1, int(ok))
  assert ok, done.stdout + done.stderr


def test_spmd_launch_tpu_passes_arguments_and_environment_as_text(fake, tmp_path, record):
  args = evil(tmp_path)
  env_value = f"x; touch {tmp_path}/pwned7 $(touch {tmp_path}/pwned8)"
  done = fake.launch(
    "--no-copy",
    "--remote-dir",
    ".",
    "--env",
    f"RUN_NAME={env_value}",
    "--",
    PY,
    "-c",
    ECHO_ARGV,
    *args,
  )
  verbatim = all(
    f"[w{w}] ARGV {json.dumps(args)}" in done.stdout
    and f"[w{w}] ENV {json.dumps(env_value)}" in done.stdout
    for w in range(2)
  )
  created = list(tmp_path.glob("pwned*")) + list(fake.root.rglob("pwned*"))
  record(
    "11. metacharacters through spmd-launch tpu (remote shell over ssh)",
    1,
    int(done.returncode == 0 and verbatim and not created),
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert verbatim, done.stdout
  assert not created, created


def test_spmd_launch_k8s_passes_command_and_environment_verbatim(tmp_path, record):
  args = [*evil(tmp_path), "$(SPMD_NUM_PROCESSES) $$"]
  code = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['EXTRA']]))"
  manifest = write_manifest(
    tmp_path,
    *("--num-hosts", "1", "--env", "EXTRA=$(SPMD_NUM_PROCESSES) $$"),
    command=(PY, "-c", code, *args),
  )
  ((_, _, rc, out),) = run_pods(manifest, timeout_s=30)
  ok = (
    rc == 0
    and json.loads(out) == [args, "$(SPMD_NUM_PROCESSES) $$"]
    and not list(tmp_path.rglob("pwned*"))
  )
  record("11. metacharacters through spmd-launch k8s (a pod's command)", 1, int(ok))
  assert ok, out


def test_spmd_launch_slurm_quotes_everything_in_its_script(tmp_path, record):
  args = evil(tmp_path)
  script = sbatch_script(
    ["printf", "%s\\n", *args], nodes=1, job_name=f"x; touch {tmp_path}/pwned9"
  )
  srun = "srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 "
  done = subprocess.run(
    ["bash", "-c", script.replace(srun, "")],
    capture_output=True,
    text=True,
    timeout=30,
  )
  ok = (
    done.returncode == 0
    and done.stdout == "".join(f"{a}\n" for a in args)
    and f"#SBATCH --job-name='x; touch {tmp_path}/pwned9'" in script
    and not list(tmp_path.rglob("pwned*"))
  )
  record("11. metacharacters through spmd-launch slurm (the sbatch script)", 1, int(ok))
  assert ok, (script, done.stdout, done.stderr)


def test_no_code_path_starts_a_shell_on_its_own():
  """spmd, trainers and launch never call os.system/os.popen or subprocess with shell=True.

  The shells that do run (ssh's remote command, the sbatch script, a pod's
  wrapper) get quoted text, tested above.
  """
  found = []
  for path in sorted(p for d in ("spmd", "trainers", "launch") for p in (ROOT / d).rglob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if not isinstance(node, ast.Call):
        continue
      name = ast.unparse(node.func)
      if name in ("os.system", "os.popen", "os.execl", "os.spawnl"):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
      for kw in node.keywords:
        if kw.arg == "shell" and not (
          isinstance(kw.value, ast.Constant) and kw.value.value is False
        ):
          found.append(f"{path.relative_to(ROOT)}:{node.lineno} shell=")
  assert not found, found
