"""A fake Cloud TPU for spmd-launch tpu tests: workers are directories on this machine.

tests/fakes/gcloud records every call and runs each `tpu-vm ssh --command` with
bash in the worker's own fake home, so the launcher's remote shell strings run
for real. Used by tests/test_launch_tpu.py and the launch-security fault test.
"""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.multiprocess import ROOT

FAKES = ROOT / "tests" / "fakes"
LAUNCHER = (sys.executable, "-m", "launch.launch_cli", "tpu", "--tpu", "pod")
ECHO_ARGV = (
  "import json, os, sys; print('ARGV', json.dumps(sys.argv[1:])); "
  "print('ENV', json.dumps(os.environ['RUN_NAME']))"
)


class FakeTpu:
  def __init__(self, tmp_path: Path):
    self.root = tmp_path / "tpu"
    self.root.mkdir()
    self.log = tmp_path / "gcloud.jsonl"
    self.env = dict(
      os.environ,
      PATH=f"{FAKES}{os.pathsep}{os.environ['PATH']}",
      FAKE_GCLOUD_LOG=str(self.log),
      FAKE_TPU_ROOT=str(self.root),
      FAKE_TPU_WORKERS="2",
      PYTHONPATH=str(ROOT),
      PYTHONUNBUFFERED="1",
      JAX_PLATFORMS="cpu",
      SPMD_CPU_DEVICES="2",
      SPMD_HEARTBEAT_TIMEOUT_S="5",
      SPMD_SHUTDOWN_TIMEOUT_S="5",
      SPMD_INIT_TIMEOUT_S="30",
    )
    for name in list(self.env):
      if name.startswith("MEGASCALE_") or name in (
        "SPMD_COORDINATOR_ADDRESS",
        "SPMD_COORDINATOR_BIND_ADDRESS",
        "SPMD_NUM_PROCESSES",
        "SPMD_PROCESS_ID",
      ):
        del self.env[name]

  def launch(self, *args: str, timeout: int = 90) -> subprocess.CompletedProcess:
    """`spmd-launch tpu --tpu pod --zone us-central2-b ARGS` as its own process, hard-limited."""
    return subprocess.run(
      ["timeout", "-k", "5", str(timeout), *LAUNCHER, "--zone", "us-central2-b", *args],
      env=self.env,
      cwd=ROOT,
      capture_output=True,
      text=True,
    )

  def calls(self) -> list[list[str]]:
    if not self.log.exists():
      return []
    return [json.loads(line) for line in self.log.read_text().splitlines()]

  def ssh_calls(self, worker: str) -> list[list[str]]:
    return [c for c in self.calls() if c[2:4] == ["tpu-vm", "ssh"] and f"--worker={worker}" in c]

  def home(self, node: str, worker: int) -> Path:
    return self.root / node / f"worker-{worker}"


def fake_tpu(tmp_path: Path) -> Iterator[FakeTpu]:
  """A fixture's body: the fake TPU, and whatever a failed test left running on it killed after."""
  tpu = FakeTpu(tmp_path)
  yield tpu
  for pgid in tpu.root.glob("*/worker-*/.spmd-launch/*.pgid"):
    try:
      os.killpg(int(pgid.read_text()), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass
