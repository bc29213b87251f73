"""Longer than it was trained: an imported model with other RoPE settings, on purpose only.

The llama3 fixture (`tests/fixtures/hf/llama3`: max_position_embeddings 256,
rope_theta 5e5, llama3 scaling of factor 8 from 64) is trained at 512 tokens
with rope_theta 2e6 and factor 16, under `config.checkpoint.rope_override`.
Without the opt-in the same change is refused, and naming the opt-in; with
it, any other disagreement is still refused, and a llama3 scaling that
cannot stretch the folder's context is named.

One run, in this process on the 8 CPU devices, takes one step whose
learning rate is the warmup's first, 0, so its checkpoint holds the folder's
weights: the model it restores from its recorded config must then compute
what our Llama built directly with the new fields computes on them, and its
export must carry the new RoPE and context into config.json and import back
alike. Its own run: no other test trains past a folder's context.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import ml_collections
import numpy as np
import pytest

from configs import hf
from tests.data_fixtures import training_data
from tests.test_hf_weights import _config, _imported
from trainers.checkpoints import hf_export, saved_run
from trainers.hf import model_config
from trainers.models.llama import LlamaConfig
from trainers.run.train import train_and_evaluate
from trainers.sampling.restore import restore_model
from trainers.tasks import make_task
from trainers.tasks.llama import llama_config

FIXTURES = "tests/fixtures/hf"
# The run's RoPE; the folder's is theta 5e5, llama3 factor 8 from 64 positions.
NEW_ROPE = {"rope_theta": 2e6, "rope_factor": 16.0}
SEQ_LEN = 512  # the folder's max_position_embeddings is 256
OPT_IN = r"set config\.checkpoint\.rope_override=True"


def _longer(folder: str, **model) -> ml_collections.ConfigDict:
  """configs/hf.py on `folder`, at SEQ_LEN with NEW_ROPE (and `model`), not opted in."""
  config = hf.get_config(str(folder))
  config.model.seq_len = SEQ_LEN
  for name, value in {**NEW_ROPE, **model}.items():
    config.model[name] = value
  return config


def test_a_rope_change_or_a_longer_context_without_the_opt_in_is_refused_naming_it():
  config = _longer(f"{FIXTURES}/llama3")
  with pytest.raises(
    ValueError, match=r"rope_theta=2000000.0 but the folder's is 500000.0.*" + OPT_IN
  ):
    make_task(config)
  config = hf.get_config(f"{FIXTURES}/llama3")
  config.model.seq_len = SEQ_LEN  # the folder's RoPE, a longer context: told too
  with pytest.raises(
    ValueError, match=r"seq_len=512 but the folder's max_position_embeddings is 256.*" + OPT_IN
  ):
    make_task(config)


@pytest.mark.parametrize(
  "field,value,named",
  [
    ("num_kv_heads", 4, "num_kv_heads=4 but the folder's is 2"),
    ("vocab_size", 128, "vocab_size=128 but the folder's is 96"),
    ("d_ff", 64, "d_ff=64 but the folder's is 96"),
  ],
)
def test_with_the_opt_in_any_other_disagreement_is_still_refused(field, value, named):
  config = _longer(f"{FIXTURES}/llama3", **{field: value})
  config.checkpoint.rope_override = True
  with pytest.raises(ValueError, match=named) as error:
    make_task(config)
  assert "rope_theta" not in str(error.value)  # the RoPE change itself is allowed
  assert "lets only the RoPE fields and seq_len differ" in str(error.value)


@pytest.mark.parametrize(
  "model,named",
  [
    ({"rope_scaling": "yarn"}, r"rope_scaling='yarn' must be one of \('none', 'llama3'\)"),
    ({"rope_scaling": "llama3", "rope_factor": 1.0}, r"rope_factor=1.0 must be > 1"),
    ({"rope_scaling": "llama3", "rope_factor": 0.5}, r"rope_factor >= 1.*rope_factor=0.5"),
    (
      {"rope_scaling": "llama3", "rope_original_length": 8192},
      r"rope_original_length=8192 is longer than .*qwen2's max_position_embeddings=256",
    ),
    (
      {"rope_scaling": "llama3", "rope_original_length": 256, "seq_len": 128},
      r"rope_original_length=256 is longer than seq_len=128",
    ),
  ],
)
def test_rope_settings_that_cannot_stretch_the_context_are_named(model, named):
  """On qwen2 (no scaling, 256 positions): each value the override cannot use, named."""
  config = _longer(f"{FIXTURES}/qwen2", **model)
  config.checkpoint.rope_override = True
  with pytest.raises(ValueError, match=named):
    make_task(config)


def test_a_llama3_scaling_turned_on_starts_from_the_folders_context():
  """configs/hf.py sets rope_original_length to the folder's context: only the factor is new."""
  config = _longer(f"{FIXTURES}/qwen2", rope_scaling="llama3", rope_factor=2.0)
  config.checkpoint.rope_override = True
  assert llama_config(config).rope_original_length == 256


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One step at 512 tokens from the llama3 folder with the new RoPE, in this process.

  Its own run (see the module's docstring); learning rate 0, so the
  checkpoint holds the folder's weights and logits can be compared with a
  model built directly.
  """
  root = tmp_path_factory.mktemp("rope_run")
  folder = root / "llama3"
  shutil.copytree(f"{FIXTURES}/llama3", folder)
  data = training_data(root / "text")
  config = _longer(folder)
  config.checkpoint.rope_override = True
  config.data.source, config.data.dir = data["source"], data["dir"]
  config.compilation_cache_dir = data["cache"]
  config.global_batch = 8
  config.mesh.ici = "data=2,fsdp=4,tensor=1"
  config.train.precision = "float32"
  config.train.steps = 1
  config.train.warmup_steps = 5  # step 1's learning rate is 0: the weights stay the folder's
  config.checkpoint.every = 1
  config.eval_every = 0
  config.sample_tokens = 0
  config.data.validation_percent = 25
  lines = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: lines.append(record.getMessage())
  logger = logging.getLogger("trainers.tasks.llama")
  logger.addHandler(handler)
  try:
    summary = train_and_evaluate(config, str(root / "run"))
  finally:
    logger.removeHandler(handler)
  return {"root": root, "folder": folder, "workdir": root / "run", "summary": summary, "log": lines}


def _new_fields(folder) -> LlamaConfig:
  """Our Llama built directly with the folder's fields and the new RoPE and length."""
  return _config(folder, seq_len=SEQ_LEN, **NEW_ROPE)


def _long_tokens() -> np.ndarray:
  """Token ids past the folder's 256 positions."""
  return np.random.default_rng(0).integers(0, 96, size=(2, 320)).astype(np.int32)


def test_the_run_logs_each_change_and_records_the_new_values(run):
  assert run["summary"]["steps"] == 1 and np.isfinite(run["summary"]["eval_loss"]), run["summary"]
  changes = [line for line in run["log"] if "changes the RoPE of" in line]
  assert len(changes) == 1, run["log"]
  for change in (
    "rope_theta 500000.0 -> 2000000.0",
    "rope_factor 8.0 -> 16.0",
    "max positions 256 -> 512",
    "config.checkpoint.rope_override",
  ):
    assert change in changes[0], changes[0]
  recorded = saved_run.saved_config(run["workdir"])
  assert recorded.checkpoint.rope_override is True
  assert (recorded.model.rope_theta, recorded.model.rope_factor) == (2e6, 16.0)
  assert recorded.model.seq_len == SEQ_LEN


def test_the_trained_model_computes_with_the_new_rope(run):
  """The recorded config's model on the checkpoint (the folder's weights) = our Llama with the new fields."""
  config = saved_run.saved_config(run["workdir"])
  restored = restore_model(config, saved_run.find_checkpoint(str(run["workdir"])), on_cpu=True)
  tokens = _long_tokens()
  logits = np.asarray(restored.model(tokens))
  wanted = np.asarray(_imported(run["folder"], _new_fields(run["folder"]))(tokens))
  np.testing.assert_allclose(logits, wanted, rtol=1e-4, atol=1e-4)
  folders = np.asarray(_imported(run["folder"], _config(run["folder"]))(tokens))
  assert not np.allclose(logits, folders, rtol=1e-2, atol=1e-2)  # the RoPE did change


def test_export_writes_the_new_rope_and_context_and_imports_back(run):
  out = run["root"] / "export"
  hf_export.export(str(run["workdir"]), str(out), dtype="float32")
  written = json.loads((out / "config.json").read_text())
  assert written["rope_theta"] == 2e6
  assert written["rope_scaling"] == {
    "rope_type": "llama3",
    "factor": 16.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
  }
  assert written["max_position_embeddings"] == SEQ_LEN
  # A reader takes the new positions: configs/hf.py on the export needs no opt-in.
  again = hf.get_config(str(out))
  assert again.checkpoint.rope_override is False
  imported, new = llama_config(again), _new_fields(run["folder"])
  for name in (*model_config.ROPE_FIELDS, "seq_len"):
    assert getattr(imported, name) == getattr(new, name), name
  tokens = _long_tokens()
  np.testing.assert_allclose(
    np.asarray(_imported(out, _config(out, seq_len=SEQ_LEN))(tokens)),
    np.asarray(_imported(run["folder"], _new_fields(run["folder"]))(tokens)),
    rtol=1e-5,
    atol=1e-5,
  )


def test_without_an_override_the_export_keeps_the_folders_context():
  """max_position_embeddings is the folder's when the run trained within it."""
  base = model_config.read_config(f"{FIXTURES}/llama3")
  fields = dataclasses.asdict(_config(f"{FIXTURES}/llama3", seq_len=32))
  assert model_config.hf_config(fields, "float32", base)["max_position_embeddings"] == 256
