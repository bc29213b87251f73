"""spmd-launch local: N processes, fail-fast, timeouts, and what it reports."""

import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from launch import allocator, launch_cli, local, processes
from launch.processes import OutputReader, popen

pytestmark = pytest.mark.multiprocess  # every test starts processes

PY = sys.executable


def test_every_process_gets_its_environment():
  code = (
    "import os; print(os.environ['SPMD_PROCESS_ID'], os.environ['SPMD_NUM_PROCESSES'], "
    "os.environ['SPMD_COORDINATOR_ADDRESS'], os.environ['SPMD_COORDINATOR_BIND_ADDRESS'], "
    "os.environ['SPMD_CPU_DEVICES'])"
  )
  result = local.run_local([PY, "-c", code], num_processes=3, devices_per_process=2, echo=False)
  assert result.ok, result.report()
  lines = [p.output.split() for p in result.processes]
  assert [line[:2] for line in lines] == [["0", "3"], ["1", "3"], ["2", "3"]]
  addresses = {line[2] for line in lines}
  assert len(addresses) == 1 and addresses.pop().startswith("127.0.0.1:")
  assert all(line[2] == line[3] and line[4] == "2" for line in lines)  # bound to loopback


def test_fail_fast_stops_the_others_and_names_the_first_failure():
  code = (
    "import sys, time, os\nif os.environ['SPMD_PROCESS_ID'] == '1': sys.exit(3)\ntime.sleep(120)"
  )
  start = time.monotonic()
  result = local.run_local([PY, "-c", code], num_processes=3, grace_s=1, echo=False)
  assert time.monotonic() - start < 60  # a hang bound, not a performance figure
  assert not result.ok and result.first_failure == 1
  assert "process 1 failed first: exit code 3" in result.summary()
  assert result.processes[0].returncode == -9 and result.processes[0].killed_by_launcher
  assert "stopped by the launcher" in result.summary()


def test_a_process_that_stopped_for_its_peer_is_not_named_when_both_end_between_two_polls():
  """Process 0 exits 87 ("another process failed first") as process 1 exits 1: on a
  busy machine the launcher can see both at its next poll, and names process 1."""
  done = [subprocess.Popen([PY, "-c", f"import sys; sys.exit({code})"]) for code in (87, 1)]
  for proc in done:
    proc.wait()  # both have ended before the launcher looks
  outcome = processes.watch(done, 1, 60, None, on_kill=lambda: 0.0)
  assert outcome.first_failure == 1


def test_a_killed_process_is_named_with_its_signal():
  code = (
    "import os, signal, time\nif os.environ['SPMD_PROCESS_ID'] == '0': "
    "os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(120)"
  )
  result = local.run_local([PY, "-c", code], num_processes=2, grace_s=1, echo=False)
  assert result.first_failure == 0
  assert "process 0 failed first: killed by SIGKILL" in result.summary()


def test_processes_that_ignore_sigterm_are_still_stopped():
  # JAX catches SIGTERM for preemption; the launcher must not rely on it.
  code = (
    "import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if os.environ['SPMD_PROCESS_ID'] == '1': sys.exit(1)\ntime.sleep(120)"
  )
  result = local.run_local([PY, "-c", code], num_processes=2, grace_s=1, echo=False)
  assert result.first_failure == 1 and result.processes[0].returncode == -9


def test_the_job_time_limit_kills_everything():
  result = local.run_local(
    [PY, "-c", "import time; time.sleep(120)"], num_processes=2, timeout_s=2, grace_s=1, echo=False
  )
  assert result.timed_out and not result.ok
  assert all(p.returncode is not None and p.returncode != 0 for p in result.processes)
  assert "ran past its time limit" in result.summary()


@pytest.mark.skipif(not shutil.which("timeout"), reason="needs timeout (coreutils)")
def test_a_job_has_no_time_limit_unless_given_one(capsys):
  # Each process names its parent: `timeout` when it runs under the job's time limit.
  parent = ["sh", "-c", "cat /proc/$PPID/comm"]
  assert launch_cli.main(["local", "-n", "2", "--no-pin-cpus", "--", *parent]) == 0
  out = capsys.readouterr().out
  lines = [line for line in out.splitlines() if line.startswith("[p")]
  assert len(lines) == 2 and not [line for line in lines if line.endswith(" timeout")], out
  assert (
    launch_cli.main(["local", "-n", "2", "--no-pin-cpus", "--timeout", "30", "--", *parent]) == 0
  )
  out = capsys.readouterr().out
  assert "[p0] timeout\n" in out and "[p1] timeout\n" in out, out
  unlimited = local.run_local(parent, 1, echo=False)
  assert unlimited.ok and unlimited.processes[0].output != "timeout\n", unlimited.report()
  with pytest.raises(ValueError, match="timeout_s=-1"):
    local.run_local(parent, 1, timeout_s=-1, echo=False)


