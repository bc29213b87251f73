"""A realistic small LM (~110M parameters, GPT-2-small sized) for a GPU or TPU slice.

  spmd-train --config=configs/lm_small.py --workdir=workdir/lm_small
  # on a TPU pod slice, on every worker (see spmd-launch tpu), e.g. FSDP x tensor:
  spmd-train --config=configs/lm_small.py --workdir=gs://... \\
      --config.mesh.ici=data=-1,fsdp=4,tensor=2 --config.mesh.rules=fsdp_tp

bf16 compute with fp32 parameters and optimizer state. On 2 CPU cores it
would take days: plan it with `spmd-mesh --config=configs/lm_small.py` instead.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.seq_len = 1024
  config.model.num_layers = 12
  config.model.d_model = 768
  config.model.num_heads = 12
  config.model.d_ff = 3072
  config.train.precision = "bfloat16"
  config.model.param_dtype = "float32"
  config.global_batch = 256
  config.mesh.ici = "data=-1,fsdp=1,tensor=1"
  config.mesh.rules = "fsdp"
  config.train.steps = 20_000
  config.train.learning_rate = 6e-4
  config.train.warmup_steps = 1000
  config.train.micro_batches = 1
  config.log_every = 50
  config.eval_every = 1000
  config.eval_batches = 20
  config.checkpoint.every = 1000
  config.checkpoint.keep = 3
  config.checkpoint.keep_period = 5000
  return config
