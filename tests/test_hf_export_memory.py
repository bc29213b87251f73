"""`spmd-export --format=safetensors` reads and writes one block at a time, not the model.

A scanned Llama of about 47M parameters (188 MB in float32) trains for one
step through `spmd-train`; its checkpoint is exported in a fresh process
whose high-water mark of resident memory is read around the export alone
(`tests/workers/export_memory.py`). Reading the model whole, as the export
did before, raised it by about four times the model's bytes (the restored
parameters, then their HF copies). Read one layer of a weight at a time,
the rise is what `hf_export` says it holds: the largest saved chunk twice
(as read and decoded; a run saved from one device has each weight's stack
over the layers as one chunk, 42 MB here) and a few layers' tensors, not
the model. The exported tensors equal the checkpoint's, converted whole,
bit for bit.

The worker runs with a fixed glibc mmap threshold: by default glibc raises
the threshold to the size of the largest block freed (up to 32 MiB), so after
the warm-up export the layers' buffers come from per-thread arenas, which keep
freed memory resident; how much depends on how many threads tensorstore
starts, that is on the machine's cores. With the threshold fixed, a freed
buffer leaves the resident set, and the rise is what the export holds.

Its own run, not a shared one: the bound needs a model whose chunks are a
small part of it (a scanned 47M-parameter Llama), which no shared run trains.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.data_fixtures import training_data
from tests.multiprocess import ROOT
from trainers.checkpoints import saved_run
from trainers.checkpoints.hf_export import plan_tensors
from trainers.checkpoints.saved_arrays import SavedWeights
from trainers.hf.safetensors_files import TensorFile

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LAYERS, D_MODEL, D_FF = 6, 768, 2304
LAYER_BYTES = D_MODEL * D_FF * 4  # one layer of an MLP weight in float32: the largest block


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("export_memory")
  data = training_data(root / "text")
  workdir = root / "run"
  command = [
    sys.executable,
    "-m",
    "trainers.run.train_cli",
    f"--config={ROOT / 'configs' / 'llama_tiny.py'}",
    f"--workdir={workdir}",
    f"--config.data.dir={data['dir']}",
    f"--config.data.source={data['source']}",
    f"--config.model.num_layers={LAYERS}",
    f"--config.model.d_model={D_MODEL}",
    f"--config.model.d_ff={D_FF}",
    "--config.model.scan_layers=True",
    "--config.model.seq_len=32",
    "--config.global_batch=4",
    "--config.train.steps=1",
    "--config.checkpoint.every=1",
    "--config.eval_every=0",
    "--config.sample_tokens=0",
    "--config.data.validation_percent=25",
  ]
  env = {
    "PYTHONPATH": str(ROOT),
    "JAX_COMPILATION_CACHE_DIR": data["cache"],
    "PATH": "/usr/bin:/bin",
  }
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  return {"root": root, "workdir": workdir, "env": env}


@pytest.fixture(scope="module")
def exported(run):
  """The run's checkpoint exported once by the measuring worker: (folder, what it measured)."""
  out = run["root"] / "hf"
  worker = [sys.executable, "-m", "tests.workers.export_memory", str(run["workdir"]), str(out)]
  # A fixed threshold turns off glibc's dynamic one (see the module docstring); 1 MiB is
  # well under a layer's buffers and over the small objects.
  env = {**run["env"], "MALLOC_MMAP_THRESHOLD_": str(2**20)}
  done = subprocess.run(
    [*worker, str(LAYER_BYTES)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return out, json.loads(done.stdout.strip().splitlines()[-1])


def test_the_export_holds_one_weight_not_the_model(exported):
  _, measured = exported
  model_bytes = measured["parameters"] * 4
  rise = (measured["peak_kib"] - measured["before_kib"]) * 1024
  largest_chunk = LAYERS * LAYER_BYTES
  held = 2 * largest_chunk + 4 * LAYER_BYTES + 16 * 2**20  # 16 MiB: the allocator's slack
  assert rise < held < 0.8 * model_bytes, (rise / 2**20, held / 2**20, model_bytes / 2**20)


def test_the_exported_tensors_are_the_checkpoints_bit_for_bit(run, exported):
  out, _ = exported
  ref = saved_run.find_checkpoint(run["workdir"])
  params = saved_run.restore_weights(ref)["params"]
  exported = TensorFile(out / "model.safetensors")
  planned = plan_tensors(SavedWeights(ref).arrays)
  assert sorted(exported.names()) == sorted(t.name for t in planned)
  for tensor in planned:
    value = params
    for part in tensor.source.removeprefix("params/").split("/"):
      value = value[part]
    value = np.asarray(value if tensor.layer is None else value[tensor.layer])
    expected = tensor.layout.to_hf(value)
    assert exported.read(tensor.name).tobytes() == expected.tobytes(), tensor.name
