"""Hugging Face weights in: the golden fixtures of `tests/fixtures/hf/make_fixtures.py`.

The fixtures are tiny random models saved by `transformers` with its own
logits on fixed token ids; no torch is needed here. Our Llama, built from
each folder's config.json with the folder's weights, must give the same
logits: float32, rtol 1e-4 with atol 1e-4 (logits near zero have no
relative precision; the largest are about 6).
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
from flax import nnx

from configs import hf as hf_configs
from spmd.mesh import create_mesh
from trainers.checkpoints import hf_export
from trainers.hf import checkpoint, model_config, safetensors_files
from trainers.hf.safetensors_files import TensorFile, write_file
from trainers.models import decode
from trainers.models.llama import Llama, LlamaConfig, param_count
from trainers.step.state import make_state
from trainers.tasks import make_task
from trainers.tasks.llama import llama_config

FIXTURES = "tests/fixtures/hf"
FAMILIES = ("llama3", "qwen2")


def _config(folder, **overrides) -> LlamaConfig:
  fields = model_config.llama_fields(model_config.read_config(folder))
  return LlamaConfig(**{**fields, "attention": "xla", **overrides})


def _imported(folder, config: LlamaConfig, devices=None) -> Llama:
  """Our Llama with the folder's weights, each parameter split over `devices` by its first axis."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
  devices = devices or jax.devices()[:1]
  mesh = jax.sharding.Mesh(np.array(devices), ("x",))

  def target(a):
    split = a.shape and a.shape[0] % len(devices) == 0
    spec = jax.sharding.PartitionSpec("x" if split else None)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

  return nnx.merge(graphdef, checkpoint.read_params(folder, jax.tree.map(target, abstract)))


def _logits(model: Llama, folder) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.load(f"{folder}/golden_tokens.npy", allow_pickle=False)
  golden = np.load(f"{folder}/golden_logits.npy", allow_pickle=False)
  return np.asarray(model(jnp.asarray(tokens))), golden


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scan", [True, False])
def test_imported_model_reproduces_transformers_logits(family, scan):
  folder = f"{FIXTURES}/{family}"
  logits, golden = _logits(_imported(folder, _config(folder, scan_layers=scan)), folder)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)


def test_sliced_reads_on_four_devices_give_the_same_model():
  """Each device's slice is read alone (the first axis split 4 ways, heads included)."""
  folder = f"{FIXTURES}/llama3"
  logits, golden = _logits(_imported(folder, _config(folder), jax.devices()[:4]), folder)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)


def test_the_fixtures_tell_the_features_apart():
  """Without llama3's RoPE scaling, or with the q/k/v biases zeroed, the logits miss."""
  folder = f"{FIXTURES}/llama3"
  unscaled, golden = _logits(_imported(folder, _config(folder, rope_scaling="none")), folder)
  assert not np.allclose(unscaled, golden, rtol=1e-4, atol=1e-4)
  folder = f"{FIXTURES}/qwen2"
  model = _imported(folder, _config(folder, scan_layers=False))
  for block in model.blocks:
    block.attn.key_bias.set_value(jnp.zeros_like(block.attn.key_bias.get_value()))
  unbiased, golden = _logits(model, folder)
  assert not np.allclose(unbiased, golden, rtol=1e-4, atol=1e-4)


def test_bf16_files_become_float32_parameters_exactly():
  folder = f"{FIXTURES}/llama3"
  model = _imported(folder, _config(folder, scan_layers=False))
  name = "model.layers.1.mlp.down_proj.weight"
  stored = TensorFile(f"{folder}/model.safetensors").read(name)
  assert stored.dtype.name == "bfloat16"
  ours = model.blocks[1].mlp.down.get_value()
  assert ours.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(ours), stored.astype(np.float32).T)


def test_a_sharded_folder_reads_as_the_single_file(tmp_path):
  """model.safetensors.index.json's shards: the layers in one file, the rest in another."""
  folder = f"{FIXTURES}/qwen2"
  single = TensorFile(f"{folder}/model.safetensors")
  shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
  for name in single.names():
    shard = sorted(shards)[0 if ".layers." in name else 1]
    shards[shard][name] = single.read(name)
  weight_map = {n: shard for shard, tensors in shards.items() for n in tensors}
  for shard, tensors in shards.items():
    write_file(tmp_path / shard, tensors)
  (tmp_path / checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
  shutil.copy(f"{folder}/config.json", tmp_path / "config.json")
  for name in ("golden_tokens.npy", "golden_logits.npy"):
    shutil.copy(f"{folder}/{name}", tmp_path / name)
  assert checkpoint.is_hf_folder(tmp_path)
  logits, golden = _logits(_imported(tmp_path, _config(folder)), tmp_path)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)


