"""Mixtral and Qwen2-MoE folders in and out: the golden fixtures of `tests/fixtures/hf/make_fixtures.py`.

`mixtral/`: 4 experts, top 2 renormalised, every layer routed, bf16 files.
`qwen2_moe/`: 4 experts, top 2 not renormalised (`norm_topk_prob` false), a
shared expert with its sigmoid gate, layer 0 dense (`decoder_sparse_step`
2), q/k/v biases, float32 files. Both in the Hub's layout, one tensor per
expert, which transformers 5's `save_pretrained` writes.

Our Llama built from each folder gives transformers' logits (float32, as
`tests/test_hf_weights.py` compares them) with the experts split over the
devices, each device reading only its slice of the expert tensors; and
`spmd-export --format=safetensors` writes the folder back bit for bit. All
in one process, on fake CPU devices: no run is trained.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from configs import hf as hf_configs
from tests.test_hf_weights import FIXTURES, _config, _logits
from trainers.checkpoints import hf_export, saved_run
from trainers.hf import checkpoint, model_config
from trainers.hf.safetensors_files import TensorFile, write_file
from trainers.models.llama import Llama, LlamaConfig

MOE_FAMILIES = ("mixtral", "qwen2_moe")
# Qwen2-MoE's fixture routes every other layer, which scanned layers cannot hold.
BUILDS = [("mixtral", True), ("mixtral", False), ("qwen2_moe", False)]


def _experts_split(config: LlamaConfig) -> tuple:
  """(graphdef, target): the experts split 2 ways and their width 2 more; every other weight whole."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("expert", "width"))
  P = jax.sharding.PartitionSpec

  def target(path, a):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    stacked = int(config.scan_layers)  # the layers' axis comes first when scanned
    if "/expert_" in name:
      # [experts, d_model, d_ff] (gate, up) or [experts, d_ff, d_model] (down)
      width = 2 if "expert_down" not in name else 1
      spec = [None] * a.ndim
      spec[stacked], spec[stacked + width] = "expert", "width"
    elif "/router" in name:  # [d_model, experts]
      spec = [None] * (a.ndim - 1) + ["expert"]
    else:
      spec = []
    return jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, P(*spec))
    )

  return graphdef, jax.tree.map_with_path(target, abstract)


def _imported(folder, config: LlamaConfig) -> Llama:
  graphdef, target = _experts_split(config)
  return nnx.merge(graphdef, checkpoint.read_params(folder, target))


# Scanned Mixtral and unrolled Qwen2-MoE: both ways of stacking the experts, and no
# third forward pass (the reads of unrolled Mixtral are checked below, cheaply).
@pytest.mark.parametrize("family, scan", [("mixtral", True), ("qwen2_moe", False)])
def test_imported_mixture_reproduces_transformers_logits(family, scan):
  folder = f"{FIXTURES}/{family}"
  logits, golden = _logits(_imported(folder, _config(folder, scan_layers=scan)), folder)
  np.testing.assert_allclose(logits, golden, rtol=1e-4, atol=1e-4)


