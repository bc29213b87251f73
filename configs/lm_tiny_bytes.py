"""A tiny byte-level LM (vocabulary 256, 4 KB chunks of the corpus): `lm_tiny` on bytes.

  spmd-launch local --num-processes 2 --devices-per-process 2 -- \\
      spmd-train --config=configs/lm_tiny_bytes.py --workdir=workdir/lm_tiny_bytes

The step-time benchmarks measure this model, so their figures compare
across changes of the demo's data. On one process: drop the spmd-launch part.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.seq_len = 64
  config.model.num_layers = 2
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.d_ff = 512
  # Two small layers, run as a plain list of blocks: at this size the scan's
  # loop and the remat cost more than they save, since compile time and
  # activation memory are small either way
  # (`python -m benchmarks.investigations.step_variants` compares the layouts).
  # A seed gives the same weights in either layout.
  config.model.scan_layers = False
  config.global_batch = 32
  config.train.steps = 300
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 30
  config.log_every = 10
  config.eval_every = 100
  config.eval_batches = 4
  config.checkpoint.every = 100
  return config
