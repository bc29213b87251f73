"""LoRA adapters out and in, in peft's format, against peft + transformers' own logits.

The fixtures (`tests/fixtures/hf/make_fixtures.py`) hold, beside the llama3
and qwen2 models, a peft adapter folder each (`<name>_lora/`: rank 4,
alpha 12, A and B random and non-zero) and the logits peft computes with it
in float32. No torch here: the folders are read with numpy and json.

One run, in this process on the 8 CPU devices, starts from the llama3 folder
with its peft adapters (`config.lora.init_from`) and takes one step whose
learning rate is the warmup's first, 0, so its checkpoint holds the folder's
adapters. From it: `spmd-export --format=peft` (the folder's tensors, bit
for bit), `--format=safetensors --merge-lora` (peft's logits from the
merged model), and the sampling and `--mode=eval` restore (peft's logits
with the adapters applied, the base checked by its hash).

Its own run, not a shared one: no other test starts from a peft folder, and
one in-process step (about 20 s) is cheaper than a multi-process job.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from configs import hf
from spmd.errors import UserError
from tests.data_fixtures import training_data
from tests.test_hf_weights import _config, _imported, _logits
from trainers.checkpoints import export_cli, hf_export, lora_export, peft, saved_run
from trainers.checkpoints.damage import CheckpointError
from trainers.config import resolve
from trainers.hf.layouts import layout_for
from trainers.hf.safetensors_files import TensorFile
from trainers.models import lora
from trainers.run.evaluate import evaluate_run
from trainers.run.train import train_and_evaluate
from trainers.sampling.restore import restore_model

FIXTURES = "tests/fixtures/hf"
SETTINGS = lora.LoRASettings(rank=4, alpha=12.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


def _with_adapters(folder: str, adapter_folder, scan_layers=True):
  """Our Llama imported from `folder` with the adapters of a peft folder (float32)."""
  model = _imported(folder, _config(folder, scan_layers=scan_layers))
  adapters = lora.find_adapters(model, SETTINGS)
  model = lora.add_adapters(model, adapters, seed=0)
  for path, value in peft.read_adapters(adapter_folder, adapters).items():
    getattr(lora._module_at(model, path[:-1]), path[-1])[...] = jnp.asarray(value)
  return model


def _golden(family: str) -> np.ndarray:
  return np.load(f"{FIXTURES}/{family}_lora/golden_logits.npy", allow_pickle=False)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_peft_folder_on_its_base_gives_peft_logits(family, scan_layers):
  folder = f"{FIXTURES}/{family}"
  model = _with_adapters(folder, f"{folder}_lora", scan_layers)
  logits, base = _logits(model, folder)
  np.testing.assert_allclose(logits, _golden(family), rtol=1e-4, atol=1e-4)
  assert np.abs(base - _golden(family)).max() > 1.0  # the adapters change the logits


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_read_then_written_is_the_folder_bit_for_bit(family):
  """Our A and B from the folder, back in peft's layout: the stored tensors, every one."""
  folder = f"{FIXTURES}/{family}"
  adapters = lora.find_adapters(_imported(folder, _config(folder)), SETTINGS)
  values = peft.read_adapters(f"{folder}_lora", adapters)
  stored = TensorFile(f"{folder}_lora/{peft.WEIGHTS_FILE}")
  planned = peft.plan(adapters)
  assert sorted(t.name for t in planned) == stored.names()
  for t in planned:
    ours = peft.to_peft(t, values[t.source][t.layer])
    np.testing.assert_array_equal(ours, stored.read(t.name), err_msg=t.name)


def test_peft_layout_is_the_hf_export_layout_of_the_product():
  """B_hf @ A_hf (peft's delta) is our A @ B written as the safetensors export writes W."""
  folder = f"{FIXTURES}/llama3"
  adapters = lora.find_adapters(_imported(folder, _config(folder)), SETTINGS)
  rng = np.random.default_rng(0)
  for adapter in adapters:
    a = rng.normal(size=adapter.a_shape[1:]).astype(np.float32)
    b = rng.normal(size=adapter.b_shape[1:]).astype(np.float32)
    n_in = math.prod(a.shape[:-1])
    w = (a.reshape(n_in, -1) @ b.reshape(4, -1)).reshape(adapter.shape[1:])
    hf_w = layout_for("/".join(adapter.path), scanned=True).to_hf(w)
    ta, tb = (t for t in peft.plan([adapter])[:2])
    np.testing.assert_allclose(peft.to_peft(tb, b) @ peft.to_peft(ta, a), hf_w, rtol=1e-5)


