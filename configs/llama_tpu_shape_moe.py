"""A mixture-of-experts Llama that fills one v5e chip: 8 experts, top 2, about 500M parameters.

  spmd-plan --config=configs/llama_tpu_shape_moe.py --topology=v5e-1
  benchmarks/tpu_shapes.sh --shapes=moe       # on the chip: its MFU through spmd-train (E-P9)

The TPU check's attention (`llama_tpu_check.py`: d_model 1536, 12 query
heads of 128 sharing 4 key/value heads, 2048-token sequences, a
32000-token vocabulary) with every MLP routed: 8 SwiGLU experts of width
1024, each token taking the top 2 by a softmax router (Mixtral's gates),
dropless (`trainers/models/moe.py`). 9 layers: about 494M parameters, of
which about 190M are active a token; float32 parameters and Adam state
take 16 bytes a parameter, about 7.6 GiB. MFU counts the active
parameters' FLOPs (the router, two experts, attention), as the task's
`flops_per_step` does.
"""

from configs import llama_tpu_check


def get_config():
  config = llama_tpu_check.get_config()
  config.model.num_layers = 9
  config.model.moe_experts = 8
  config.model.moe_top_k = 2
  config.model.moe_d_ff = 1024
  config.global_batch = 8
  return config