def test_the_fixture_tells_renormalised_gates_from_raw_ones():
  """Qwen2-MoE's norm_topk_prob=false: renormalising its gates (Mixtral's way) misses the logits."""
  folder = f"{FIXTURES}/qwen2_moe"
  config = _config(folder, scan_layers=False, moe_norm_topk=True)
  logits, golden = _logits(_imported(folder, config), folder)
  assert not np.allclose(logits, golden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family, scan", BUILDS)
def test_each_device_reads_only_its_slice_of_the_experts(family, scan, monkeypatch):
  """Each device's read of an expert weight is its slice's bytes: a quarter, never every expert whole.

  A host reads for its own devices only (`make_array_from_callback`), so a
  device that reads no more than its slice means a host that reads no more
  than its devices hold, however the experts' axis is split.
  """
  folder = f"{FIXTURES}/{family}"
  file_bytes = [0]
  original_read, original_slice = TensorFile.read, checkpoint.read_slice

  def counting_read(self, name, index=None):
    part = original_read(self, name, index)
    file_bytes[0] += part.nbytes
    return part

  reads = []

  def recording_slice(weights, layout, shape, index):
    before = file_bytes[0]
    value = original_slice(weights, layout, shape, index)
    reads.append(
      (layout.template, file_bytes[0] - before, value.nbytes, value.size / np.prod(shape))
    )
    return value

  monkeypatch.setattr(TensorFile, "read", counting_read)
  monkeypatch.setattr(checkpoint, "read_slice", recording_slice)
  _, target = _experts_split(_config(folder, scan_layers=scan))
  checkpoint.read_params(folder, target)
  experts = [r for r in reads if ".experts.{e}." in r[0]]
  for template, read, held, share in experts:
    assert read == held and share == 0.25, (template, read, held, share)
  # Together the devices read each expert tensor once: all of it, no part twice.
  stored = TensorFile(f"{folder}/model.safetensors")
  whole = sum(stored.nbytes(n) for n in stored.names() if ".experts." in n)
  assert sum(read for _, read, _, _ in experts) == whole


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_spmd_export_writes_the_imported_folder_back_bit_for_bit(family, tmp_path, monkeypatch):
  """`hf_export.export` (spmd-export's) of the untrained import: every tensor's bytes and dtype.

  The run's weights are the import itself (`weights_of`), so no run is
  trained: what is under test is the export's plan, layouts and config.json.
  """
  folder = f"{FIXTURES}/{family}"
  config = hf_configs.get_config(folder)
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / saved_run.CONFIG_FILE).write_text(config.to_json())
  params = nnx.to_pure_dict(nnx.state(_imported(folder, _config(folder, scan_layers=False))))
  ref = saved_run.CheckpointRef(workdir / "checkpoints", 0)
  monkeypatch.setattr(saved_run, "find_checkpoint", lambda *args, **kwargs: ref)
  out = tmp_path / "export"
  written = hf_export.export(
    str(workdir), str(out), weights_of=lambda *_: hf_export.InMemoryWeights(params)
  )
  ours, theirs = TensorFile(out / "model.safetensors"), TensorFile(f"{folder}/model.safetensors")
  assert ours.names() == theirs.names()
  for name in theirs.names():
    a, b = ours.read(name), theirs.read(name)
    assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes(), name
  exported = json.loads((out / "config.json").read_text())
  fixture = model_config.read_config(folder)
  assert exported["model_type"] == family and written.dtype == fixture["dtype"]
  assert model_config.llama_fields(exported) == model_config.llama_fields(fixture)
  moe_fields = {
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
    "qwen2_moe": (
      "num_experts",
      "num_experts_per_tok",
      "moe_intermediate_size",
      "shared_expert_intermediate_size",
      "norm_topk_prob",
      "decoder_sparse_step",
      "qkv_bias",
    ),
  }[family]
  for field in (*moe_fields, "router_aux_loss_coef", "architectures"):
    assert exported[field] == fixture[field], field


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_configs_hf_takes_the_routed_mlp_and_its_loss_weight_from_the_folder(family):
  config = hf_configs.get_config(f"{FIXTURES}/{family}")
  hf = model_config.read_config(f"{FIXTURES}/{family}")
  assert config.model.moe_experts == 4 and config.model.moe_top_k == 2
  # transformers counts the balance 2 (top k) times ours: the same loss.
  assert config.model.moe_load_balancing_coef == hf["router_aux_loss_coef"] * 2
  assert config.model.moe_z_loss_coef == 0.0
  assert config.model.scan_layers == (family == "mixtral")  # Qwen2-MoE's layer 0 is dense
  assert config.model.moe_norm_topk == (family == "mixtral")
  assert config.model.moe_shared_d_ff == (48 if family == "qwen2_moe" else 0)