@pytest.mark.parametrize(
  "setting, value, named",
  [
    ("use_rslora", True, "use_rslora=True"),
    ("use_dora", True, "use_dora=True"),
    ("modules_to_save", ["lm_head"], "modules_to_save=['lm_head']"),
    ("rank_pattern", {"q_proj": 8}, "rank_pattern={'q_proj': 8}"),
    ("alpha_pattern", {"q_proj": 8}, "alpha_pattern={'q_proj': 8}"),
    ("bias", "lora_only", "bias='lora_only'"),
  ],
)
def test_settings_not_implemented_are_refused_naming_them(tmp_path, setting, value, named):
  folder = tmp_path / "adapter"
  shutil.copytree(f"{FIXTURES}/llama3_lora", folder)
  config = json.loads((folder / peft.CONFIG_FILE).read_text())
  (folder / peft.CONFIG_FILE).write_text(json.dumps({**config, setting: value}))
  with pytest.raises(ValueError, match="are not implemented") as raised:
    peft.read_config(folder)
  assert named in str(raised.value) and "\n" not in str(raised.value)


def test_a_folder_of_another_rank_dropout_or_other_modules_is_refused(tmp_path):
  folder = f"{FIXTURES}/llama3"
  model = _imported(folder, _config(folder))
  other = lora.LoRASettings(rank=8, alpha=12.0, targets=SETTINGS.targets)
  with pytest.raises(
    ValueError, match=r"r=4, lora_alpha=12, lora_dropout=0, but config.lora has rank=8, alpha=12, "
  ):
    peft.read_adapters(f"{folder}_lora", lora.find_adapters(model, other))
  dropped = lora.LoRASettings(rank=4, alpha=12.0, dropout=0.05, targets=SETTINGS.targets)
  with pytest.raises(ValueError, match=r"lora_dropout=0, but .* dropout=0.05: set them as"):
    peft.read_adapters(f"{folder}_lora", lora.find_adapters(model, dropped))
  # What our export writes for a run with dropout, a folder with it is read with it.
  written = peft.adapter_config(dropped, lora.find_adapters(model, dropped), "")
  assert written["lora_dropout"] == 0.05
  with_dropout = tmp_path / "adapter"
  shutil.copytree(f"{folder}_lora", with_dropout)
  config = json.loads((with_dropout / peft.CONFIG_FILE).read_text())
  (with_dropout / peft.CONFIG_FILE).write_text(json.dumps({**config, "lora_dropout": 0.05}))
  assert peft.read_adapters(with_dropout, lora.find_adapters(model, dropped))
  fewer = lora.LoRASettings(rank=4, alpha=12.0, targets=("q", "v"))
  with pytest.raises(
    ValueError,
    match=r"the folder adapts, config.lora.targets does not: down_proj, gate_proj, k_proj, o_proj, up_proj\)",
  ):
    peft.read_adapters(f"{folder}_lora", lora.find_adapters(model, fewer))


