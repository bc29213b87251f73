"""Fault 12: a run whose workdir and data live on cloud storage (a local GCS emulator).

The README's pod commands use `--workdir=gs://...`. Here 2 processes x 2
devices train on `gs://bucket/run` with `data.dir=gs://bucket/data`, from a
working directory that must stay empty. Promise: the same end, bit for bit,
as the uninterrupted local reference run, across a kill -9 and a restart; a
step left without its commit marker (what a kill during a save leaves on an
object store, which cannot rename atomically) is skipped with a warning
naming it, never restored and never called damage.
"""

import json
import os
import re
import signal
import time

import pytest
from etils import epath

from tests.configs import train_tiny
from tests.faults import harness
from tests.faults.conftest import injections
from tests.gcs_emulator import GcsEmulator
from trainers.checkpoints.step_folders import COMMIT_MARKER

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
  """The coordinator is killed while a save is on its way to the store, and the last committed
  step loses its commit marker too: two unfinished steps, as a kill that lands during a
  save leaves under load. The restart names exactly the steps left unfinished, removes
  them, resumes from the last committed one and ends bit-identical to the reference."""
  reference = harness.reference_hash(data, tmp_path_factory)
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  # A workdir no other test uses: the freeze and the kill find processes by their --workdir.
  workdir = epath.Path("gs://bucket/run-killed")
  bucket_dir = gcs.root / "bucket" / "run-killed"
  env = {**gcs.env(), "SPMD_DATA_CACHE": str(tmp_path / "host_cache")}
  os.environ.update(gcs.env())  # this process reads the bucket too
  # With the loss curve: the run's end writes it to the store too.
  flags = (*harness.long_run(), "--config.data.dir=gs://bucket/data", "--config.loss_curve=True")

  first = harness.start(data, workdir, *flags, env=env, cwd=cwd)
  try:
    try:
      harness.wait_for(lambda: len(committed(workdir)) >= 3, 300, "three committed checkpoints")
      in_flight, running = _freeze_during_a_save(first, workdir, bucket_dir, 2)
    except TimeoutError as e:
      raise AssertionError(first.output[-5000:]) from e
    # The coordinator: it alone writes commit markers, so the step in flight stays unfinished.
    os.kill(running[0], signal.SIGKILL)
    _signal_all(running.values(), signal.SIGCONT)
    first_code = first.launcher.wait(timeout=120)
  finally:
    first.kill()
  assert first_code != 0 and "killed by SIGKILL" in first.output, first.output
  # As if a second kill had come during the save before: its commit marker never written.
  saved = committed(workdir)
  (workdir / "checkpoints" / str(saved[-1]) / COMMIT_MARKER).unlink()
  before = saved[-2]
  unfinished = _unfinished(workdir)
  assert {saved[-1], in_flight} <= unfinished, (saved, in_flight, unfinished)

  second = harness.start(data, workdir, *flags, env=env, cwd=cwd)
  code = second.wait(600)
  out = second.output
  resumed = harness.resumed_steps(first.output + out)
  removed = _removed(out, workdir)  # what the restart named as unfinished and removed
  left_here = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))
  ok = (
    code == 0
    and resumed == [before]
    and removed == unfinished
    and not _unfinished(workdir)
    and harness.param_hash(out) == reference
    and not left_here
  )
  record(
    "12. gs:// workdir and data: kill -9 during a save, last save left unfinished, restart",
    1,
    int(ok),
    None,
    0 if ok else None,
  )
  assert code == 0, out
  assert removed == unfinished, (removed, unfinished, out)
  assert not _unfinished(workdir), out  # each one removed, then saved again in full
  assert resumed == [before], (resumed, out)
  assert harness.param_hash(out) == reference, out
  assert (workdir / "data").exists() is False  # data.dir is its own: gs://bucket/data
  assert epath.Path("gs://bucket/data").exists() and (workdir / "metrics.jsonl").exists()
  assert (workdir / "loss.png").exists() and (workdir / "summary.json").exists()
  assert list((workdir / "tensorboard").iterdir()), "no TensorBoard events on the bucket"
  assert not left_here, left_here


def _unfinished(workdir: epath.Path) -> set[int]:
  """The step folders on the store without a commit marker."""
  root = workdir / "checkpoints"
  steps = {int(p.name) for p in root.iterdir() if p.name.isdigit()}
  return steps - set(committed(workdir))


# When the store goes away: both once met only under load, so each is forced. The end of
# the run: process 0 alone writes the loss curve and summary.json after the others are done
# (its loss curve held up here so the store can go first).
STORE_LOSSES = ("during an async save", "while process 0 writes the run's summary")