def test_a_shape_that_disagrees_is_an_error_naming_the_tensor():
  folder = f"{FIXTURES}/llama3"
  config = dataclasses.replace(_config(folder), d_ff=128)
  with pytest.raises(
    ValueError,
    match=r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 96\).*needs \(64, 128\)",
  ):
    _imported(folder, config)


def test_tensors_the_model_has_no_place_for_are_an_error():
  """Qwen2's biases read into a Llama without qkv_bias: named, never dropped."""
  folder = f"{FIXTURES}/qwen2"
  with pytest.raises(ValueError, match=r"self_attn\.[qkv]_proj\.bias.*no place in the model"):
    _imported(folder, _config(folder, qkv_bias=False))


@pytest.mark.parametrize(
  "field, value, named",
  [
    ("sliding_window", 4096, "sliding_window=4096"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling="),
    ("attention_bias", True, "attention_bias=True"),
    ("quantization_config", {"bits": 4}, "['quantization_config']"),
    ("model_type", "gemma", "model_type='gemma'"),
  ],
)
def test_config_fields_the_model_does_not_implement_are_named(field, value, named):
  hf = model_config.read_config(f"{FIXTURES}/llama3")
  hf.pop("rope_parameters")
  hf[field] = value
  with pytest.raises(model_config.UnsupportedConfig) as error:
    model_config.llama_fields(hf)
  assert named in str(error.value)


def _family_config(family: str) -> dict:
  """A config.json of `family` as transformers saves it (the fixtures; Mistral from the Llama's)."""
  if family != "mistral":
    return model_config.read_config(f"{FIXTURES}/{family}")
  hf = model_config.read_config(f"{FIXTURES}/llama3")
  for llama_only in ("attention_bias", "mlp_bias", "pretraining_tp"):
    hf.pop(llama_only)
  hf.update(
    architectures=["MistralForCausalLM"],
    model_type="mistral",
    rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
    sliding_window=None,
  )
  return hf


# What transformers 5.25 fills in for a field config.json leaves out
# (LlamaConfig(), MistralConfig(), Qwen2Config()); None: num_attention_heads.
TRANSFORMERS_DEFAULTS = {
  "llama": {"rms_norm_eps": 1e-6, "num_key_value_heads": None, "vocab_size": 32000},
  "mistral": {"rms_norm_eps": 1e-6, "num_key_value_heads": 8, "vocab_size": 32000},
  "qwen2": {"rms_norm_eps": 1e-6, "num_key_value_heads": 32, "vocab_size": 151936},
}


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_fields_left_out_take_the_defaults_transformers_gives_them(family):
  hf = _family_config("llama3" if family == "llama" else family)
  defaults = TRANSFORMERS_DEFAULTS[family]
  left_out = {k: v for k, v in hf.items() if k not in defaults}
  fields = model_config.llama_fields(left_out)
  kv_heads = defaults["num_key_value_heads"] or hf["num_attention_heads"]
  assert (fields["norm_eps"], fields["num_kv_heads"]) == (defaults["rms_norm_eps"], kv_heads)
  assert fields["vocab_size"] == defaults["vocab_size"]


def test_a_mistral_config_without_sliding_window_has_transformers_window_of_4096():
  """MistralConfig's sliding_window defaults to 4096: only an explicit null means none."""
  hf = _family_config("mistral")
  assert model_config.llama_fields(hf)["num_kv_heads"] == 2  # null: full attention, read
  del hf["sliding_window"]
  with pytest.raises(model_config.UnsupportedConfig, match="sliding_window=4096"):
    model_config.llama_fields(hf)


def test_both_spellings_of_rope_settings_read_alike():
  """transformers 5's `rope_parameters` and 4's `rope_theta` + `rope_scaling`."""
  new = model_config.read_config(f"{FIXTURES}/llama3")
  old = dict(new)
  params = dict(old.pop("rope_parameters"))
  old["rope_theta"] = params.pop("rope_theta")
  old["rope_scaling"] = params
  assert model_config.llama_fields(old) == model_config.llama_fields(new)
  assert model_config.llama_fields(new)["rope_scaling"] == "llama3"


@pytest.mark.parametrize("family", [*FAMILIES, "mixtral", "qwen2_moe"])
def test_hf_config_takes_shape_tokenizer_and_weights_from_the_folder(family):
  """configs/hf.py:FOLDER builds the folder's model (biases counted) on a TP mesh of 8 devices."""
  folder = f"{FIXTURES}/{family}"
  config = hf_configs.get_config(folder)
  assert config.checkpoint.init_from == folder
  assert config.data.tokenizer == f"{folder}/tokenizer.json"
  mesh = create_mesh("data=-1,fsdp=2,tensor=2")
  config.mesh.rules = "fsdp_tp"
  setup = make_state(make_task(config).model, config, mesh)
  count = sum(leaf.size for leaf in jax.tree.leaves(setup.abstract["params"]))
  assert count == param_count(llama_config(config))
  assert count == sum(
    int(np.prod(TensorFile(f"{folder}/model.safetensors").shape(n)))
    for n in TensorFile(f"{folder}/model.safetensors").names()
  )


def test_a_config_that_disagrees_with_the_folder_names_the_fields():
  config = hf_configs.get_config(f"{FIXTURES}/llama3")
  config.model.num_kv_heads = 4
  with pytest.raises(ValueError, match="num_kv_heads=4 but the folder's is 2"):
    make_task(config)


@pytest.mark.multiprocess  # starts the GCS emulator
def test_a_folder_on_cloud_storage_imports_by_byte_ranges(tmp_path, monkeypatch):
  """gs://: a local GCS emulator serves the fixture; the slices are read from it, no copy."""
  from etils import epath

  from tests.gcs_emulator import serving

  with serving(tmp_path / "gcs", monkeypatch):
    url = "gs://bucket/models/llama3"
    for name in ("config.json", "model.safetensors", "golden_tokens.npy", "golden_logits.npy"):
      (epath.Path(url) / name).write_bytes(open(f"{FIXTURES}/llama3/{name}", "rb").read())
    assert checkpoint.is_hf_folder(url)
    config = LlamaConfig(**model_config.llama_fields(model_config.read_config(url)))
    model = _imported(url, dataclasses.replace(config, attention="xla"), jax.devices()[:2])
    tokens = np.load(f"{FIXTURES}/llama3/golden_tokens.npy", allow_pickle=False)
    golden = np.load(f"{FIXTURES}/llama3/golden_logits.npy", allow_pickle=False)
    np.testing.assert_allclose(model(jnp.asarray(tokens)), golden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kv_cache_path_gives_the_golden_logits_too(family):
  """Sampling's prefill (biases, scaled RoPE) reproduces them, and cached decoding equals uncached."""
  folder = f"{FIXTURES}/{family}"
  model = _imported(folder, _config(folder, scan_layers=False))
  tokens = jnp.asarray(np.load(f"{folder}/golden_tokens.npy", allow_pickle=False))
  golden = np.load(f"{folder}/golden_logits.npy", allow_pickle=False)
  logits, _ = decode.prefill(model, tokens)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)
  prompt = tokens[:, :4]
  np.testing.assert_array_equal(
    decode.generate(model, prompt, 6), decode.generate_uncached(model, prompt, 6)
  )


def test_mistral_without_a_sliding_window_is_a_llama():
  """Mistral 7B v0.2's config.json, shrunk: no window, no biases, untied."""
  hf = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "attention_dropout": 0.0,
  }
  fields = model_config.llama_fields(hf)
  assert (fields["qkv_bias"], fields["rope_scaling"], fields["rope_theta"]) == (False, "none", 1e6)
  assert model_config.hf_config(fields, "bfloat16", hf)["model_type"] == "mistral"
  with pytest.raises(model_config.UnsupportedConfig, match="sliding_window=4096"):
    model_config.llama_fields({**hf, "sliding_window": 4096})


