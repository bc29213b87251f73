"""spmd-launch tpu, through a fake gcloud whose TPU workers are directories on this machine.

tests/fakes/gcloud records every call and runs each `tpu-vm ssh --command` with
bash in the worker's own fake home, so the launcher's remote shell strings run
for real: the code copy, the JAX job across workers and slices, the kill of
every worker after one fails, and the quoting of what the user passed.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch import launch_cli
from launch.local import free_port
from tests.fake_tpu import ECHO_ARGV, LAUNCHER, fake_tpu
from tests.multiprocess import ROOT, WORKERS

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def fake(tmp_path):
  yield from fake_tpu(tmp_path)


def live_members(pgid: int) -> list[int]:
  """Processes of group `pgid` that are still running (zombies are done)."""
  members = []
  for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if int(fields[2]) == pgid and fields[0] != "Z":
      members.append(int(stat.parent.name))
  return members


def test_the_code_is_copied_and_a_two_worker_jax_job_forms(fake):
  done = fake.launch(
    "--coordinator-port",
    str(free_port()),
    "--install-command",
    "touch installed",
    "--env",
    "PYTHONPATH=.",  # the copied code, not this checkout
    "--timeout",
    "60",
    "--",
    sys.executable,
    "tests/workers/init_worker.py",
    "tpu",
  )
  out = done.stdout + done.stderr
  assert done.returncode == 0, out
  assert done.stdout.count("devices 4 local 2 processes 2") == 2, out
  assert "spmd-launch: all 2 workers exited 0" in done.stdout
  for w in range(2):
    code = fake.home("pod", w) / "spmd-harness"
    assert f"[w{w}] tpu process {w} slice 0 of 1 megascale - spmd from {code}\n" in done.stdout
    assert (code / "launch" / "tpu.py").read_text() == (ROOT / "launch" / "tpu.py").read_text()
    assert (code / "installed").exists()  # the install command ran in the code directory
    assert not (code / ".git").exists() and not list(code.rglob("__pycache__/*.py"))
    assert not list(fake.home("pod", w).glob("*.tar.gz"))  # unpacked, then removed
  calls = fake.calls()
  assert calls[0][:5] == ["compute", "tpus", "tpu-vm", "describe", "pod"]
  scp = [c for c in calls if c[2:4] == ["tpu-vm", "scp"]]
  assert len(scp) == 1 and "--worker=all" in scp[0] and scp[0][5].startswith("pod:~/")
  setup = [c[-2] for c in fake.ssh_calls("all")]
  assert len(setup) == 2 and "tar -xzf" in setup[0] and "touch installed" in setup[1]
  assert len(fake.ssh_calls("0")) == 1 and len(fake.ssh_calls("1")) == 1
  assert all(c[-1] == "--zone=us-central2-b" for c in calls)


def test_one_worker_failing_stops_the_job_on_every_worker(fake, tmp_path):
  ready = tmp_path / "worker-0-running"
  code = (
    "import os, pathlib, sys, time\n"
    "pathlib.Path('job.pgid').write_text(str(os.getpgrp()))\n"
    f"ready = pathlib.Path({str(ready)!r})\n"
    "if os.environ['SPMD_PROCESS_ID'] == '1':\n"
    "  deadline = time.time() + 20\n"
    "  while not ready.exists() and time.time() < deadline: time.sleep(0.05)\n"
    "  sys.exit(3)\n"
    "ready.touch()\n"
    "time.sleep(120)\n"
  )
  start = time.monotonic()
  done = fake.launch(
    "--no-copy", "--remote-dir", ".", "--grace", "1", "--", sys.executable, "-c", code
  )
  took = time.monotonic() - start
  out = done.stdout + done.stderr
  assert done.returncode == 1, out
  assert took < 30, out  # a hang bound: ~5 s here
  assert "worker 1 on pod failed first: exit code 3" in done.stderr
  assert "worker 0: exit code 143 (killed by SIGTERM) (stopped by the launcher)" in done.stderr
  kills = [c for c in fake.ssh_calls("all") if ".stop" in c[-2]]
  assert len(kills) == 1 and "kill -TERM" in kills[0][-2], fake.calls()
  groups = [int((fake.home("pod", w) / "job.pgid").read_text()) for w in range(2)]
  assert len(set(groups)) == 2 and os.getpgrp() not in groups  # each job in its own group
  deadline = time.monotonic() + 5
  while any(live_members(g) for g in groups) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not [live_members(g) for g in groups if live_members(g)]


def test_multislice_creates_the_queued_resource_and_runs_one_job_over_both_slices(fake):
  done = fake.launch(
    "--num-slices",
    "2",
    "--create",
    "--accelerator-type",
    "v4-16",
    "--runtime-version",
    "tpu-ubuntu2204-base",
    "--poll-interval",
    "0.1",
    "--no-copy",
    "--remote-dir",
    ".",
    "--coordinator-port",
    str(free_port()),
    "--timeout",
    "90",
    "--",
    sys.executable,
    str(WORKERS / "init_worker.py"),
    "tpu",
    timeout=120,
  )
  out = done.stdout + done.stderr
  assert done.returncode == 0, out
  assert done.stdout.count("devices 8 local 2 processes 4") == 4, out
  for s in range(2):
    for w in range(2):
      expected = f"[s{s}w{w}] tpu process {2 * s + w} slice {s} of 2 megascale 127.0.0.1:8080"
      assert expected in done.stdout, out
  calls = fake.calls()
  create = [c for c in calls if c[2:4] == ["queued-resources", "create"]]
  assert create == [
    [
      "compute",
      "tpus",
      "queued-resources",
      "create",
      "pod",
      "--accelerator-type=v4-16",
      "--runtime-version=tpu-ubuntu2204-base",
      "--node-count=2",
      "--node-prefix=pod",
      "--zone=us-central2-b",
    ]
  ]
  polls = [c for c in calls if c[2:4] == ["queued-resources", "describe"]]
  assert len(polls) == 2  # PROVISIONING, then ACTIVE
  described = [c[4] for c in calls if c[2:4] == ["tpu-vm", "describe"]]
  assert described == ["pod-0", "pod-1"]
  ssh = sorted((c[4], c[5]) for c in calls if c[2:4] == ["tpu-vm", "ssh"])
  assert ssh == [(f"pod-{s}", f"--worker={w}") for s in range(2) for w in range(2)]


def test_a_failed_queued_resource_is_reported_and_nothing_runs(fake):
  fake.env["FAKE_QR_FINAL_STATE"] = "FAILED"
  done = fake.launch("--num-slices", "2", "--poll-interval", "0.1", "--", "true", timeout=30)
  assert done.returncode == 1
  assert "describe failed (exit code 1)" in done.stderr and "NOT_FOUND" in done.stderr
  (fake.root / "queued-resources").mkdir()
  (fake.root / "queued-resources" / "pod.json").write_text('{"flags": {}, "describes": 1}')
  done = fake.launch("--num-slices", "2", "--poll-interval", "0.1", "--", "true", timeout=30)
  assert done.returncode == 1
  assert "queued resource 'pod' is FAILED" in done.stderr
  assert not [c for c in fake.calls() if "tpu-vm" in c]


def test_dry_run_prints_every_command_and_runs_none(fake, monkeypatch, capsys):
  for name in ("PATH", "FAKE_GCLOUD_LOG", "FAKE_TPU_ROOT"):
    monkeypatch.setenv(name, fake.env[name])
  args = ["tpu", "--tpu", "pod", "--zone", "z", "--project", "p", "--dry-run"]
  assert launch_cli.main([*args, "--", "true"]) == 2
  assert "give --num-workers" in capsys.readouterr().err
  evil = f"--name=x; touch {fake.root}/pwned"
  assert launch_cli.main([*args, "--num-workers", "2", "--install", "--", "spmd-train", evil]) == 0
  lines = capsys.readouterr().out.splitlines()
  commands = [line for line in lines if not line.startswith("#")]
  assert all(line.startswith("gcloud compute tpus ") for line in commands)
  assert all(line.endswith("--zone=z --project=p") for line in commands)
  assert "gcloud compute tpus tpu-vm describe pod --format=json --zone=z --project=p" in lines
  assert any(" tpu-vm scp " in line and "--worker=all" in line for line in commands)
  assert any("pip install -e" in line and "--worker=all" in line for line in commands)
  workers = [line for line in commands if "--worker=0" in line or "--worker=1" in line]
  assert len(workers) == 2 and "SPMD_PROCESS_ID=1" in workers[1]
  assert any(".stop" in line and "--worker=all" in line for line in commands)  # the kill
  assert not fake.log.exists()  # nothing ran

  # The printed line is what a run would issue, and pastes as is: run it on the fake.
  (fake.home("pod", 0) / "spmd-harness").mkdir(parents=True)  # --remote-dir, on worker 0
  program = shlex.join([sys.executable, "-c", ECHO_ARGV.replace("RUN_NAME", "SPMD_PROCESS_ID")])
  # spmd-train sits inside the single-quoted --command=...: quote the stand-in for that too.
  pasted = workers[0].replace("spmd-train", program.replace("'", "'\"'\"'"))
  done = subprocess.run(
    ["timeout", "-k", "5", "30", "bash", "-c", pasted],
    env=fake.env,
    capture_output=True,
    text=True,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert f'ARGV {json.dumps([evil])}\nENV "0"\n' == done.stdout
  assert not list(fake.root.rglob("pwned"))

  image = ["--image", "gcr.io/p/spmd:1", "--num-workers", "1", "--install"]
  assert launch_cli.main([*args, *image, "--", "spmd-train", "--workdir=/w"]) == 0
  out = capsys.readouterr().out
  assert " tpu-vm scp " not in out and "tar -xzf" not in out  # nothing to copy
  assert "--command=sudo docker pull gcr.io/p/spmd:1'" in out
  run = [line for line in out.splitlines() if "--worker=0" in line]
  assert len(run) == 1
  assert "sudo docker run --rm --privileged --net=host" in run[0]
  assert "--entrypoint=spmd-train" in run[0] and " -e SPMD_PROCESS_ID=0 " in run[0]
  assert "gcr.io/p/spmd:1 --workdir=/w" in run[0]


def test_sigterm_to_the_launcher_lets_the_job_save_on_every_worker(fake, tmp_path):
  code = (
    "import signal, sys, time\n"
    "def save(*_):\n"
    "  print('saving', flush=True); time.sleep(0.3); print('saved', flush=True)\n"
    "  sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, save)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
  )
  logs = tmp_path / "logs"
  # `timeout` passes the test's SIGTERM on and SIGKILLs `-k` seconds later: the
  # job's save and stop, on two workers' busy cores, must fit in that. It took
  # longer than a 5 s `-k` there, so `-k` is the launcher's own --term-grace and some.
  launcher = subprocess.Popen(
    [
      *("timeout", "-k", "30", "60", *LAUNCHER, "--zone", "z", "--no-copy", "--remote-dir", "."),
      *("--term-grace", "20", "--log-dir", str(logs), "--", sys.executable, "-c", code),
    ],
    env=fake.env,
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  deadline = time.monotonic() + 30
  files = [logs / f"process_{i}.log" for i in range(2)]
  while time.monotonic() < deadline and launcher.poll() is None:
    if all(f.exists() and "ready" in f.read_text() for f in files):
      break
    time.sleep(0.05)
  launcher.send_signal(signal.SIGTERM)  # timeout passes it on to the launcher
  out, _ = launcher.communicate(timeout=60)
  assert launcher.returncode == 0, out
  assert "stopped by a signal; all 2 workers exited 0 (saved)" in out
  assert [f.read_text().splitlines()[-1] for f in files] == ["saved", "saved"]


def test_a_task_folder_outside_the_checkout_is_shipped_with_the_code(fake, tmp_path):
  folder = tmp_path / "elsewhere" / "my_task"
  folder.mkdir(parents=True)
  (folder / "config.py").write_text("# a user's config\n")
  (folder / "task.py").write_text("# a user's task\n")
  outside = fake.launch("--timeout", "30", "--", "true", f"--config={folder / 'config.py'}")
  assert outside.returncode == 2, outside.stdout + outside.stderr
  assert f"--ship {folder} and --config=ship/my_task/config.py" in outside.stderr, outside.stderr
  assert not fake.calls()  # refused before any gcloud call
  done = fake.launch(
    "--ship",
    str(folder),
    "--timeout",
    "30",
    "--",
    sys.executable,
    "-c",
    "import sys; print(open(sys.argv[1][9:].replace('config', 'task')).read())",
    "--config=ship/my_task/config.py",
  )
  out = done.stdout + done.stderr
  assert done.returncode == 0, out
  assert out.count("# a user's task") == 2, out  # both workers read it from their copy
  for w in range(2):
    shipped = fake.home("pod", w) / "spmd-harness" / "ship" / "my_task"
    assert (shipped / "config.py").read_text() == "# a user's config\n"


def test_a_128_worker_job_holds_few_threads_and_one_descriptor_per_running_worker(
  fake, tmp_path, monkeypatch, capsys
):
  # The launcher runs in this process, so a sampler thread sees its threads and descriptors.
  workers = 128
  for name in ("PATH", "FAKE_GCLOUD_LOG", "FAKE_TPU_ROOT"):
    monkeypatch.setenv(name, fake.env[name])
  monkeypatch.setenv("FAKE_TPU_WORKERS", str(workers))
  logs = tmp_path / "logs"

  def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))

  threads_before, fds_before = threading.active_count(), open_fds()
  peak = {"threads": 0, "fds": 0}
  done = threading.Event()

  def sample() -> None:
    while not done.is_set():
      peak["threads"] = max(peak["threads"], threading.active_count())
      peak["fds"] = max(peak["fds"], open_fds())
      time.sleep(0.005)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  start = time.monotonic()
  try:
    code = launch_cli.main(
      [
        *("tpu", "--tpu", "pod", "--zone", "z", "--no-copy", "--remote-dir", "."),
        *("--timeout", "90", "--log-dir", str(logs), "--", "echo", "hi"),
      ]
    )
  finally:
    done.set()
    sampler.join()
  took = time.monotonic() - start
  threads = peak["threads"] - threads_before - 1  # the sampler is not the launcher's
  fds = peak["fds"] - fds_before
  with capsys.disabled():
    print(f"\n{workers} workers: {took:.1f} s, peak +{threads} threads, +{fds} descriptors")
  out = capsys.readouterr().out
  assert code == 0, out
  assert f"spmd-launch: all {workers} workers exited 0" in out
  assert all(f"[w{w}] hi\n" in out for w in range(workers)), out
  assert all((logs / f"process_{w}.log").read_text() == "hi\n" for w in range(workers))
  # Threads do not grow with the workers; descriptors grow by one pipe per running ssh.
  assert threads <= 4, (threads, fds)
  assert fds <= workers + 16, (threads, fds)
