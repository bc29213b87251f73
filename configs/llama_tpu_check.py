"""The TPU check's Llama: about 501M parameters, bf16 compute, one v5e chip.

  spmd-plan --config=configs/llama_tpu_check.py --topology=v5e-1
  python -m benchmarks.tpu_check        # on the chip (benchmarks/tpu_check.sh)

16 layers, d_model 1536, 12 query heads of 128 sharing 4 key/value heads,
SwiGLU width 4096, a 32000-token vocabulary, 2048-token sequences; 8 rows a
step (16,384 tokens), about the most a v5e chip's HBM takes: float32
parameters and Adam state (about 5.6 GiB) with bf16 compute, layers scanned
and keeping their matmul outputs except the query, key and value
projections (recomputed: with them kept, XLA recomputes a bigger product to
fit the float32 weight gradients at 8 rows), attention by splash on a TPU. The data is
the default byte corpus; the check itself feeds synthetic batches.
"""

from configs import default
from trainers.tasks import llama


def get_config():
  config = default.get_config()
  config.task = "llama"
  config.model = llama.default_model_config()
  config.model.vocab_size = 32000
  config.model.seq_len = 2048
  config.model.num_layers = 16
  config.model.d_model = 1536
  config.model.num_heads = 12
  config.model.num_kv_heads = 4
  config.model.d_ff = 4096
  config.model.rope_theta = 500000.0
  config.train.precision = "bfloat16"
  config.model.scan_layers = True
  config.model.remat_policy = "minimal_no_qkv"
  config.global_batch = 8
  config.mesh.ici = "data=-1,fsdp=1,tensor=1"
  config.train.steps = 1000
  config.train.learning_rate = 3e-4
  config.train.warmup_steps = 100
  config.sample_tokens = 0
  return config