@pytest.mark.parametrize(
  "family, field, value, named",
  [
    ("mixtral", "router_jitter_noise", 0.01, "router_jitter_noise=0.01"),
    ("mixtral", "sliding_window", 4096, "sliding_window=4096"),
    ("qwen2_moe", "mlp_only_layers", [1], "mlp_only_layers=[1]"),
    ("qwen2_moe", "shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0"),
    ("qwen2_moe", "use_sliding_window", True, "use_sliding_window=True"),
    ("qwen2_moe", "router_topk_bias", True, "['router_topk_bias']"),
  ],
)
def test_mixture_fields_the_model_does_not_implement_are_named(family, field, value, named):
  hf = model_config.read_config(f"{FIXTURES}/{family}")
  hf[field] = value
  with pytest.raises(model_config.UnsupportedConfig) as error:
    model_config.llama_fields(hf)
  assert named in str(error.value)


def test_a_dense_layer_listed_in_mlp_only_layers_is_read():
  """Layer 0 is dense by decoder_sparse_step=2 already: listing it changes nothing, so it reads."""
  hf = model_config.read_config(f"{FIXTURES}/qwen2_moe")
  assert model_config.llama_fields({**hf, "mlp_only_layers": [0]}) == model_config.llama_fields(hf)


def test_a_missing_expert_tensor_is_an_error_naming_it(tmp_path):
  folder = f"{FIXTURES}/mixtral"
  stored = TensorFile(f"{folder}/model.safetensors")
  gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
  write_file(
    tmp_path / "model.safetensors", {n: stored.read(n) for n in stored.names() if n != gone}
  )
  shutil.copy(f"{folder}/config.json", tmp_path / "config.json")
  with pytest.raises(
    ValueError, match=rf"tensor '{gone}' \(our blocks/mlp/expert_down\) is missing"
  ):
    _imported(tmp_path, _config(folder))


def test_a_folder_with_fused_experts_is_an_error_saying_so(tmp_path):
  """transformers 5's in-memory names (`experts.gate_up_proj`) in a file: named, not "missing" alone."""
  folder = f"{FIXTURES}/qwen2_moe"
  stored = TensorFile(f"{folder}/model.safetensors")
  tensors = {n: stored.read(n) for n in stored.names() if ".mlp.experts." not in n}
  gate_up = [
    np.concatenate(
      [stored.read(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight") for p in "gate up".split()]
    )
    for e in range(4)
  ]
  tensors["model.layers.1.mlp.experts.gate_up_proj"] = np.stack(gate_up)
  write_file(tmp_path / "model.safetensors", tensors)
  shutil.copy(f"{folder}/config.json", tmp_path / "config.json")
  with pytest.raises(
    ValueError, match=r"'model.layers.1.mlp.experts.gate_up_proj' holds the experts fused"
  ):
    _imported(tmp_path, _config(folder, scan_layers=False))


# The config.json of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen1.5-MoE-A2.7B, transcribed
# (transformers 4's spelling: rope_theta, torch_dtype; no rope_parameters).
HUB_CONFIGS = {
  "mixtral": {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
  },
  "qwen2_moe": {
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "model_type": "qwen2_moe",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "norm_topk_prob": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
  },
}


@pytest.mark.parametrize(
  "family, want",
  [
    ("mixtral", {"moe_experts": 8, "moe_top_k": 2, "moe_d_ff": 14336, "moe_shared_d_ff": 0}),
    ("qwen2_moe", {"moe_experts": 60, "moe_top_k": 4, "moe_d_ff": 1408, "moe_shared_d_ff": 5632}),
  ],
)
def test_the_hubs_own_config_json_reads(family, want):
  """The real models' configs, not only what the fixture script saved: every field accounted for."""
  fields = model_config.llama_fields(HUB_CONFIGS[family])
  assert {k: fields[k] for k in want} == want
  assert fields["qkv_bias"] == (family == "qwen2_moe") and fields["moe_norm_topk"] == (
    family == "mixtral"
  )
  LlamaConfig(**fields)  # a model this Llama builds