# ---------------------------------------------------------------------------
# Out: our parameters as HF tensors (the export's conversion, without a run).


@pytest.mark.parametrize(
  "family, scan",
  # The mixtures' experts, one tensor each (tests/test_hf_moe.py has their logits);
  # Qwen2-MoE's fixture routes every other layer, which scanned layers cannot hold.
  [
    *((f, scan) for f in FAMILIES for scan in (True, False)),
    ("mixtral", True),
    ("qwen2_moe", False),
  ],
)
def test_parameters_convert_back_to_the_files_tensors_bit_for_bit(family, scan):
  folder = f"{FIXTURES}/{family}"
  stored = TensorFile(f"{folder}/model.safetensors")
  params = nnx.to_pure_dict(nnx.state(_imported(folder, _config(folder, scan_layers=scan))))
  model_type = model_config.read_config(folder)["model_type"]
  tensors = hf_export.hf_tensors(params, stored.dtype(stored.names()[0]), model_type)
  assert sorted(tensors) == stored.names()  # tied qwen2: no lm_head.weight
  for name, value in tensors.items():
    assert value.tobytes() == stored.read(name).tobytes(), name


def test_sharded_export_writes_an_index_and_reads_back(tmp_path):
  folder = f"{FIXTURES}/qwen2"
  params = nnx.to_pure_dict(nnx.state(_imported(folder, _config(folder))))
  tensors = hf_export.hf_tensors(params, np.dtype(np.float32))
  weights = hf_export.InMemoryWeights(params)
  files, _ = hf_export.write_weights(tmp_path, weights, np.dtype(np.float32), max_bytes=64 * 1024)
  index = json.loads((tmp_path / checkpoint.INDEX_FILE).read_text())
  assert len(files) > 2 and files[-1] == checkpoint.INDEX_FILE
  assert sorted(index["weight_map"]) == sorted(tensors)
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
  for name in (*files[:-1],):
    assert (tmp_path / name).stat().st_size <= 64 * 1024 + 4096 or len(
      TensorFile(tmp_path / name).names()
    ) == 1
  for name in ("config.json", "golden_tokens.npy", "golden_logits.npy"):
    shutil.copy(f"{folder}/{name}", tmp_path / name)
  logits, golden = _logits(_imported(tmp_path, _config(folder)), tmp_path)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)