@pytest.mark.parametrize("when", STORE_LOSSES)
def test_a_store_unreachable_during_an_async_save_is_named_and_the_run_resumes(
  data, tmp_path, tmp_path_factory, record, gcs, when
):
  reference = harness.reference_hash(data, tmp_path_factory)
  at_the_end = when == STORE_LOSSES[1]
  # A workdir of its own: the freeze finds a job's processes by their --workdir, and the
  # two cases may run at once on two pytest workers (each its own emulator, one machine).
  run = "run-end" if at_the_end else "run-save"
  workdir = epath.Path(f"gs://bucket/{run}")
  bucket_dir = gcs.root / "bucket" / run
  env = {**gcs.env(), "SPMD_DATA_CACHE": str(tmp_path / "host_cache")}
  os.environ.update(gcs.env())
  # At the end only the last save matters (the store goes after it), so that run saves there
  # alone; the other needs saves on the way, one of them caught in flight. With the loss
  # curve: the run's end writes it to the store too.
  every = harness.STEPS if at_the_end else harness.EVERY
  flags = (
    *harness.long_run(every),
    "--config.data.dir=gs://bucket/data",
    "--config.loss_curve=True",
  )
  budget = ("--config.checkpoint.save_timeout_s=15", "--config.train.step_timeout_s=60")
  entry, delay = (
    ("tests.workers.slow_chief_end_train", "20") if at_the_end else (harness.ENTRIES[0], "0")
  )

  # Process 0 is held up until the store is gone (at most `delay`), then writes to it.
  store_gone = tmp_path / "store_gone"
  held = dict(SPMD_TEST_END_DELAY_S=delay, SPMD_TEST_END_RELEASE_FILE=str(store_gone))
  first = harness.start(data, workdir, *flags, *budget, env=dict(env, **held), entry=entry)
  try:
    if at_the_end:  # the last save committed and the metrics closed: process 0 is held up
      harness.wait_for(lambda: _final_metrics_written(bucket_dir), 300, "the end of the run", 0.01)
      last_committed = committed(workdir)[-1]
      gcs.stop()
      store_gone.touch()
    else:  # frozen while a save is on its way, so the store goes away under it
      harness.wait_for(lambda: len(committed(workdir)) >= 2, 300, "two committed checkpoints")
      _, running = _freeze_during_a_save(first, workdir, bucket_dir, 2)
      last_committed = committed(workdir)[-1]
      gcs.stop()
      _signal_all(running.values(), signal.SIGCONT)
    started = time.monotonic()
    code = first.launcher.wait(timeout=300)
    took = time.monotonic() - started
  finally:
    first.kill()
  out = first.output
  named = any(
    what in out
    for what in (
      f"checkpoint save to {workdir}/checkpoints failed",  # the store's error
      f"checkpoint save to {workdir}/checkpoints did not finish",  # or its silence
      f"writing {workdir}/metrics.jsonl failed",  # or the metrics' upload came first
      f"writing {workdir}/tensorboard/",  # or the events' upload at the final eval
      f"writing the loss curve and summary.json to {workdir} failed",  # or the end's
    )
  )
  gcs.start()
  # The resumed run saves at its end alone: the resume and its end are the claim, and every
  # save on the way is a round of uploads to the emulator (the interval compiles nothing).
  resume_flags = (*harness.long_run(every=harness.STEPS), "--config.data.dir=gs://bucket/data")
  second = harness.start(data, workdir, *resume_flags, env=env)
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
  record(f"12. checkpoint store unreachable {when}", 1, int(ok), took, None)
  assert code != 0 and named, out
  assert resumed_code == 0, second.output
  assert resumed and resumed[0] >= last_committed, (resumed, last_committed)
  assert harness.param_hash(second.output) == reference, second.output


def _final_metrics_written(bucket_dir) -> bool:
  """The run's last step is committed and its final eval is in metrics.jsonl on the store."""
  last = bucket_dir / "checkpoints" / str(harness.STEPS) / COMMIT_MARKER
  metrics = bucket_dir / "metrics.jsonl"
  if not (last.exists() and metrics.exists()):
    return False
  for line in metrics.read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:  # the emulator may be midway through writing the object
      return False
    if row.get("step") == harness.STEPS and "eval_loss" in row:
      return True
  return False


def _uncommitted_step(bucket_dir, resumed: int) -> int | None:
  """A step after `resumed` the job is saving on the store: files, no commit marker yet."""
  root = bucket_dir / "checkpoints"
  if not root.is_dir():
    return None
  for folder in root.iterdir():
    if folder.name.isdigit() and int(folder.name) > resumed:
      if not (folder / COMMIT_MARKER).exists() and any(p.is_file() for p in folder.rglob("*")):
        return int(folder.name)
  return None


