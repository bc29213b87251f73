"""Fault 9: damaged, incomplete or foreign checkpoints, restored in this process.

The checkpoints are copies of the reference run's (2 processes x 2 devices);
each test resumes from them here, on 1 process x 8 devices, with
`stop_at_step` at the saved step so nothing trains. Promise: a loud error
naming the step, directory and what is wrong, or, for the same model saved
on another mesh, a restore onto this one that is exact; never a silent
partial restore; nothing in the code path unpickles anything.
"""

import errno
import pickle
import re
import shutil
import sys

import jax
import orbax.checkpoint as ocp
import pytest

from tests.configs import train_tiny
from tests.faults import harness
from tests.faults.conftest import injections
from trainers.checkpoints import step_folders
from trainers.checkpoints.damage import CheckpointError
from trainers.checkpoints.restore import restore_or_init
from trainers.checkpoints.step_folders import COMMIT_MARKER
from trainers.run import train as train_lib
from trainers.run.train import train_and_evaluate

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]

_UNPICKLED: list | None = None  # while a restore is watched: what was unpickled


def _audit(event, args):
  if _UNPICKLED is not None and event == "pickle.find_class":
    _UNPICKLED.append(args)


sys.addaudithook(_audit)  # audit hooks cannot be removed; this one only records while watching


def watch_restores(monkeypatch) -> list:
  """Records any unpickling inside `restore_or_init`: pickle's entry points,
  and every class any unpickler asks for (an audit event). Returns the record."""
  seen: list = []
  restore = restore_or_init
  originals = {name: getattr(pickle, name) for name in ("load", "loads", "Unpickler")}

  def refuse(name):
    def call(*args, **kwargs):
      seen.append(f"pickle.{name}")
      return originals[name](*args, **kwargs)

    return call

  def watched(*args, **kwargs):
    global _UNPICKLED
    _UNPICKLED = seen
    for name in originals:
      setattr(pickle, name, refuse(name))
    try:
      return restore(*args, **kwargs)
    finally:
      _UNPICKLED = None
      for name, original in originals.items():
        setattr(pickle, name, original)

  monkeypatch.setattr(train_lib, "restore_or_init", watched)  # where the run calls it
  return seen


def config(data, step, **model):
  c = train_tiny.get_config()
  c.data.source, c.data.dir = data["source"], data["dir"]
  c.compilation_cache_dir = data["cache"]
  c.train.steps = harness.STEPS
  c.train.stop_at_step = step  # resume at the saved step: restore only, no training
  c.eval_every = 0
  c.sample_tokens = 0
  for key, value in model.items():
    c.model[key] = value
  return c


@pytest.fixture
def saved(data, tmp_path_factory, tmp_path):
  """A workdir holding a copy of the reference run's checkpoints: (workdir, last step, hash)."""
  reference, ref_dir = harness.reference_run(data, tmp_path_factory)
  workdir = tmp_path / "run"
  shutil.copytree(ref_dir / "checkpoints", workdir / "checkpoints")
  return workdir, max(harness.committed_steps(workdir)), reference


def test_another_mesh_restores_exactly_a_leftover_temp_dir_is_ignored_nothing_unpickled(
  data, saved, record, monkeypatch
):
  workdir, step, reference = saved
  leftover = workdir / "checkpoints" / f"{step + 2}.orbax-checkpoint-tmp-1234567"
  leftover.mkdir()
  (leftover / "half_written").write_text("x")
  step_folders.record_save(workdir / "checkpoints", step + 2)  # as the run does before a save
  # Another tool's (not in the run's ledger), off the save schedule: kept.
  foreign = workdir / "checkpoints" / f"{step + 1}.orbax-checkpoint-tmp-99"
  foreign.mkdir()
  (foreign / "theirs").write_text("x")
  unpickled = watch_restores(monkeypatch)
  summary = train_and_evaluate(config(data, step), str(workdir))
  exact = (
    summary["resumed_from"] == f"checkpoint step {step}" and summary["param_hash"] == reference
  )
  headers = {bytes([0x80, protocol]) for protocol in range(2, 6)}
  pickles = [p for p in workdir.rglob("*") if p.is_file() and p.read_bytes()[:2] in headers] + list(
    workdir.rglob("*.pkl")
  )
  record("9. checkpoint of another mesh and process count (2 x 2 -> 1 x 8)", 1, int(exact))
  record("9. leftover temporary directory", 1, int(exact and not leftover.exists()))
  record("9. another tool's temporary directory (kept)", 1, int((foreign / "theirs").exists()))
  record("9. restore unpickles nothing", 1, int(not unpickled and not pickles))
  assert summary["resumed_from"] == f"checkpoint step {step}", summary["resumed_from"]
  assert summary["param_hash"] == reference  # bit for bit, on another layout
  assert not leftover.exists()  # removed, never restored
  assert (foreign / "theirs").exists()  # not the run's: never deleted
  # Restored from the target's shardings alone: no per-array sharding file is
  # written (it cost a quarter of each save's CPU), none is needed.
  assert not list((workdir / "checkpoints").rglob("_sharding")), "orbax _sharding file written"
  assert not unpickled, unpickled
  assert not pickles, pickles


