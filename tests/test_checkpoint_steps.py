"""Step folders judged once (`trainers.checkpoints.step_folders`): committed, the harness's unfinished, foreign.

Folders another tool left in a checkpoint directory are never deleted: not at
start, not by `checkpoint.keep`'s rotation, not by a save; the run goes on
beside them, or stops with an error naming the folder where it would write
into one. The multi-host decision is tested on a GCS emulator with 4
processes in tests/faults/test_cloud_storage.py.
"""

import json

import jax.numpy as jnp
import pytest
from etils import epath

from tests.configs import train_tiny
from trainers.checkpoints import saved_run, step_folders
from trainers.checkpoints.damage import CheckpointError
from trainers.checkpoints.manager import make_manager
from trainers.checkpoints.restore import latest_committed_step
from trainers.checkpoints.saver import Saver
from trainers.checkpoints.step_folders import COMMIT_MARKER, LEDGER, ForeignStepError
from trainers.run.train import train_and_evaluate


def _folder(root: epath.Path, name: str, *files: str) -> epath.Path:
  path = root / name
  path.mkdir(parents=True)
  for f in files:
    (path / f).parent.mkdir(parents=True, exist_ok=True)
    (path / f).write_text("x")
  return path


def _ledger(root: epath.Path, *steps: int) -> None:
  (root / LEDGER).write_text(json.dumps({"steps": list(steps)}))


def _committed_harness_step(root: epath.Path, step: int) -> None:
  _folder(root, str(step), COMMIT_MARKER, "state/x", "data/x")


def test_each_kind_of_folder_is_judged_by_marker_ledger_and_items(tmp_path):
  root = epath.Path(tmp_path)
  _committed_harness_step(root, 2)  # in the ledger
  _committed_harness_step(root, 4)  # an earlier version's: no ledger entry, the harness's items
  _folder(root, "6", COMMIT_MARKER, "default/x")  # another tool's orbax checkpoint
  _folder(root, "8", "state/x")  # the ledger's, cut short: no marker
  _folder(root, "10.orbax-checkpoint-tmp", COMMIT_MARKER)  # killed between marker and rename
  _folder(root, "12", "state/x")  # no marker, not in the ledger
  _folder(root, "14.orbax-checkpoint-tmp-99", "x")  # another tool's orbax temporary
  (root / "16").write_text("a file")  # step-like, not a folder
  _folder(root, "007", "x")  # not a name orbax gives a step: not step-like
  _folder(root, "metadata", "x")
  _ledger(root, 2, 8, 10)
  steps = step_folders.list_steps(root)
  assert steps.committed == (2, 4)
  assert steps.unfinished == ("8", "10.orbax-checkpoint-tmp")
  assert steps.foreign == ("6", "12", "14.orbax-checkpoint-tmp-99", "16")
  assert steps.latest == 4
  assert steps.foreign_at(14) == ["14.orbax-checkpoint-tmp-99"]
  assert step_folders.StepDirs.from_json(json.loads(json.dumps(steps.to_json()))) == steps


def test_settle_removes_only_the_harness_s_unfinished_steps_and_rewrites_the_ledger(tmp_path):
  root = epath.Path(tmp_path)
  _committed_harness_step(root, 2)
  _folder(root, "3", "foreign.bin")
  _folder(root, "4", "state/x")
  _folder(root, "6.orbax-checkpoint-tmp", "state/x")
  _ledger(root, 2, 4, 6, 40)  # 40: gone already
  steps = step_folders.settle(root)
  assert steps.unfinished == ("4", "6.orbax-checkpoint-tmp") and steps.foreign == ("3",)
  assert sorted(p.name for p in root.iterdir()) == ["2", "3", LEDGER]
  assert step_folders.read_ledger(root) == {2}
  assert (root / "3" / "foreign.bin").exists()


def test_no_ledger_means_nothing_is_the_harness_s_to_delete(tmp_path):
  root = epath.Path(tmp_path)
  _folder(root, "1", "foreign.bin")
  _folder(root, "5.orbax-checkpoint-tmp", "x")
  steps = step_folders.settle(root)
  assert steps.committed == () and steps.unfinished == ()
  assert steps.foreign == ("1", "5.orbax-checkpoint-tmp")
  assert sorted(p.name for p in root.iterdir()) == ["1", "5.orbax-checkpoint-tmp"]
  (root / LEDGER).write_text("{not json")  # unreadable: counts as empty, the safe side
  assert step_folders.settle(root).foreign == ("1", "5.orbax-checkpoint-tmp")