def _run_config(folder, data, adapter_folder):
  config = hf.get_config(str(folder))
  config.data.source, config.data.dir = data["source"], data["dir"]
  config.compilation_cache_dir = data["cache"]
  config.model.seq_len = 32
  config.global_batch = 8
  config.mesh.ici = "data=2,fsdp=4,tensor=1"
  config.train.precision = "float32"
  config.train.steps = 1
  config.train.warmup_steps = 5  # step 1's learning rate is 0: the adapters stay the folder's
  config.checkpoint.every = 1
  config.eval_every = 0
  config.eval_batches = 1
  config.sample_tokens = 0
  config.data.validation_percent = 25
  config.lora.targets = "q,k,v,o,gate,up,down"
  config.lora.rank, config.lora.alpha = 4, 12.0
  config.lora.init_from = str(adapter_folder)
  return config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One step from the llama3 folder and its peft adapters, in this process (8 CPU devices).

  Its own run (see the module's docstring): learning rate 0, so its
  checkpoint holds the folder's adapters bit for bit, which a run that
  learns (tests/test_lora_resume.py's) cannot give.
  """
  root = tmp_path_factory.mktemp("peft_run")
  folder = root / "llama3"
  shutil.copytree(f"{FIXTURES}/llama3", folder)
  data = training_data(root / "text")
  config = _run_config(folder, data, f"{FIXTURES}/llama3_lora")
  workdir = root / "run"
  train_and_evaluate(config, str(workdir))
  return {"root": root, "folder": folder, "workdir": workdir, "config": config, "data": data}


def test_export_peft_is_the_imported_folder_bit_for_bit(run, capsys):
  out = run["root"] / "peft"
  args = ["--format=peft", f"--workdir={run['workdir']}", f"--out={out}"]
  assert export_cli.main(args) == 0
  assert "adapter parameters" in capsys.readouterr().out
  ours, theirs = (
    TensorFile(out / peft.WEIGHTS_FILE),
    TensorFile(f"{FIXTURES}/llama3_lora/{peft.WEIGHTS_FILE}"),
  )
  assert ours.names() == theirs.names() and ours.metadata["written_by"] == "spmd-export"
  for name in theirs.names():
    np.testing.assert_array_equal(ours.read(name), theirs.read(name), err_msg=name)
  written = json.loads((out / peft.CONFIG_FILE).read_text())
  fixture = json.loads(pathlib.Path(f"{FIXTURES}/llama3_lora/{peft.CONFIG_FILE}").read_text())
  for key in (
    "r",
    "lora_alpha",
    "target_modules",
    "peft_type",
    "task_type",
    "bias",
    "fan_in_fan_out",
    "use_rslora",
    "use_dora",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "lora_dropout",
    "init_lora_weights",
    "inference_mode",
  ):
    assert written[key] == fixture[key], key
  assert written["base_model_name_or_path"] == str(run["folder"])
  # It loads back: our reader of peft folders gives peft's logits from it.
  model = _with_adapters(f"{FIXTURES}/llama3", out)
  logits, _ = _logits(model, f"{FIXTURES}/llama3")
  np.testing.assert_allclose(logits, _golden("llama3"), rtol=1e-4, atol=1e-4)
  # Again into the same folder: replaced; a file no export wrote is refused.
  assert export_cli.main(args) == 0
  (out / peft.WEIGHTS_FILE).write_bytes((run["root"] / "llama3" / "model.safetensors").read_bytes())
  assert export_cli.main(args) == 2
  assert "not written by spmd-export" in capsys.readouterr().err


def test_merged_export_gives_peft_logits(run, capsys):
  out = run["root"] / "merged"
  base = ["--format=safetensors", f"--workdir={run['workdir']}", f"--out={out}"]
  assert export_cli.main(base) == 2  # a LoRA checkpoint is not a model: said in one line
  err = capsys.readouterr().err.strip()
  assert "--format=peft writes them" in err and len(err.splitlines()) == 1, err
  assert export_cli.main([*base, "--merge-lora", "--dtype=float32"]) == 0
  assert TensorFile(out / "model.safetensors").metadata["written_by"] == "spmd-export"
  shutil.copy(f"{FIXTURES}/llama3/golden_tokens.npy", out / "golden_tokens.npy")
  shutil.copy(f"{FIXTURES}/llama3_lora/golden_logits.npy", out / "golden_logits.npy")
  logits, golden = _logits(_imported(out, _config(out)), out)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)


def test_sampling_and_eval_apply_the_adapters(run):
  ref = saved_run.find_checkpoint(str(run["workdir"]))
  restored = restore_model(run["config"], ref)
  logits, _ = _logits(restored.model, f"{FIXTURES}/llama3")
  np.testing.assert_allclose(logits, _golden("llama3"), rtol=1e-4, atol=1e-4)
  record = evaluate_run(str(run["workdir"]), run["config"], eval_batches=1)
  assert np.isfinite(record["eval_loss"]) and record["step"] == 1


def test_sampling_on_other_base_weights_is_refused(run):
  other = run["root"] / "other"
  shutil.copytree(run["folder"], other)
  path = other / "model.safetensors"
  raw = bytearray(path.read_bytes())
  raw[-1] ^= 1  # the last tensor's last byte
  path.write_bytes(bytes(raw))
  config = run["config"].copy_and_resolve_references()
  config.checkpoint.init_from = str(other)
  with pytest.raises(CheckpointError, match=r"holds LoRA adapters trained on the base weights"):
    restore_model(config, saved_run.find_checkpoint(str(run["workdir"])))


def test_a_run_from_a_folder_it_cannot_reproduce_stops_before_its_data(run, tmp_path):
  """Its own run, refused before any data is prepared or step compiled: the refusal is the claim."""
  folder = tmp_path / "adapter"
  shutil.copytree(f"{FIXTURES}/llama3_lora", folder)
  config = json.loads((folder / peft.CONFIG_FILE).read_text())
  (folder / peft.CONFIG_FILE).write_text(json.dumps({**config, "use_dora": True}))
  data = dict(run["data"], dir=str(tmp_path / "no_data"))
  with pytest.raises(UserError, match=r"use_dora=True are not implemented"):
    train_and_evaluate(_run_config(run["folder"], data, folder), str(tmp_path / "run"))
  assert not (tmp_path / "no_data").exists()


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_merged_weights_give_peft_logits(family, tmp_path):
  """The merge on each family (qwen2: biases, tied embeddings), the adapters read from its folder."""
  folder = f"{FIXTURES}/{family}"
  config = hf.get_config(folder)
  config.lora.targets, config.lora.rank, config.lora.alpha = "q,k,v,o,gate,up,down", 4, 12.0
  run = lora_export.run_adapters(config, "--merge-lora")
  adapters: dict = {}
  for path, value in peft.read_adapters(f"{folder}_lora", run.adapters).items():
    node = adapters
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  merged = lora_export.MergedWeights(pathlib.Path(folder), hf_export.InMemoryWeights(adapters), run)
  hf_export.write_weights(tmp_path, merged, np.dtype(np.float32), hf_export.DEFAULT_MAX_SHARD_BYTES)
  shutil.copy(f"{folder}/config.json", tmp_path / "config.json")
  shutil.copy(f"{folder}/golden_tokens.npy", tmp_path / "golden_tokens.npy")
  shutil.copy(f"{folder}_lora/golden_logits.npy", tmp_path / "golden_logits.npy")
  logits, golden = _logits(_imported(tmp_path, _config(folder)), tmp_path)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)


def test_a_merge_onto_a_mixture_writes_its_experts_back(tmp_path):
  """LoRA on a Mixtral's attention (adapters at zero): the merged folder is the base's, bit for bit."""
  folder = f"{FIXTURES}/mixtral"
  config = hf.get_config(folder)
  config.lora.targets, config.lora.rank, config.lora.alpha = "q,k,v,o", 4, 12.0
  run = lora_export.run_adapters(config, "--merge-lora")
  zeros = {}
  for adapter in run.adapters:
    for path, shape in ((adapter.a_path, adapter.a_shape), (adapter.b_path, adapter.b_shape)):
      node = zeros
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = np.zeros(shape, np.float32)
  merged = lora_export.MergedWeights(pathlib.Path(folder), hf_export.InMemoryWeights(zeros), run)
  bf16 = TensorFile(f"{folder}/model.safetensors").dtype("model.norm.weight")
  hf_export.write_weights(
    tmp_path, merged, bf16, hf_export.DEFAULT_MAX_SHARD_BYTES, family="mixtral"
  )
  ours, theirs = (
    TensorFile(tmp_path / "model.safetensors"),
    TensorFile(f"{folder}/model.safetensors"),
  )
  assert ours.names() == theirs.names()
  for name in theirs.names():
    assert ours.read(name).tobytes() == theirs.read(name).tobytes(), name


def test_lora_init_from_needs_the_targets_and_the_base():
  config = hf.get_config(f"{FIXTURES}/llama3")
  config.lora.init_from = f"{FIXTURES}/llama3_lora"
  with pytest.raises(ValueError, match=r"lora.init_from=.* set lora.targets, lora.rank"):
    resolve(config)
