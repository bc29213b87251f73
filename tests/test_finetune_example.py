"""`examples/finetune_llama`, copied outside the checkout and run as a user would, on 2 x 2.

The tiny HF Llama 3 fixture is imported, fine-tuned on the example's own
`sft.jsonl` with the loss on the completions only, sampled through the KV
cache at the end of the run, and exported to safetensors, whose tensors have
the fixture's names, shapes and dtype and moved from its values.

Its own job, not a shared run: it is the example's run, from the copy's
folder with no PYTHONPATH, and no other test fine-tunes from an HF folder.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.faults import harness
from tests.multiprocess import ROOT
from tests.session_settings import compilation_cache_dir
from trainers.checkpoints import export_cli
from trainers.hf.safetensors_files import TensorFile

EXAMPLE = ROOT / "examples" / "finetune_llama"
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama3"
STEPS = 4


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_copy_imports_fine_tunes_on_completions_samples_and_exports(tmp_path):
  copy = tmp_path / "elsewhere" / "my_finetune"
  shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__"))
  workdir = tmp_path / "run"
  train = [
    "trainers.run.train_cli",
    f"--config={copy / 'config.py'}:{FIXTURE}",
    f"--workdir={workdir}",
    f"--config.data.dir={tmp_path / 'data'}",
    "--config.model.seq_len=32",
    "--config.global_batch=8",
    "--config.mesh.ici=data=1,fsdp=-1,tensor=1",
    f"--config.train.steps={STEPS}",
    "--config.train.warmup_steps=1",
    "--config.train.learning_rate=1e-2",
    "--config.log_every=1",
    "--config.eval_every=0",
    "--config.checkpoint.every=0",
  ]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy needs none
  env["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir()
  job = harness.launch(train, workdir, 2, 2, 0, 300, env, copy)
  assert job.wait(320) == 0, job.output
  out = job.output

  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["resumed_from"] == f"init_from {FIXTURE} (Hugging Face)"
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "loss" in r]
  assert len(steps) == STEPS and all(np.isfinite(r["loss"]) for r in steps)
  # Completion-only loss: the targets counted are far fewer than the tokens.
  assert all(0 < r["weight"] < 0.5 * r["units"] for r in steps), steps
  assert "sample (greedy, prompt 'Q: 2 + 3 = ? A: '" in out, out[-3000:]

  export = tmp_path / "export"
  assert export_cli.main(["--format=safetensors", f"--workdir={workdir}", f"--out={export}"]) == 0
  ours, theirs = TensorFile(export / "model.safetensors"), TensorFile(FIXTURE / "model.safetensors")
  assert ours.names() == theirs.names()
  moved = 0
  for name in theirs.names():
    a, b = ours.read(name), theirs.read(name)
    assert (a.shape, a.dtype) == (b.shape, b.dtype), name
    moved += a.tobytes() != b.tobytes()
  assert moved, "fine-tuning left every tensor as imported"
  assert (export / "tokenizer.json").read_bytes() == (FIXTURE / "tokenizer.json").read_bytes()
