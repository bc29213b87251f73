"""`paths.copy_tree`: a file is the same only when it is known to be a copy; copies are whole.

The cases a size check got wrong: a file changed to the same size (a task's
code edited in place) stayed stale on every host; a whole file was read into
memory; and a copy cut short left a partial file under the final name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from etils import epath

from trainers import paths

ROOT = Path(__file__).resolve().parents[1]
LONG_AGO = 1_000_000_000.0  # a time far enough back that the file is settled


def _write(path: Path, text: str, settled: bool = True) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  if settled:  # written a while ago, as a task's file or a dataset is
    os.utime(path, (LONG_AGO, LONG_AGO))


def test_a_file_changed_to_the_same_size_is_copied_again_locally(tmp_path):
  src, dst = tmp_path / "src", tmp_path / "dst"
  _write(src / "code" / "task.py", "LR = 0.1\n")
  _write(src / "data.bin", "x" * 100)
  assert paths.copy_tree(epath.Path(src), epath.Path(dst)) == 2
  assert paths.copy_tree(epath.Path(src), epath.Path(dst)) == 0  # nothing changed
  _write(src / "code" / "task.py", "LR = 0.5\n", settled=False)  # same size, just now
  assert paths.copy_tree(epath.Path(src), epath.Path(dst)) == 1
  assert (dst / "code" / "task.py").read_text() == "LR = 0.5\n"
  os.utime(src / "code" / "task.py", (LONG_AGO + 5, LONG_AGO + 5))  # the edit, settled
  _write(src / "code" / "task.py", "LR = 0.9\n", settled=False)
  os.utime(src / "code" / "task.py", (LONG_AGO + 9, LONG_AGO + 9))  # a later edit, settled
  assert paths.copy_tree(epath.Path(src), epath.Path(dst)) == 1
  assert paths.copy_tree(epath.Path(src), epath.Path(dst)) == 0
  assert (dst / "code" / "task.py").read_text() == "LR = 0.9\n"
  # A copy whose target was changed under it is copied again, too.
  (dst / "data.bin").write_text("y" * 100)
  assert paths.copy_tree(epath.Path(src), epath.Path(dst)) == 1
  assert (dst / "data.bin").read_text() == "x" * 100
  # The record and any partial file are the copy's own, never data.
  assert sorted(p.name for p in dst.iterdir()) == [paths.COPIES, "code", "data.bin"]


def test_a_copy_staged_back_to_where_it_came_from_is_not_copied_again(tmp_path):
  """Process 0 prepares data locally and uploads it; each host stages it back."""
  prepared, shared = tmp_path / "prepared", tmp_path / "shared"
  _write(prepared / "train.array_record", "r" * 1000)
  assert paths.copy_tree(epath.Path(prepared), epath.Path(shared)) == 1
  assert paths.copy_tree(epath.Path(shared), epath.Path(prepared)) == 0
  assert paths.copy_tree(epath.Path(prepared), epath.Path(shared)) == 0


@pytest.mark.multiprocess  # a process of its own (or the storage emulator)
def test_a_killed_copy_leaves_no_file_under_the_final_name(tmp_path):
  """The kernel kills the copying process mid-write (SIGXFSZ past a file-size limit)."""
  src, dst = tmp_path / "src", tmp_path / "dst"
  src.mkdir()
  with open(src / "big.bin", "wb") as f:
    f.write(os.urandom(1 << 20) * 32)  # 32 MiB
  limit = 8 << 20
  code = textwrap.dedent(f"""
    import resource, signal
    from etils import epath
    from trainers import paths
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's kill, please
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    paths.copy_tree(epath.Path({str(src)!r}), epath.Path({str(dst)!r}))
  """)
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == -signal.SIGXFSZ, (done.returncode, done.stderr)
  assert not (dst / "big.bin").exists(), "a partial file under the final name"
  assert [p.name for p in dst.iterdir() if p.name.startswith(".big.bin.partial-")]
  # The next copy is whole, and never copies the partial file left behind.
  assert paths.copy_tree(epath.Path(src), epath.Path(dst)) == 1
  assert (dst / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
  assert paths.copy_tree(epath.Path(dst), epath.Path(tmp_path / "again")) == 1


@pytest.mark.multiprocess  # a process of its own (or the storage emulator)
def test_a_copy_streams_a_file_larger_than_its_memory_limit(tmp_path):
  src, dst = tmp_path / "src", tmp_path / "dst"
  src.mkdir()
  size = 160 << 20
  with open(src / "big.bin", "wb") as f:
    f.truncate(size)  # sparse: no disk for the source
  code = textwrap.dedent(f"""
    import resource
    from etils import epath
    from trainers import paths
    with open("/proc/self/status") as f:
      used = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    headroom = 64 << 20  # well under the file's size: a whole-file read cannot fit
    resource.setrlimit(resource.RLIMIT_AS, (used + headroom, used + headroom))
    print(paths.copy_tree(epath.Path({str(src)!r}), epath.Path({str(dst)!r})))
  """)
  env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
  )
  assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]
  assert (dst / "big.bin").stat().st_size == size


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """A GCS emulator's `gs://bucket`, for this test's processes."""

  from tests.gcs_emulator import serving

  with serving(tmp_path / "gcs", monkeypatch) as emulator:
    yield emulator


@pytest.mark.multiprocess  # a process of its own (or the storage emulator)
def test_a_file_changed_to_the_same_size_is_copied_again_to_and_from_cloud_storage(
  tmp_path, bucket
):
  local, staged = tmp_path / "local", tmp_path / "staged"
  remote = epath.Path("gs://bucket/run/code")
  _write(local / "task.py", "LR = 0.1\n")
  _write(local / "sub" / "util.py", "A = 1\n")
  # local -> gs://
  assert paths.copy_tree(epath.Path(local), remote) == 2
  assert paths.copy_tree(epath.Path(local), remote) == 0
  _write(local / "task.py", "LR = 0.5\n")
  os.utime(local / "task.py", (LONG_AGO + 5, LONG_AGO + 5))
  assert paths.copy_tree(epath.Path(local), remote) == 1
  assert (remote / "task.py").read_text() == "LR = 0.5\n"
  # gs:// -> local (what a host does with a run's code/)
  assert paths.copy_tree(remote, epath.Path(staged)) == 2
  assert paths.copy_tree(remote, epath.Path(staged)) == 0
  (remote / "task.py").write_text("LR = 0.9\n")  # a new run rewrites its code, same size
  assert paths.copy_tree(remote, epath.Path(staged)) == 1
  assert (staged / "task.py").read_text() == "LR = 0.9\n"
  # Only the files and the record: no partial objects left by the renames.
  assert bucket.objects() == [
    f"run/code/{paths.COPIES}",
    "run/code/sub/util.py",
    "run/code/task.py",
  ]


@pytest.mark.multiprocess
def test_a_copy_to_cloud_storage_killed_mid_upload_publishes_nothing(tmp_path, bucket):
  """The source is a pipe this test feeds: the copy is surely mid-upload when it is killed."""
  src = tmp_path / "src"
  src.mkdir()
  os.mkfifo(src / "big.bin")
  code = textwrap.dedent(f"""
    from etils import epath
    from trainers import paths
    paths.copy_tree(epath.Path({str(src)!r}), epath.Path("gs://bucket/data"))
  """)
  child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE)
  try:
    with open(src / "big.bin", "wb") as pipe:  # opens once the copy reads
      pipe.write(os.urandom(1 << 20) * 12)  # past gcsfs's 5 MiB upload blocks
      pipe.flush()
      child.kill()
    child.wait(timeout=60)
  finally:
    if child.poll() is None:
      child.kill()
      child.wait()
  assert child.returncode == -signal.SIGKILL
  assert bucket.objects() == [], bucket.objects()
