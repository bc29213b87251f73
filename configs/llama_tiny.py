"""A tiny Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention) that learns in minutes on CPU.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=configs/llama_tiny.py --workdir=workdir/llama_tiny

On the demo's data: a BPE of 1024 ids trained on the embedded corpus, its
documents packed into windows with segment ids (shared with lm_tiny in the
data dir). With tensor parallelism the activations follow the rules, e.g.
`--config.mesh.ici=data=-1,tensor=2 --config.mesh.rules=fsdp_tp`.
"""

from configs import default
from trainers.tasks import llama


def get_config():
  config = default.get_config()
  config.task = "llama"
  config.model = llama.default_model_config()
  config.model.seq_len = 64
  config.model.num_layers = 2
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.num_kv_heads = 2
  config.model.d_ff = 384
  config.model.vocab_size = 1024
  config.data.tokenizer = "bpe"
  config.data.pack = True
  # Two small layers: a plain list of blocks, as lm_tiny (the scan's loop and
  # remat cost more than they save at this depth).
  config.model.scan_layers = False
  config.global_batch = 32
  config.train.steps = 300
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 30
  config.log_every = 10
  config.eval_every = 100
  config.eval_batches = 4
  config.checkpoint.every = 100
  config.sample_tokens = 48
  config.sample_prompt = "import"  # a whole word, as lm_tiny's (see there)
  return config
