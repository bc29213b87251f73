"""Mixtral 8x7B's shape (about 46.7B parameters, 12.9B active a token) for a TPU pod; plan it first.

  spmd-plan --config=configs/mixtral_8x7b.py --topology=v5p-256
  # on every worker of the slice (see spmd-launch tpu):
  spmd-train --config=configs/mixtral_8x7b.py --workdir=gs://...

The built-in Llama with every MLP routed (`model.moe_*`, docs/training.md,
"Mixture of experts"): 32 layers, d_model 4096, 32 query heads sharing 8
key/value heads, 8 SwiGLU experts of width 14336 of which each token takes
2 (softmax gates renormalised over the two), vocabulary 32000 (untied),
4096-token sequences, RoPE base 1e6. bf16 compute with float32 parameters
and optimizer state, layers scanned and fully rematerialised, pure FSDP
over the slice: the experts' weights are split along `embed` as a dense
MLP's are (no `expert` mesh axis), each device routing its own rows.

The batch is MaxText's published Mixtral setting on v5p (36 rows of 4096
tokens a device, 4608 rows on v5p-256): benchmarks/moe_memory.py (E-M1)
compares the bytes a device needs with MaxText's own compile of it.
"""

from configs import llama3_8b


def get_config():
  # Llama-3-8B's layers, heads, widths, dtypes, remat and schedule; Mixtral's
  # vocabulary, sequence, RoPE base and routed MLPs, at MaxText's batch.
  config = llama3_8b.get_config()
  config.model.vocab_size = 32000
  config.model.seq_len = 4096
  config.model.rope_theta = 1e6
  config.model.moe_experts = 8
  config.model.moe_top_k = 2
  config.model.moe_d_ff = 14336
  config.global_batch = 4608  # 36 rows a device on v5p-256's 128 chips
  config.mesh.ici = "data=1,fsdp=-1,tensor=1"
  config.mesh.rules = "fsdp"
  return config
