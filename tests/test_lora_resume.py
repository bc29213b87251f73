"""LoRA from a Hugging Face folder through `spmd-train`: saved on 2 x 2, resumed on 1 x 4.

One job trains the fixture's Llama with adapters on all seven projections
and `lora.dropout` 0.1, 2 processes x 2 devices, 4 steps, a checkpoint
every 2. Its checkpoints hold the adapters and their optimizer state, not
the frozen weights, and name the base by path and content hash; its peft
export carries the dropout. Its step-2 checkpoint resumed by 1 process x 4
devices (the frozen weights read from the folder again) gives steps 3 and 4
bit for bit, dropout masks included (drawn from the seed and the step, the
same bits on any mesh); resumed with a folder whose weights differ in one
value, it is refused, naming both.

Its own job, not a shared run: the only LoRA run on several processes and
the only one whose adapters learn over several steps (tests/test_lora_peft.py's
run keeps the peft folder's adapters at learning rate 0). The resume is a
second job, as a resume on another host count must be; the refusal and the
export read the saved run in this process.
"""

from __future__ import annotations

import json
import re
import shutil
import struct

import pytest

from configs import hf
from tests.data_fixtures import training_data
from tests.multiprocess import ROOT, run_trainer
from trainers.checkpoints import export_cli, peft
from trainers.checkpoints.damage import CheckpointError
from trainers.run.train import train_and_evaluate

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama3"


# The run's settings, given to `spmd-train` as flags and to the in-process refusal as they are.
SETTINGS = {
  "model.seq_len": 32,
  "global_batch": 8,
  "mesh.ici": "data=2,fsdp=2,tensor=1",
  "train.steps": 4,
  "train.warmup_steps": 1,
  "train.learning_rate": 1e-2,
  "checkpoint.every": 2,
  "log_every": 1,
  "eval_every": 0,
  "sample_tokens": 0,
  "data.validation_percent": 25,
  "lora.targets": "q,k,v,o,gate,up,down",
  "lora.rank": 4,
  "lora.alpha": 8.0,
  # Masks drawn from (seed, step): the resume below is bit-identical with them.
  "lora.dropout": 0.1,
}


def _train(data, workdir, folder, num_processes, devices):
  command = [
    f"--config={ROOT / 'configs' / 'hf.py'}:{folder}",
    f"--workdir={workdir}",
    f"--config.data.dir={data['dir']}",
    f"--config.data.source={data['source']}",
    *(f"--config.{name}={value}" for name, value in SETTINGS.items()),
  ]
  return run_trainer(
    command,
    num_processes=num_processes,
    devices_per_process=devices,
    cache=data["cache"],
    timeout_s=300,
  )


def _losses(workdir) -> dict[int, float]:
  """Each step's loss, the last one logged for it (a resume appends)."""
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp("lora")
  folder = root / "llama3"
  shutil.copytree(FIXTURE, folder)
  data = training_data(root / "text")
  workdir = root / "run"
  result = _train(data, workdir, folder, 2, 2)
  assert result.ok, result.report()
  return {"root": root, "folder": folder, "data": data, "workdir": workdir}


def test_checkpoints_hold_the_adapters_and_name_the_base(saved):
  step = saved["workdir"] / "checkpoints" / "2"
  tree = json.loads((step / "state" / "_METADATA").read_text())["tree_metadata"]
  params = sorted(k for k in tree if k.startswith("('params'"))
  assert len(params) == 14 and all("_lora_" in k for k in params), params
  record = json.loads((step / "data" / "metadata").read_text())
  assert record["lora_base"]["source"] == str(saved["folder"])
  assert re.fullmatch(r"[0-9a-f]{16}", record["lora_base"]["hash"])


def test_the_peft_export_carries_the_runs_dropout(saved, tmp_path):
  out = tmp_path / "peft"
  assert export_cli.main(["--format=peft", f"--workdir={saved['workdir']}", f"--out={out}"]) == 0
  written = json.loads((out / peft.CONFIG_FILE).read_text())
  assert written["lora_dropout"] == 0.1 and written["r"] == 4


def test_resume_on_one_process_is_bit_identical(saved, tmp_path):
  """Its own job: a resume on another host count (1 x 4) is the claim, and only a job has one."""
  workdir = tmp_path / "run"
  shutil.copytree(saved["workdir"], workdir)
  shutil.rmtree(workdir / "checkpoints" / "4")
  resumed = _train(saved["data"], workdir, saved["folder"], 1, 4)
  assert resumed.ok, resumed.report()
  assert re.search(r"state from\s+: checkpoint step 2\n", resumed.processes[0].output)
  want, got = _losses(saved["workdir"]), _losses(workdir)
  assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
  assert want[4] < want[1]  # and the adapters learn


def _changed_copy(folder, to):
  """The folder with one bf16 value of its first tensor changed (its lowest mantissa bit)."""
  shutil.copytree(folder, to)
  path = to / "model.safetensors"
  raw = bytearray(path.read_bytes())
  (size,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8 : 8 + size])
  name = next(k for k in sorted(header) if k != "__metadata__")
  raw[8 + size + header[name]["data_offsets"][0]] ^= 1
  path.write_bytes(bytes(raw))
  return to


def test_resume_with_other_base_weights_is_refused(saved, tmp_path):
  """In this process (8 devices, not the run's 2 x 2): the base's hash is the same on any mesh,
  so the refusal is for the weights alone, and it needs no job of its own."""
  workdir = tmp_path / "run"
  shutil.copytree(saved["workdir"], workdir)
  other = _changed_copy(saved["folder"], tmp_path / "other")
  config = hf.get_config(str(other))
  settings = {
    **SETTINGS,
    "mesh.ici": "data=-1,fsdp=1,tensor=1",
    "data.dir": saved["data"]["dir"],
    "data.source": saved["data"]["source"],
    "compilation_cache_dir": saved["data"]["cache"],
  }
  for name, value in settings.items():
    *parents, last = name.split(".")
    section = config
    for part in parents:
      section = section[part]
    section[last] = value
  with pytest.raises(CheckpointError) as refused:
    train_and_evaluate(config, str(workdir))
  assert re.search(
    rf"checkpoint step 4 holds LoRA adapters trained on the base weights {saved['folder']} "
    rf"\(content hash [0-9a-f]{{16}}\), but this run's base weights are {other} "
    r"\(content hash [0-9a-f]{16}\)",
    str(refused.value),
  ), refused.value
