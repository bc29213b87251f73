"""Runs made once per pytest run and read by every test that needs them.

A training job is the costliest thing a test sets up. One that several tests
read (a straight run to compare with, to resume from, to sample) is built by
whichever xdist worker asks first, under a lock, in the run's session folder
(`tests/session_settings.py`); the other worker waits and reads it. Tests get
a copy (`copy_of`) and never change the original.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from launch.local import run_local
from tests import session_settings
from tests.data_fixtures import training_data
from tests.multiprocess import ROOT

_DONE = "shared_run.json"  # written last: its presence means the folder is whole


def shared_run(name: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
  """(folder, facts) of `name`, built by `build(folder) -> facts` once per pytest run.

  `facts` must be JSON (a run's losses, its parameter hash, its output). A
  build that fails leaves nothing behind, and the next test to ask builds again.
  """
  root = session_settings.session_dir() / "shared_runs"
  root.mkdir(parents=True, exist_ok=True)
  folder, done = root / name, root / name / _DONE
  with open(root / f"{name}.lock", "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      shutil.rmtree(folder, ignore_errors=True)
      folder.mkdir()
      facts = build(folder)
      done.write_text(json.dumps(facts))
  return folder, json.loads(done.read_text())


def copy_of(folder: Path, into: Path) -> Path:
  """A copy of a shared run's `folder` at `into` (which must not exist), for a test to change."""
  shutil.copytree(folder, into, symlinks=True)
  return into


def prepared_training_data() -> dict[str, str]:
  """The run's one training corpus (`training_data`), prepared as tests/configs/train_tiny.py reads it.

  Prepared here, before any job reads it, so that jobs on both workers find it
  built and only read it. A job whose data settings differ builds its own
  dataset beside it: give it a `training_data` of its own instead.
  """

  def build(folder: Path) -> dict:
    # Imported here: TFDS takes seconds to import, and most test modules never prepare data.
    from tests.configs import train_tiny
    from trainers.data.prepare.text_corpus import prepare_text_corpus
    from trainers.tasks.lm_data import CORPUS_RECORD_BYTES

    data = training_data(folder)
    prepare_text_corpus(
      data["dir"],
      data["source"],
      chunk_bytes=CORPUS_RECORD_BYTES,
      validation_percent=train_tiny.get_config().data.validation_percent,
    )
    return data

  return shared_run("training_data", build)[1]


# The straight llama_tiny run that tests/test_llama.py resumes and
# tests/test_sample.py samples: 40 steps on 2 processes x 1 device, saved at
# 20 and 40, its own greedy sample of 12 tokens after "the" at the end.
LLAMA_TINY_STEPS = 40
LLAMA_TINY_SAMPLE = ("--config.sample_prompt=the", "--config.sample_tokens=12")


def train_llama_tiny(data: dict, workdir: Path, *overrides: str) -> tuple[dict[int, float], str]:
  """spmd-train on llama_tiny (packed BPE tokens of `data`'s text), 2 processes x 1 device.

  Returns the losses by step (the last row of a step wins, so a resumed
  copy reads its own) and process 0's output.
  """
  command = [
    sys.executable,
    "-m",
    "trainers.run.train_cli",
    f"--config={ROOT / 'configs' / 'llama_tiny.py'}",
    f"--workdir={workdir}",
    f"--config.data.dir={data['dir']}",
    f"--config.data.source={data['source']}",
    f"--config.train.steps={LLAMA_TINY_STEPS}",
    "--config.train.warmup_steps=5",
    "--config.log_every=1",
    "--config.eval_every=0",
    "--config.checkpoint.every=20",
    "--config.data.validation_percent=25",
    *LLAMA_TINY_SAMPLE,
    *overrides,
  ]
  result = run_local(
    command,
    num_processes=2,
    devices_per_process=1,
    timeout_s=240,
    grace_s=10,
    echo=False,
    cwd=str(ROOT),
    env={"PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": data["cache"]},
  )
  assert result.ok, result.report()
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}, result.processes[0].output


def llama_tiny_run() -> tuple[Path, dict]:
  """(folder, facts) of the straight llama_tiny run: folder/run is its workdir, folder/data its data.

  facts: "losses" (by step, keys as strings: JSON), "output" (process 0's),
  "data" (`training_data`'s paths, the same data for a resumed copy).
  """

  def build(folder: Path) -> dict:
    data = training_data(folder / "data")
    losses, output = train_llama_tiny(data, folder / "run")
    return {"losses": losses, "output": output, "data": data}

  return shared_run("llama_tiny", build)
