"""Fault 12: a run whose workdir and data live on cloud storage (a local GCS emulator).

The README's pod commands use `--workdir=gs://...`. Here 2 processes x 2
devices train on `gs://bucket/run` with `data.dir=gs://bucket/data`, from a
working directory that must stay empty. Promise: the same end, bit for bit,
as the uninterrupted local reference run, across a kill -9 and a restart; a
step left without its commit marker (what a kill during a save leaves on an
object store, which cannot rename atomically) is skipped with a warning
naming it, never restored and never called damage.
"""

import os
import signal
import time

import pytest
from etils import epath

from tests.faults import harness
from tests.gcs_emulator import GcsEmulator
from trainers.checkpoint import COMMIT_MARKER

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults, pytest.mark.timeout(900)]


@pytest.fixture
def gcs(tmp_path):
  emulator = GcsEmulator(tmp_path / "gcs")
  emulator.start()
  yield emulator
  emulator.stop()


def committed(workdir: epath.Path) -> list[int]:
  root = workdir / "checkpoints"
  if not root.exists():
    return []
  return sorted(
    int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / COMMIT_MARKER).exists()
  )


def test_a_gs_run_killed_mid_save_resumes_bit_identical_and_writes_nothing_locally(
  data, tmp_path, tmp_path_factory, record, gcs
):
  reference = harness.reference_hash(data, tmp_path_factory)
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  workdir = epath.Path("gs://bucket/run")
  env = {**gcs.env(), "SPMD_DATA_CACHE": str(tmp_path / "host_cache")}
  os.environ.update(gcs.env())  # this process reads the bucket too
  flags = (*harness.long_run(), "--config.data.dir=gs://bucket/data")

  first = harness.start(data, workdir, *flags, env=env, cwd=cwd)
  try:
    try:
      harness.wait_for(lambda: len(committed(workdir)) >= 3, 300, "three committed checkpoints")
    except TimeoutError as e:
      raise AssertionError(first.output[-5000:]) from e
    running = harness.wait_for(
      lambda: len(found := harness.pids(workdir)) == 2 and found, 60, "both processes"
    )
    os.kill(running[1], signal.SIGKILL)
    first_code = first.launcher.wait(timeout=120)
  finally:
    first.kill()
  assert first_code != 0 and "killed by SIGKILL" in first.output, first.output
  # As if the kill had come during the last save: its commit marker never written.
  saved = committed(workdir)
  unfinished, before = saved[-1], saved[-2]
  (workdir / "checkpoints" / str(unfinished) / COMMIT_MARKER).unlink()

  second = harness.start(data, workdir, *flags, env=env, cwd=cwd)
  code = second.wait(600)
  out = second.output
  resumed = harness.resumed_steps(first.output + out)
  skipped = f"checkpoint steps [{unfinished}] in {workdir / 'checkpoints'} were never finished"
  left_here = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))
  ok = (
    code == 0
    and resumed == [before]
    and skipped in out
    and harness.param_hash(out) == reference
    and not left_here
  )
  record(
    "12. gs:// workdir and data: kill -9, last save left unfinished, restart",
    1,
    int(ok),
    None,
    0 if ok else None,
  )
  assert code == 0, out
  assert skipped in out, out
  assert resumed == [before], (resumed, out)
  assert harness.param_hash(out) == reference, out
  assert (workdir / "data").exists() is False  # data.dir is its own: gs://bucket/data
  assert epath.Path("gs://bucket/data").exists() and (workdir / "metrics.jsonl").exists()
  assert (workdir / "loss.png").exists() and (workdir / "summary.json").exists()
  assert list((workdir / "tensorboard").iterdir()), "no TensorBoard events on the bucket"
  assert not left_here, left_here


def test_a_store_unreachable_during_an_async_save_is_named_and_the_run_resumes(
  data, tmp_path, tmp_path_factory, record, gcs
):
  reference = harness.reference_hash(data, tmp_path_factory)
  workdir = epath.Path("gs://bucket/run")
  env = {**gcs.env(), "SPMD_DATA_CACHE": str(tmp_path / "host_cache")}
  os.environ.update(gcs.env())
  flags = (*harness.long_run(), "--config.data.dir=gs://bucket/data")
  budget = ("--config.checkpoint.save_timeout_s=15", "--config.train.step_timeout_s=60")

  first = harness.start(data, workdir, *flags, *budget, env=env)
  try:
    harness.wait_for(lambda: len(committed(workdir)) >= 2, 300, "two committed checkpoints")
    last_committed = committed(workdir)[-1]
    gcs.stop()  # the store goes away while the run saves every other step
    started = time.monotonic()
    code = first.launcher.wait(timeout=300)
    took = time.monotonic() - started
  finally:
    first.kill()
  out = first.output
  named = any(
    what in out
    for what in (
      "checkpoint save to gs://bucket/run/checkpoints failed",  # the store's error
      "checkpoint save to gs://bucket/run/checkpoints did not finish",  # or its silence
      "writing gs://bucket/run/metrics.jsonl failed",  # or the metrics' upload came first
    )
  )
  gcs.start()
  second = harness.start(data, workdir, *flags, env=env)
  resumed_code = second.wait(600)
  resumed = harness.resumed_steps(out + second.output)
  ok = (
    code != 0
    and named
    and resumed_code == 0
    and resumed
    and resumed[0] >= last_committed
    and harness.param_hash(second.output) == reference
  )
  record("12. checkpoint store unreachable during an async save", 1, int(ok), took, None)
  assert code != 0 and named, out
  assert resumed_code == 0, second.output
  assert resumed and resumed[0] >= last_committed, (resumed, last_committed)
  assert harness.param_hash(second.output) == reference, second.output
