"""The accelerator check's Llama: about 1.8B parameters, bf16 compute, one GPU.

  benchmarks/accelerator_check.sh        # on a machine with one GPU
  spmd-plan --config=configs/llama_gpu_check.py --gpu=h200 --num_gpus=1

24 layers, d_model 2560, 20 query heads of 128 sharing 4 key/value heads,
SwiGLU width 6912, a 32000-token vocabulary, 4096-token sequences; 16 rows a
step (65,536 tokens). Float32 parameters and Adam state (about 29 GB) with
bf16 compute, layers scanned and keeping their matmul outputs: about half of
an H200's 141 GB before the compiler's temporaries. The data is the
default byte corpus; the check itself feeds synthetic batches.
"""

from configs import default
from trainers.tasks import llama


def get_config():
  config = default.get_config()
  config.task = "llama"
  config.model = llama.default_model_config()
  config.model.vocab_size = 32000
  config.model.seq_len = 4096
  config.model.num_layers = 24
  config.model.d_model = 2560
  config.model.num_heads = 20
  config.model.num_kv_heads = 4
  config.model.d_ff = 6912
  config.model.rope_theta = 500000.0
  config.train.precision = "bfloat16"
  config.model.scan_layers = True
  config.model.remat_policy = "minimal"
  config.global_batch = 16
  config.mesh.ici = "data=-1,fsdp=1,tensor=1"
  config.train.steps = 1000
  config.train.learning_rate = 3e-4
  config.train.warmup_steps = 100
  config.sample_tokens = 0
  return config
