"""A Hugging Face folder in and out through the real entry points, on 2 processes x 2 devices.

`spmd-train --config=configs/hf.py:tests/fixtures/hf/llama3`, FSDP over the
4 devices (each process reads only its devices' slices of the bf16 files),
for one step whose learning rate is the warmup's first, 0: the saved
parameters are the imported ones; each process says how much of the files
it read. Then `spmd-export --format=safetensors`:
its tensors equal the fixture's bit for bit (bf16, its dtype by default),
its config.json carries the fixture's fields, and the folder imports back
with transformers' golden logits. Read with numpy and json alone: no torch.

Its own job, not a shared run: no other test trains from an HF folder.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
import pytest

from launch.local import run_local
from tests.data_fixtures import training_data
from tests.multiprocess import ROOT
from trainers.checkpoints import export_cli
from trainers.hf import checkpoint, model_config
from trainers.hf.safetensors_files import TensorFile

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama3"


# What a folder saved by transformers holds besides tokenizer.json: its chat
# template in a file of its own (transformers 5), and a SentencePiece model
# (Llama 2, Mistral); the export copies them as bytes.
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}\n"
EXTRA_FILES = {"chat_template.jinja": CHAT_TEMPLATE.encode(), "tokenizer.model": bytes(range(256))}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_run")
  folder = root / "llama3"  # the fixture, with the files of a folder transformers saved
  shutil.copytree(FIXTURE, folder)
  for name, content in EXTRA_FILES.items():
    (folder / name).write_bytes(content)
  data = training_data(root / "text")
  workdir = root / "run"
  command = [
    sys.executable,
    "-m",
    "trainers.run.train_cli",
    f"--config={ROOT / 'configs' / 'hf.py'}:{folder}",
    f"--workdir={workdir}",
    f"--config.data.dir={data['dir']}",
    f"--config.data.source={data['source']}",
    "--config.model.seq_len=32",
    "--config.global_batch=8",
    "--config.mesh.ici=data=1,fsdp=-1,tensor=1",
    "--config.train.precision=float32",
    "--config.train.steps=1",
    "--config.train.warmup_steps=5",
    "--config.checkpoint.every=1",
    "--config.eval_every=0",
    "--config.sample_tokens=0",
    "--config.data.validation_percent=25",
  ]
  result = run_local(
    command,
    num_processes=2,
    devices_per_process=2,
    timeout_s=300,
    grace_s=10,
    echo=False,
    cwd=str(ROOT),
    env={"PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": data["cache"]},
  )
  assert result.ok, result.report()
  out = root / "export"
  assert export_cli.main(["--format=safetensors", f"--workdir={workdir}", f"--out={out}"]) == 0
  outputs = [p.output for p in result.processes]
  return {"workdir": workdir, "export": out, "folder": folder, "outputs": outputs}


def test_the_run_starts_from_the_folder(run):
  summary = json.loads((run["workdir"] / "summary.json").read_text())
  assert summary["resumed_from"] == f"init_from {run['folder']} (Hugging Face)"


def test_each_process_reads_only_its_devices_slices(run):
  """FSDP over 2 processes: each reads part of the files, not all (the norms are replicated)."""
  for output in run["outputs"]:
    found = re.search(r"hf import: process \d read ([\d.]+) MiB of the ([\d.]+) MiB", output)
    assert found, output[-2000:]
    read, total = map(float, found.groups())
    assert 0 < read < 0.75 * total, found.group(0)


def test_export_equals_the_imported_files_bit_for_bit(run):
  ours, theirs = (
    TensorFile(run["export"] / "model.safetensors"),
    TensorFile(FIXTURE / "model.safetensors"),
  )
  assert ours.names() == theirs.names()
  for name in theirs.names():
    a, b = ours.read(name), theirs.read(name)
    assert a.dtype == b.dtype and a.dtype.name == "bfloat16", name
    assert a.tobytes() == b.tobytes(), name


def test_export_config_carries_the_fixture_fields(run):
  exported = json.loads((run["export"] / "config.json").read_text())
  fixture = json.loads((FIXTURE / "config.json").read_text())
  assert model_config.llama_fields(exported) == model_config.llama_fields(fixture)
  for field in ("bos_token_id", "eos_token_id", "architectures", "model_type", "vocab_size"):
    assert exported[field] == fixture[field], field
  assert exported["torch_dtype"] == "bfloat16"
  assert (run["export"] / "tokenizer.json").read_bytes() == (
    FIXTURE / "tokenizer.json"
  ).read_bytes()
  assert checkpoint.is_hf_folder(run["export"])


def test_export_loads_back_with_the_golden_logits(run):
  from tests.test_hf_weights import _config, _imported, _logits

  folder = run["export"]
  for name in ("golden_tokens.npy", "golden_logits.npy"):
    (folder / name).write_bytes((FIXTURE / name).read_bytes())
  logits, golden = _logits(_imported(folder, _config(folder)), folder)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)


def test_export_carries_every_file_of_the_folder_but_its_weights_and_config(run):
  """The chat template and tokenizer.model too: a fixed list of names dropped them."""
  for name in ("tokenizer.json", "generation_config.json", *EXTRA_FILES):
    assert (run["export"] / name).read_bytes() == (run["folder"] / name).read_bytes(), name


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_an_export_dtype_safetensors_weights_do_not_take_is_one_line(run, dtype, tmp_path, capsys):
  """bf16 was a TypeError traceback; int8 wrote integer weights."""
  out = tmp_path / "export"
  args = ["--format=safetensors", f"--workdir={run['workdir']}", f"--out={out}", f"--dtype={dtype}"]
  assert export_cli.main(args) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and f"--dtype: invalid choice: '{dtype}'" in err, err
  assert not out.exists()