def test_a_file_written_a_tensor_at_a_time_reads_back_with_the_reference_reader(tmp_path):
  rng = np.random.default_rng(0)
  tensors = {
    "model.b": rng.standard_normal((3, 5)).astype(np.float32),
    "model.a": rng.standard_normal((7,)).astype(np.float32),
    "model.c": rng.standard_normal((2, 2, 3)).astype(np.float32),
  }
  entries = [(name, value.dtype, value.shape) for name, value in tensors.items()]
  path = tmp_path / "streamed.safetensors"
  safetensors_files.write_streamed(path, entries, iter(tensors.values()))
  with safetensors.safe_open(str(path), framework="numpy") as f:
    assert sorted(f.keys()) == sorted(tensors)
    assert f.metadata() == {"format": "pt"}
    for name, value in tensors.items():
      assert f.get_tensor(name).tobytes() == value.tobytes(), name
  wrong = iter([tensors["model.b"].astype(np.float64)])
  with pytest.raises(ValueError, match=r"model.b: got float64\[3, 5\], its entry says float32"):
    safetensors_files.write_streamed(tmp_path / "wrong.safetensors", entries, wrong)


def _weights_of(folder) -> dict[str, bytes]:
  """Each tensor as `checkpoint.Weights` reads the folder (through the index when there is one)."""
  weights = checkpoint.Weights(folder)
  return {name: weights.file(name).read(name).tobytes() for name in weights.names()}


@pytest.mark.parametrize("first,second", [("sharded", "single"), ("single", "sharded")])
def test_a_second_export_into_the_same_folder_leaves_only_its_own_weights(tmp_path, first, second):
  """Re-exporting into one `--out`: the first export's files must not outlive it.

  Sharded then single: a stale index made the import read the old shards.
  Single then sharded: a stale model.safetensors is what transformers reads
  first, ahead of the index.
  """
  folder = f"{FIXTURES}/qwen2"
  params = nnx.to_pure_dict(nnx.state(_imported(folder, _config(folder))))
  older = jax.tree.map(lambda a: np.asarray(a) + 1, params)  # an earlier run's weights
  sizes = {"sharded": 64 * 1024, "single": 10**9}
  f32 = np.dtype(np.float32)
  hf_export.write_weights(tmp_path, hf_export.InMemoryWeights(older), f32, sizes[first])
  files, _ = hf_export.write_weights(
    tmp_path, hf_export.InMemoryWeights(params), f32, sizes[second]
  )
  want = {name: value.tobytes() for name, value in hf_export.hf_tensors(params, f32).items()}
  stale = sorted(k for k, v in _weights_of(tmp_path).items() if want.get(k) != v)
  assert not stale, f"the import reads the first export's {stale}"
  left = {p.name for p in tmp_path.iterdir()} - set(files)
  assert not left, f"the first export's {sorted(left)} remain"


def test_an_export_never_deletes_weights_it_did_not_write(tmp_path):
  """A folder holding someone's model.safetensors (the folder a run started from, say) is refused."""
  folder = f"{FIXTURES}/qwen2"
  shutil.copy(f"{folder}/model.safetensors", tmp_path / "model.safetensors")
  before = (tmp_path / "model.safetensors").read_bytes()
  params = nnx.to_pure_dict(nnx.state(_imported(folder, _config(folder))))
  with pytest.raises(ValueError, match=rf"{tmp_path}.*'model.safetensors'.*not written by"):
    hf_export.write_weights(
      tmp_path, hf_export.InMemoryWeights(params), np.dtype(np.float32), 64 * 1024
    )
  assert (tmp_path / "model.safetensors").read_bytes() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
