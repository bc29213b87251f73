"""configs/mixtral_8x7b.py shrunk for tests of its figures: 2 layers, 4 experts, small widths.

python -m benchmarks.moe_memory --config=tests/configs/mixtral_tiny.py --topology=v5p-8
"""

from configs import mixtral_8x7b


def get_config():
  config = mixtral_8x7b.get_config()
  config.model.vocab_size = 512
  config.model.seq_len = 256
  config.model.num_layers = 2
  config.model.d_model = 256
  config.model.num_heads = 2
  config.model.num_kv_heads = 1
  config.model.d_ff = 512
  config.model.moe_experts = 4
  config.model.moe_d_ff = 512
  config.global_batch = 8
  return config
