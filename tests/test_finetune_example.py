"""`examples/finetune_llama`, copied outside the checkout and run as a user would, on 2 x 2.

The tiny HF Llama 3 fixture is imported, fine-tuned on the example's own
`sft.jsonl` with the loss on the completions only, sampled through the KV
cache at the end of the run, and exported to safetensors, whose tensors have
the fixture's names, shapes and dtype and moved from its values.

The LoRA variant (`lora.py`) runs from the same copy on the same prepared
data (`example`, made once for the module): the base frozen, adapters on
the seven projections, in two micro-batches under the bf16 policy; then
`--format=peft`, `--merge-lora` and `spmd-sample` on its workdir.

Their own jobs, not shared runs: they are the example's runs, from the
copy's folder with no PYTHONPATH, and no other test fine-tunes from an HF
folder on several processes.
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
from trainers.checkpoints import export_cli, peft
from trainers.hf.safetensors_files import TensorFile
from trainers.sampling import sample_cli

EXAMPLE = ROOT / "examples" / "finetune_llama"
FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama3"
STEPS = 4
PROMPT = "Q: 2 + 3 = ? A: "


@pytest.fixture(scope="module")
def example(tmp_path_factory):
  """The example copied outside the checkout, and one data folder for its runs (read, not changed)."""
  root = tmp_path_factory.mktemp("finetune_example")
  copy = root / "elsewhere" / "my_finetune"
  shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__"))
  return {"copy": copy, "data": root / "data"}


def _train(example, config_file, workdir, *flags):
  """The copy's config on 2 processes x 2 devices; the job's output."""
  train = [
    "trainers.run.train_cli",
    f"--config={example['copy'] / config_file}:{FIXTURE}",
    f"--workdir={workdir}",
    f"--config.data.dir={example['data']}",
    "--config.model.seq_len=32",
    "--config.global_batch=8",
    "--config.mesh.ici=data=1,fsdp=-1,tensor=1",
    f"--config.train.steps={STEPS}",
    "--config.train.warmup_steps=1",
    "--config.log_every=1",
    "--config.eval_every=0",
    "--config.checkpoint.every=0",
    *flags,
  ]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy needs none
  env["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir()
  job = harness.launch(train, workdir, 2, 2, 0, 300, env, example["copy"])
  assert job.wait(320) == 0, job.output
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["resumed_from"] == f"init_from {FIXTURE} (Hugging Face)"
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in rows if "loss" in r]
  assert len(steps) == STEPS and all(np.isfinite(r["loss"]) for r in steps)
  # Completion-only loss: the targets counted are far fewer than the tokens.
  assert all(0 < r["weight"] < 0.5 * r["units"] for r in steps), steps
  assert f"sample (greedy, prompt {PROMPT!r}" in job.output, job.output[-3000:]
  return job.output


def _moved(ours: TensorFile, theirs: TensorFile) -> set[str]:
  """The tensors whose bytes differ (names, shapes and dtypes must be the same)."""
  assert ours.names() == theirs.names()
  moved = set()
  for name in theirs.names():
    a, b = ours.read(name), theirs.read(name)
    assert (a.shape, a.dtype) == (b.shape, b.dtype), name
    if a.tobytes() != b.tobytes():
      moved.add(name)
  return moved


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_copy_imports_fine_tunes_on_completions_samples_and_exports(example, tmp_path):
  workdir = tmp_path / "run"
  _train(example, "config.py", workdir, "--config.train.learning_rate=1e-2")
  export = tmp_path / "export"
  assert export_cli.main(["--format=safetensors", f"--workdir={workdir}", f"--out={export}"]) == 0
  moved = _moved(
    TensorFile(export / "model.safetensors"), TensorFile(FIXTURE / "model.safetensors")
  )
  assert moved, "fine-tuning left every tensor as imported"
  assert (export / "tokenizer.json").read_bytes() == (FIXTURE / "tokenizer.json").read_bytes()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_lora_variant_trains_adapters_exports_them_merges_and_samples(
  example, tmp_path, capsys
):
  workdir = tmp_path / "lora"
  _train(
    example,
    "lora.py",
    workdir,
    "--config.train.learning_rate=1e-2",
    "--config.train.micro_batches=2",  # gradient accumulation of the adapters alone
  )
  # The checkpoint holds the adapters alone and names the imported folder as their base.
  record = json.loads((workdir / "checkpoints" / str(STEPS) / "data" / "metadata").read_text())
  assert record["lora_base"]["source"] == str(FIXTURE)

  adapters = tmp_path / "peft"
  assert export_cli.main(["--format=peft", f"--workdir={workdir}", f"--out={adapters}"]) == 0
  written = json.loads((adapters / peft.CONFIG_FILE).read_text())
  assert (written["r"], written["lora_alpha"]) == (16, 32.0)
  assert sorted(written["target_modules"]) == sorted(
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
  )
  tensors = TensorFile(adapters / peft.WEIGHTS_FILE)
  assert len(tensors.names()) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
  b = [n for n in tensors.names() if n.endswith("lora_B.weight")]
  assert all(np.abs(tensors.read(n)).max() > 0 for n in b), "B never left zero"

  merged = tmp_path / "merged"
  args = ["--format=safetensors", "--merge-lora", f"--workdir={workdir}", f"--out={merged}"]
  assert export_cli.main(args) == 0
  moved = _moved(
    TensorFile(merged / "model.safetensors"), TensorFile(FIXTURE / "model.safetensors")
  )
  # The projections moved, by their adapters; the embeddings, norms and head stayed as imported.
  assert moved and all(n.endswith("proj.weight") for n in moved), sorted(moved)
  assert (merged / "tokenizer.json").read_bytes() == (FIXTURE / "tokenizer.json").read_bytes()

  capsys.readouterr()
  assert sample_cli.main([f"--workdir={workdir}", f"--prompt={PROMPT}", "--num_tokens=4"]) == 0
  assert PROMPT in capsys.readouterr().out
