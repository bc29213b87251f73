"""Start from a Hugging Face model folder: its shape, weights and tokenizer from the folder.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=configs/hf.py:tests/fixtures/hf/llama3 --workdir=workdir/hf

The folder (local or gs://) holds config.json and model.safetensors (or
shards with model.safetensors.index.json): Llama 2/3/3.1, Mistral without a
sliding window, Qwen2, or the mixtures of experts Mixtral and Qwen2-MoE
(`trainers.hf.model_config` names any field the model does not implement).
A mixture of experts takes its load-balancing weight from the folder's
`router_aux_loss_coef` (`model_config.moe_training_fields`); one routed only
every few layers (Qwen2-MoE's `decoder_sparse_step`) runs with unscanned
layers, since scanned layers must be alike. `config.model` is set from config.json,
`checkpoint.init_from` to the folder, and its tokenizer.json, when it has
one, becomes the run's tokenizer. Parameters are float32 (bf16 files are
upcast exactly), computed in bfloat16; `spmd-export --format=safetensors`
writes the files back in the folder's dtype.

To train longer than the folder's max_position_embeddings, stretch RoPE on
purpose (docs/finetune.md, "Train longer than the folder was trained"):

  spmd-train --config=configs/hf.py:FOLDER --workdir=workdir/long \
      --config.checkpoint.rope_override=True --config.model.seq_len=8192 \
      --config.model.rope_theta=2e6
"""

from etils import epath

from configs import default
from trainers.hf import model_config
from trainers.tasks import llama

# The training window when config.json allows more: Llama 3.1's 131072 would
# be the run's sequence length otherwise (override with --config.model.seq_len).
MAX_SEQ_LEN = 2048


def get_config(folder: str):
  if not folder:
    raise ValueError("configs/hf.py needs the model folder: --config=configs/hf.py:FOLDER")
  hf = model_config.read_config(folder)
  config = default.get_config()
  config.task = "llama"
  config.model = llama.default_model_config()
  # Llama 3.1's scaling stretches the context the model was trained for: a
  # folder without it was trained for its max_position_embeddings, so a run
  # that turns it on (checkpoint.rope_override) starts from that length.
  config.model.rope_original_length = model_config.max_positions(hf)
  fields = {**model_config.llama_fields(hf), **model_config.moe_training_fields(hf)}
  for name, value in fields.items():
    config.model[name] = value
  if config.model.moe_every > 1:
    config.model.scan_layers = False
  config.model.seq_len = min(model_config.max_positions(hf), MAX_SEQ_LEN)
  config.model.param_dtype = "float32"
  config.train.precision = "bfloat16"
  config.checkpoint.init_from = folder
  tokenizer = epath.Path(folder) / "tokenizer.json"
  if tokenizer.exists():
    config.data.tokenizer = str(tokenizer)
    config.data.pack = True
  config.train.learning_rate = 1e-5  # a fine-tune's, not pretraining's
  config.train.warmup_steps = 10
  return config