def _data_files(step_dir):
  return sorted(
    (p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
    key=lambda p: -p.stat().st_size,
  )


def test_a_truncated_array_file_is_a_loud_error_never_a_partial_restore(
  data, saved, record, tmp_path
):
  """CI truncates the main data file; the full run each array file in turn.

  Orbax keeps per-process files a merged checkpoint no longer reads: a
  truncated one of those may restore the exact state, which is fine. What
  must never happen is a restore of different values.
  """
  workdir, step, reference = saved
  files = _data_files(workdir / "checkpoints" / str(step))
  files = [f.relative_to(workdir) for f in files][: injections(1, len(files))]
  errors, exact, problems = 0, 0, []
  for i, name in enumerate(files):
    copy = tmp_path / f"damaged{i}"
    shutil.copytree(workdir, copy)
    target = copy / name
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    try:
      summary = train_and_evaluate(config(data, step), str(copy))
    except CheckpointError as e:
      message = str(e)
      if f"checkpoint step {step} in {copy / 'checkpoints'}" in message and "damaged" in message:
        errors += 1
      else:
        problems.append(f"{name}: unclear error {message}")
    else:
      if summary["param_hash"] == reference:
        exact += 1
      else:
        problems.append(f"{name}: a truncated file restored different values")
  record("9. truncated array file", len(files), errors + exact)
  assert not problems, problems
  assert errors >= 1, "no truncation was noticed"


def test_a_step_without_commit_marker_is_skipped_never_restored_never_called_damage(
  data, saved, record, caplog
):
  """What a kill during a save leaves on an object store (no atomic rename): a step
  directory without orbax's commit marker. It is named, skipped and removed; the run
  resumes from the step before and saves that step again."""
  workdir, step, _ = saved
  committed = [s for s in harness.committed_steps(workdir) if s < step]
  (workdir / "checkpoints" / str(step) / COMMIT_MARKER).unlink()
  with caplog.at_level("WARNING"):
    summary = train_and_evaluate(config(data, step), str(workdir))
  warned = [r.getMessage() for r in caplog.records if "never finished" in r.getMessage()]
  ok = (
    summary["resumed_from"] == f"checkpoint step {max(committed)}"
    and len(warned) == 1
    and f"[{step}]" in warned[0]
    and (workdir / "checkpoints" / str(step) / COMMIT_MARKER).exists()  # saved again, whole
  )
  record("9. step without commit marker (a kill mid-save on an object store)", 1, int(ok))
  assert summary["resumed_from"] == f"checkpoint step {max(committed)}", summary["resumed_from"]
  assert len(warned) == 1 and f"[{step}]" in warned[0], warned
  assert (workdir / "checkpoints" / str(step) / COMMIT_MARKER).exists()


def test_a_checkpoint_of_another_model_is_a_loud_error_naming_the_arrays(data, saved, record):
  workdir, step, _ = saved
  with pytest.raises(CheckpointError) as raised:
    train_and_evaluate(config(data, step, d_model=64), str(workdir))
  message = str(raised.value)
  ok = (
    f"checkpoint step {step} in {workdir / 'checkpoints'} holds a different model" in message
    and bool(
      re.search(r"params\.\S+: saved \(.*32.*\) float32, this config needs \(.*64.*\)", message)
    )
  )
  record("9. checkpoint of another model", 1, int(ok))
  assert ok, message


TROUBLE = {
  "permission denied": lambda: PermissionError(errno.EACCES, "Permission denied", "ckpt"),
  "network (tensorstore)": lambda: ValueError(
    "Error reading local file: UNAVAILABLE: Connection reset by peer"
  ),
  "I/O error": lambda: OSError(errno.EIO, "Input/output error"),
  "out of memory (XLA)": lambda: jax.errors.JaxRuntimeError(
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB"
  ),
  "out of host memory": lambda: MemoryError(),
}


@pytest.mark.parametrize("kind", list(TROUBLE))
def test_storage_or_machine_trouble_is_raised_as_what_it_is_never_called_damage(
  data, saved, record, monkeypatch, kind
):
  """A good checkpoint that cannot be read *now*: the error keeps its type, names the step
  and path, and advises nothing (moving the step away would throw a good one away)."""
  workdir, step, _ = saved
  error = TROUBLE[kind]()

  def restore(self, *args, **kwargs):
    raise error

  monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
  with pytest.raises(type(error)) as raised:
    train_and_evaluate(config(data, step), str(workdir))
  notes = "\n".join(getattr(raised.value, "__notes__", []))
  text = f"{raised.value}\n{notes}"
  ok = (
    not isinstance(raised.value, CheckpointError)
    and f"checkpoint step {step} in {workdir / 'checkpoints'}" in notes
    and "move" not in text.lower()
    and "damaged" not in text.lower()
  )
  record(f"9. {kind} while restoring: raised as such, no advice", 1, int(ok))
  assert not isinstance(raised.value, CheckpointError), text
  assert f"checkpoint step {step} in {workdir / 'checkpoints'}" in notes, text
  assert "move" not in text.lower() and "damaged" not in text.lower(), text