def _fake_nvidia_smi(folder, gpus: int) -> str:
  """A PATH whose `nvidia-smi -L` lists `gpus` GPUs (one with MIG devices), and nothing else."""
  folder.mkdir()
  lines = [f"GPU {i}: NVIDIA H100 (UUID: GPU-{i:04d})" for i in range(gpus)]
  lines[-1:-1] = ["  MIG 1g.10gb     Device  0: (UUID: MIG-0000)"]
  script = folder / "nvidia-smi"
  script.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
  script.chmod(0o755)
  return str(folder)


def test_cuda_processes_get_their_own_gpus(tmp_path):
  def gpus(num_processes, per_process, base, **kwargs):
    envs = local.job_envs(num_processes, 1234, per_process, 5.0, base, "cuda", **kwargs)
    assert [e["SPMD_PROCESS_ID"] for e in envs] == [str(i) for i in range(num_processes)]
    return [e["CUDA_VISIBLE_DEVICES"] for e in envs]

  # From the CUDA_VISIBLE_DEVICES the launcher was given, as ids or UUIDs.
  assert gpus(2, 2, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == ["4,5", "6,7"]
  assert gpus(2, 1, {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == ["GPU-a", "GPU-b"]
  # Else from nvidia-smi -L (its MIG lines are not GPUs); else as many as the job needs.
  four = {"PATH": _fake_nvidia_smi(tmp_path / "four", 4)}
  assert gpus(4, 1, four) == ["0", "1", "2", "3"]
  assert gpus(3, 2, {"PATH": str(tmp_path)}) == ["0,1", "2,3", "4,5"]
  # Too few is an error naming the counts, unless sharing is asked for.
  two = {"PATH": _fake_nvidia_smi(tmp_path / "two", 2)}
  with pytest.raises(ValueError, match=r"2 processes x 2 GPUs need 4 GPUs, but 2 are visible"):
    gpus(2, 2, two)
  with pytest.raises(ValueError, match=r"devices_per_process=3 GPUs per process, but only 2"):
    gpus(1, 3, two, share_gpus=True)
  shared = local.job_envs(3, 1234, 1, 5.0, two, "cuda", share_gpus=True)
  assert [e["CUDA_VISIBLE_DEVICES"] for e in shared] == ["0", "1", "0"]
  assert {e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in shared} == {"0.375"}
  told = {**two, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # the user's own allocation rule
  mine = local.job_envs(3, 1234, 1, 5.0, told, "cuda", share_gpus=True)
  assert not [e for e in mine if "XLA_PYTHON_CLIENT_MEM_FRACTION" in e]
  # CPU hosts keep the environment's CUDA_VISIBLE_DEVICES, set or not.
  cpu = local.job_envs(2, 1234, 2, 5.0, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "cpu")
  assert [e["CUDA_VISIBLE_DEVICES"] for e in cpu] == ["4,5,6,7"] * 2
  assert not [e for e in local.job_envs(2, 1234, 2, 5.0, four, "cpu") if "CUDA_VISIBLE" in str(e)]


def test_the_cli_gives_cuda_processes_their_gpus_or_says_there_are_too_few(capsys, monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
  show = ["--no-pin-cpus", "--", "sh", "-c", "echo gpus $CUDA_VISIBLE_DEVICES"]
  assert launch_cli.main(["local", "-n", "3", "--platform", "cuda", *show]) == 0
  out = capsys.readouterr().out
  assert all(f"[p{i}] gpus {g}\n" in out for i, g in enumerate("235")), out
  argv = ["local", "-n", "2", "--devices-per-process", "2", "--platform", "cuda", *show]
  assert launch_cli.main(argv) == 2
  assert "need 4 GPUs, but 3 are visible" in capsys.readouterr().err
  assert launch_cli.main([*argv[:-5], "--share-gpus", *show]) == 0
  out = capsys.readouterr().out
  assert "[p0] gpus 2,3\n" in out and "[p1] gpus 5,2\n" in out, out


def test_cli_exit_code_and_prefixed_output(capsys):
  assert launch_cli.main(["local", "-n", "2", "--", PY, "-c", "print('hello')"]) == 0
  out = capsys.readouterr().out
  assert "[p0] hello" in out and "[p1] hello" in out
  code = "import os, sys; sys.exit(int(os.environ['SPMD_PROCESS_ID']) * 7)"
  assert (
    launch_cli.main(["local", "--num-processes", "2", "--grace", "1", "--", PY, "-c", code]) == 1
  )
  assert "process 1 failed first: exit code 7" in capsys.readouterr().err
  assert launch_cli.main(["nowhere"]) == 2  # a user error: one line, exit 2
  assert "invalid choice: 'nowhere'" in capsys.readouterr().err


def test_the_output_reader_splits_lines_as_text_mode_readline_did(tmp_path):
  # CRLF and lone CR, a bad byte, a character split across two reads, no final newline.
  data = b"a\r\nb\rc\xff\n" + "\u00e9".encode() * 40000 + b"\n" + b"tail"
  (tmp_path / "data").write_bytes(data)
  write = "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())"
  procs = [popen([PY, "-c", write, str(tmp_path / "data")]) for _ in range(3)]
  outputs = [[] for _ in procs]
  reader = OutputReader()
  for p, out in zip(procs, outputs):
    reader.add(p.stdout, out, echo=False, log_path=str(tmp_path / f"{p.pid}.log"))
  assert reader.join(timeout=30)
  expected = io.TextIOWrapper(io.BytesIO(data), procs[0].stdout.encoding, "replace").readlines()
  assert outputs == [expected] * 3
  assert all(p.wait() == 0 and p.stdout.closed for p in procs)
  assert (tmp_path / f"{procs[0].pid}.log").read_text(errors="replace") == "".join(expected)


def test_a_stalled_stdout_holds_up_no_child_and_loses_no_line(monkeypatch):
  """The launcher's stdout is not being read (a paused terminal, a pipe into a busy
  process): the children are still read as they print, so one that prints more than a
  pipe holds is not stopped mid-line, one that fails says why and exits at once, and
  every line is kept and echoed, in order, once stdout moves again."""

  class Stalled:  # a consumer that takes nothing until released
    def __init__(self):
      self.released, self.text = threading.Event(), []

    def write(self, text):
      self.released.wait()
      self.text.append(text)

    def flush(self):
      pass

  stdout = Stalled()
  monkeypatch.setattr(sys, "stdout", stdout)
  chatty = "for i in range(4000): print('%04d' % i + 'x' * 60)\nprint('done')"
  failing = "import sys; print('the checkpoint store is unreachable'); sys.exit(3)"
  procs = [popen([PY, "-c", chatty]), popen([PY, "-c", failing])]
  outputs = [[], []]
  reader = OutputReader()
  for i, p in enumerate(procs):
    reader.add(p.stdout, outputs[i], prefix=f"[p{i}]")
  try:
    codes = [p.wait(timeout=60) for p in procs]
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"a child is held up printing while the launcher's stdout is stalled: {e}")
  finally:
    stdout.released.set()
    for p in procs:
      p.kill()
  assert reader.join(timeout=30)
  assert codes == [0, 3]
  chatty_lines = [f"{i:04d}" + "x" * 60 + "\n" for i in range(4000)] + ["done\n"]
  assert outputs == [chatty_lines, ["the checkpoint store is unreachable\n"]]
  echoed = "".join(stdout.text).splitlines()
  assert "[p1] the checkpoint store is unreachable" in echoed
  assert [line for line in echoed if line.startswith("[p0]")] == [
    f"[p0] {line[:-1]}" for line in chatty_lines
  ]


def _launcher(*args):
  return subprocess.Popen(
    [PY, "-m", "launch.launch_cli", "local", *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )


def test_sigterm_to_the_launcher_is_forwarded_so_the_job_can_save(tmp_path):
  code = (
    "import signal, sys, time\n"
    "def save(*_):\n"
    "  print('saving', flush=True); time.sleep(0.5); print('saved', flush=True)\n"
    "  sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, save)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
  )
  launcher = _launcher(
    "--num-processes", "2", "--term-grace", "20", "--log-dir", str(tmp_path), "--", PY, "-c", code
  )
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline:
    logs = [tmp_path / f"process_{i}.log" for i in range(2)]
    if all(p.exists() and "ready" in p.read_text() for p in logs):
      break
    time.sleep(0.05)
  launcher.send_signal(signal.SIGTERM)
  out, _ = launcher.communicate(timeout=60)
  assert launcher.returncode == 0, out
  assert "stopped by a signal; all 2 processes exited 0 (saved)" in out
  for i in range(2):
    assert (tmp_path / f"process_{i}.log").read_text().splitlines()[-1] == "saved"


def test_max_restarts_runs_the_job_again_after_a_failure(tmp_path):
  marker = tmp_path / "attempted"
  code = (
    "import os, pathlib, sys\n"
    f"marker = pathlib.Path({str(marker)!r})\n"
    "if os.environ['SPMD_PROCESS_ID'] == '0' and not marker.exists():\n"
    "  marker.touch(); sys.exit(5)\n"
    "print('done', os.environ['SPMD_COORDINATOR_ADDRESS'])\n"
  )
  launcher = _launcher(
    "--num-processes", "2", "--max-restarts", "1", "--grace", "1", "--", PY, "-c", code
  )
  out, _ = launcher.communicate(timeout=60)
  assert launcher.returncode == 0, out
  assert "attempt 1 failed (process 0 failed first: exit code 5)" in out
  assert "2 attempts (1 restarts)" in out
  none = _launcher(
    "--num-processes", "1", "--max-restarts", "0", "--", PY, "-c", "import sys; sys.exit(3)"
  )
  out, _ = none.communicate(timeout=60)
  assert none.returncode == 1 and "process 0 failed first: exit code 3" in out


def _affinities(num_processes: int, **kwargs) -> list[list[int]]:
  """Each process's CPUs, as `taskset` reports them from inside the job."""
  result = local.run_local(
    ["sh", "-c", "taskset -cp $$"], num_processes, timeout_s=30, echo=False, **kwargs
  )
  assert result.ok, result.report()

  def cpus(taskset_line: str) -> list[int]:  # "pid 7's current affinity list: 0-2,5"
    out = []
    for part in taskset_line.rsplit(":", 1)[1].strip().split(","):
      first, _, last = part.partition("-")
      out += range(int(first), int(last or first) + 1)
    return out

  return [cpus(p.output.strip()) for p in result.processes]


@pytest.mark.skipif(not shutil.which("taskset"), reason="needs taskset (util-linux)")
def test_processes_get_disjoint_cpus_by_default_and_all_when_unpinned():
  every = sorted(os.sched_getaffinity(0))
  assert _affinities(2) == local.cpu_shares(2)  # the default: simulated hosts own their CPUs
  assert _affinities(2, pin_cpus=True) == local.cpu_shares(2)
  assert _affinities(2, pin_cpus=False) == [every, every]
  assert _affinities(1) == [every]  # one process keeps the whole machine


def test_a_refusing_taskset_means_unpinned_by_default_and_an_error_when_asked(
  tmp_path, monkeypatch
):
  # A sandbox that refuses sched_setaffinity: taskset exists but fails.
  fake = tmp_path / "taskset"
  fake.write_text("#!/bin/sh\necho 'taskset: failed to set pid 0 affinity' >&2\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  assert not local.taskset_works()
  every = str(sorted(os.sched_getaffinity(0)))
  show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
  result = local.run_local(show, 2, timeout_s=30, echo=False)
  assert result.ok, result.report()
  assert [p.output.strip() for p in result.processes] == [every, every]
  asked = local.run_local(show, 2, timeout_s=30, echo=False, pin_cpus=True)
  assert not asked.ok and "failed to set" in asked.report()


def test_tcmalloc_is_put_first_in_ld_preload_when_found(tmp_path):
  empty, lib = tmp_path / "empty", tmp_path / "lib"
  empty.mkdir()
  lib.mkdir()
  (lib / "libtcmalloc_minimal.so.4").write_bytes(b"")
  dirs = [str(empty), str(lib)]
  found = str(lib / "libtcmalloc_minimal.so.4")
  assert allocator.find_tcmalloc(dirs) == found
  assert allocator.with_tcmalloc({}, dirs)["LD_PRELOAD"] == found
  assert allocator.with_tcmalloc({"LD_PRELOAD": "/x.so"}, dirs)["LD_PRELOAD"] == f"{found} /x.so"
  # Opted out, already preloaded, or not installed: the environment is left alone.
  assert "LD_PRELOAD" not in allocator.with_tcmalloc({"SPMD_TCMALLOC": "0"}, dirs)
  mine = {"LD_PRELOAD": "/opt/libtcmalloc.so.4"}
  assert allocator.with_tcmalloc(mine, dirs) == mine
  assert allocator.with_tcmalloc({}, [str(empty)]) == {}


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="TCMalloc is not installed here")
def test_launched_processes_run_with_tcmalloc_unless_told_not_to():
  # The dynamic loader really maps it into the process (not just an env var).
  probe = ["sh", "-c", "grep -c tcmalloc /proc/self/maps || true"]
  on = local.run_local(probe, num_processes=2, timeout_s=30, echo=False)
  off = local.run_local(probe, num_processes=1, timeout_s=30, echo=False, tcmalloc=False)
  assert on.ok and off.ok, on.report() + off.report()
  assert [int(p.output) > 0 for p in on.processes] == [True, True]
  assert int(off.processes[0].output) == 0
