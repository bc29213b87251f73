"""W&B tracking (`trainers.reporting.tracking`), read back from an offline run's own records.

A tiny run trains with `config.wandb.mode=offline`; the `.wandb` file W&B
writes is read back here (the LevelDB log format W&B's transaction log uses,
holding its `Record` protos) and must hold every record of `metrics.jsonl`,
the summary, and, after a restart, the same run continuing.

The training test is marked `multiprocess`: `wandb.init` starts W&B's own
service process. Without `wandb` installed (CI installs `.[test,tpu]`) it is
skipped; the missing-package error is tested either way.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

from tests.configs import train_tiny
from trainers.config import checks
from trainers.reporting import tracking
from trainers.reporting.metrics import read_metrics

# Skipped before its fixtures, so a skipped test prepares no data.
needs_wandb = pytest.mark.skipif(
  importlib.util.find_spec("wandb") is None, reason="the wandb extra is not installed"
)

# W&B's transaction log: a 7-byte header, then LevelDB log blocks of records.
_HEADER = b":W&B\xe1\xbe\x00"  # ident, magic 0xBEE1 little-endian, version 0
_BLOCK = 32768
_FULL, _LAST = 1, 4


def _records(path: Path) -> list:
  """The `wandb_internal_pb2.Record`s of a `.wandb` file, in order."""
  from wandb.proto import wandb_internal_pb2

  data = path.read_bytes()
  assert data[: len(_HEADER)] == _HEADER, f"{path} is not a W&B transaction log"
  pos, pending, records = len(_HEADER), b"", []
  while pos + 7 <= len(data):
    if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
      pos += _BLOCK - pos % _BLOCK
      continue
    _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    if length == 0 and kind == 0:
      break
    pending += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (_FULL, _LAST):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      records.append(record)
      pending = b""
  return records


def _items(items) -> dict:
  return {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}


def _history(records: list) -> list[dict]:
  """Each logged row, without W&B's own `_` keys."""
  rows = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
  return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def _summary(path: Path) -> dict:
  summary = {}
  for r in _records(path):
    if r.WhichOneof("record_type") == "summary":
      summary.update(_items(r.summary.update))
  return summary


def _run_file(workdir: Path, run_id: str, index: int) -> Path:
  """The `index`-th offline run folder's `.wandb` file (W&B names folders by start time)."""
  files = sorted((workdir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
  return files[index]


def test_a_project_without_wandb_installed_is_one_line_naming_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
  config = train_tiny.get_config()
  config.wandb.project = "p"
  with pytest.raises(ValueError) as raised:
    checks.check_values(checks._merged(config, config))
  assert str(raised.value) == tracking.MISSING
  assert "pip install spmd-harness[wandb]" in tracking.MISSING
  with pytest.raises(ImportError, match=r"spmd-harness\[wandb\]"):
    tracking.start_run(config.wandb, "/nonexistent", {})


@needs_wandb
@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_offline_run_holds_the_metrics_file_s_records_and_resumes_the_same_run(
  training_corpus, tmp_path, monkeypatch
):
  """Trains its own run: the W&B run is what it reads, and no shared run has one."""
  import wandb

  from trainers.run.train import train_and_evaluate

  monkeypatch.delenv("WANDB_DIR", raising=False)  # W&B's files go under the workdir
  monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's capture of stdout alone

  def config(steps: int):
    config = train_tiny.get_config()
    config.data.source, config.data.dir = training_corpus["source"], training_corpus["dir"]
    config.compilation_cache_dir = training_corpus["cache"]
    config.train.steps, config.eval_every, config.checkpoint.every = steps, 3, 3
    config.sample_tokens = 0
    config.wandb.project, config.wandb.mode = "spmd-test", "offline"
    return config

  workdir = tmp_path / "run"
  try:
    summary = train_and_evaluate(config(6), str(workdir))
    # The run is finished, but W&B's service closes its files after `finish` returns:
    # wait for it, as the end of a process does (W&B's atexit teardown), before reading.
    wandb.teardown()
    run_id = (workdir / tracking.RUN_ID_FILE).read_text().strip()
    first = _run_file(workdir, run_id, 0)
    written = [
      {k: v for k, v in r.items() if k != "time"} for r in read_metrics(workdir / "metrics.jsonl")
    ]
    assert _history(_records(first)) == written  # every record, train and eval, value for value
    assert [r["step"] for r in written if "loss" in r] == [1, 2, 3, 4, 5, 6]
    logged = _summary(first)
    for name in ("steps", "train_loss", "eval_loss", "workdir", "resumed_from"):
      assert logged[name] == summary[name], name
    assert "loss_history" not in logged

    again = train_and_evaluate(config(8), str(workdir))
    wandb.teardown()
    assert again["resumed_from"] == "checkpoint step 6"
    assert (workdir / tracking.RUN_ID_FILE).read_text().strip() == run_id
    steps = [
      row["step"] for row in _history(_records(_run_file(workdir, run_id, 1))) if "loss" in row
    ]
    assert steps == [7, 8]  # the same W&B run, continued
  finally:
    wandb.teardown()  # stops W&B's service process


@needs_wandb
@pytest.mark.multiprocess
def test_an_error_ends_the_w_and_b_run_as_failed_and_a_preemption_says_so(tmp_path, monkeypatch):
  import wandb

  monkeypatch.delenv("WANDB_DIR", raising=False)
  monkeypatch.setenv("WANDB_CONSOLE", "off")
  settings = train_tiny.get_config().wandb
  settings.project, settings.mode = "spmd-test", "offline"
  try:
    with pytest.raises(RuntimeError, match="stopped"):
      with tracking.open_tracker(settings, tmp_path, {}, enabled=True) as tracker:
        tracker.log(1, {"loss": 2.5})
        tracker.mark_preempting()
        raise RuntimeError("stopped")
  finally:
    wandb.teardown()
  records = _records(_run_file(tmp_path, (tmp_path / tracking.RUN_ID_FILE).read_text().strip(), 0))
  kinds = [r.WhichOneof("record_type") for r in records]
  assert "preempting" in kinds
  assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [1]
  assert _history(records) == [{"step": 1, "loss": 2.5}]