def _freeze_during_a_save(
  job: harness.Job, workdir: epath.Path, bucket_dir, processes: int, after: int | None = None
) -> tuple[int, dict[int, int]]:
  """Stops every process of `job` (SIGSTOP) while a step after `after` (default: the last
  committed) is being saved: its files on the store, its commit marker not. Returns that
  step and {process id: pid}; the caller kills and continues them."""
  for _ in range(20):  # a tiny save can commit between the look and the freeze
    since = max(committed(workdir), default=0) if after is None else after
    step = harness.wait_for(
      lambda s=since: _uncommitted_step(bucket_dir, s), 300, "a save in flight", 0.005
    )
    running = harness.pids(workdir)
    _signal_all(running.values(), signal.SIGSTOP)
    time.sleep(0.3)  # an upload already sent (the commit marker's) lands meanwhile
    marker = bucket_dir / "checkpoints" / str(step) / COMMIT_MARKER
    if len(running) == processes and not marker.exists():
      return step, running
    _signal_all(running.values(), signal.SIGCONT)
  raise AssertionError(f"no save was caught in flight in 20 tries\n{job.output[-5000:]}")


def _signal_all(pids, sig) -> None:
  for pid in pids:
    try:
      os.kill(pid, sig)
    except ProcessLookupError:
      pass


def test_4_hosts_on_gs_killed_mid_save_agree_on_what_to_remove_at_every_restart(
  data, tmp_path, record, gcs
):
  """4 processes save every step to gs://; a process is killed during a save, and again in
  each restart. Every restart must start cleanly: process 0 alone judges the step folders
  and removes the cut-short one the harness wrote, the others act on its answer (they once
  listed the store themselves, while orbax's own clean-up deleted on process 0: a barrier
  timeout or a second delete of the same folder). CI: one kill; `make faults`: five."""
  kills = injections(1, 5)
  workdir = epath.Path("gs://bucket/hosts4")
  bucket_dir = gcs.root / "bucket" / "hosts4"
  os.environ.update(gcs.env())
  # Each kill catches the first save after the step the job resumed from, so a few steps a
  # kill are room enough; and a few after the last, for the restart to save and finish.
  steps = 4 + 4 * kills
  flags = (
    # train_tiny's own schedule where it is long enough (CI's one kill), stopped at
    # `steps`: one 4 x 1 step for the whole test, compiled by its first attempt.
    f"--config.train.steps={max(steps, train_tiny.get_config().train.steps)}",
    f"--config.train.stop_at_step={steps}",
    "--config.checkpoint.every=1",
    "--config.checkpoint.keep=2",
    "--config.eval_every=0",
  )
  job = harness.start(
    data, workdir, *flags, num_processes=4, devices=1, max_restarts=kills, env=gcs.env()
  )
  caught, resumed = [], 0
  try:
    for kill in range(kills):
      step, running = _freeze_during_a_save(job, workdir, bucket_dir, 4, after=resumed)
      caught.append(step)
      os.kill(running[kill % 4], signal.SIGKILL)  # the coordinator too, in turn
      _signal_all(running.values(), signal.SIGCONT)
      harness.gone_after(list(running.values()), 60)
      try:
        harness.wait_for(
          lambda k=kill: len(harness.resumed_steps(job.output)) > k, 300, "the next attempt"
        )
      except TimeoutError as e:  # a restart that hangs (hosts that disagree, in a barrier)
        failures = [line for line in job.output.splitlines() if "spmd-launch: attempt" in line]
        raise AssertionError(
          f"{e}; after kill {kill + 1}: {failures}\n{job.output[-8000:]}"
        ) from None
      resumed = harness.resumed_steps(job.output)[-1]
    code = job.launcher.wait(timeout=300)
  finally:
    job.kill()
  out = job.output
  failed = out.count("spmd-launch: attempt ")  # one line per failed attempt: the kills, no more
  restarts = re.split(r"spmd-launch: attempt \d+ failed", out)[1:]
  # After each kill: the cut-short step named and removed, an earlier one resumed.
  found = [(step, _removed(text, workdir), _resumed(text)) for step, text in zip(caught, restarts)]
  bad = [
    (step, removed, r) for step, removed, r in found if step not in removed or not 0 <= r < step
  ]
  ok = code == 0 and failed == kills and not bad
  record(
    "12. gs:// on 4 processes: kill -9 during a save, restart, repeatedly", kills, int(ok) * kills
  )
  assert code == 0 and failed == kills, out[-20000:]
  assert not bad, (bad, out[-20000:])


def _removed(text: str, workdir: epath.Path) -> set[int]:
  """The steps a restart named as cut short and removed."""
  where = re.escape(str(workdir / "checkpoints"))
  named = re.findall(rf"checkpoint steps \[([0-9, ]+)\] in {where} were never finished", text)
  return {int(s) for found in named for s in found.split(",")}


def _resumed(text: str) -> int:
  found = re.search(r"; state from (?:checkpoint step (\d+)|fresh init)", text)
  return int(found.group(1) or 0) if found else -1