def test_the_ledger_holds_the_step_about_to_be_saved_and_what_is_still_there(tmp_path):
  root = epath.Path(tmp_path)
  _committed_harness_step(root, 2)
  _ledger(root, 1, 2)  # 1 was rotated away since
  # 3: in flight, nothing of it listed yet (an object store lists a folder once a file
  # has landed); it stays, or a kill before its commit would leave a "foreign" folder.
  step_folders.record_save(root, 4, saving=[2, 3])
  assert step_folders.read_ledger(root) == {2, 3, 4}
  _folder(root, "3", "state.bin")  # its first file lands; the kill comes before the commit
  assert step_folders.list_steps(root).unfinished == ("3",)
  assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_save_schedule_into_a_foreign_folder_is_an_error_at_start(tmp_path):
  root = epath.Path(tmp_path)
  _committed_harness_step(root, 2)
  _ledger(root, 2)
  _folder(root, "1", "foreign.bin")  # before the resumed step: never written to
  _folder(root, "5", "other.txt")  # not on the schedule
  make_manager(str(root), every=2, keep=1).close()
  _folder(root, "6", "other.txt")  # on the schedule
  with pytest.raises(ForeignStepError) as raised:
    make_manager(str(root), every=2, keep=1)
  message = str(raised.value)
  assert f"{root / '6'} is not this run's" in message and "every 2 steps" in message
  assert f"Move it out of {root}, or use another --workdir" in message
  assert (root / "6" / "other.txt").exists() and (root / "1" / "foreign.bin").exists()


def _state():
  return {"w": jnp.arange(4.0)}


def test_saves_past_keep_rotate_the_run_s_steps_and_never_a_foreign_folder(tmp_path):
  root = epath.Path(tmp_path)
  foreign = {"1": "foreign.bin", "3": "half/written.bin", "7": "other.txt", "13": "x.txt"}
  for name, f in foreign.items():
    _folder(root, name, f)
  _folder(root, "5", COMMIT_MARKER, "default/x")  # another tool's committed orbax step
  saver = Saver(make_manager(str(root), every=2, keep=1))
  try:
    for step in (2, 4, 6, 8, 10):
      assert saver.save(step, _state(), {"position": step})
      saver.wait()
    # Off the schedule (a preemption's save, say): refused on every host alike.
    with pytest.raises(ForeignStepError, match=r"/13 is not this run's .* the save of step 13"):
      saver.save(13, _state(), {})
  finally:
    saver.close()
  for name, f in foreign.items():
    assert (root / name / f).exists(), name
  assert (root / "5" / COMMIT_MARKER).exists()
  assert step_folders.list_steps(root).committed == (10,)
  assert not step_folders.read_ledger(root) & {1, 3, 5, 7, 13}  # never taken for the run's
  reopened = make_manager(str(root), every=2, keep=1)
  assert reopened.all_steps() == [10] and latest_committed_step(reopened) == 10
  reopened.close()


@pytest.fixture(scope="module")
def data(training_corpus):
  return training_corpus


def _tiny(data, steps: int, every: int, keep: int):
  config = train_tiny.get_config()
  config.data.source, config.data.dir = data["source"], data["dir"]
  config.compilation_cache_dir = data["cache"]
  config.eval_every = 0
  config.sample_tokens = 0
  config.train.steps = steps
  config.checkpoint.every, config.checkpoint.keep = every, keep
  return config


@pytest.mark.slow
def test_a_run_beside_another_tool_s_step_folders_keeps_them_all(data, tmp_path):
  """Another tool's step-like folders in the workdir: the run trains, saves past `keep`,
  resumes, and every one of them is still there, untouched."""
  workdir = epath.Path(tmp_path) / "run"
  root = workdir / "checkpoints"
  foreign = {
    "1": "foreign.bin",
    "7": "other.txt",
    "3": "state/unfinished.bin",  # digit-named, no commit marker
    "9.orbax-checkpoint-tmp-5": "x",  # another tool's orbax temporary
  }
  for name, f in foreign.items():
    _folder(root, name, f)
  summary = train_and_evaluate(_tiny(data, steps=8, every=2, keep=1), str(workdir))
  assert summary["steps"] == 8
  again = train_and_evaluate(_tiny(data, steps=12, every=2, keep=1), str(workdir))
  assert again["resumed_from"] == "checkpoint step 8"
  for name, f in foreign.items():
    assert (root / name / f).read_text() == "x", name
  steps = step_folders.list_steps(root)
  assert steps.committed == (12,) and steps.unfinished == ()
  assert saved_run.find_checkpoint(workdir).step == 12
  with pytest.raises(CheckpointError, match="was not written by this harness"):
    saved_run.find_checkpoint(workdir, step=7)


def test_a_run_that_would_save_into_another_tool_s_folder_stops_before_training(data, tmp_path):
  workdir = epath.Path(tmp_path) / "run"
  _folder(workdir / "checkpoints", "4", "other.txt")
  with pytest.raises(ForeignStepError) as raised:
    train_and_evaluate(_tiny(data, steps=8, every=2, keep=1), str(workdir))
  assert f"{workdir / 'checkpoints' / '4'} is not this run's" in str(raised.value)
  assert "use another --workdir" in str(raised.value)
  assert (workdir / "checkpoints" / "4" / "other.txt").read_text() == "x"
  assert not (workdir / "metrics.jsonl").exists()  # nothing trained
