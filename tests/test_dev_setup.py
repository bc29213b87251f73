"""The development machine's own commands: what the Makefile and .gitignore promise a contributor."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.multiprocess  # each test runs git or make


def test_tpu_wheels_folder_is_git_ignored():
  """`benchmarks/tpu_setup.sh --download` fills .whl-tpu/ with wheels; `git add -A` must not take them."""
  result = subprocess.run(
    ["git", "check-ignore", "--no-index", "-q", ".whl-tpu/jax-0.10.2-py3-none-any.whl"],
    cwd=ROOT,
    timeout=30,
  )
  assert result.returncode == 0, ".whl-tpu/ is not ignored by .gitignore"


def test_make_test_tpu_skips_with_its_reason_on_a_machine_without_a_tpu():
  """On a development machine `make test-tpu` runs the venv's python, not the system python3 without JAX."""
  venv_python = ROOT / ".venv" / "bin" / "python"
  if not venv_python.exists():
    pytest.skip("no .venv here: `make test` creates it")
  env = {k: v for k, v in os.environ.items() if k not in ("TPU_PYTHON", "MAKEFLAGS", "MAKELEVEL")}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(
    ["make", "--no-print-directory", "test-tpu"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-3000:]
  assert "No module named" not in out
  assert "needs a TPU" in out and " skipped" in out, out[-3000:]
