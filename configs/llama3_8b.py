"""Llama-3-8B's shape (about 8.0B parameters) for a TPU pod; plan it before running it.

  spmd-plan --config=configs/llama3_8b.py --topology=v5p-256
  # on every worker of the slice (see spmd-launch tpu):
  spmd-train --config=configs/llama3_8b.py --workdir=gs://...

32 layers, d_model 4096, 32 query heads sharing 8 key/value heads, SwiGLU
width 14336, vocabulary 128256 (untied), 8192-token sequences, RoPE base
500000. bf16 compute with float32 parameters and optimizer state, layers
scanned and rematerialised, FSDP with 4-way tensor parallelism (4 devices
share each layer's heads and MLP; the 8 key/value heads split 4 ways).
The data is still the default byte corpus until a tokenized dataset is
named in `data.name`.

131,072-token sequences, 32 a step (4M tokens), on the same slice: each
sequence split over 8 `context` devices, the rows over 16 FSDP ones and the
state over all 128 (docs/training.md, "Long sequences"). The plan compiles
it through libtpu and it fits: 16.17 GiB of the 95 GiB a chip has (the
compiler's peak), with splash on each device's 16,384 queries against the
gathered keys and values (benchmarks/context_memory.py, C1, compares it
with MaxText's).

  spmd-plan --config=configs/llama3_8b.py --topology=v5p-256 \
      --config.model.seq_len=131072 --config.global_batch=32 \
      --config.mesh.ici=data=1,fsdp=16,context=8,tensor=1 --config.mesh.rules=fsdp
"""

from configs import default
from trainers.tasks import llama


def get_config():
  config = default.get_config()
  config.task = "llama"
  config.model = llama.default_model_config()
  config.model.vocab_size = 128256
  config.model.seq_len = 8192
  config.model.num_layers = 32
  config.model.d_model = 4096
  config.model.num_heads = 32
  config.model.num_kv_heads = 8
  config.model.d_ff = 14336
  config.model.rope_theta = 500000.0
  config.model.tie_embeddings = False
  config.train.precision = "bfloat16"
  config.model.param_dtype = "float32"
  config.model.scan_layers = True
  config.model.remat_policy = "full"
  config.global_batch = 256  # 2M tokens a step, Llama 3's early batch size
  config.mesh.ici = "data=1,fsdp=-1,tensor=4"
  config.mesh.rules = "fsdp_tp"
  config.train.steps = 100_000
  config.train.learning_rate = 3e-4
  config.train.warmup_steps = 2000
  config.train.b2 = 0.95
  config.log_every = 10
  config.eval_every = 1000
  config.checkpoint.every = 1000
  # No end-of-run sample: the data is bytes with no tokenizer, so it would show
  # ids; spmd-sample reads the checkpoints instead.
  config.sample_tokens = 0
  return config
